"""The per-tensor twins: ``quantize`` (saturating, the canonical NaN), the delayed-scaling
cast-transposes and their norm / activation forms, ``dequantize``, ``gemm`` and ``linear``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import activations, norms
from ..formats import amax, apply_scales, as_f32, fp8_dtype, fp8_max
from ..ops.cast_transpose import QT_ROW_MULTIPLE
from ..ops.sources import in_parts
from ..quantized import DelayedQuantized, Quantized
from ..state import ScaleRing, next_ring, observe as observe_ring, scale_for_step


_CANONICAL_NAN = 0x7F  # what the hardware's cvt.rn.satfinite writes for any NaN


def quantize(x: jax.Array, scale: jax.Array, fmt: str = "e4m3") -> Quantized:
  """``q = saturate(rne(x * (1 / scale)))``, amax = max |x|. ml_dtypes' cast does not saturate,
  so clip first; NaN becomes the canonical NaN byte 0x7F. The scale comes back as an f32
  array."""
  scale = jnp.asarray(scale, jnp.float32)
  return Quantized(data=cast(as_f32(x) * (1.0 / as_f32(scale)), fmt), scale=scale,
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


def cast(y: jax.Array, fmt: str) -> jax.Array:
  """f32 -> FP8 with saturation and the canonical NaN, as ``quantize``."""
  dt, fmax = fp8_dtype(fmt), fp8_max(fmt)
  q = jnp.clip(y, -fmax, fmax).astype(dt)
  return jnp.where(jnp.isnan(y), jax.lax.bitcast_convert_type(jnp.uint8(_CANONICAL_NAN), dt), q)


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
