"""The per-tensor family's grouped rules (``DelayedScaling``, ``CurrentScaling``): the rows of x
in consecutive groups, group g multiplied by expert kernel g, every GEMM a grouped FP8 GEMM
(``grouped_gemm``, ``grouped_gemm_wgrad``).

Linear, forward: x is cast-transposed once with its ring (E4M3: the row-major copy for the
forward GEMM, the transposed one kept for wgrad); each expert kernel [K, N] is cast-transposed
with its own ring (one scale per expert, ``b_scale [G]``), then one grouped GEMM ``y = x @
kernels[g]`` per group, with the bias of each row's group added in f32 before the output's one
rounding. Backward: the output gradient is cast-transposed once (E5M2 under HYBRID) and feeds
dgrad (``dx = g @ kernels[g].T``, a grouped GEMM against the kernels' row-major FP8 copies) and
wgrad (``dkernels[g] = x[rows of g].T @ g[rows of g]``, the grouped GEMM with the contraction
ragged, over the transposed copies); dbias sums g's rows per group in f32 (XLA). Only FP8
copies are saved: x transposed and the kernels. The rings' observations leave the rule as the
gradient with respect to the state, as in ``per_tensor``; a kernels' stacked ring observes each
expert's amax. Under current scaling every ring is a blank one set to its tensor's amax of this
step.

MLP (the gated expert MLP of a mixture of experts): the up projection as the linear's forward,
then ``activation_cast_transpose`` reads its output y once and writes ``act(y)`` in both FP8
layouts (one ring, one scale for every expert's rows), the down projection's grouped GEMM on
it; in the backward the down projection's dgrad dh and y are read once by
``activation_grad_cast_transpose``, which writes the up projection's output gradient in both
layouts for its dgrad and wgrad, as ``per_tensor``'s MLP does. The bias gradients are XLA's
per-group sums: the output gradient's rows, and for bias_in the activation's gradient
(``jax_fp8.activations.grad`` of dh and y, one more read of both, where a bias exists).

wgrad's groups must start at multiples of ``ROW_ALIGN`` (16) of the transposed copies' columns.
Where the caller has not promised that (``aligned=False``), the backward copies the transposed
FP8 operands into a layout whose groups start at multiples of 16 (``aligned_columns``): one
gather of FP8 bytes each, the forward and dgrad untouched.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import activations
from .._residuals import op_outputs, packed, read_and_saved
from ..formats import ROW_ALIGN
from ..ops.cast_transpose import (activation_cast_transpose, activation_grad_cast_transpose,
                                  cast_transpose_delayed)
from ..ops.grouped_gemm import grouped_gemm, grouped_gemm_wgrad
from ..quantized import Quantized
from ..state import ScaleRing, stacked
from ._shared import gemm_out, group_bias, group_bias_grad, take_columns, wgrad_layout
from .per_tensor import (MLP_RING_FMTS, blank_rings, kernel_fp8, rowwise, scaled, shared,
                         transposed, zero_like)


@dataclasses.dataclass(frozen=True)
class Static:
  """What a rule is traced for (its one nondiff argument). ``dtypes``: the linear's (x's, the
  output's, the kernels', the bias's or None), the MLP's (x's, the output's, kernel_in's,
  kernel_out's, bias_in's, bias_out's, None for no bias); ``current``: current scaling (blank
  rings); ``aligned``: the caller's promise that every non-empty group starts at a multiple of
  ``ROW_ALIGN``; ``activation``: the MLP's."""

  axis_name: tuple[str, ...] | None
  dtypes: tuple
  current: bool
  aligned: bool
  activation: str | None = None


def _kernels_fp8(kernels, ring, s: Static):
  """Each expert kernel [K, N] cast-transposed with its own ring (the per-tensor cast-transpose
  under vmap: one call writing the stacks in place): tensor data [G, K, N], data_t [G, N, K],
  scale [G]; the stacked ring's observation."""
  return jax.vmap(lambda k, r: kernel_fp8(k, None, r, s.current, s.axis_name))(kernels, ring)


def _fprop(qx: Quantized, qk: Quantized, bias, group_sizes, out_dtype) -> jax.Array:
  """The forward GEMM: qx.data [M, K] against each row's expert's qk.data_t [G, N, K] (scale
  [G]), the bias [G, N] of each row's group (none for a row in no group) added in f32 before
  the one rounding to ``out_dtype``: [M, N]."""
  y = grouped_gemm(qx.data, qk.data_t, qx.scale, qk.scale, group_sizes,
                   out_dtype=gemm_out(out_dtype) if bias is None else jnp.float32)
  if bias is not None:
    y = y + group_bias(bias, group_sizes, qx.data.shape[0])
  return y.astype(out_dtype)


