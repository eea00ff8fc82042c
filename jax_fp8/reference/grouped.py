"""The grouped (ragged) twins of a mixture of experts: ``grouped_gemm``, ``grouped_gemm_wgrad``
(per-tensor or block scales), ``grouped_linear`` and ``block_grouped_linear``
(``jax.lax.ragged_dot``'s groups: consecutive rows, negative sizes counting as 0, clipped at
M)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..formats import BLOCK, BLOCK_ROW_ALIGN, ROW_ALIGN, apply_scales
from .block import block_quantize, expand_scales, group_quantize
from .per_tensor import quantize_delayed


def _group_of_rows(group_sizes, rows: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """One-hot [rows, G] f32 of each row's group (no group: all zero), and each group's first
  row and end [G]: groups take consecutive rows from row 0, a negative size counts as 0, and
  the bounds are clipped to ``rows`` (the running sum saturating there, never wrapping)."""
  end = jax.lax.associative_scan(lambda a, b: jnp.minimum(a, rows - b) + b,
                                 jnp.clip(group_sizes, 0, rows))
  start = jnp.concatenate([jnp.zeros((1,), end.dtype), end[:-1]])
  row = jnp.arange(rows)[:, None]
  return ((row >= start) & (row < end)).astype(jnp.float32), start, end


def grouped_gemm(a, b, a_scale, b_scale, group_sizes, *, out_dtype=jnp.bfloat16) -> jax.Array:
  """``d[m] = a_scale * b_scale[g] * a[m] @ b[g].T`` for each row m of group g, zero for rows
  in no group; a [M, K], b [G, N, K], b_scale a scalar or [G]. Block scales (a_scale
  [M, K/128], b_scale [G, ceil(N/128), K/128]): a and each b[g] dequantized first, as
  ``block_gemm`` does, then the same product with unit scales."""
  if jnp.ndim(a_scale) == 2:
    (m, k), n = a.shape, b.shape[1]
    a = a.astype(jnp.float32) * expand_scales(a_scale, m, k, 1)  # [M, K]
    b = jax.vmap(lambda bg, s: bg.astype(jnp.float32) * expand_scales(s, n, k, BLOCK))(
        b, b_scale)  # [G, N, K]
    a_scale = b_scale = jnp.float32(1)
  onehot, _, _ = _group_of_rows(group_sizes, a.shape[0])
  per_group = jnp.einsum("mk,gnk->mgn", a.astype(jnp.float32), b.astype(jnp.float32),
                         precision=jax.lax.Precision.HIGHEST)  # every row against every group
  b_scale = jnp.broadcast_to(b_scale, (b.shape[0],))
  d = apply_scales(per_group, a_scale, b_scale[None, :, None])
  return jnp.sum(jnp.where(onehot[:, :, None] > 0, d, 0.0), axis=1).astype(out_dtype)


def grouped_gemm_wgrad(a_t, b_t, a_scale, b_scale, group_sizes, *,
                       out_dtype=jnp.float32) -> jax.Array:
  """``d[g] = a_scale * b_scale * sum over rows m of g of a_t[:, m] b_t[:, m]^T``; a_t [K, M],
  b_t [N, M]; a non-empty group whose first row is not a multiple of 16 is NaN. Block scales
  (a_scale [K, M/128], b_scale [N, M/128]): a_t and b_t dequantized first, the same sums with
  unit scales, and a non-empty group whose first row is not a multiple of 128 NaN.
  """
  align = ROW_ALIGN
  if jnp.ndim(a_scale) == 2:
    a_t = a_t.astype(jnp.float32) * expand_scales(a_scale, *a_t.shape, 1)  # [K, M]
    b_t = b_t.astype(jnp.float32) * expand_scales(b_scale, *b_t.shape, 1)  # [N, M]
    a_scale = b_scale = jnp.float32(1)
    align = BLOCK_ROW_ALIGN
  onehot, start, end = _group_of_rows(group_sizes, a_t.shape[1])
  acc = jnp.einsum("km,nm,mg->gkn", a_t.astype(jnp.float32), b_t.astype(jnp.float32), onehot,
                   precision=jax.lax.Precision.HIGHEST)
  d = apply_scales(acc, a_scale, b_scale)
  bad = (start % align != 0) & (end > start)
  return jnp.where(bad[:, None, None], jnp.nan, d).astype(out_dtype)


def grouped_linear(x, kernels, group_sizes, bias=None, *, state) -> jax.Array:
  """The FP8 grouped linear's forward, unfused: x quantized with its ring, each expert kernel
  with its own ring of the stacked ``state.kernels`` (E4M3), the grouped GEMM in f32, each
  row's group's bias added (none for a row in no group). ``x [M, K]``, ``kernels [G, K, N]``,
  ``bias [G, N]``; returns ``[M, N]`` in x's dtype."""
  cx = quantize_delayed(x, state.x).tensor  # [M, K]
  ck = jax.vmap(lambda k, r: quantize_delayed(k, r).tensor)(kernels, state.kernels)  # [G, K, N]
  y = grouped_gemm(cx.data, jnp.swapaxes(ck.data, 1, 2), cx.scale, ck.scale, group_sizes,
                   out_dtype=jnp.float32)  # [M, N]
  return _plus_group_bias(y, bias, group_sizes).astype(x.dtype)


def _plus_group_bias(y, bias, group_sizes) -> jax.Array:
  """y [M, N] f32 plus each row's group's bias [G, N] in f32 (none for a row in no group)."""
  if bias is None:
    return y
  onehot, _, _ = _group_of_rows(group_sizes, y.shape[0])  # [M, G]
  return y + onehot @ bias.astype(jnp.float32)


def block_grouped_linear(x, kernels, group_sizes, bias=None, *, recipe) -> jax.Array:
  """The block-scaled grouped linear's forward, unfused: x in 1 x 128 groups along K, each
  expert kernel in 128 x 128 blocks (E4M3), the block-scaled grouped GEMM in f32, each row's
  group's bias added (none for a row in no group). ``x [M, K]``, ``kernels [G, K, N]``,
  ``bias [G, N]``; returns ``[M, N]`` in x's dtype."""
  kw = {"fmt": "e4m3", "eps": recipe.eps, "ue8m0": recipe.ue8m0}
  qx = group_quantize(x, **kw)  # [M, K], scale [M, K/128]
  qk = jax.vmap(lambda k: block_quantize(k, **kw))(kernels)  # [G, K, N], scale [G, K/128, N/128]
  y = grouped_gemm(qx.data, jnp.swapaxes(qk.data, 1, 2), qx.scale, jnp.swapaxes(qk.scale, 1, 2),
                   group_sizes, out_dtype=jnp.float32)  # [M, N]
  return _plus_group_bias(y, bias, group_sizes).astype(x.dtype)
