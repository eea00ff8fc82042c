"""FP8 formats and the jnp numerics every layer shares.

Convention used everywhere in jax_fp8: **scale is the dequantization step**,
``x ~= q * scale`` with ``q = saturate(round_nearest_even(x * (1 / scale)))`` (as in
``jax.nn.scaled_matmul`` and DeepGEMM). No API takes a ``scale_inv``. Casts saturate (±inf and
values beyond the format's largest finite value go to ±max); NaN stays NaN (byte 0x7F).
f32 subnormals count as zero on every backend (XLA's CPU runtime flushes them).

Formats (Micikevicius et al., "FP8 Formats for Deep Learning", 2022): "e4m3" is
``float8_e4m3fn`` (max 448, no inf), "e5m2" is ``float8_e5m2`` (max 57344). The block-scaled
formats' facts too: MXFP8's E8M0 scales and NVFP4's E2M1 elements with their scale rules. The
NVFP4 recipe's stochastic rounding is in ``jax_fp8.stochastic_rounding``, its random Hadamard
transform in ``jax_fp8.hadamard``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi

FORMATS: dict[str, jnp.dtype] = {
    "e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "e5m2": jnp.dtype(jnp.float8_e5m2),
}
FP8_DTYPES = tuple(FORMATS.values())
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def fp8_dtype(fmt: str) -> jnp.dtype:
  """The JAX dtype of an FP8 format name: "e4m3" -> float8_e4m3fn, "e5m2" -> float8_e5m2.

  Raises:
    TypeError / ValueError: ``fmt`` is not a string / not one of the names.
  """
  if not isinstance(fmt, str):
    raise TypeError(f"fmt must be one of {sorted(FORMATS)}, got {type(fmt).__name__} {fmt!r}")
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
  return FORMATS[fmt]


def fp8_max(fmt: str) -> float:
  """Largest finite value of the format (448 for e4m3, 57344 for e5m2), from the dtype."""
  return float(jnp.finfo(fp8_dtype(fmt)).max)


@jax.custom_jvp
def _flush_subnormal(x):
  return jnp.where(jnp.abs(x) < np.finfo(np.float32).tiny, x * 0, x)


# The flush is not part of the math: its derivative is 1 everywhere, exact zeros included
# (the select's own derivative would be 0 there, so a parameter initialized to zero, a LayerNorm
# beta say, would get no gradient through it).
_flush_subnormal.defjvp(lambda primals, tangents: (_flush_subnormal(*primals), tangents[0]))


def as_f32(x: jax.Array) -> jax.Array:
  """x in f32 with subnormals flushed to (signed) zero: f32 subnormals count as zero on every
  backend (XLA's CPU runtime flushes them, GPUs do not). Differentiable as the identity."""
  return _flush_subnormal(jnp.asarray(x).astype(jnp.float32))


def amax(x: jax.Array, axis=None) -> jax.Array:
  """max |x| in f32 over ``axis`` (all axes by default), NaN where x holds a NaN, subnormals
  counting as zero (as ``as_f32``). Not differentiable (an amax only ever sets a scale).

  Two forms with the same results, chosen when the program is lowered: on the CPU
  ``amax_and_nan_search``; elsewhere ``amax_of_bits``, one reduction where the other needs two.
  XLA:CPU of jax 0.12 emitted invalid LLVM IR for the second inside the NVFP4 twin's fused
  block reductions."""
  x = jnp.asarray(x)
  return jax.lax.platform_dependent(x, cpu=functools.partial(amax_and_nan_search, axis=axis),
                                    default=functools.partial(amax_of_bits, axis=axis))


def amax_of_parts(xs) -> jax.Array:
  """``amax`` over all elements of several arrays (a tuple / list), NaN where any holds one."""
  return amax(jnp.stack([amax(x) for x in xs]))


def amax_and_nan_search(x: jax.Array, axis=None) -> jax.Array:
  """``amax`` as a max of |x| and a search for NaNs (XLA's CPU max reduction can drop them)."""
  a = jnp.abs(as_f32(x))
  nan = jnp.isnan(a)
  return jnp.where(jnp.any(nan, axis=axis), jnp.nan,
                   jnp.max(jnp.where(nan, 0.0, a), axis=axis, initial=0.0))


def amax_of_bits(x: jax.Array, axis=None) -> jax.Array:
  """``amax`` as one integer max over the magnitude bits in x's own float dtype (f32 for
  others): a NaN's bits exceed every number's, so no second reduction looks for NaNs."""
  if x.dtype not in FLOAT_DTYPES:
    x = x.astype(jnp.float32)
  uint = jnp.uint32 if x.dtype.itemsize == 4 else jnp.uint16
  magnitude = jax.lax.bitcast_convert_type(x, uint) & uint(np.iinfo(uint).max >> 1)
  return as_f32(jax.lax.bitcast_convert_type(jnp.max(magnitude, axis=axis, initial=0), x.dtype))


def apply_scales(acc: jax.Array, a_scale: jax.Array, b_scale: jax.Array) -> jax.Array:
  """``acc * a_scale * b_scale`` in f32 with no intermediate underflow or overflow: the scales'
  mantissas multiply ``acc`` and their exponents are added in once, so the result is exact to
  f32 rounding wherever it is a normal f32, even when ``a_scale * b_scale`` alone is not
  (e.g. scales of 2e-23 and 2e-18 from tensors of magnitude 1e-20 and 1e-15)."""
  ma, ea = jnp.frexp(jnp.asarray(a_scale, jnp.float32))
  mb, eb = jnp.frexp(jnp.asarray(b_scale, jnp.float32))
  return jnp.ldexp(acc * (ma * mb), ea + eb)


# Block scaling (DeepSeek-V3): 1 x BLOCK groups of activations and gradients, BLOCK x BLOCK blocks
# of weights, each group's amax floored at GROUP_EPS by default (recipes.BlockScaling.eps).
BLOCK = _ffi.CONSTANTS["block_tile"]  # 128
GROUP_EPS = 1e-10
# K and N of every FP8 GEMM: cuBLASLt's FP8 alignment.
DIM_MULTIPLE = _ffi.CONSTANTS["gemm_dim_multiple"]  # 16
# The grouped GEMMs' wgrad: each group's rows start at a multiple of ROW_ALIGN, of BLOCK_ROW_ALIGN
# under block scales (whole 1 x 128 groups along the rows).
ROW_ALIGN = _ffi.CONSTANTS["grouped_row_align"]  # 16
BLOCK_ROW_ALIGN = _ffi.CONSTANTS["grouped_block_row_align"]  # 128


# MXFP8 (OCP Microscaling Formats v1.0): one E8M0 scale per MX_BLOCK consecutive elements. An
# E8M0 byte e means 2**(e - E8M0_BIAS); 0xFF (E8M0_NAN) is NaN; there is no zero.
MX_BLOCK = _ffi.CONSTANTS["mx_block"]  # 32
E8M0_BIAS = 127
E8M0_NAN = 0xFF


def e8m0_rceil(block_amax: jax.Array, fmt: str) -> jax.Array:
  """The E8M0 scale byte of blocks with max |x| ``block_amax`` (f32 >= 0, any shape), rounded up
  ("RCEIL", as cuBLAS and TransformerEngine do): the smallest power of two ``2**k`` with
  ``block_amax / 2**k <= fmt_max``, so the block never saturates, clamped to the E8M0 range
  (k in [-127, 127]); an all-zero block (or a subnormal amax, zero on every backend) gets the
  smallest scale (byte 0), a block holding a NaN or an infinity the NaN byte 0xFF. From the
  amax's bits, as csrc/mx.h computes it: with amax = m * 2**e (m in [1, 2)) and fmt_max =
  1.75 * 2**emax, k = e - emax, plus 1 where m > 1.75. uint8, ``block_amax``'s shape."""
  fmax = fp8_max(fmt)
  emax = int(np.floor(np.log2(fmax)))
  assert fmax == 1.75 * 2.0**emax, "both FP8 formats' largest value is 1.75 * 2**emax"
  b = jax.lax.bitcast_convert_type(jnp.asarray(block_amax, jnp.float32), jnp.uint32)
  k = (b >> 23).astype(jnp.int32) - 127 - emax + ((b & 0x7FFFFF) > 0x600000).astype(jnp.int32)
  k = jnp.where(b < 0x800000, -E8M0_BIAS, jnp.clip(k, -E8M0_BIAS, E8M0_BIAS))
  return jnp.where(b >= 0x7F800000, E8M0_NAN, k + E8M0_BIAS).astype(jnp.uint8)


def e8m0_top(fmt: str) -> int:
  """The E8M0 byte of the largest scale ``e8m0_rceil`` gives a finite amax, 2**(128 - emax)
  (e4m3 247, e5m2 240), as csrc/mx.h."""
  return 128 - int(np.log2(fp8_max(fmt) / 1.75)) + E8M0_BIAS


def top_scale_saturate(x: jax.Array, fmt: str) -> jax.Array:
  """``x`` (f32) with its finite elements clamped to +-(the largest FP8 value below 2**emax) *
  2**(128 - emax), e4m3 240 * 2**120, e5m2 28672 * 2**113: the saturation of the top
  power-of-two scale a finite amax gets, 2**(128 - emax), under which an element rounded up to
  2**emax would dequantize to 2**128 (inf). Only an element beyond the limit changes, and it
  puts every group holding it at the top scale, so the rule applies to every element of a
  power-of-two-scaled group (MXFP8, ue8m0 block scaling) unconditionally. NaN and infinities
  kept. As csrc/numerics.h top_scale_saturate."""
  limit = np.float32(240.0 * 2.0**120 if fp8_dtype(fmt) == jnp.float8_e4m3fn
                     else 28672.0 * 2.0**113)
  return jnp.where(jnp.isfinite(x), jnp.clip(x, -limit, limit), x)


def e8m0_saturate(x: jax.Array, scale: jax.Array, fmt: str) -> jax.Array:
  """``top_scale_saturate`` of the elements of blocks of the top scale (``e8m0_top``; ``scale``:
  E8M0 bytes broadcasting against ``x``), other blocks unchanged. As csrc/mx.h
  e8m0_saturate."""
  return jnp.where(scale == e8m0_top(fmt), top_scale_saturate(x, fmt), x)


def e8m0_apply(values: jax.Array, scale: jax.Array) -> jax.Array:
  """``values * 2**(scale - 127)`` in f32 (``scale``: E8M0 bytes broadcasting against
  ``values``), NaN where the scale is 0xFF. Applied as an exponent (ldexp), not as a factor:
  the scales below 2**-126 are f32 subnormals, which XLA's CPU runtime flushes to zero, while
  the products are normal f32s down to 2**-126."""
  e = jnp.asarray(scale).astype(jnp.int32)
  y = jnp.ldexp(jnp.asarray(values, jnp.float32), e - E8M0_BIAS)
  return jnp.where(e == E8M0_NAN, jnp.nan, y)


# NVFP4 (NVIDIA's NVFP4 pretraining report, arXiv 2509.25149): E2M1 elements
# (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}), one E4M3 scale per NVFP4_BLOCK consecutive elements (or per
# NVFP4_BLOCK x NVFP4_BLOCK tile), one f32 per-tensor scale.
NVFP4_BLOCK = _ffi.CONSTANTS["nvfp4_block"]  # 16
E2M1_MAX = 6.0
# The rule's divisions are written so that XLA computes them as written on every backend: a
# division by a constant (6, 448 * 6) is a product with its f32 reciprocal (XLA rewrites it
# so), and no array is divided by a broadcast scalar (XLA may turn that into a product with the
# scalar's reciprocal in one program and not in another).
INV_E2M1_MAX = np.float32(1 / E2M1_MAX)


def nvfp4_global_scale(tensor_amax: jax.Array) -> jax.Array:
  """The per-tensor scale ``amax * f32(1 / (448 * 6))`` (jax_fp8's convention: a dequantization
  step), so the block scales span E4M3's range, at least FLT_MIN (so the encoding factor
  ``f32(1 / 6) / global_scale`` of the block scales stays finite); 1 for an all-zero tensor,
  NaN for a tensor holding a NaN or an infinity. f32 []."""
  a = jnp.asarray(tensor_amax, jnp.float32)
  tiny = np.float32(np.finfo(np.float32).tiny)
  s = jnp.where(a > 0, jnp.maximum(a * np.float32(1 / (fp8_max("e4m3") * E2M1_MAX)), tiny),
                jnp.float32(1))
  return jnp.where(jnp.isfinite(a), s, jnp.nan)