def _dgrad(qg: Quantized, qk: Quantized, group_sizes, dtype) -> jax.Array:
  """dgrad: the gradient's qg.data [M, N] against each row's expert's kernel qk.data [G, K, N]
  (scale [G]): [M, K] in ``dtype``."""
  return grouped_gemm(qg.data, qk.data, qg.scale, qk.scale, group_sizes,
                      out_dtype=gemm_out(dtype)).astype(dtype)  # dgrad [M, K]


def _wgrad(a: Quantized, b: Quantized, layout, dtype) -> jax.Array:
  """wgrad: ``d[g] = a[:, rows of g] @ b[:, rows of g].T`` of the transposed copies a.data_t
  [K, M16] and b.data_t [N, M16] read in ``layout`` (``_shared.wgrad_layout``): [G, K, N] in
  ``dtype``."""
  src, sizes = layout
  a_t, b_t = a.data_t, b.data_t
  if src is not None:  # the groups moved to start at multiples of ROW_ALIGN, zero columns between
    a_t, b_t = take_columns(a_t, src), take_columns(b_t, src)  # [K, P], [N, P]
  return grouped_gemm_wgrad(a_t, b_t, a.scale, b.scale, sizes,
                            out_dtype=gemm_out(dtype)).astype(dtype)  # wgrad [G, K, N]


def _blank_rings(recipe, fmts, kernels, groups: int) -> tuple:
  """Current scaling's rings in ``fmts``' order (``per_tensor.blank_rings``), those at the
  indices ``kernels`` stacked over the ``groups`` experts."""
  return tuple(stacked(r, groups) if i in kernels else r
               for i, r in enumerate(blank_rings(recipe, fmts)))


# Linear: rings (x, kernels stacked, grad), GroupedLinearState's order.

class Saved(NamedTuple):
  """The linear rule's residuals."""

  x: Quantized  # x transposed: data_t e4m3 [K, M16], scale []
  kernels: Quantized  # data e4m3 [G, K, N], scale [G]
  grad_ring: ScaleRing
  x_observed: ScaleRing
  kernels_observed: ScaleRing  # stacked [G]


def _forward(x, kernels, bias, group_sizes, rings, s: Static):
  """y, what the backward needs, and the x and kernel rings' observations."""
  rx, rk, _ = rings
  cx = cast_transpose_delayed(x, scaled(rx, x, s.current, s.axis_name),
                              observe=True)  # data [M, K], data_t [K, M16] e4m3
  ck = _kernels_fp8(kernels, rk, s)  # data [G, K, N], data_t [G, N, K] e4m3
  y = _fprop(cx.tensor, ck.tensor, bias, group_sizes, s.dtypes[1])  # [M, N]
  return y, (transposed(cx.tensor), rowwise(ck.tensor)), (cx.ring, ck.ring)


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
  cg = cast_transpose_delayed(g, scaled(saved.grad_ring, g, s.current, s.axis_name),
                              observe=True)  # data [M, N], data_t [N, M16]
  dx = _dgrad(cg.tensor, saved.kernels, group_sizes, x_dtype)  # [M, K]
  layout = wgrad_layout(group_sizes, g.shape[0], s.aligned, ROW_ALIGN)
  dk = _wgrad(saved.x, cg.tensor, layout, k_dtype)  # [G, K, N]
  rg = saved.grad_ring if s.current else shared(cg.ring, saved.grad_ring, s.axis_name)
  return (dx, dk, group_bias_grad(g, group_sizes, b_dtype), None,
          (saved.x_observed, saved.kernels_observed, rg))


_grouped_linear.defvjp(*packed(_grouped_linear_fwd, _grouped_linear_bwd))


def grouped_linear(x, kernels, bias, group_sizes, rings, recipe, axis_name, dtypes, aligned):
  """The family's FP8 grouped linear of x [M, K] (in the compute dtype) against kernels
  [G, K, N] (``rings``: the state's (x, kernels stacked, grad), None under current scaling):
  y [M, N] in ``dtypes[1]``."""
  current_ = not recipe.stateful
  if current_:
    rings = _blank_rings(recipe, ("fwd", "fwd", "bwd"), (1,), kernels.shape[0])
  s = Static(axis_name, dtypes, current_, aligned)
  return op_outputs(_grouped_linear(x, kernels, bias, group_sizes, rings, s))


# MLP: rings (x, kernel_in stacked, grad_in, hidden, kernel_out stacked, grad_out),
# GroupedMlpState's order.

class MlpSaved(NamedTuple):
  """The MLP rule's residuals."""

  x: Quantized  # x transposed: data_t e4m3 [K, M16], scale []
  k_in: Quantized  # data e4m3 [G, K, N], scale [G]
  y: jax.Array  # the up projection's output [M, N], in the compute dtype
  h: Quantized  # act(y) transposed: data_t e4m3 [F, M16], scale []
  k_out: Quantized  # data e4m3 [G, F, D], scale [G]


