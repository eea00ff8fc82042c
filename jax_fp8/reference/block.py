"""The block-scaling twins (DeepSeek-V3; csrc/numerics.h ``group_scale`` and the block kernels):
1 x 128 groups and 128 x 128 blocks, their cast-transposes with norm / activation sources,
``block_gemm`` and ``block_linear``."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import activations, norms
from ..formats import BLOCK, GROUP_EPS, amax, as_f32, fp8_max, top_scale_saturate
from ..quantized import Quantized
from .per_tensor import cast, gemm


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


def _saturated(x, fmt: str, ue8m0: bool) -> jax.Array:
  """x in f32, under ue8m0 scales with the top scale's saturation (``top_scale_saturate``)."""
  return top_scale_saturate(as_f32(x), fmt) if ue8m0 else as_f32(x)


def group_quantize(x, *, group_size=BLOCK, fmt="e4m3", eps=GROUP_EPS, ue8m0=False,
                   scale_layout="row") -> Quantized:
  """Per-token-group quantization: groups of ``group_size`` along the last axis.
  ``x [..., K]`` -> ``data [..., K]``, ``scale`` ``[..., K/g]`` ("row"), ``[K/g, M]`` ("col", M
  the product of the leading dims) or ``[K/g, ceil4(M)]`` zero-padded ("col_tma")."""
  *lead, k = x.shape
  g = x.reshape(*lead, k // group_size, group_size)
  s = group_scale(amax(g, axis=-1), eps, fmt, ue8m0)  # [..., K/g]
  q = cast(_saturated(g, fmt, ue8m0) * (1.0 / s)[..., None], fmt).reshape(x.shape)
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
  q = cast(_saturated(t, fmt, ue8m0) * (1.0 / s)[:, None, :, None], fmt)
  q = q.reshape(t.shape[0] * BLOCK, -1)[:r, :c]
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
