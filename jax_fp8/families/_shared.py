"""What several families' rules share: the input norm's two ends, the output cut by ``split``,
zero rows for whole blocks along M, the bias gradient by XLA, the ``CastKernel`` counts, and for
the grouped linears the rows' groups, their biases and bias gradients, the GEMMs' output dtype
and the layout whose groups start at aligned rows."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import norms
from ..ops.grouped_gemm import group_bounds
from ..quantized import Quantized


class Cast(NamedTuple):
  """A ``CastKernel`` as a family's rules take it (``cast_kernel.check_cast``): the kernel's FP8
  copies and ``uses``, the zero whose gradient counts the layers' FP8 uses of the cast."""

  fp8: Quantized
  uses: jax.Array


def normalized(x, norm_params, norm):
  """x's norm by XLA in f32 (``norm``: (name, epsilon)), or x without one."""
  if norm is None:
    return x
  return norms.normalize(x, *norm_params, norm=norm[0], epsilon=norm[1])


def input_grad(dx, normed, norm, x_dtype):
  """(dx, the norm parameters' gradients) from the gradient of the GEMMs' input: through the
  norm (its jnp backward, which XLA fuses; ``normed``: the residual (x, norm_params)), or dx
  itself in x's dtype without one."""
  if norm is None:
    return dx.astype(x_dtype), (None, None)
  x, norm_params = normed
  name, epsilon = norm
  _, vjp = jax.vjp(lambda x, g, b: norms.normalize(x, g, b, norm=name, epsilon=epsilon), x,
                   *norm_params)
  dx, *grads = vjp(dx.astype(jnp.float32))
  return dx, tuple(grads)


def normed_residual(x, norm_params, norm):
  """What the backward of a fused norm needs: (x, norm_params), or None without a norm."""
  return None if norm is None else (x, norm_params)


def split_output(ys, split):
  """The one output of ``ys`` cut along its last axis into parts of ``split``'s sizes (None:
  ys as they are)."""
  if split is None:
    return ys
  return tuple(jnp.split(ys[0], list(itertools.accumulate(split))[:-1], axis=-1))


def pad_rows(v, multiple: int):
  """v [M, C] with zero rows appended up to a multiple of ``multiple``: whole MXFP8 / NVFP4
  blocks along M for wgrad. Zeros change no block's amax and add nothing to a sum; NVFP4's
  Hadamard transform, the same on both wgrad operands, cancels in their product whatever the
  rows hold."""
  return jnp.pad(v, ((0, -v.shape[0] % multiple), (0, 0)))


def bias_grad(g, b_dtype):
  """dbias, the column sums of g [M, N] in f32 by XLA, in the bias's dtype (None without a
  bias)."""
  return None if b_dtype is None else jnp.sum(g.astype(jnp.float32), axis=0).astype(b_dtype)


def cast_uses(casts):
  """The ``uses`` of a layer's ``casts`` (each None or a ``Cast``), kept as residuals for
  ``cast_grads``."""
  return tuple(None if c is None else c.uses for c in casts)


def cast_grads(uses):
  """The cotangent of a layer's ``casts`` in its backward, from their ``cast_uses``: one use
  each, none for the FP8 copies."""
  return tuple(None if u is None else Cast(None, jnp.ones_like(u)) for u in uses)


def row_groups(group_sizes, rows: int) -> jax.Array:
  """int32 [rows]: each row's group under ``group_sizes`` [G] (``grouped_gemm``'s groups:
  consecutive from row 0, a negative size counted as 0, clipped to ``rows``), G for a row in no
  group."""
  _, end = group_bounds(group_sizes, rows)
  return jnp.searchsorted(end, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def group_bias(bias, group_sizes, rows: int) -> jax.Array:
  """f32 [rows, N]: the bias [G, N] of each row's group, zero for a row in no group."""
  table = jnp.concatenate([bias.astype(jnp.float32), jnp.zeros((1, bias.shape[1]), jnp.float32)])
  return table[row_groups(group_sizes, rows)]


def group_bias_grad(g, group_sizes, b_dtype):
  """dbias [G, N] of a grouped linear: each group's rows of g [M, N] summed in f32 by XLA
  (``segment_sum``; rows in no group dropped), in the bias's dtype (None without a bias)."""
  if b_dtype is None:
    return None
  groups, rows = group_sizes.shape[0], g.shape[0]
  return jax.ops.segment_sum(g.astype(jnp.float32), row_groups(group_sizes, rows),
                             num_segments=groups + 1)[:groups].astype(b_dtype)


def gemm_out(dtype) -> jnp.dtype:
  """The grouped GEMMs' output dtype for a result in ``dtype``: bfloat16 as it is, f32 for
  float32 and float16 (then rounded once to float16)."""
  return jnp.dtype(jnp.bfloat16) if dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)


