"""Plain-jnp twins of every jax_fp8 op: the specification and the test oracle (also of MXFP8 and
NVFP4 quantization, with stochastic rounding and the random Hadamard transform, ahead of their
kernels).

Same signatures and results as the fast ops; unfused and written to be read. Quantize results
must match the CUDA and CPU kernels bit for bit; GEMM and linear results within stated
tolerances. Tests and benchmarks import this module; the library does not. The ring rules and
the formats' numerics come from ``jax_fp8.state``, ``jax_fp8.formats``, ``stochastic_rounding``,
``hadamard`` and ``philox`` (their one jnp definition), so the twins check the kernels against
them; the result types from ``jax_fp8.quantized`` (the ops' own, so a test compares a twin's
result with the op's field by field); from ``jax_fp8.ops`` only layout constants, none of the
ops' argument checks: a twin raises only where it cannot compute.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from . import activations, norms
from .formats import (BLOCK, E2M1_MAX, E8M0_BIAS, GROUP_EPS, INV_E2M1_MAX, MX_BLOCK, NVFP4_BLOCK,
                      amax, apply_scales, as_f32, e8m0_apply, e8m0_rceil, e8m0_saturate,
                      fp8_dtype, fp8_max, nvfp4_global_scale)
from .hadamard import hadamard_transform
from .ops.cast_transpose import QT_ROW_MULTIPLE
from .ops.grouped_gemm import ROW_ALIGN as GROUPED_ROW_ALIGN
from .ops.sources import in_parts
from .philox import key_words
from .quantized import DelayedQuantized, Quantized
from .state import ScaleRing, next_ring, observe as observe_ring, scale_for_step
from .stochastic_rounding import e2m1_round_stochastic, sr_bits

_CANONICAL_NAN = 0x7F  # what the hardware's cvt.rn.satfinite writes for any NaN


def quantize(x: jax.Array, scale: jax.Array, fmt: str = "e4m3") -> Quantized:
  """``q = saturate(rne(x * (1 / scale)))``, amax = max |x|. ml_dtypes' cast does not saturate,
  so clip first; NaN becomes the canonical NaN byte 0x7F. The scale comes back as an f32
  array."""
  scale = jnp.asarray(scale, jnp.float32)
  return Quantized(data=_cast(as_f32(x) * (1.0 / as_f32(scale)), fmt), scale=scale,
                   amax=amax(x))


def quantize_delayed(x: jax.Array, ring: ScaleRing, *, observe: bool = False) -> DelayedQuantized:
  """Quantize with the ring's scale (current scaling on a fresh ring), then record the amax
  (the next ring, or with ``observe`` the ring's observation)."""
  a = amax(x)
  s = scale_for_step(ring, a)
  moved = observe_ring(ring, a) if observe else next_ring(ring, a)
  return DelayedQuantized(Quantized(data=quantize(x, s, ring.fmt).data, scale=s, amax=a), moved)


def cast_transpose_delayed(x, ring: ScaleRing, *, with_dbias: bool = False,
                           observe: bool = False) -> DelayedQuantized:
  """quantize_delayed, plus the transposed copy padded with zero columns to a multiple of 16,
  plus (optionally) the f32 column sums of x; x in parts (a tuple / list) is their
  concatenation along the columns."""
  x = jnp.concatenate(x, axis=1) if in_parts(x) else jnp.asarray(x)
  out = quantize_delayed(x, ring, observe=observe)
  q = out.tensor.data  # [R, C]
  qt = jnp.pad(q.T, ((0, 0), (0, -x.shape[0] % QT_ROW_MULTIPLE)))  # [C, ceil16(R)]
  dbias = jnp.sum(as_f32(x), axis=0) if with_dbias else None  # [C]
  return DelayedQuantized(dataclasses.replace(out.tensor, data_t=qt), out.ring, dbias)


def activation_cast_transpose(y, ring: ScaleRing, *, activation: str,
                              observe: bool = False) -> DelayedQuantized:
  """cast_transpose_delayed of the f32 activation of y (``jax_fp8.activations.apply``)."""
  return cast_transpose_delayed(activations.apply(y, activation), ring, observe=observe)


def activation_grad_cast_transpose(dh, y, ring: ScaleRing, *, activation: str,
                                   with_dbias: bool = False,
                                   observe: bool = False) -> DelayedQuantized:
  """cast_transpose_delayed of the f32 gradient through the activation
  (``jax_fp8.activations.grad``)."""
  return cast_transpose_delayed(activations.grad(dh, y, activation), ring,
                                with_dbias=with_dbias, observe=observe)


def norm_cast_transpose(x, row_stats, gamma, beta, ring: ScaleRing, *, norm: str,
                        observe: bool = False) -> DelayedQuantized:
  """cast_transpose_delayed of the f32 norm of x from its row statistics, each product and
  sum rounded on its own as the kernels round them (``jax_fp8.norms.apply``)."""
  return cast_transpose_delayed(norms.apply(x, row_stats, gamma, beta, norm), ring,
                                observe=observe)


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """``q * scale`` computed in f32, cast to ``dtype``."""
  return (q.astype(jnp.float32) * scale).astype(dtype)


def gemm(a, b, a_scale, b_scale, *, bias=None, out_dtype=jnp.bfloat16, out_scale=None):
  """``(a_scale * b_scale) * a @ b.T + bias`` with f32 products and sums; a [M, K], b [N, K].
  With ``out_scale`` (an e4m3 output): the pair (d e4m3, amax), ``quantize``'s data and amax
  of that result."""
  acc = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32).T,
                   precision=jax.lax.Precision.HIGHEST)  # [M, N]
  d = apply_scales(acc, a_scale, b_scale)
  if bias is not None:
    d = d + bias.astype(jnp.float32)
  if out_scale is None:
    return d.astype(out_dtype)
  out = quantize(d, out_scale)
  return out.data, out.amax


