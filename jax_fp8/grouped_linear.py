"""``grouped_linear``: a mixture of experts' linear, ``y[rows of g] = x[rows of g] @ kernels[g] +
bias[g]`` for consecutive row groups (``jax.lax.ragged_dot``'s semantics), with grouped FP8 GEMMs
forward and backward, as a ``jax.custom_vjp`` of the recipe's family
(``jax_fp8.families.grouped_family``). This module checks the arguments once and dispatches
once: the family's FP8 path, or below the recipe's ``fp8_min_intensity`` XLA's ``ragged_dot``
in the compute dtype."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import checks, sharding
from .families import grouped_family
from .families._shared import group_bias
from .layer_checks import (amax_axes, check_dims, check_rings, check_stateless, compute_dtype,
                           float_array, fp8_pays)
from .layer_state import GroupedLinearState
from .ops.grouped_gemm import MAX_GROUPS, XLA_RAGGED_DOT, group_bounds
from .recipes import RECIPES, Recipe, check_recipe
from .state import ScaleRing


def grouped_linear(x: jax.Array, kernels: jax.Array, group_sizes: jax.Array,
                   bias: jax.Array | None = None, *, recipe: Recipe,
                   state: GroupedLinearState | None = None, aligned: bool = False,
                   amax_axis_name: str | tuple[str, ...] | None = None,
                   dtype=None) -> jax.Array:
  """A grouped (mixture-of-experts) linear with FP8 GEMMs forward and backward: the rows of x
  in G consecutive groups, ``y[rows of g] = x[rows of g] @ kernels[g] + bias[g]``, as
  ``jax.lax.ragged_dot(x, kernels, group_sizes)`` plus the bias.

  Group g holds rows ``[start_g, end_g)``: ``end_g`` is the sum of ``max(group_sizes[j], 0)``
  for ``j <= g``, clipped to M, and ``start_g = end_{g-1}`` (0 for the first). The sizes are
  device values (traced: one compilation for every value, no host synchronization); a negative
  size counts as 0, rows past M are dropped, and a row in no group (past the sum) gets y = 0
  and dx = 0 and adds nothing to any gradient.

  Under the per-tensor recipes x and the output gradient have one scale each, and each expert
  kernel its own (the grouped GEMMs' ``b_scale [G]``): a kernel of small weights keeps its
  precision beside a large one. The forward runs ``grouped_gemm`` on x's and the kernels' E4M3
  copies, dgrad ``grouped_gemm`` on the gradient's (E5M2 under HYBRID) and the kernels' other
  layout, wgrad ``grouped_gemm_wgrad`` on x's and the gradient's transposed copies; only FP8
  copies are saved. The kernels are cast-transposed one expert after another (the per-tensor
  kernel in a loop of G launches). The GEMMs promote to f32 (the recipe's
  ``fast_accum_gemms`` does not apply to them).

  Args:
    x: [M, K] float32 / bfloat16 / float16, the rows grouped consecutively by expert (a
      mixture of experts' tokens after their permutation).
    kernels: [G, K, N] float32 / bfloat16 / float16, one [K, N] kernel per expert (Flax's
      layout), quantized from its own dtype.
    group_sizes: [G] int32, the rows of each group in order, 1 <= G <= 1024.
    bias: optional [G, N] float32 / bfloat16 / float16, one bias per expert, added in f32
      before the output's rounding.
    recipe: a ``DelayedScaling`` (the state's rings must have been made by it) or a
      ``CurrentScaling`` (stateless); ``fp8_min_intensity`` as in ``linear``, the intensity of
      the grouped GEMM ``M*N*K / (M*K + G*K*N + M*N)`` (below it: XLA's ``ragged_dot`` in the
      compute dtype, no ring moved).
    state: under ``DelayedScaling``, a ``GroupedLinearState``
      (``GroupedLinearState.create(G, recipe)``: rings for x and the gradient, and one ring per
      expert kernel, stacked); differentiate with respect to it and pass that gradient to
      ``jax_fp8.update_state``. Under ``CurrentScaling``: None.
    aligned: a bool; True promises that every non-empty group starts at a row that is a
      multiple of 16 (``grouped_gemm.ROW_ALIGN``), as a token permutation that pads each
      expert's rows lays them out; the kernel gradient of a group that breaks the promise is
      NaN (a device value: it cannot be checked at trace time). False (default): any sizes;
      the backward copies the two transposed FP8 operands of wgrad into a layout whose groups
      start at multiples of 16 (one gather of FP8 bytes each, [K, P] and [N, P] with
      ``P = round_up(M + 15 G, 16)``).
    amax_axis_name: as in ``linear``: under ``pmap`` / ``shard_map`` the axes whose devices
      share the scales (data parallel, every device holding all G experts); amaxes, and the
      kernels' rings expert by expert, are max-reduced over them.
    dtype: the output's dtype, in which x is quantized (float32, bfloat16, float16); None: x's.
      x's gradient comes back in x's dtype, the kernels' and bias's in theirs.
  Returns:
    [M, N] in ``dtype`` (default x's).
  Raises:
    TypeError / ValueError at trace time: x not [M, K] or kernels not [G, K, N] of a float
    dtype, K not shared, group_sizes not int32 [G] (TypeError) or of another G than the
    kernels' or outside 1..1024 (ValueError), bias not [G, N], K or N not a multiple of 16 on
    the FP8 path, a recipe that is not a recipe, or one without grouped GEMMs (TypeError:
    BlockScaling, MXFP8BlockScaling and NVFP4BlockScaling, for which no block-scaled grouped
    GEMM exists yet), a state that is not a ``GroupedLinearState`` of this G and recipe, a
    state given to CurrentScaling, aligned not a bool, amax_axis_name as in ``linear``.

  Method: per-tensor delayed scaling with the HYBRID format (Micikevicius et al. 2022; NVIDIA
  TransformerEngine), per-expert weight scales as TransformerEngine's grouped linear keeps
  them; the grouped GEMMs are ``jax.lax.ragged_dot``'s contractions (``grouped_gemm``).
  """
  x = float_array(x, "x")
  if x.ndim != 2:
    raise ValueError(f"x must be [M, K] (the rows grouped consecutively by expert), got shape "
                     f"{list(x.shape)}")
  kernels = float_array(kernels, "kernels")
  if kernels.ndim != 3 or kernels.shape[1] != x.shape[1]:
    raise ValueError(f"kernels must be [G, K, N] with x's K={x.shape[1]}, got shape "
                     f"{list(kernels.shape)}")
  (m, k), (groups, _, n) = x.shape, kernels.shape
  group_sizes = checks.array(group_sizes, "group_sizes")
  if group_sizes.dtype != jnp.int32 or group_sizes.ndim != 1:
    raise TypeError(f"group_sizes must be int32 [G], got {checks.describe(group_sizes)}")
  if group_sizes.shape[0] != groups:
    raise ValueError(f"group_sizes [G] and kernels [G, K, N] must share G, got group_sizes "
                     f"[{group_sizes.shape[0]}] and kernels {list(kernels.shape)}")
  if not 1 <= groups <= MAX_GROUPS:
    raise ValueError(f"kernels must hold 1 to {MAX_GROUPS} experts, got G={groups}")
  if bias is not None:
    bias = float_array(bias, "bias")
    if bias.shape != (groups, n):
      raise ValueError(f"bias must be [G, N] = [{groups}, {n}], got {list(bias.shape)}")
  check_grouped_recipe(recipe)
  aligned = checks.boolean(aligned, "aligned")
  out_dtype = compute_dtype(x, dtype)
  fp8 = fp8_pays(recipe, m, n, k, groups)
  if fp8:
    check_dims(recipe, {"K": k, "N": n})
  rings = None
  if recipe.stateful:
    rings = _state_rings(recipe, state, groups)
  else:
    check_stateless(recipe, state, amax_axis_name)
  amax_axis_name = amax_axes(x, kernels, bias, state, amax_axis_name)
  x = x.astype(out_dtype)
  if not fp8:
    return _grouped_linear_in_dtype(x, kernels, bias, group_sizes)
  x, kernels, bias, group_sizes = sharding.vary_like((x, kernels, bias, group_sizes), x,
                                                     kernels, bias, group_sizes)
  dtypes = (x.dtype, out_dtype, kernels.dtype, None if bias is None else bias.dtype)
  return grouped_family(recipe).grouped_linear(x, kernels, bias, group_sizes, rings, recipe,
                                               amax_axis_name, dtypes, aligned)


def check_grouped_recipe(recipe) -> None:
  """TypeError unless ``recipe`` is a recipe that ``grouped_linear`` serves, naming those."""
  check_recipe(recipe)
  if not recipe.grouped:
    raise TypeError(ungrouped_reason(recipe))


def ungrouped_reason(recipe: Recipe) -> str:
  """Why ``grouped_linear`` does not serve ``recipe`` (one whose ``grouped`` is False), naming
  the recipes it serves (``check_grouped_recipe``'s error, ``convert``'s reason)."""
  takes = " or ".join(c.article() for c in RECIPES if c.grouped)
  return (f"grouped_linear takes {takes} (per-tensor scales, one per expert for the kernels), "
          f"got {type(recipe).__name__}: no block-scaled grouped FP8 GEMM exists yet")


def _state_rings(recipe: Recipe, state, groups: int):
  """The rings of ``state`` (x, kernels stacked [G], grad), checked against the recipe and G:
  TypeError / ValueError naming what is wrong."""
  if not isinstance(state, GroupedLinearState):
    raise TypeError(f"state must be a jax_fp8.GroupedLinearState (GroupedLinearState.create("
                    f"{groups}, recipe)), got {type(state).__name__}")
  (name_x, rx), (name_k, rk), (name_g, rg) = state.named_rings()
  if not isinstance(rk, ScaleRing):
    raise TypeError(f"{name_k} must be a jax_fp8.ScaleRing stacked over the experts, got "
                    f"{type(rk).__name__}")
  shapes = tuple(jnp.shape(v) for v in (rk.amax_history, rk.scale, rk.steps))
  if (len(shapes[0]) != 2 or shapes[0][0] != groups or shapes[1] != (groups,)
      or shapes[2] != (groups,)):
    raise ValueError(f"{name_k} must hold one ring per expert, stacked: amax_history [G, L], "
                     f"scale [G] and steps [G] with G={groups} (GroupedLinearState.create("
                     f"{groups}, recipe)), got amax_history {list(shapes[0])}, scale "
                     f"{list(shapes[1])}, steps {list(shapes[2])}")
  first = dataclasses.replace(rk, amax_history=rk.amax_history[0], scale=rk.scale[0],
                              steps=rk.steps[0])
  check_rings(((name_x, rx), (f"{name_k}[0]", first), (name_g, rg)),
              (recipe.fwd_fmt, recipe.fwd_fmt, recipe.bwd_fmt), recipe)
  return rx, rk, rg


def _grouped_linear_in_dtype(x, kernels, bias, group_sizes):
  """The grouped linear where FP8 cannot pay: XLA's ``ragged_dot`` in x's dtype, no ring
  touched; the groups clipped as ``grouped_gemm`` clips them."""
  start, end = group_bounds(group_sizes, x.shape[0])
  y = XLA_RAGGED_DOT(x, kernels.astype(x.dtype), end - start)
  if bias is None:
    return y
  return (y.astype(jnp.float32) + group_bias(bias, group_sizes, x.shape[0])).astype(x.dtype)
