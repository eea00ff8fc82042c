"""Block-scaling cases of the suite (DeepSeek-V3 recipe): the quantizers against copy bandwidth
and their jnp twins, the block-scaled GEMM against the per-tensor FP8 GEMM, the block-scaled
linear against BF16 and per-tensor FP8, and the effect of PDL on a quantize -> GEMM ->
quantize chain."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

import jax_fp8
from jax_fp8 import reference

from . import peers
from .timing import device_time


def _quant_row(case, shape, t, t_jnp, nbytes, ceil):
  return {"case": case, "shape": list(shape), "us": t * 1e6, "TBps": nbytes / t / 1e12,
          "of_copy": nbytes / t / 1e12 / ceil["copy_TBps"], "jnp_us": t_jnp * 1e6,
          "vs_jnp": t_jnp / t}


def bench_quantizers(shapes, rand, ceil):
  """group_quantize (1 x 128, scales in cuBLASLt's layout), block_quantize (128 x 128) and
  group_cast_transpose (both directions): bf16 read once, FP8 (and f32 scales) written."""
  rows = []
  for shape in shapes:
    x = rand(2, shape, jnp.bfloat16, 3.0)
    n, scale_bytes = x.size, x.size // 128 * 4
    cases = [
        ("group_quantize", lambda x: jax_fp8.group_quantize(x, scale_layout="col"),
         lambda x: reference.group_quantize(x, scale_layout="col"), 3 * n + scale_bytes),
        ("block_quantize", jax_fp8.block_quantize, reference.block_quantize, 3 * n),
        ("group_cast_transpose", jax_fp8.group_cast_transpose, reference.group_cast_transpose,
         4 * n + 2 * scale_bytes),
    ]
    for case, ours, ref, nbytes in cases:
      rows.append(_quant_row(case, shape, device_time(ours, x), device_time(ref, x), nbytes,
                             ceil))
  return rows


def bench_gemm(shapes, rand):
  """Block-scaled GEMMs, 1 x 128 activations times b in 128 x 128 blocks (forward, dgrad) or
  in 1 x 128 groups (wgrad), against the per-tensor FP8 GEMM and BF16 on the same operands."""
  rows = []
  for m, n, k in shapes:
    a = rand(3, (m, k), jnp.float8_e4m3fn)
    b = rand(4, (n, k), jnp.float8_e4m3fn)
    sa = jnp.abs(rand(5, (m, k // 128), jnp.float32)) + 0.5
    one = jnp.float32(1)
    flops = 2 * m * n * k
    tensor = device_time(lambda a, b: jax_fp8.gemm(a, b, one, one), a, b)
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    bf16 = device_time(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ()))), a16, b16)
    for case, b_rows in (("block gemm", -(-n // 128)), ("block gemm 1x128", n)):
      sb = jnp.abs(rand(6, (b_rows, k // 128), jnp.float32)) + 0.5
      ours = device_time(lambda a, b, sa, sb: jax_fp8.gemm(a, b, sa, sb), a, b, sa, sb)
      rows.append({"case": case, "shape": [m, n, k], "us": ours * 1e6,
                   "TFLOPs": flops / ours / 1e12, "per_tensor_TFLOPs": flops / tensor / 1e12,
                   "vs_per_tensor": tensor / ours, "vs_bf16": bf16 / ours})
  return rows


def bench_linear(shapes, linear_problem, fwd_bwd):
  """Block-scaled linear forward + backward against BF16, per-tensor jax_fp8 and pure-XLA FP8
  (the operands and warm per-tensor state from ``run.linear_problem``)."""
  rows = []
  recipe = jax_fp8.BlockScaling()
  for m, n, k in shapes:
    g, x, w, b, state = linear_problem(m, n, k)
    ours = device_time(fwd_bwd(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=recipe)),
                       g, x, w, b)
    tensor = device_time(fwd_bwd(lambda x, w, b, s: jax_fp8.linear(x, w, b, state=s)),
                         g, x, w, b, state)
    bf16 = device_time(fwd_bwd(peers.bf16_linear), g, x, w, b)
    xla8 = device_time(fwd_bwd(peers.xla_fp8_linear), g, x, w, b)
    rows.append({"case": "block linear fwd+bwd", "shape": [m, n, k], "us": ours * 1e6,
                 "TFLOPs": 6 * m * n * k / ours / 1e12, "bf16_us": bf16 * 1e6,
                 "vs_bf16": bf16 / ours, "vs_per_tensor": tensor / ours, "vs_xla_fp8": xla8 / ours})
  return rows


def bench_pdl(shapes, rand):
  """group_quantize -> block GEMM -> group_quantize with Programmatic Dependent Launch on and
  off (JAX_FP8_PDL=0; read when XLA captures the launches, so each setting compiles anew)."""
  rows = []
  for m, n, k in shapes:
    x = rand(9, (m, k), jnp.bfloat16)
    w = rand(10, (k, n), jnp.bfloat16, k**-0.5)
    qw, sw = jax_fp8.block_quantize(w)

    def chain(x, qw, sw):
      qx, sx = jax_fp8.group_quantize(x, scale_layout="col")
      y = jax_fp8.gemm(qx, qw.T, sx.T, sw.T)
      return jax_fp8.group_quantize(y, scale_layout="col")

    times = {}
    for pdl in ("1", "0"):
      os.environ["JAX_FP8_PDL"] = pdl
      jax.clear_caches()
      times[pdl] = device_time(chain, x, qw, sw, iters=50)
    os.environ.pop("JAX_FP8_PDL")
    jax.clear_caches()
    rows.append({"case": "pdl chain", "shape": [m, n, k], "us": times["1"] * 1e6,
                 "pdl_off_us": times["0"] * 1e6, "saved_us": (times["0"] - times["1"]) * 1e6,
                 "pdl_speedup": times["0"] / times["1"]})
  return rows
