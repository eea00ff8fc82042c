"""The MXFP8 and NVFP4 twins (OCP MX v1.0; NVIDIA's NVFP4: E4M3 block scales over a global
scale, stochastic rounding, the random Hadamard transform) and their GEMMs on the dequantized
operands."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..formats import (E2M1_MAX, E8M0_BIAS, INV_E2M1_MAX, MX_BLOCK, NVFP4_BLOCK, amax, as_f32,
                       e8m0_apply, e8m0_rceil, e8m0_saturate, nvfp4_global_scale)
from ..hadamard import hadamard_transform
from ..philox import key_words
from ..quantized import Quantized
from ..stochastic_rounding import e2m1_round_stochastic, sr_bits
from .per_tensor import cast


def _mxfp8_rowwise(x, fmt):
  """x [R, C] -> (data FP8 [R, C], scales E8M0 [R, C/32]), blocks along the rows."""
  r, c = x.shape
  xb = as_f32(x).reshape(r, c // MX_BLOCK, MX_BLOCK)
  scales = e8m0_rceil(amax(xb, axis=-1), fmt)
  k = scales.astype(jnp.int32) - E8M0_BIAS
  xb = e8m0_saturate(xb, scales[..., None], fmt)
  q = cast(jnp.ldexp(xb, -k[..., None]), fmt)  # exact: a power of two
  q = jnp.where((scales == 0xFF)[..., None], cast(jnp.float32(jnp.nan), fmt), q)
  return q.reshape(r, c), scales


def mxfp8_quantize(x, *, rowwise=True, columnwise=False, fmt="e4m3") -> Quantized:
  """MXFP8 (OCP MX v1.0): E4M3 (or E5M2) elements with one E8M0 scale per 32 consecutive
  elements, rounded up (``formats.e8m0_rceil``): ``x ~= data * 2**(scale - 127)``. A block
  holding a NaN or an infinity gets the NaN scale 0xFF and NaN data.

  x [R, C] (f32 / bf16 / f16; C a multiple of 32, and R too with ``columnwise``) -> a
  ``Quantized`` with ``data`` [R, C] and ``scale`` uint8 [R, C/32] (``rowwise``), ``data_t``
  [C, R] and ``scale_t`` [C, R/32] (``columnwise``: x.T quantized the same way, from x
  itself)."""
  data, scale = _mxfp8_rowwise(x, fmt) if rowwise else (None, None)  # [R, C], [R, C/32]
  data_t, scale_t = _mxfp8_rowwise(x.T, fmt) if columnwise else (None, None)  # [C, R], [C, R/32]
  return Quantized(data=data, scale=scale, data_t=data_t, scale_t=scale_t)


def mxfp8_dequantize(data, scales, dtype=jnp.float32):
  """``data * 2**(scales - 127)`` in ``dtype``; data [R, C], scales [R, C/32]."""
  return e8m0_apply(data.astype(jnp.float32), jnp.repeat(scales, MX_BLOCK, axis=1)).astype(dtype)


def mxfp8_gemm(a, b, a_scales, b_scales, *, out_dtype=jnp.bfloat16):
  """``a @ b.T`` of MXFP8 operands (a [M, K], b [N, K], scales [., K/32]) from their f32 values,
  summed in f32 at full precision."""
  return jnp.matmul(mxfp8_dequantize(a, a_scales), mxfp8_dequantize(b, b_scales).T,
                    precision=jax.lax.Precision.HIGHEST).astype(out_dtype)


def _nvfp4_rowwise(x, global_scale, block_2d, bits=None):
  """x [R, C] f32 -> (data uint8 [R, C/2], scales E4M3 [R, C/16]); with ``block_2d`` one scale
  per 16 x 16 tile, repeated on each of its 16 rows; with ``bits`` (uint32 [R, C], 16-bit
  integers) stochastic rounding, else round-to-nearest-even."""
  r, c = x.shape
  xb = x.reshape(r, c // NVFP4_BLOCK, NVFP4_BLOCK)
  block_amax = amax(xb, axis=-1)  # [R, C/16]
  if block_2d:  # the max over each tile's 16 rows, for every row of the tile
    tiles = block_amax.reshape(r // NVFP4_BLOCK, NVFP4_BLOCK, -1)
    nan = jnp.any(jnp.isnan(tiles), axis=1, keepdims=True)
    tile = jnp.where(nan, jnp.nan, jnp.max(jnp.where(jnp.isnan(tiles), 0, tiles), axis=1,
                                             keepdims=True))
    block_amax = jnp.broadcast_to(tile, tiles.shape).reshape(r, -1)
  encode = INV_E2M1_MAX / global_scale  # a scalar: no array is divided by a broadcast
  scales = cast(block_amax * encode, "e4m3")  # RNE, saturating, NaN kept
  step = scales.astype(jnp.float32) * global_scale  # an element's dequantization step
  inv = jnp.where(step > 0, 1 / step, 0.0)  # x * (1 / step), jax_fp8's rule for every format
  y = xb * inv[..., None]
  y = jnp.where(jnp.isnan(y), 0.0, jnp.clip(y, -E2M1_MAX, E2M1_MAX))  # NaN: its scale says so
  if bits is not None:  # exact E2M1 values, so the cast below keeps them
    y = e2m1_round_stochastic(y, bits.reshape(y.shape))
  codes = jax.lax.bitcast_convert_type(y.astype(jnp.float4_e2m1fn), jnp.uint4).astype(jnp.uint8)
  codes = codes.reshape(r, c // 2, 2)
  return codes[..., 0] | (codes[..., 1] << 4), scales


def nvfp4_quantize(x, *, rowwise=True, columnwise=False, block_2d=False,
                   stochastic_rounding=False, key=None, rht=False, rht_seed=None, global_amax=None,
                   global_amax_t=None) -> Quantized:
  """NVFP4: ``x ~= e2m1 * scale * global_scale``, the global scale
  ``formats.nvfp4_global_scale(amax(x))``, each block's scale ``e4m3(block_amax *
  (f32(1 / 6) / global_scale))``, each element ``e2m1(x * (1 / (scale * global_scale)))`` saturating at +-6 (an
  all-zero block: scale 0, elements 0), rounded to nearest even or, with
  ``stochastic_rounding``, by ``stochastic_rounding.e2m1_round_stochastic`` with the bits
  ``stochastic_rounding.sr_bits`` draws under ``key`` (direction 0 for the rowwise copy, 1 for
  the columnwise). A NaN or infinity makes its block's scale NaN (and the global scale NaN).

  x [R, C] (f32 / bf16 / f16; C a multiple of 16, and R too with ``columnwise`` or
  ``block_2d``) -> a ``Quantized`` with ``global_scale`` f32 [], and ``data`` uint8 [R, C/2]
  (element 2i in the low nibble) with ``scale`` float8_e4m3fn [R, C/16] (``rowwise``),
  ``data_t`` / ``scale_t`` the same for x.T (``columnwise``). ``block_2d``: 16 x 16 tiles, one scale each
  (repeated on the tile's rows), so the two directions hold the same numbers (round to
  nearest only). ``rht``: the columnwise copy quantizes x.T with each 16-element group of its
  rows through ``hadamard.hadamard_transform(., rht_seed)`` (``rht_seed`` a Python int, None:
  0), under its own global scale ``global_scale_t`` (from the transformed tensor's amax).
  ``global_amax`` / ``global_amax_t``: the amax (f32 []) to take the global scales from
  instead of this x's, e.g. the max over the devices that hold parts of the tensor; a value
  below the tensor's own amax saturates the block scales at 448 and the elements at +-6.

  Raises ValueError only where the twin cannot compute: ``stochastic_rounding`` without a
  ``key`` (or with a key that is not two uint32 words), a global amax that is not a scalar. The
  combinations ``jax_fp8.nvfp4_quantize`` refuses besides (stochastic rounding with
  ``block_2d``, ``rht`` without ``columnwise`` or with ``block_2d``, an option given without
  the one it belongs to) are the op's own checks, tested there; here such an option is
  computed as written or has no effect."""
  if stochastic_rounding and key is None:
    raise ValueError("stochastic_rounding=True draws its bits under a key: got key=None")
  for name, v in (("global_amax", global_amax), ("global_amax_t", global_amax_t)):
    if v is not None and jnp.shape(v) != ():
      raise ValueError(f"{name} must be a scalar, got shape {jnp.shape(v)}")
  x = as_f32(x)
  r, c = x.shape
  words = key_words(key) if stochastic_rounding else None
  bits = lambda rows, cols, direction: (  # noqa: E731
      None if words is None else sr_bits(words, rows, cols // NVFP4_BLOCK, direction))
  gs = nvfp4_global_scale(amax(x) if global_amax is None else global_amax)
  data = scale = data_t = scale_t = gs_t = None
  if rowwise:
    data, scale = _nvfp4_rowwise(x, gs, block_2d, bits(r, c, 0))  # [R, C/2], [R, C/16]
  if columnwise:
    xt, gs_cols = x.T, gs
    if rht:
      xt = hadamard_transform(xt, 0 if rht_seed is None else rht_seed)
      gs_t = gs_cols = nvfp4_global_scale(amax(xt) if global_amax_t is None else global_amax_t)
    data_t, scale_t = _nvfp4_rowwise(xt, gs_cols, block_2d, bits(c, r, 1))  # [C, R/2], [C, R/16]
  return Quantized(data=data, scale=scale, data_t=data_t, scale_t=scale_t, global_scale=gs,
                   global_scale_t=gs_t)


def nvfp4_gemm(a, b, a_scales, b_scales, a_global_scale, b_global_scale, *,
               out_dtype=jnp.bfloat16):
  """``a @ b.T`` of NVFP4 operands (data uint8 [., K/2], scales [., K/16], global scales f32
  []) from their f32 values, summed in f32 at full precision."""
  return jnp.matmul(nvfp4_dequantize(a, a_scales, a_global_scale),
                    nvfp4_dequantize(b, b_scales, b_global_scale).T,
                    precision=jax.lax.Precision.HIGHEST).astype(out_dtype)


def nvfp4_dequantize(data, scales, global_scale, dtype=jnp.float32):
  """``e2m1 * scale * global_scale`` in ``dtype``; data uint8 [R, C/2], scales [R, C/16]."""
  r, half = data.shape
  codes = jnp.stack([data & 0xF, data >> 4], axis=-1).reshape(r, 2 * half).astype(jnp.uint4)
  values = jax.lax.bitcast_convert_type(codes, jnp.float4_e2m1fn).astype(jnp.float32)
  step = jnp.repeat(scales.astype(jnp.float32), NVFP4_BLOCK, axis=1) * global_scale
  return (values * step).astype(dtype)
