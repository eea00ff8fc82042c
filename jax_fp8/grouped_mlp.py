"""``grouped_mlp``: a mixture of experts' expert MLP, ``act(x[rows of g] @ kernel_in[g] +
bias_in[g]) @ kernel_out[g] + bias_out[g]`` for consecutive row groups, with grouped FP8 GEMMs
forward and backward and the activation and its gradient computed inside the cast-transposes
that quantize them (as ``mlp`` does), as a ``jax.custom_vjp`` of the recipe's family
(``jax_fp8.families.grouped_family``). This module checks the arguments once and dispatches
once: the family's FP8 path, or below the recipe's ``fp8_min_intensity`` XLA's ``ragged_dot``
and activation in the compute dtype."""

from __future__ import annotations

import jax

from . import activations, checks, sharding
from .families import grouped_family
from .grouped_linear import ragged_in_dtype
from .layer_checks import (amax_axes, check_dims, check_grouped_recipe, check_stateless,
                           compute_dtype, float_array, fp8_pays, grouped_bias, grouped_operands,
                           mlp_dims, state_rings)
from .layer_state import GroupedMlpState
from .recipes import Recipe


def grouped_mlp(x: jax.Array, kernel_in: jax.Array, kernel_out: jax.Array,
                group_sizes: jax.Array, bias_in: jax.Array | None = None,
                bias_out: jax.Array | None = None, *, activation: str = "swiglu",
                recipe: Recipe, state: GroupedMlpState | None = None, aligned: bool = False,
                amax_axis_name: str | tuple[str, ...] | None = None, dtype=None) -> jax.Array:
  """The expert MLPs of a mixture of experts with FP8 GEMMs forward and backward: the rows of x
  in G consecutive groups, ``out[rows of g] = act(x[rows of g] @ kernel_in[g] + bias_in[g]) @
  kernel_out[g] + bias_out[g]``, the activation and its gradient fused into the
  cast-transposes.

  The groups are ``grouped_linear``'s (``jax.lax.ragged_dot``'s): group g holds rows
  ``[start_g, end_g)``, ``end_g`` the sum of ``max(group_sizes[j], 0)`` for ``j <= g`` clipped
  to M; the sizes are device values (one compilation for every value, no host
  synchronization); a row in no group (past the sum) gets out = 0 and dx = 0 and adds nothing
  to any gradient.

  Under the per-tensor recipes the up projection runs as ``grouped_linear``'s forward (x one
  scale, each expert's kernel_in its own); ``activation_cast_transpose`` reads its output y
  once and writes ``act(y)`` in both FP8 layouts with one scale for all the experts' rows; the
  down projection is the grouped GEMM of that against each expert's kernel_out (its own
  scale). The backward casts the output gradient once (E5M2 under HYBRID) for the down
  projection's dgrad dh and wgrad; ``activation_grad_cast_transpose`` reads dh and y once and
  writes the up projection's output gradient for its dgrad and wgrad. Saved: the FP8 copies of
  x (transposed), both kernels and act(y) (transposed), and y in the compute dtype. The GEMMs
  promote to f32 (the recipe's ``fast_accum_gemms`` does not apply to them). Under
  ``BlockScaling`` the same GEMMs are block-scaled (E4M3 everywhere, as ``grouped_linear``'s):
  x and the output gradient group cast-transposed, ``activation_group_cast_transpose`` and
  ``activation_grad_group_cast_transpose`` writing act(y) and the up projection's output
  gradient in 1 x 128 groups along the columns and 128-row groups along M, the kernels in
  128 x 128 blocks, each expert's its own; saved likewise (x and act(y) transposed, both
  kernels' blocks, y).

  Args:
    x: [M, K] float32 / bfloat16 / float16, the rows grouped consecutively by expert.
    kernel_in: [G, K, N] float32 / bfloat16 / float16, each expert's up projection (Flax's
      layout); N = F, or 2F for a gated activation (columns [gate | up]).
    kernel_out: [G, F, D] float32 / bfloat16 / float16, each expert's down projection.
    group_sizes: [G] int32, the rows of each group in order, 1 <= G <= 1024.
    bias_in: optional [G, N]; bias_out: optional [G, D] (float32 / bfloat16 / float16), one
      bias per expert, each added in f32 before its GEMM's output is rounded.
    activation: "swiglu" (default), "geglu", "silu" or "gelu" (tanh approximation;
      ``jax_fp8.activations``).
    recipe: a ``DelayedScaling`` (the state's rings must have been made by it), a
      ``CurrentScaling`` (stateless; the activation's amax from XLA's activation of y, its
      gradient's likewise) or a ``BlockScaling`` (stateless; K, F and D multiples of 128).
      FP8 runs where both grouped GEMMs reach the recipe's
      ``fp8_min_intensity`` (``grouped_linear``'s intensity, ``M*N*K / (M*K + G*K*N + M*N)``
      and ``M*D*F / (M*F + G*F*D + M*D)``); below it the MLP is XLA's ``ragged_dot`` and
      activation in the compute dtype, rings untouched.
    state: under ``DelayedScaling``, a ``GroupedMlpState`` (``GroupedMlpState.create(G,
      recipe)``: one ring each for x, the activation and the two gradients, one ring per
      expert for each kernel, stacked); differentiate with respect to it and pass that
      gradient to ``jax_fp8.update_state``. Under the stateless recipes: None.
    aligned: a bool, ``grouped_linear``'s promise: True, every non-empty group starts at a row
      that is a multiple of the recipe's ``grouped_row_align`` (16; 128 under
      ``BlockScaling``), else that group's kernel gradients are NaN; False (default), any
      sizes, the wgrad operands laid out so (as ``grouped_linear`` lays them out).
    amax_axis_name: as in ``grouped_linear`` (``BlockScaling`` reduces no amax: None or ()).
    dtype: the compute dtype of the GEMMs and the activation, and the output's (float32,
      bfloat16, float16); None: x's. x's gradient comes back in x's dtype, the kernels' and
      biases' in theirs.
  Returns:
    [M, D] in ``dtype`` (default x's).
  Raises:
    TypeError / ValueError at trace time: x not [M, K] or a kernel not [G, ., .] of a float
    dtype, K not shared, N not 2F under a gated activation (F otherwise), the kernels' G
    different, group_sizes not int32 [G] (TypeError) or of another G or outside 1..1024
    (ValueError), a bias not [G, N] / [G, D], an unknown activation, K, F or D not a multiple
    of 16 (128 under BlockScaling) on the FP8 path, a recipe without grouped GEMMs (TypeError
    naming those that have them), a state that is not a ``GroupedMlpState`` of this G and
    recipe, a state given to a stateless recipe, aligned not a bool, amax_axis_name as in
    ``linear``; under BlockScaling, G K, G F or M rows beyond 65535 * 128 (the block
    quantizers' grid).

  Method: per-tensor delayed scaling with the HYBRID format (Micikevicius et al. 2022; NVIDIA
  TransformerEngine), per-expert weight scales; the activation fused as TransformerEngine's
  LayerNormMLP fuses it; block scaling as DeepSeek-V3 (arXiv 2412.19437, section 3.3) trained
  its experts; gated expert MLPs as in Mixtral (Jiang et al. 2024) and DeepSeek-V3.
  """
  activations.check(activation)
  x, kernel_in, group_sizes = grouped_operands(x, kernel_in, group_sizes, "kernel_in")
  kernel_out = float_array(kernel_out, "kernel_out")
  groups = kernel_in.shape[0]
  if kernel_out.ndim != 3 or kernel_out.shape[0] != groups:
    raise ValueError(f"kernel_out must be [G, F, D] with kernel_in's G={groups}, got shape "
                     f"{list(kernel_out.shape)}")
  k, n, f, d = mlp_dims(activation, x, kernel_in, kernel_out)
  bias_in = grouped_bias(bias_in, "bias_in", groups, n, "N")
  bias_out = grouped_bias(bias_out, "bias_out", groups, d, "D")
  check_grouped_recipe(recipe, "grouped_mlp")
  aligned = checks.boolean(aligned, "aligned")
  out_dtype = compute_dtype(x, dtype)
  m = x.shape[0]
  fp8 = fp8_pays(recipe, m, n, k, groups) and fp8_pays(recipe, m, d, f, groups)
  if fp8:
    check_dims(recipe, {"K": k, "F": f, "D": d})
  rings = None
  if recipe.stateful:
    rings = state_rings(state, GroupedMlpState, recipe, groups)
  else:
    check_stateless(recipe, state, amax_axis_name)
  amax_axis_name = amax_axes(x, (kernel_in, kernel_out), (bias_in, bias_out), state,
                             amax_axis_name)
  x = x.astype(out_dtype)
  if not fp8:
    h = activations.apply(ragged_in_dtype(x, kernel_in, bias_in, group_sizes), activation)
    return ragged_in_dtype(h.astype(x.dtype), kernel_out, bias_out, group_sizes)
  args = sharding.vary_like((x, kernel_in, kernel_out, bias_in, bias_out, group_sizes), x,
                            kernel_in, kernel_out, bias_in, bias_out, group_sizes)
  dtypes = (x.dtype, out_dtype, kernel_in.dtype, kernel_out.dtype,
            None if bias_in is None else bias_in.dtype,
            None if bias_out is None else bias_out.dtype)
  return grouped_family(recipe).grouped_mlp(*args, rings, recipe, activation, amax_axis_name,
                                            dtypes, aligned)
