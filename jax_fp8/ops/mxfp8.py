"""MXFP8 quantization (OCP Microscaling Formats v1.0): E4M3 (or E5M2) elements with one E8M0
scale, a power of two, per 32 consecutive elements, rounded up ("RCEIL", as cuBLAS's
VEC32_UE8M0 GEMMs and TransformerEngine take it: ``formats.e8m0_rceil``), so that no block
saturates: ``x ~= data * 2**(scale - 127)``; except at the top scale (amax above 1.75 * 2**127),
whose elements saturate just below 2**emax so that none dequantizes to inf
(``formats.e8m0_saturate``). A block holding a NaN or an infinity gets the NaN scale 0xFF and
NaN data. On Hopper no tensor core reads these operands; the bytes are the ones a
Blackwell block-scaled GEMM reads.

CUDA kernels (PDL-launched): rowwise alone, the group quantize kernel with E8M0 scales
(``csrc/kernels/group_quantize.cuh``); with a columnwise copy, ``csrc/kernels/mxfp8_quantize.cuh``
(both directions from one read of x). Numerics ``csrc/mx.h``, shared with the CPU handler
``csrc/ffi/mxfp8_quantize_cpu.cc``;
jnp twins ``jax_fp8.reference.mxfp8_quantize`` / ``mxfp8_dequantize``; tests:
``tests/test_mxfp8.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import checks, sharding
from ..formats import FLOAT_DTYPES, MX_BLOCK, e8m0_apply, fp8_dtype
from ..quantized import Quantized


_OUTPUTS = ("data", "scale", "data_t", "scale_t")  # the kernel's results, in order


def mxfp8_quantize(x: jax.Array, *, rowwise: bool = True, columnwise: bool = False,
                   fmt: str = "e4m3") -> Quantized:
  """MXFP8 quantization of ``x`` along its rows and / or its columns, both from one read.

  Args:
    x: [R, C] float32 / bfloat16 / float16; C a positive multiple of 32, R a multiple of 32
      with ``columnwise``; f32 subnormals count as zero.
    rowwise: quantize 1 x 32 blocks along the rows (the operand of a GEMM contracting over C).
    columnwise: quantize 32 x 1 blocks along the columns, written transposed (the operand of a
      GEMM contracting over R, e.g. wgrad), from x itself (the MX spec's rule: not a
      requantization of the rowwise copy).
    fmt: "e4m3" (the MXFP8 recipe's format for every tensor) or "e5m2".
  Returns:
    ``Quantized``: with ``rowwise``, ``data`` [R, C] in the FP8 dtype and ``scale`` uint8
    [R, C/32] (E8M0 bytes); with ``columnwise``, ``data_t`` [C, R] and ``scale_t`` uint8
    [C, R/32], the same for x.T; a direction not asked for None.
  Raises:
    TypeError at trace time: x's dtype, a direction flag that is not a bool. ValueError: a
    shape the rules above exclude, no direction asked for, an unknown fmt.
  """
  x = checks.float_input(x)
  rowwise = checks.boolean(rowwise, "rowwise")
  columnwise = checks.boolean(columnwise, "columnwise")
  qdt = fp8_dtype(fmt)
  if not (rowwise or columnwise):
    raise ValueError("mxfp8_quantize needs rowwise=True or columnwise=True (or both)")
  if x.ndim != 2 or x.shape[1] == 0 or x.shape[1] % MX_BLOCK:
    raise ValueError(f"x must be [R, C] with C a positive multiple of {MX_BLOCK} (whole MXFP8 "
                     f"blocks along the rows), got shape {x.shape}")
  r, c = x.shape
  if columnwise and r % MX_BLOCK:
    raise ValueError(f"columnwise=True needs x's rows R a multiple of {MX_BLOCK} (whole blocks "
                     f"along the columns), got shape {x.shape}")
  names = ["data", "scale"] * rowwise + ["data_t", "scale_t"] * columnwise

  def impl(x):
    r, c = x.shape
    shapes = {"data": ((r, c), qdt), "scale": ((r, c // MX_BLOCK), jnp.uint8),
              "data_t": ((c, r), qdt), "scale_t": ((c, r // MX_BLOCK), jnp.uint8)}
    outs = jax.ffi.ffi_call(
        "jax_fp8_mxfp8_quantize",
        tuple(jax.ShapeDtypeStruct(shapes[n][0] if n in names else (0,), shapes[n][1])
              for n in _OUTPUTS),
        vmap_method="sequential",
    )(x, rowwise=rowwise, columnwise=columnwise)
    return tuple(o for o, n in zip(outs, _OUTPUTS) if n in names)

  def plan(mesh, shapes):  # whole blocks on each device; no collective
    rs, cs = sharding.spec(shapes[0].sharding, 2)
    rs = sharding.even(mesh, rs, r, MX_BLOCK if columnwise else 1)
    cs = sharding.even(mesh, cs, c, MX_BLOCK)
    xs, ts = sharding.named(mesh, rs, cs), sharding.named(mesh, cs, rs)
    return impl, (xs,), (xs, xs) * rowwise + (ts, ts) * columnwise

  # A dimension is tied to its scales' dimension (compound factors) where it is blocked.
  rf, rb = sharding.grouped("r", r, MX_BLOCK) if columnwise else ("r", None)
  cf, cb = sharding.grouped("c", c, MX_BLOCK) if rowwise else ("c", None)
  outs = [f"{rf} {cf}", f"{rf} {cb}"] * rowwise + [f"{cf} {rf}", f"{cf} {rb}"] * columnwise
  sizes = {f"{d}1": MX_BLOCK for d, f in (("r", rf), ("c", cf)) if f.startswith("(")}
  results = sharding.call("mxfp8_quantize", impl, plan, f"{rf} {cf} -> " + ", ".join(outs), x,
                          **sizes)
  return Quantized(**dict(zip(names, sharding.vary_like(results, x))))


def mxfp8_dequantize(data: jax.Array, scales: jax.Array, dtype=jnp.float32) -> jax.Array:
  """``data * 2**(scales - 127)`` in ``dtype``, NaN where a scale is 0xFF. Plain XLA, so it fuses
  into its consumer. Exact in float32 and, for E4M3 / E5M2 data, in bfloat16 (the MXFP8
  recipe's GEMM emulation on Hopper) except where a value falls below bfloat16's normals.

  Args:
    data: [..., C] float8_e4m3fn / float8_e5m2 (``data`` or ``data_t`` of ``mxfp8_quantize``'s
      ``Quantized``).
    scales: uint8 [..., C/32], the E8M0 scales of ``data``'s blocks.
    dtype: float32 / bfloat16 / float16.
  Raises:
    TypeError at trace time: dtypes. ValueError: scales' shape not data's with the last axis
    divided by 32.
  """
  data = checks.fp8_array(data, "data")
  scales = checks.array(scales, "scales")
  if scales.dtype != jnp.uint8:
    raise TypeError(f"scales must be uint8 (E8M0 bytes), got {scales.dtype}")
  dtype = checks.dtype(dtype, "dtype", FLOAT_DTYPES)
  if (data.ndim < 1 or data.shape[-1] % MX_BLOCK
      or scales.shape != (*data.shape[:-1], data.shape[-1] // MX_BLOCK)):
    raise ValueError(f"scales must be data's shape with the last axis divided by {MX_BLOCK}, "
                     f"got data {data.shape} and scales {scales.shape}")
  return e8m0_apply(data.astype(jnp.float32), jnp.repeat(scales, MX_BLOCK, axis=-1)).astype(dtype)


def mxfp8_gemm(a: jax.Array, b: jax.Array, a_scales: jax.Array, b_scales: jax.Array, *,
               out_dtype=jnp.bfloat16) -> jax.Array:
  """``a @ b.T`` of two MXFP8 operands (TN, as block-scaled GEMMs take them: both contract over
  their last axis), each element times its block's E8M0 scale, summed in f32. Emulated on
  Hopper, which has no MX tensor cores: both operands are dequantized to bfloat16 (exact for
  E4M3 / E5M2 times a power of two, wherever the value stays a bfloat16 normal) and multiplied
  by XLA's BF16 GEMM with f32 accumulation, so the result is the MX GEMM's (OCP MX v1.0) up to
  the order of the f32 sums. A Blackwell GEMM with 32-element UE8M0 scales (cuBLASLt's
  VEC32_UE8M0 mode) would take the same operands. Arguments in ``gemm``'s order.

  Args:
    a: [M, K] float8_e4m3fn / float8_e5m2: ``mxfp8_quantize``'s ``data`` (or ``data_t``).
    b: [N, K] likewise.
    a_scales, b_scales: uint8 [M, K/32] and [N, K/32], their E8M0 scales (``scale`` or
      ``scale_t``).
    out_dtype: float32 / bfloat16 / float16.
  Returns:
    [M, N] in out_dtype.
  Raises:
    TypeError / ValueError at trace time: dtypes; operands that are not 2-D with one K; scales
    not their data's shape with K divided by 32.
  """
  out_dtype = checks.dtype(out_dtype, "out_dtype", FLOAT_DTYPES)
  a, b = checks.fp8_array(a, "a"), checks.fp8_array(b, "b")
  for name, data, scales in (("a", a, a_scales), ("b", b, b_scales)):
    scales = checks.array(scales, f"{name}_scales")
    if (scales.dtype != jnp.uint8 or data.ndim != 2 or data.shape[1] % MX_BLOCK
        or scales.shape != (data.shape[0], data.shape[1] // MX_BLOCK)):
      raise ValueError(f"{name} must be [rows, K] with K a multiple of {MX_BLOCK} and "
                       f"{name}_scales uint8 [rows, K/{MX_BLOCK}] (E8M0 bytes), got {name} "
                       f"{data.dtype}{list(data.shape)} and {name}_scales "
                       f"{scales.dtype}{list(scales.shape)}")
  if a.shape[1] != b.shape[1]:
    raise ValueError(f"a [M, K] and b [N, K] must share K, got a {list(a.shape)} and b "
                     f"{list(b.shape)}")
  a16 = mxfp8_dequantize(a, a_scales, jnp.bfloat16)
  b16 = mxfp8_dequantize(b, b_scales, jnp.bfloat16)
  return jax.lax.dot_general(a16, b16, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32).astype(out_dtype)
