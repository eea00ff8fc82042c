"""Block-scaling cases of the suite (DeepSeek-V3 recipe): the quantizers against copy bandwidth
and their jnp twins, the block-scaled GEMM against the per-tensor FP8 GEMM, jax_fp8's own
block-scaled kernels against cuBLASLt's, the block-scaled linear against BF16 and per-tensor
FP8, and the effect of PDL on a quantize -> GEMM -> quantize chain; the MXFP8 and NVFP4
quantizers against their jnp twins."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp

import jax_fp8
from jax_fp8 import reference
from jax_fp8.hadamard import hadamard_transform
from jax_fp8.ops.gemm import ALGORITHMS

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


def _gemm_problem(m, n, k, rand):
  """e4m3 a [M, K] and b [N, K], a's 1 x 128 scales, the GEMM's FLOPs and the per-tensor FP8
  GEMM's seconds on a and b."""
  a = rand(3, (m, k), jnp.float8_e4m3fn)
  b = rand(4, (n, k), jnp.float8_e4m3fn)
  sa = jnp.abs(rand(5, (m, k // 128), jnp.float32)) + 0.5
  one = jnp.float32(1)
  return a, b, sa, 2 * m * n * k, device_time(lambda a, b: jax_fp8.gemm(a, b, one, one), a, b)


def bench_gemm(shapes, rand):
  """Block-scaled GEMMs, 1 x 128 activations times b in 128 x 128 blocks (forward, dgrad) or
  in 1 x 128 groups (wgrad), against the per-tensor FP8 GEMM and BF16 on the same operands."""
  rows = []
  for m, n, k in shapes:
    a, b, sa, flops, tensor = _gemm_problem(m, n, k, rand)
    a16, b16 = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)
    bf16 = device_time(lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ()))), a16, b16)
    for case, b_rows in (("block gemm", -(-n // 128)), ("block gemm 1x128", n)):
      sb = jnp.abs(rand(6, (b_rows, k // 128), jnp.float32)) + 0.5
      ours = device_time(lambda a, b, sa, sb: jax_fp8.gemm(a, b, sa, sb), a, b, sa, sb)
      rows.append({"case": case, "shape": [m, n, k], "us": ours * 1e6,
                   "TFLOPs": flops / ours / 1e12, "per_tensor_TFLOPs": flops / tensor / 1e12,
                   "vs_per_tensor": tensor / ours, "vs_bf16": bf16 / ours})
  return rows


def bench_kernels(shapes, rand):
  """jax_fp8's block-scaled GEMM kernels (``gemm(..., algorithm=name)``, each timed) against
  cuBLASLt's block-scaled GEMM (its timed best, ``algorithm="cublaslt"``) and the per-tensor FP8
  GEMM on the same operands: a in 1 x 128 groups, b in 128 x 128 blocks (forward, dgrad) or
  1 x 128 groups (wgrad), bf16 output. A row per form: the fastest kernel of ours, its name,
  and every kernel's rate."""
  rows = []
  for m, n, k in shapes:
    a, b, sa, flops, tensor = _gemm_problem(m, n, k, rand)
    for case, b_rows in (("block gemm kernels", -(-n // 128)), ("block gemm 1x128 kernels", n)):
      sb = jnp.abs(rand(6, (b_rows, k // 128), jnp.float32)) + 0.5
      t = {name: device_time(lambda a, b, sa, sb, name=name: jax_fp8.gemm(
          a, b, sa, sb, algorithm=name), a, b, sa, sb) for name in ALGORITHMS[1:]}
      lt = t.pop("cublaslt")
      best = min(t, key=t.get)
      rows.append({"case": case, "shape": [m, n, k], "us": t[best] * 1e6, "kernel": best,
                   "TFLOPs": flops / t[best] / 1e12, "cublaslt_TFLOPs": flops / lt / 1e12,
                   "per_tensor_TFLOPs": flops / tensor / 1e12, "vs_cublaslt": lt / t[best],
                   "vs_per_tensor": tensor / t[best],
                   "kernels_TFLOPs": {name: flops / us / 1e12 for name, us in t.items()}})
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
    qw = jax_fp8.block_quantize(w)

    def chain(x, qw):
      qx = jax_fp8.group_quantize(x, scale_layout="col")
      y = jax_fp8.gemm(qx.data, qw.data.T, qx.scale.T, qw.scale.T)
      return jax_fp8.group_quantize(y, scale_layout="col")

    times = {}
    for pdl in ("1", "0"):
      os.environ["JAX_FP8_PDL"] = pdl
      jax.clear_caches()
      times[pdl] = device_time(chain, x, qw, iters=50)
    os.environ.pop("JAX_FP8_PDL")
    jax.clear_caches()
    rows.append({"case": "pdl chain", "shape": [m, n, k], "us": times["1"] * 1e6,
                 "pdl_off_us": times["0"] * 1e6, "saved_us": (times["0"] - times["1"]) * 1e6,
                 "pdl_speedup": times["0"] / times["1"]})
  return rows


def bench_mx_nvfp4(shapes, rand, ceil):
  """MXFP8 and NVFP4 quantization of bf16 x against the jnp twins (XLA's fusions): rowwise,
  and both directions from one read (NVFP4 also with the wgrad operand's options: stochastic
  rounding and the Hadamard transform). Bytes: x read (2 an element); per element and
  direction written, MXFP8 1 + 1/32 (FP8 byte, E8M0 scale), NVFP4 1/2 + 1/16 (E2M1 nibble, E4M3
  scale). NVFP4 runs twice: as called plainly, with XLA's pass for the global amax (two with
  the transform), which these bytes do not count (the ratio to copy is against one read); and
  with the global amaxes given ("amax given": e.g. known from the step before), where the op
  is its kernel."""
  key = jax.random.key(0)
  rows = []
  for shape in shapes:
    x = rand(2, shape, jnp.bfloat16, 3.0)
    given = dict(global_amax=jnp.max(jnp.abs(x)).astype(jnp.float32))
    given_t = dict(given, global_amax_t=jnp.max(jnp.abs(
        hadamard_transform(x.astype(jnp.float32), 0, axis=0))))
    sr = dict(stochastic_rounding=True, key=key)
    mx, nv = ((jax_fp8.mxfp8_quantize, reference.mxfp8_quantize),
              (jax_fp8.nvfp4_quantize, reference.nvfp4_quantize))
    cases = [("mxfp8_quantize rowwise", mx, dict(), 1 + 1 / 32),
             ("mxfp8_quantize both", mx, dict(columnwise=True), 2 * (1 + 1 / 32))]
    for suffix, amax, amax_t in (("", {}, {}), (", amax given", given, given_t)):
      cases += [(f"nvfp4_quantize rowwise{suffix}", nv, amax, 1 / 2 + 1 / 16),
                (f"nvfp4_quantize rowwise sr{suffix}", nv, dict(amax, **sr), 1 / 2 + 1 / 16),
                (f"nvfp4_quantize both{suffix}", nv, dict(amax, columnwise=True),
                 2 * (1 / 2 + 1 / 16)),
                (f"nvfp4_quantize both rht+sr{suffix}", nv,
                 dict(amax_t, columnwise=True, rht=True, **sr), 2 * (1 / 2 + 1 / 16))]
    for name, (op, ref), kw, written in cases:
      nbytes = x.size * (2 + written)
      t = device_time(lambda x: op(x, **kw), x)
      tj = device_time(lambda x: ref(x, **kw), x)
      rows.append({"case": name, "shape": list(x.shape), "us": t * 1e6,
                   "TBps": nbytes / t / 1e12, "of_copy": nbytes / t / 1e12 / ceil["copy_TBps"],
                   "jnp_us": tj * 1e6, "vs_jnp": tj / t})
  return rows