def _mlp_forward(x, k_in, k_out, b_in, b_out, group_sizes, rings, s: Static):
  """out, what the backward needs, and the forward rings' observations (x, kernel_in, hidden,
  kernel_out). Under current scaling each ring is first set to its tensor's scale (the
  activation's amax from XLA's activation of y)."""
  rx, rk_in, _, rh, rk_out, _ = rings
  out_dtype = s.dtypes[1]
  cx = cast_transpose_delayed(x, scaled(rx, x, s.current, s.axis_name),
                              observe=True)  # [M, K], [K, M16]
  ck_in = _kernels_fp8(k_in, rk_in, s)  # [G, K, N], [G, N, K]
  y = _fprop(cx.tensor, ck_in.tensor, b_in, group_sizes, out_dtype)  # [M, N]
  if s.current:
    rh = scaled(rh, activations.apply(y, s.activation), s.current, s.axis_name)
  ch = activation_cast_transpose(y, rh, activation=s.activation, observe=True)  # [M, F]
  ck_out = _kernels_fp8(k_out, rk_out, s)  # [G, F, D], [G, D, F]
  out = _fprop(ch.tensor, ck_out.tensor, b_out, group_sizes, out_dtype)  # [M, D]
  saved = MlpSaved(transposed(cx.tensor), rowwise(ck_in.tensor), read_and_saved(y),
                   transposed(ch.tensor), rowwise(ck_out.tensor))
  return out, saved, (cx.ring, ck_in.ring, ch.ring, ck_out.ring)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _grouped_mlp(x, k_in, k_out, b_in, b_out, group_sizes, rings, s: Static):
  return _mlp_forward(x, k_in, k_out, b_in, b_out, group_sizes, rings, s)[0]


def _grouped_mlp_fwd(x, k_in, k_out, b_in, b_out, group_sizes, rings, s: Static):
  out, saved, observed = _mlp_forward(x, k_in, k_out, b_in, b_out, group_sizes, rings, s)
  forward_rings, grad_rings = tuple(rings[i] for i in (0, 1, 3, 4)), (rings[2], rings[5])
  if s.current:  # the observations are dropped: the blank rings get zero gradients
    return out, (saved, group_sizes, zero_like(grad_rings), zero_like(forward_rings))
  return out, (saved, group_sizes, grad_rings, shared(observed, forward_rings, s.axis_name))


def _grouped_mlp_bwd(s: Static, res, g):
  saved, group_sizes, grad_rings, observed = res
  rg_in, rg_out = grad_rings
  x_dtype, _, k_in_dtype, k_out_dtype, b_in_dtype, b_out_dtype = s.dtypes
  y = saved.y
  cg = cast_transpose_delayed(g, scaled(rg_out, g, s.current, s.axis_name),
                              observe=True)  # [M, D], [D, M16]
  layout = wgrad_layout(group_sizes, g.shape[0], s.aligned, ROW_ALIGN)
  dh = _dgrad(cg.tensor, saved.k_out, group_sizes, y.dtype)  # [M, F]
  dk_out = _wgrad(saved.h, cg.tensor, layout, k_out_dtype)  # [G, F, D]
  dy = None
  if s.current or b_in_dtype is not None:  # XLA's, for its amax or dbias_in
    dy = activations.grad(dh, y, s.activation)  # [M, N] f32
  if s.current:
    rg_in = scaled(rg_in, dy, s.current, s.axis_name)
  cdy = activation_grad_cast_transpose(dh, y, rg_in, activation=s.activation,
                                       observe=True)  # [M, N], [N, M16]
  dx = _dgrad(cdy.tensor, saved.k_in, group_sizes, x_dtype)  # [M, K]
  dk_in = _wgrad(saved.x, cdy.tensor, layout, k_in_dtype)  # [G, K, N]
  rg = grad_rings if s.current else shared((cdy.ring, cg.ring), grad_rings, s.axis_name)
  ox, ok_in, oh, ok_out = observed
  return (dx, dk_in, dk_out, group_bias_grad(dy, group_sizes, b_in_dtype),
          group_bias_grad(g, group_sizes, b_out_dtype), None,
          (ox, ok_in, rg[0], oh, ok_out, rg[1]))


_grouped_mlp.defvjp(*packed(_grouped_mlp_fwd, _grouped_mlp_bwd))


def grouped_mlp(x, k_in, k_out, b_in, b_out, group_sizes, rings, recipe, activation, axis_name,
                dtypes, aligned):
  """The family's fused FP8 grouped MLP of x [M, K] (in the compute dtype) with kernel_in
  [G, K, N] and kernel_out [G, F, D] (``rings``: the state's six in ``GroupedMlpState``'s
  order, None under current scaling): out [M, D] in ``dtypes[1]``."""
  current_ = not recipe.stateful
  if current_:
    rings = _blank_rings(recipe, MLP_RING_FMTS, (1, 4), k_in.shape[0])
  s = Static(axis_name, dtypes, current_, aligned, activation)
  return op_outputs(_grouped_mlp(x, k_in, k_out, b_in, b_out, group_sizes, rings, s))
