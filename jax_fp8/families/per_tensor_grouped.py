"""The per-tensor family's grouped linear (``DelayedScaling``, ``CurrentScaling``): the rows of x
in consecutive groups, group g multiplied by expert kernel g, every GEMM a grouped FP8 GEMM
(``grouped_gemm``, ``grouped_gemm_wgrad``).

Forward: x is cast-transposed once with its ring (E4M3: the row-major copy for the forward GEMM,
the transposed one kept for wgrad); each expert kernel [K, N] is cast-transposed with its own
ring (one scale per expert, ``b_scale [G]``), then one grouped GEMM ``y = x @ kernels[g]`` per
group, with the bias of each row's group added in f32 before the output's one rounding.
Backward: the output gradient is cast-transposed once (E5M2 under HYBRID) and feeds dgrad
(``dx = g @ kernels[g].T``, a grouped GEMM against the kernels' row-major FP8 copies) and wgrad
(``dkernels[g] = x[rows of g].T @ g[rows of g]``, the grouped GEMM with the contraction ragged,
over the transposed copies); dbias sums g's rows per group in f32 (XLA). Only FP8 copies are
saved: x transposed and the kernels. The rings' observations leave the rule as the gradient with
respect to the state, as in ``per_tensor``; the kernels' stacked ring observes each expert's
amax. Under current scaling every ring is a blank one set to its tensor's amax of this step.

wgrad's groups must start at multiples of ``ROW_ALIGN`` (16) of the transposed copies' columns.
Where the caller has not promised that (``aligned=False``), the backward copies both transposed
FP8 operands into a layout whose groups start at multiples of 16 (``aligned_columns``): one
gather of FP8 bytes each, the forward and dgrad untouched.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .._residuals import op_outputs, packed
from ..ops.cast_transpose import cast_transpose_delayed
from ..ops.grouped_gemm import ROW_ALIGN, group_bounds, grouped_gemm, grouped_gemm_wgrad
from ..quantized import Quantized
from ..state import ScaleRing
from ._shared import group_bias, row_groups
from .per_tensor import kernel_fp8, rowwise, scaled, shared, transposed, zero_like


@dataclasses.dataclass(frozen=True)
class Static:
  """What the rule is traced for (its one nondiff argument). ``dtypes``: (x's, the output's,
  the kernels', the bias's or None); ``current``: current scaling (blank rings); ``aligned``:
  the caller's promise that every non-empty group starts at a multiple of ``ROW_ALIGN``."""

  axis_name: tuple[str, ...] | None
  dtypes: tuple
  current: bool
  aligned: bool


def gemm_out(dtype) -> jnp.dtype:
  """The grouped GEMMs' output dtype for a result in ``dtype``: bfloat16 as it is, f32 for
  float32 and float16 (then rounded once to float16)."""
  return jnp.dtype(jnp.bfloat16) if dtype == jnp.bfloat16 else jnp.dtype(jnp.float32)


