"""``moe_mlp``: a mixture-of-experts MLP with FP8 experts — a router in f32, top-k routing, the
tokens permuted into one aligned block per expert, the experts' MLPs as grouped FP8 GEMMs with
the activation fused into their cast-transposes (``grouped_mlp``, forward and backward), and
the results combined with the routing weights; optionally the experts split over a mesh axis
(``moe_parallel``).

Sources: the sparsely-gated MoE layer (Shazeer et al. 2017), Switch Transformer's
load-balancing loss (Fedus et al. 2021), gated expert MLPs (Mixtral, Jiang et al. 2024;
DeepSeek-V3, 2024), dropless grouped experts (MegaBlocks, Gale et al. 2022).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import activations, checks
from .grouped_mlp import grouped_mlp
from .layer_checks import axis_bound, check_grouped_recipe, check_stateless, float_array
from .layer_state import GroupedMlpState, check_stateful
from .moe_parallel import expert_parallel
from .moe_routing import load_balancing_loss, permute, top_k_routing, unpermute
from .recipes import Recipe


@functools.partial(jax.tree_util.register_dataclass, data_fields=["experts"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class MoeState:
  """The scale rings of ``moe_mlp`` under ``DelayedScaling``: ``experts``, the experts'
  ``GroupedMlpState`` (one ring each for their input, activation and two gradients, one ring
  per expert for each kernel)."""

  experts: GroupedMlpState

  @classmethod
  def create(cls, num_experts: int, recipe: Recipe) -> "MoeState":
    """Fresh rings for ``num_experts`` experts (``GroupedMlpState.create``). Raises TypeError /
    ValueError for num_experts not an int >= 1 or a stateless recipe."""
    num_experts = checks.integer(num_experts, "num_experts", lo=1)
    check_stateful(recipe, cls)
    return cls(GroupedMlpState.create(num_experts, recipe))


def check_expert_axis(expert_axis, recipe, owner: str) -> None:
  """``expert_axis`` None, or the name (str) of an axis bound here (the call runs inside the
  shard_map over it) under a stateless recipe; TypeError / ValueError otherwise."""
  if expert_axis is None:
    return
  if not isinstance(expert_axis, str):
    raise TypeError(f"{owner}'s expert_axis must be None or a mesh axis name (str), got "
                    f"{checks.describe(expert_axis)}")
  if recipe.stateful:
    raise TypeError(f"{owner} with expert_axis takes a stateless recipe (CurrentScaling, "
                    f"BlockScaling), got {type(recipe).__name__}")
  if not axis_bound(expert_axis):
    raise ValueError(f"{owner}'s expert_axis names the axis {expert_axis!r}, which is not bound "
                     f"here: call inside the shard_map over it (or pass None)")


def local_experts(num_experts: int, expert_axis: str | None, recipe, owner: str) -> int:
  """The experts one device holds: all, or ``num_experts / n`` over an ``expert_axis`` of n
  devices; ``check_expert_axis``'s errors, and ValueError where n does not divide E."""
  check_expert_axis(expert_axis, recipe, owner)
  if expert_axis is None:
    return num_experts
  n = jax.lax.axis_size(expert_axis)
  if num_experts % n:
    raise ValueError(f"{owner}.num_experts ({num_experts}) must be a multiple of the size of "
                     f"expert_axis '{expert_axis}' ({n})")
  return num_experts // n


def expert_init(init, num_experts: int, expert_axis: str | None):
  """An initializer of a stack of expert kernels ``[E_local, ...]``: ``init`` itself without
  ``expert_axis``; with it, this device's slice of the whole ``[E, ...]`` stack that ``init``
  makes from the key, so each device's experts differ and equal one device's."""
  if expert_axis is None:
    return init

  def sliced(key, shape, dtype=jnp.float32):
    local = shape[0]
    whole = init(key, (num_experts,) + tuple(shape[1:]), dtype)
    return jax.lax.dynamic_slice_in_dim(whole, jax.lax.axis_index(expert_axis) * local, local)
  return sliced