def _group_of_rows(group_sizes, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One-hot [rows, G] f32 of each row's group (no group: all zero), and each group's first
  row and end [G]: groups take consecutive rows from row 0, a negative size counts as 0, and
  the bounds are clipped to ``rows``."""
  end = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows)
  start = jnp.concatenate([jnp.zeros((1,), end.dtype), end[:-1]])
  row = jnp.arange(rows)[:, None]
  return ((row >= start) & (row < end)).astype(jnp.float32), start, end


def grouped_gemm(a, b, a_scale, b_scale, group_sizes, *, out_dtype=jnp.bfloat16) -> jax.Array:
  """``d[m] = a_scale * b_scale[g] * a[m] @ b[g].T`` for each row m of group g, zero for rows
  in no group; a [M, K], b [G, N, K], b_scale a scalar or [G]."""
  onehot, _, _ = _group_of_rows(group_sizes, a.shape[0])
  per_group = jnp.einsum("mk,gnk->mgn", a.astype(jnp.float32), b.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)  # every row against every group
  b_scale = jnp.broadcast_to(b_scale, (b.shape[0],))
  d = apply_scales(per_group, a_scale, b_scale[None, :, None])
  return jnp.sum(jnp.where(onehot[:, :, None] > 0, d, 0.0), axis=1).astype(out_dtype)


def grouped_gemm_wgrad(a_t, b_t, a_scale, b_scale, group_sizes, *,
                       out_dtype=jnp.float32) -> jax.Array:
  """``d[g] = a_scale * b_scale * sum over rows m of g of a_t[:, m] b_t[:, m]^T``; a_t [K, M],
  b_t [N, M]; a non-empty group whose first row is not a multiple of 16 is NaN.
  """
  onehot, start, end = _group_of_rows(group_sizes, a_t.shape[1])
  acc = jnp.einsum("km,nm,mg->gkn", a_t.astype(jnp.float32), b_t.astype(jnp.float32), onehot,
                   precision=jax.lax.Precision.HIGHEST)
  d = apply_scales(acc, a_scale, b_scale)
  bad = (start % GROUPED_ROW_ALIGN != 0) & (end > start)
  return jnp.where(bad[:, None, None], jnp.nan, d).astype(out_dtype)


def linear(x, kernel, bias=None, *, state) -> jax.Array:
  """The FP8 linear's forward, unfused: quantize x and kernel with their rings (E4M3), GEMM in
  f32, add the bias. ``x [..., K]``, ``kernel [K, N]``, returns ``[..., N]`` in x's dtype.
  (The recipe is implied by the rings; the amax axis changes only the rings' update.)"""
  x2 = x.reshape(-1, x.shape[-1])  # [M, K]
  cx = quantize_delayed(x2, state.x).tensor
  ck = quantize_delayed(kernel, state.kernel).tensor  # [K, N]
  y = gemm(cx.data, ck.data.T, cx.scale, ck.scale, out_dtype=jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype).reshape(*x.shape[:-1], kernel.shape[-1])


def grouped_linear(x, kernels, group_sizes, bias=None, *, state) -> jax.Array:
  """The FP8 grouped linear's forward, unfused: x quantized with its ring, each expert kernel
  with its own ring of the stacked ``state.kernels`` (E4M3), the grouped GEMM in f32, each
  row's group's bias added (none for a row in no group). ``x [M, K]``, ``kernels [G, K, N]``,
  ``bias [G, N]``; returns ``[M, N]`` in x's dtype."""
  cx = quantize_delayed(x, state.x).tensor  # [M, K]
  ck = jax.vmap(lambda k, r: quantize_delayed(k, r).tensor)(kernels, state.kernels)  # [G, K, N]
  y = grouped_gemm(cx.data, jnp.swapaxes(ck.data, 1, 2), cx.scale, ck.scale, group_sizes,
                   out_dtype=jnp.float32)  # [M, N]
  if bias is not None:
    onehot, _, _ = _group_of_rows(group_sizes, x.shape[0])  # [M, G]
    y = y + onehot @ bias.astype(jnp.float32)
  return y.astype(x.dtype)

# Block scaling (DeepSeek-V3 recipe; csrc/numerics.h group_scale and the block kernels).

def group_scale(amax_: jax.Array, eps: float, fmt: str, ue8m0: bool) -> jax.Array:
  """Scale of a group or block: ``max(amax, eps) * f32(1 / fmt_max)``, NaN and inf kept; with
  ue8m0 rounded up to a power of two from the f32 bits."""
  a = jnp.where(jnp.isnan(amax_) | (amax_ >= eps), amax_, jnp.float32(eps))
  s = a * (np.float32(1.0) / np.float32(fp8_max(fmt)))
  if not ue8m0:
    return s
  b = jax.lax.bitcast_convert_type(s, jnp.uint32)
  up = jax.lax.bitcast_convert_type((b + np.uint32(0x007FFFFF)) & np.uint32(0xFF800000),
                                   jnp.float32)
  return jnp.where(jnp.isfinite(s), up, s)


def _cast(y: jax.Array, fmt: str) -> jax.Array:
  """f32 -> FP8 with saturation and the canonical NaN, as ``quantize``."""
  dt, fmax = fp8_dtype(fmt), fp8_max(fmt)
  q = jnp.clip(y, -fmax, fmax).astype(dt)
  return jnp.where(jnp.isnan(y), jax.lax.bitcast_convert_type(jnp.uint8(_CANONICAL_NAN), dt), q)


def group_quantize(x, *, group_size=BLOCK, fmt="e4m3", eps=GROUP_EPS, ue8m0=False,
                   scale_layout="row") -> Quantized:
  """Per-token-group quantization: groups of ``group_size`` along the last axis.
  ``x [..., K]`` -> ``data [..., K]``, ``scale`` ``[..., K/g]`` ("row"), ``[K/g, M]`` ("col", M
  the product of the leading dims) or ``[K/g, ceil4(M)]`` zero-padded ("col_tma")."""
  *lead, k = x.shape
  g = x.reshape(*lead, k // group_size, group_size)
  s = group_scale(amax(g, axis=-1), eps, fmt, ue8m0)  # [..., K/g]
  q = _cast(as_f32(g) * (1.0 / s)[..., None], fmt).reshape(x.shape)
  if scale_layout == "row":
    return Quantized(data=q, scale=s)
  st = s.reshape(-1, k // group_size).T  # [K/g, M]
  if scale_layout == "col_tma":
    st = jnp.pad(st, ((0, 0), (0, -st.shape[1] % 4)))
  return Quantized(data=q, scale=st)


def _tiles(x, fill=0.0):
  """x [R, C] padded with ``fill`` to multiples of 128 and viewed as [R/128, 128, C/128, 128]."""
  r, c = x.shape
  xp = jnp.pad(as_f32(x), ((0, -r % BLOCK), (0, -c % BLOCK)), constant_values=fill)
  return xp.reshape(xp.shape[0] // BLOCK, BLOCK, xp.shape[1] // BLOCK, BLOCK)


def block_quantize(w, *, fmt="e4m3", eps=GROUP_EPS, ue8m0=False) -> Quantized:
  """128 x 128 block quantization of ``w [R, C]``: ``data [R, C]``, ``scale``
  ``[ceil(R/128), ceil(C/128)]``; edge blocks use only the elements they hold."""
  r, c = w.shape
  t = _tiles(w)
  s = group_scale(amax(t, axis=(1, 3)), eps, fmt, ue8m0)  # [R/128, C/128]
  q = _cast(t * (1.0 / s)[:, None, :, None], fmt).reshape(t.shape[0] * BLOCK, -1)[:r, :c]
  return Quantized(data=q, scale=s)


def group_cast_transpose(x, *, fmt="e4m3", eps=GROUP_EPS, ue8m0=False) -> Quantized:
  """Both directions of 128-element group quantization of ``x [R, C]`` (C a multiple of 128):
  ``data [R, C]`` with ``scale [R, C/128]`` (groups along rows of x), and ``data_t
  [C, ceil128(R)]`` with ``scale_t [C, ceil128(R)/128]`` (groups along columns of x,
  zero-padded)."""
  rows = group_quantize(x, group_size=BLOCK, fmt=fmt, eps=eps, ue8m0=ue8m0)  # [R, C]
  r = x.shape[0]
  xt = jnp.pad(as_f32(x).T, ((0, 0), (0, -r % BLOCK)))  # zero pad: amax unchanged
  cols = group_quantize(xt, group_size=BLOCK, fmt=fmt, eps=eps, ue8m0=ue8m0)  # [C, R128]
  qt = jnp.where(jnp.arange(cols.data.shape[1]) < r, cols.data,
                 jnp.zeros((), cols.data.dtype))  # zero bytes
  return Quantized(data=rows.data, scale=rows.scale, data_t=qt, scale_t=cols.scale)


def norm_group_cast_transpose(x, row_stats, gamma, beta, *, norm: str, fmt="e4m3", eps=GROUP_EPS,
                              ue8m0=False):
  """group_cast_transpose of the f32 norm of x from its row statistics, each product and sum
  rounded on its own as the kernels round them (``jax_fp8.norms.apply``)."""
  return group_cast_transpose(norms.apply(x, row_stats, gamma, beta, norm), fmt=fmt, eps=eps,
                              ue8m0=ue8m0)


def activation_group_cast_transpose(y, *, activation: str, fmt="e4m3", eps=GROUP_EPS, ue8m0=False):
  """group_cast_transpose of the f32 activation of y (``jax_fp8.activations.apply``)."""
  return group_cast_transpose(activations.apply(y, activation), fmt=fmt, eps=eps, ue8m0=ue8m0)


def activation_grad_group_cast_transpose(dh, y, *, activation: str, fmt="e4m3", eps=GROUP_EPS,
                                         ue8m0=False):
  """group_cast_transpose of the f32 gradient through the activation
  (``jax_fp8.activations.grad``; [dgate | dup] when gated)."""
  return group_cast_transpose(activations.grad(dh, y, activation), fmt=fmt, eps=eps,
                              ue8m0=ue8m0)


def expand_scales(scale, rows: int, cols: int, block_rows: int) -> jax.Array:
  """The scale of each element [rows, cols] of block scales [ceil(rows / block_rows),
  ceil(cols / 128)] with blocks of block_rows x 128: element (i, j) reads
  scale[i // block_rows, j // 128]. ValueError for scales of another shape."""
  want = (-(-rows // block_rows), -(-cols // BLOCK))
  if scale.shape != want:
    raise ValueError(f"scales of {rows} x {cols} in blocks of {block_rows} x {BLOCK} must be "
                     f"{want}, got {scale.shape}")
  return scale[(jnp.arange(rows) // block_rows)[:, None], (jnp.arange(cols) // BLOCK)[None, :]]


def block_gemm(a, b, a_scale, b_scale, *, bias=None, out_dtype=jnp.bfloat16) -> jax.Array:
  """Block-scaled ``a @ b.T`` in f32: a [M, K] with 1 x 128 scales a_scale [M, K/128]; b [N, K]
  with 128 x 128 scales [ceil(N/128), K/128] or 1 x 128 scales [N, K/128]."""
  (m, k), n = a.shape, b.shape[0]
  af = a.astype(jnp.float32) * expand_scales(a_scale, m, k, 1)
  bf = b.astype(jnp.float32) * expand_scales(b_scale, n, k, 1 if b_scale.shape[0] == n else BLOCK)
  return gemm(af, bf, jnp.float32(1), jnp.float32(1), bias=bias, out_dtype=out_dtype)


def block_linear(x, kernel, bias=None, *, recipe) -> jax.Array:
  """The block-scaled linear's forward, unfused: x in 1 x 128 groups along K, the kernel in
  128 x 128 blocks (E4M3), block GEMM in f32, plus the bias; ``x [..., K]``, ``kernel [K, N]``,
  returns ``[..., N]`` in x's dtype."""
  kw = {"fmt": "e4m3", "eps": recipe.eps, "ue8m0": recipe.ue8m0}
  x2 = x.reshape(-1, x.shape[-1])
  qx = group_quantize(x2, **kw)
  qk = block_quantize(kernel, **kw)
  y = block_gemm(qx.data, qk.data.T, qx.scale, qk.scale.T, out_dtype=jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype).reshape(*x.shape[:-1], kernel.shape[-1])


def _mxfp8_rowwise(x, fmt):
  """x [R, C] -> (data FP8 [R, C], scales E8M0 [R, C/32]), blocks along the rows."""
  r, c = x.shape
  xb = as_f32(x).reshape(r, c // MX_BLOCK, MX_BLOCK)
  scales = e8m0_rceil(amax(xb, axis=-1), fmt)
  k = scales.astype(jnp.int32) - E8M0_BIAS
  xb = e8m0_saturate(xb, scales[..., None], fmt)
  q = _cast(jnp.ldexp(xb, -k[..., None]), fmt)  # exact: a power of two
  q = jnp.where((scales == 0xFF)[..., None], _cast(jnp.float32(jnp.nan), fmt), q)
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
  scales = _cast(block_amax * encode, "e4m3")  # RNE, saturating, NaN kept
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