def aligned_columns(group_sizes, rows: int) -> tuple[jax.Array, jax.Array]:
  """A wgrad layout whose groups start at multiples of ``ROW_ALIGN``: (src, padded_sizes).
  ``src`` int32 [P], P = ``round_up(rows + (ROW_ALIGN - 1) * G, ROW_ALIGN)`` (the most the
  groups can take once each is rounded up): the column of the transposed copies each padded
  column takes, or ``rows`` for a pad (a zero column of the copies, which hold ceil16(rows),
  or past their end, read as zero by ``take_columns``); ``padded_sizes`` int32 [G], each
  group's size rounded up to ``ROW_ALIGN``. Zero columns add nothing to a group's sum."""
  start, end = group_bounds(group_sizes, rows)
  sizes = end - start
  padded = -(-sizes // ROW_ALIGN) * ROW_ALIGN  # [G]
  p_end = jnp.cumsum(padded)
  p_start = p_end - padded
  n = group_sizes.shape[0]
  total = -(-(rows + (ROW_ALIGN - 1) * n) // ROW_ALIGN) * ROW_ALIGN
  col = jnp.arange(total, dtype=jnp.int32)
  g = jnp.minimum(jnp.searchsorted(p_end, col, side="right"), n - 1)  # [P]
  offset = col - p_start[g]
  src = jnp.where(offset < sizes[g], start[g] + offset, rows)
  return src.astype(jnp.int32), padded.astype(jnp.int32)


def take_columns(data_t: jax.Array, src: jax.Array) -> jax.Array:
  """data_t [C, R'] FP8 with its columns gathered by ``src`` [P]; zero where src is out of
  range."""
  return jnp.take(data_t, src, axis=1, mode="fill", fill_value=0)


class Saved(NamedTuple):
  """The rule's residuals."""

  x: Quantized  # x transposed: data_t e4m3 [K, M16], scale []
  kernels: Quantized  # data e4m3 [G, K, N], scale [G]
  grad_ring: ScaleRing
  x_observed: ScaleRing
  kernels_observed: ScaleRing  # stacked [G]


def _kernels_fp8(kernels, ring, s: Static):
  """Each expert kernel [K, N] cast-transposed with its own ring (a loop over the experts of the
  per-tensor cast-transpose): tensor data [G, K, N], data_t [G, N, K], scale [G]; the stacked
  ring's observation."""
  return jax.vmap(lambda k, r: kernel_fp8(k, None, r, s.current, s.axis_name))(kernels, ring)


def _forward(x, kernels, bias, group_sizes, rings, s: Static):
  """y, what the backward needs, and the x and kernel rings' observations."""
  rx, rk, _ = rings
  cx = cast_transpose_delayed(x, scaled(rx, x, s.current, s.axis_name),
                              observe=True)  # data [M, K], data_t [K, M16] e4m3
  ck = _kernels_fp8(kernels, rk, s)  # data [G, K, N], data_t [G, N, K] e4m3
  qx, qk = cx.tensor, ck.tensor
  out_dtype = s.dtypes[1]
  y = grouped_gemm(qx.data, qk.data_t, qx.scale, qk.scale, group_sizes,
                   out_dtype=gemm_out(out_dtype) if bias is None else jnp.float32)  # [M, N]
  if bias is not None:  # each row's group's bias, none for a row in no group
    y = y + group_bias(bias, group_sizes, x.shape[0])
  return y.astype(out_dtype), (transposed(qx), rowwise(qk)), (cx.ring, ck.ring)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _grouped_linear(x, kernels, bias, group_sizes, rings, s: Static):
  return _forward(x, kernels, bias, group_sizes, rings, s)[0]


def _grouped_linear_fwd(x, kernels, bias, group_sizes, rings, s: Static):
  y, (qx, qk), observed = _forward(x, kernels, bias, group_sizes, rings, s)
  # Current scaling drops the observations: its blank rings get zero gradients.
  observed = zero_like(rings[:2]) if s.current else shared(observed, rings[:2], s.axis_name)
  grad_ring = zero_like(rings[2]) if s.current else rings[2]
  return y, (Saved(qx, qk, grad_ring, *observed), group_sizes)


def _grouped_linear_bwd(s: Static, res, g):
  saved, group_sizes = res
  x_dtype, _, k_dtype, b_dtype = s.dtypes
  rows = g.shape[0]
  cg = cast_transpose_delayed(g, scaled(saved.grad_ring, g, s.current, s.axis_name),
                              observe=True)  # data [M, N], data_t [N, M16]
  qg, qk = cg.tensor, saved.kernels
  dx = grouped_gemm(qg.data, qk.data, qg.scale, qk.scale, group_sizes,
                    out_dtype=gemm_out(x_dtype)).astype(x_dtype)  # dgrad [M, K]
  # the groups as the forward clipped them at M (the transposed copies are wider: ceil16(M))
  start, end = group_bounds(group_sizes, rows)
  x_t, g_t, sizes = saved.x.data_t, qg.data_t, end - start
  if not s.aligned and rows and group_sizes.shape[0] > 1:  # (one group starts at row 0)
    # the groups moved to start at multiples of ROW_ALIGN, zero columns between them
    src, sizes = aligned_columns(group_sizes, rows)
    x_t, g_t = take_columns(x_t, src), take_columns(g_t, src)  # [K, P], [N, P]
  dk = grouped_gemm_wgrad(x_t, g_t, saved.x.scale, qg.scale, sizes,
                          out_dtype=gemm_out(k_dtype)).astype(k_dtype)  # wgrad [G, K, N]
  db = None
  if b_dtype is not None:  # each group's rows of g summed in f32; rows in no group dropped
    groups = group_sizes.shape[0]
    db = jax.ops.segment_sum(g.astype(jnp.float32), row_groups(group_sizes, rows),
                             num_segments=groups + 1)[:groups].astype(b_dtype)
  rg = saved.grad_ring if s.current else shared(cg.ring, saved.grad_ring, s.axis_name)
  return dx, dk, db, None, (saved.x_observed, saved.kernels_observed, rg)


_grouped_linear.defvjp(*packed(_grouped_linear_fwd, _grouped_linear_bwd))


def grouped_linear(x, kernels, bias, group_sizes, rings, recipe, axis_name, dtypes, aligned):
  """The family's FP8 grouped linear of x [M, K] (in the compute dtype) against kernels
  [G, K, N] (``rings``: the state's (x, kernels stacked, grad), None under current scaling):
  y [M, N] in ``dtypes[1]``."""
  current_ = not recipe.stateful
  if current_:
    groups = kernels.shape[0]
    fwd = recipe.ring(recipe.fwd_fmt)
    rings = (fwd, jax.tree.map(lambda v: jnp.broadcast_to(v, (groups,) + v.shape), fwd),
             recipe.ring(recipe.bwd_fmt))
  s = Static(axis_name, dtypes, current_, aligned)
  return op_outputs(_grouped_linear(x, kernels, bias, group_sizes, rings, s))