def moe_mlp(x: jax.Array, router_kernel: jax.Array, w_in: jax.Array, w_out: jax.Array, *,
            top_k: int, recipe: Recipe, state: MoeState | None = None,
            activation: str = "swiglu", normalize_weights: bool = True,
            amax_axis_name: str | tuple[str, ...] | None = None,
            expert_axis: str | None = None, capacity: int | None = None,
            align: int | None = None) -> tuple[jax.Array, jax.Array]:
  """A mixture-of-experts MLP over tokens ``x``: each token goes to its ``top_k`` experts, each
  expert an MLP ``act(t @ w_in[e]) @ w_out[e]`` run as grouped FP8 GEMMs over all the tokens it
  received, and the token's output is the routing-weighted sum of its experts' outputs.

  The router (``x @ router_kernel`` and its softmax) runs in f32. Dropless: every token reaches
  its experts whatever the imbalance (the grouped GEMMs read the group sizes on the device);
  each expert's block of tokens is padded to a multiple of ``align`` rows (by default the
  recipe's ``grouped_row_align``: 16, or 128 under ``BlockScaling``), so the grouped MLP
  (``grouped_mlp``: the activation and its gradient inside its FP8 cast-transposes) runs with
  ``aligned=True``.

  Args:
    x: [..., D] tokens, float32 / bfloat16 / float16 (the compute dtype).
    router_kernel: [D, E] router weights.
    w_in: [E, D, F] the experts' first kernels; F = 2 H for a gated activation ([gate | up]),
      else H.
    w_out: [E, H, D] the experts' second kernels.
    top_k: experts per token, 1 <= top_k <= E.
    recipe: ``DelayedScaling``, ``CurrentScaling`` or ``BlockScaling`` (the recipes
      ``grouped_mlp`` takes; D and H multiples of its ``dim_multiple``: 16, 128 under
      ``BlockScaling``).
    state: under ``DelayedScaling`` a ``MoeState`` (``MoeState.create(E, recipe)``, or its
      slice of this device's experts under ``expert_axis``); differentiate with respect to it
      and pass the gradient to ``jax_fp8.update_state``. Under the stateless recipes: None.
    activation: "swiglu" (default), "geglu", "silu" or "gelu" (``jax_fp8.activations``),
      computed in f32 inside the grouped MLP's cast-transposes.
    normalize_weights: a bool; the k routing weights rescaled to sum to 1 (Mixtral) or the raw
      softmax probabilities.
    amax_axis_name: as in ``grouped_mlp`` (data-parallel devices that share the scales, each
      holding every expert); with ``expert_axis``, further axes to share x's and the
      gradient's amax over (never the expert axis: each device's experts keep their own
      scales, and its tokens theirs).
    expert_axis: None, or the mesh axis (bound by ``shard_map``) whose devices each hold E / n
      of the experts: then ``w_in`` / ``w_out`` (and ``state``) are this device's experts
      ``[E / n, ...]``, ``router_kernel`` is whole, and tokens travel with two all-to-alls
      (``moe_parallel.expert_parallel``). Stateless recipes only: a DelayedScaling state's x
      and gradient rings would need a max over the axis and the kernel rings none.
    capacity: with ``expert_axis``, rows per destination device, an int in [1, T * top_k]
      with T this device's tokens (None: T * top_k, dropless); a ValueError without it.
    align: row alignment of each expert's block, a multiple of the recipe's
      ``grouped_row_align`` (None: that).
  Returns:
    ``(y [..., D] in x's dtype, load_balancing_loss f32 [])``: the loss is Switch
    Transformer's ``E * sum_e f_e P_e`` over this call's tokens (add it, scaled, to the
    training loss).
  Raises:
    TypeError / ValueError at trace time: shapes and dtypes that do not fit together, top_k out
    of range, an unknown activation, w_in's F not 2 H for a gated activation, a recipe
    ``grouped_mlp`` does not take, align not a multiple of its ``grouped_row_align``, a
    DelayedScaling state missing, of other experts or with expert_axis, a state under a
    stateless recipe, w_in not E / n experts over an expert_axis of n devices, and what
    ``grouped_mlp`` raises.
  """
  x = float_array(x, "x")
  router_kernel = float_array(router_kernel, "router_kernel")
  w_in, w_out = float_array(w_in, "w_in"), float_array(w_out, "w_out")
  if x.ndim < 1:
    raise ValueError("x must be [..., D] tokens, got a scalar")
  d = x.shape[-1]
  if router_kernel.ndim != 2 or router_kernel.shape[0] != d:
    raise ValueError(f"router_kernel must be [D, E] with x's D={d}, got "
                     f"{list(router_kernel.shape)}")
  num_experts = router_kernel.shape[1]
  _, gated = activations.check(activation)
  local = w_in.shape[0] if w_in.ndim == 3 else None
  if w_in.ndim != 3 or w_in.shape[1] != d:
    raise ValueError(f"w_in must be [E, D, F] with D={d}, got {list(w_in.shape)}")
  hidden = w_in.shape[2] // 2 if gated else w_in.shape[2]
  if gated and w_in.shape[2] % 2:
    raise ValueError(f"w_in's F must be 2 H ([gate | up]) for the gated activation "
                     f"{activation!r}, got F={w_in.shape[2]}")
  if w_out.shape != (local, hidden, d):
    raise ValueError(f"w_out must be [E, H, D] = [{local}, {hidden}, {d}] (w_in's experts, H "
                     f"from w_in's F, x's D), got {list(w_out.shape)}")
  check_grouped_recipe(recipe, "moe_mlp")
  if align is None:
    align = recipe.grouped_row_align
  elif checks.integer(align, "align", 1) % recipe.grouped_row_align:
    raise ValueError(f"align must be a multiple of {type(recipe).__name__}'s grouped row "
                     f"alignment {recipe.grouped_row_align} (where the grouped wgrad's groups "
                     f"start), got {align}")
  m = recipe.dim_multiple
  if d % m or hidden % m:
    raise ValueError(f"{type(recipe).__name__}'s FP8 GEMMs need the model dimension D and the "
                     f"experts' hidden size H to be multiples of {m}, got D={d}, H={hidden}")
  normalize_weights = checks.boolean(normalize_weights, "normalize_weights")
  axis = amax_axis_name
  check_expert_axis(expert_axis, recipe, "moe_mlp")
  if expert_axis is not None:
    n = jax.lax.axis_size(expert_axis)
    if num_experts % n or local != num_experts // n:
      raise ValueError(f"with expert_axis {expert_axis!r} of {n} devices, w_in and w_out must "
                       f"hold this device's E / n of the router's {num_experts} experts, got "
                       f"w_in {list(w_in.shape)} (E a multiple of n)")
    axis = () if amax_axis_name is None else amax_axis_name
    if expert_axis in ((axis,) if isinstance(axis, str) else tuple(axis)):
      raise ValueError(f"amax_axis_name must not name the expert axis {expert_axis!r}: each "
                       f"device's experts keep their own scales")
  else:
    if local != num_experts:
      raise ValueError(f"w_in must hold the router's {num_experts} experts, got {local}")
    if capacity is not None:
      raise ValueError(f"capacity applies with expert_axis (rows per destination device); "
                       f"without it every token reaches its experts, got capacity={capacity!r}")
  if recipe.stateful and not isinstance(state, MoeState):
    raise TypeError(f"state must be a jax_fp8.moe.MoeState (MoeState.create(E, recipe)) under "
                    f"{type(recipe).__name__}, got {checks.describe(state)}")
  if recipe.stateful:
    if not isinstance(state.experts, GroupedMlpState):
      raise TypeError(f"state.experts must be a GroupedMlpState (MoeState.create(E, recipe)), "
                      f"got {type(state.experts).__name__}")
    held = list(jnp.shape(getattr(state.experts.kernel_in, "scale", None)))
    if held != [local]:
      raise ValueError(f"state must be the MoeState of w_in's {local} experts "
                       f"(MoeState.create({local}, recipe)): state.experts.kernel_in.scale "
                       f"[{local}], got {held}")
  if not recipe.stateful:
    check_stateless(recipe, state, None)  # the amax axes: grouped_mlp's check
  lead = x.shape[:-1]
  tokens = x.reshape(-1, d)
  logits = jnp.dot(tokens.astype(jnp.float32), router_kernel.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
  routing = top_k_routing(logits, top_k, normalize=normalize_weights)

  def experts(rows, group_sizes):
    return grouped_mlp(rows, w_in, w_out, group_sizes, activation=activation, recipe=recipe,
                       state=None if state is None else state.experts, aligned=True,
                       amax_axis_name=axis)

  if expert_axis is None:
    perm = permute(tokens, routing.experts, num_experts, align=align)
    y = unpermute(experts(perm.rows, perm.group_sizes), perm, routing.weights)
  else:
    y = expert_parallel(tokens, routing, num_experts, expert_axis, experts, capacity=capacity,
                        align=align)
  return y.astype(x.dtype).reshape(*lead, d), load_balancing_loss(routing)