def _padded_groups(group_sizes, rows: int, align: int):
  """(start, sizes, padded start, padded sizes) [G] int32 of the groups clipped at ``rows``
  once each group's size is rounded up to ``align``, and P = ``round_up(rows + (align - 1) * G,
  align)``, the most rows the padded groups can take."""
  start, end = group_bounds(group_sizes, rows)
  sizes = end - start
  padded = -(-sizes // align) * align  # [G]
  p_start = jnp.cumsum(padded) - padded
  total = -(-(rows + (align - 1) * group_sizes.shape[0]) // align) * align
  return start, sizes, p_start, padded, total


def aligned_columns(group_sizes, rows: int, align: int) -> tuple[jax.Array, jax.Array]:
  """A layout of the grouped rows whose groups start at multiples of ``align`` (wgrad's rule:
  ``ROW_ALIGN``, ``BLOCK_ROW_ALIGN`` under block scales): (src, padded_sizes). ``src`` int32
  [P], P = ``round_up(rows + (align - 1) * G, align)`` (the most the groups can take once each
  is rounded up): the row (a column of a transposed copy) each position takes, or ``rows``
  for a pad (a zero column of a transposed copy that holds rows rounded up to 16, or past the
  end; either way read as zero by ``take_columns``); ``padded_sizes`` int32 [G], each group's
  size rounded up to ``align``. Zero rows add nothing to a group's sum."""
  start, sizes, p_start, padded, total = _padded_groups(group_sizes, rows, align)
  n = group_sizes.shape[0]
  col = jnp.arange(total, dtype=jnp.int32)
  g = jnp.minimum(jnp.searchsorted(p_start + padded, col, side="right"), n - 1)  # [P]
  offset = col - p_start[g]
  src = jnp.where(offset < sizes[g], start[g] + offset, rows)
  return src.astype(jnp.int32), padded.astype(jnp.int32)


def wgrad_layout(group_sizes, rows: int, aligned: bool, align: int):
  """Where a grouped wgrad reads the grouped rows: (src, sizes). ``src`` None where they lie
  as they are (the caller's ``aligned`` promise that every non-empty group starts at a
  multiple of ``align``; no rows; or one group, which starts at row 0), ``sizes`` then the
  groups as the forward clipped them at ``rows``; else ``aligned_columns``' gather and the
  padded sizes."""
  if not aligned and rows and group_sizes.shape[0] > 1:
    return aligned_columns(group_sizes, rows, align)
  start, end = group_bounds(group_sizes, rows)
  return None, end - start


def aligned_positions(group_sizes, rows: int, align: int) -> jax.Array:
  """int32 [rows]: the position each row takes in ``aligned_columns``' layout (its group's
  padded start plus its place in the group), P (past the layout's end) for a row in no
  group: ``aligned_columns``' src inverted."""
  start, _, p_start, _, total = _padded_groups(group_sizes, rows, align)
  g = row_groups(group_sizes, rows)  # [rows], G for no group
  last = group_sizes.shape[0] - 1
  at = p_start[jnp.minimum(g, last)] + jnp.arange(rows) - start[jnp.minimum(g, last)]
  return jnp.where(g <= last, at, total).astype(jnp.int32)


def take_columns(data_t: jax.Array, src: jax.Array) -> jax.Array:
  """data_t [C, R'] FP8 with its columns gathered by ``src`` [P]; zero where src is out of
  range."""
  return jnp.take(data_t, src, axis=1, mode="fill", fill_value=0)
