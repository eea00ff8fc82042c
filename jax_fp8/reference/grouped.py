"""The grouped (ragged) twins of a mixture of experts: ``grouped_gemm``, ``grouped_gemm_wgrad``
and ``grouped_linear`` (``jax.lax.ragged_dot``'s groups: consecutive rows, negative sizes
counting as 0, clipped at M)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..formats import apply_scales
from ..ops.grouped_gemm import ROW_ALIGN as GROUPED_ROW_ALIGN
from .per_tensor import quantize_delayed


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
