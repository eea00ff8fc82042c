"""``grouped_linear``: a mixture of experts' linear, ``y[rows of g] = x[rows of g] @ kernels[g] +
bias[g]`` for consecutive row groups (``jax.lax.ragged_dot``'s semantics), with grouped FP8 GEMMs
forward and backward, as a ``jax.custom_vjp`` of the recipe's family
(``jax_fp8.families.grouped_family``). This module checks the arguments once and dispatches
once: the family's FP8 path, or below the recipe's ``fp8_min_intensity`` XLA's ``ragged_dot``
in the compute dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import checks, sharding
from .families import grouped_family
from .families._shared import group_bias
from .layer_checks import (amax_axes, check_dims, check_grouped_recipe, check_stateless,
                           compute_dtype, fp8_pays, grouped_bias, grouped_operands, state_rings)
from .layer_state import GroupedLinearState
from .ops.grouped_gemm import XLA_RAGGED_DOT, group_bounds
from .recipes import Recipe


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
  ``fast_accum_gemms`` does not apply to them). Under ``BlockScaling`` the same three GEMMs
  are block-scaled (E4M3 everywhere): x and the output gradient group cast-transposed (1 x 128
  groups along K and N for the forward and dgrad, 128-row groups along M for wgrad), the
  kernels in 128 x 128 blocks, each expert's its own (one block quantization of the [G K, N]
  stack).

  Args:
    x: [M, K] float32 / bfloat16 / float16, the rows grouped consecutively by expert (a
      mixture of experts' tokens after their permutation).
    kernels: [G, K, N] float32 / bfloat16 / float16, one [K, N] kernel per expert (Flax's
      layout), quantized from its own dtype.
    group_sizes: [G] int32, the rows of each group in order, 1 <= G <= 1024.
    bias: optional [G, N] float32 / bfloat16 / float16, one bias per expert, added in f32
      before the output's rounding.
    recipe: a ``DelayedScaling`` (the state's rings must have been made by it), a
      ``CurrentScaling`` (stateless) or a ``BlockScaling`` (stateless; K and N multiples of
      128); ``fp8_min_intensity`` as in ``linear``, the intensity of the grouped GEMM
      ``M*N*K / (M*K + G*K*N + M*N)`` (below it: XLA's ``ragged_dot`` in the compute dtype, no
      ring moved).
    state: under ``DelayedScaling``, a ``GroupedLinearState``
      (``GroupedLinearState.create(G, recipe)``: rings for x and the gradient, and one ring per
      expert kernel, stacked); differentiate with respect to it and pass that gradient to
      ``jax_fp8.update_state``. Under the stateless recipes: None.
    aligned: a bool; True promises that every non-empty group starts at a row that is a
      multiple of the recipe's ``grouped_row_align`` (16, ``formats.ROW_ALIGN``; 128 under
      ``BlockScaling``, ``BLOCK_ROW_ALIGN``, whose 128-row groups along M must not straddle two
      experts), as a token permutation that pads each expert's rows lays them out; the kernel
      gradient of a group that breaks the promise is NaN (a device value: it cannot be checked
      at trace time). False (default): any sizes. Per-tensor, the backward copies the two
      transposed FP8 operands of wgrad into a layout whose groups start at multiples of 16
      (one gather of FP8 bytes each, [K, P] and [N, P] with ``P = round_up(M + 15 G, 16)``).
      Under ``BlockScaling``, whose transposed copies' scales depend on where the groups lie,
      x and the output gradient are copied in their dtype into a layout of
      ``P = round_up(M + 127 G, 128)`` rows whose groups start at multiples of 128 (zero rows
      between them) before their group cast-transposes, and the forward and dgrad take the
      row-wise FP8 copies' rows back (a gather of FP8 bytes); x's transposed copy, saved for
      the backward, is then [K, P].
    amax_axis_name: as in ``linear``: under ``pmap`` / ``shard_map`` the axes whose devices
      share the scales (data parallel, every device holding all G experts); amaxes, and the
      kernels' rings expert by expert, are max-reduced over them. ``BlockScaling`` reduces no
      amax: None or ().
    dtype: the output's dtype, in which x is quantized (float32, bfloat16, float16); None: x's.
      x's gradient comes back in x's dtype, the kernels' and bias's in theirs.
  Returns:
    [M, N] in ``dtype`` (default x's).
  Raises:
    TypeError / ValueError at trace time: x not [M, K] or kernels not [G, K, N] of a float
    dtype, K not shared, group_sizes not int32 [G] (TypeError) or of another G than the
    kernels' or outside 1..1024 (ValueError), bias not [G, N], K or N not a multiple of 16
    (128 under BlockScaling) on the FP8 path, a recipe that is not a recipe, or one without
    grouped GEMMs (TypeError: MXFP8BlockScaling and NVFP4BlockScaling), a state that is not a
    ``GroupedLinearState`` of this G and recipe, a state given to a stateless recipe, aligned
    not a bool, amax_axis_name as in ``linear``; under BlockScaling, G K or M rows beyond
    65535 * 128 (the block quantizers' grid).

  Method: per-tensor delayed scaling with the HYBRID format (Micikevicius et al. 2022; NVIDIA
  TransformerEngine), per-expert weight scales as TransformerEngine's grouped linear keeps
  them; block scaling as DeepSeek-V3 (arXiv 2412.19437, section 3.3) trained its experts; the
  grouped GEMMs are ``jax.lax.ragged_dot``'s contractions (``grouped_gemm``).
  """
  x, kernels, group_sizes = grouped_operands(x, kernels, group_sizes)
  (m, k), (groups, _, n) = x.shape, kernels.shape
  bias = grouped_bias(bias, "bias", groups, n, "N")
  check_grouped_recipe(recipe, "grouped_linear")
  aligned = checks.boolean(aligned, "aligned")
  out_dtype = compute_dtype(x, dtype)
  fp8 = fp8_pays(recipe, m, n, k, groups)
  if fp8:
    check_dims(recipe, {"K": k, "N": n})
  rings = None
  if recipe.stateful:
    rings = state_rings(state, GroupedLinearState, recipe, groups)
  else:
    check_stateless(recipe, state, amax_axis_name)
  amax_axis_name = amax_axes(x, kernels, bias, state, amax_axis_name)
  x = x.astype(out_dtype)
  if not fp8:
    return ragged_in_dtype(x, kernels, bias, group_sizes)
  x, kernels, bias, group_sizes = sharding.vary_like((x, kernels, bias, group_sizes), x,
                                                     kernels, bias, group_sizes)
  dtypes = (x.dtype, out_dtype, kernels.dtype, None if bias is None else bias.dtype)
  return grouped_family(recipe).grouped_linear(x, kernels, bias, group_sizes, rings, recipe,
                                               amax_axis_name, dtypes, aligned)


def ragged_in_dtype(x, kernels, bias, group_sizes):
  """The grouped linear where FP8 cannot pay: XLA's ``ragged_dot`` of x [M, K] and kernels
  [G, K, N] in x's dtype, each row's group's bias [G, N] (or None) added in f32, no ring
  touched; the groups clipped as ``grouped_gemm`` clips them. [M, N] in x's dtype."""
  start, end = group_bounds(group_sizes, x.shape[0])
  y = XLA_RAGGED_DOT(x, kernels.astype(x.dtype), end - start)
  if bias is None:
    return y
  return (y.astype(jnp.float32) + group_bias(bias, group_sizes, x.shape[0])).astype(x.dtype)
