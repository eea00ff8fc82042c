"""Plain-jnp twins of every jax_fp8 op: the specification and the test oracle.

Same signatures as the fast ops; unfused and written to be read. Quantize results must match
the CUDA and CPU kernels bit for bit; GEMM and linear results within stated tolerances.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .scaling import ScaleRing, fp8_dtype, fp8_max, next_ring, scale_for_step

_CANONICAL_NAN = 0x7F  # what the hardware's cvt.rn.satfinite writes for any NaN


def as_f32(x: jax.Array) -> jax.Array:
  """x in f32 with subnormals flushed to (signed) zero: f32 subnormals count as zero on every
  backend (XLA's CPU runtime flushes them, GPUs do not)."""
  x = jnp.asarray(x).astype(jnp.float32)
  return jnp.where(jnp.abs(x) < np.finfo(np.float32).tiny, x * 0, x)


def amax(x: jax.Array) -> jax.Array:
  """max |x| in f32 (NaN if x holds a NaN), f32 []. The NaN is explicit: XLA's CPU max
  reduction can drop NaNs (seen with jax 0.10.2 on a [52, 80] array)."""
  a = jnp.abs(as_f32(x))
  nan = jnp.isnan(a)
  return jnp.where(jnp.any(nan), jnp.nan, jnp.max(jnp.where(nan, 0.0, a), initial=0.0))


def quantize(x: jax.Array, scale: jax.Array, fmt: str = "e4m3") -> tuple[jax.Array, jax.Array]:
  """``q = saturate(rne(x * (1 / scale)))``, amax = max |x|. ml_dtypes' cast does not saturate,
  so clip first; NaN becomes the canonical NaN byte 0x7F."""
  dt = fp8_dtype(fmt)
  fmax = fp8_max(fmt)
  y = as_f32(x) * (1.0 / as_f32(scale))
  q = jnp.clip(y, -fmax, fmax).astype(dt)
  nan = jax.lax.bitcast_convert_type(jnp.uint8(_CANONICAL_NAN), dt)
  q = jnp.where(jnp.isnan(y), nan, q)
  return q, amax(x)


def quantize_delayed(x: jax.Array, ring: ScaleRing) -> tuple[jax.Array, jax.Array, ScaleRing]:
  """Quantize with the ring's scale (current scaling on a fresh ring), then record the amax."""
  a = amax(x)
  q, _ = quantize(x, scale_for_step(ring, a), ring.fmt)
  return q, a, next_ring(ring, a)


def cast_transpose_delayed(x, ring: ScaleRing, *, with_dbias: bool = False):
  """quantize_delayed, plus the transposed copy padded with zero columns to a multiple of 16,
  plus (optionally) the f32 column sums of x."""
  q, a, nxt = quantize_delayed(x, ring)  # [R, C]
  pad = -x.shape[0] % 16
  qt = jnp.pad(q.T, ((0, 0), (0, pad)))  # [C, ceil16(R)]
  dbias = jnp.sum(as_f32(x), axis=0) if with_dbias else None  # [C]
  return q, qt, a, nxt, dbias


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """``q * scale`` computed in f32, cast to ``dtype``."""
  return (q.astype(jnp.float32) * scale).astype(dtype)


def gemm(a, b, a_scale, b_scale, *, bias=None, out_dtype=jnp.bfloat16) -> jax.Array:
  """``(a_scale * b_scale) * a @ b.T + bias`` with f32 products and sums; a [M, K], b [N, K]."""
  acc = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32).T,
                   precision=jax.lax.Precision.HIGHEST)  # [M, N]
  d = acc * (a_scale * b_scale)
  if bias is not None:
    d = d + bias.astype(jnp.float32)
  return d.astype(out_dtype)


def linear(x, kernel, bias=None, *, state) -> jax.Array:
  """The FP8 linear's forward, unfused: quantize x and kernel with their rings (E4M3), GEMM in
  f32, add the bias. ``x [..., K]``, ``kernel [K, N]``, returns ``[..., N]`` in x's dtype.
  (The recipe is implied by the rings; the amax axis changes only the rings' update.)"""
  x2 = x.reshape(-1, x.shape[-1])  # [M, K]
  qx, _, _ = quantize_delayed(x2, state.x)
  qk, _, _ = quantize_delayed(kernel, state.kernel)  # [K, N]
  sx = scale_for_step(state.x, amax(x2))
  sk = scale_for_step(state.kernel, amax(kernel))
  y = gemm(qx, qk.T, sx, sk, out_dtype=jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  return y.astype(x.dtype).reshape(*x.shape[:-1], kernel.shape[-1])
