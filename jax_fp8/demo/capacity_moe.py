"""The capacity-factor mixture of experts through dense einsums: the peers of jax_fp8's dropless
``MoeMlp`` in ``benchmarks.model_step`` and ``benchmarks.moe_layer``, in BF16 and with the
experts' einsums in FP8 through Flax's ``fp8_ops.Fp8Einsum``.

The layout of GShard and Switch Transformer (and of MaxText's "dense matmul" MoE): tokens are
routed in groups, one sequence each, and each expert takes at most C of a group's S tokens
(``expert_capacity``). The assignments past an expert's C slots are dropped: the token keeps
its other experts, and one that loses all of them leaves the layer as zero (the residual
stream carries it on). Slots go first to every token's first choice, then to the second
choices, ..., each choice in token order (GShard's priority). A one-hot dispatch einsum gathers
each expert's slots [E, G, C, D] (exact: one token a slot, zero in the empty ones), the experts
run as two batched einsums over [E, G * C] rows (an empty slot costs as much as a full one),
and a combine einsum with the routing weights (in the compute dtype) sums each token's expert
outputs back. The dispatch and combine einsums run in the compute dtype in both variants; only
the experts' two einsums run in FP8 in the Flax one (per-tensor delayed scaling in jnp, XLA's
FP8 GEMMs: the scales and amax histories of each ``Fp8Einsum`` in Flax's
"_overwrite_with_gradient" collection, replaced by its gradient each step).

Sources: GShard (Lepikhin et al. 2020, arXiv 2006.16668: group-level top-2 gating with an
expert capacity, the dispatch and combine einsums), Switch Transformer (Fedus et al. 2021,
arXiv 2101.03961: the capacity factor), Flax's ``flax.linen.fp8_ops``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

from jax_fp8 import activations, checks

from .twins import Bf16MoeMlp

DROPPED = "dropped_assignments"  # the name the layer sows its count of dropped assignments under
CAPACITY_FACTOR = 1.25  # the benchmarks' default, within the 1.0 to 2.0 the field trains with


def expert_capacity(group: int, top_k: int, num_experts: int, factor: float) -> int:
  """C, each expert's slots in a group of ``group`` tokens: ceil(factor * group * top_k / E),
  at least 1 and at most ``group`` (an expert gets at most one assignment a token). A factor of
  E / top_k or more drops nothing."""
  return min(group, max(1, math.ceil(factor * group * top_k / num_experts)))


class Dispatch(NamedTuple):
  """Where a group's assignments go: ``dispatch`` [G, S, E, C] (1 where token s fills slot c
  of expert e, else 0), ``combine`` [G, S, E, C] f32 (the routing weight there), ``dropped``
  int32 [] (the assignments that found no slot)."""
  dispatch: jax.Array
  combine: jax.Array
  dropped: jax.Array


def dispatch(experts: jax.Array, weights: jax.Array, num_experts: int, slots: int,
             dtype=jnp.bfloat16) -> Dispatch:
  """The dispatch and combine masks of top-k assignments with ``slots`` (C) slots an expert.

  Args:
    experts: [G, S, k] int32 distinct expert ids a token, best first (``Routing.experts``).
    weights: [G, S, k] combine weights (``Routing.weights``); the combine mask's gradient flows
      to them.
    num_experts: E.
    slots: C >= 1.
    dtype: the dispatch mask's dtype.
  Returns:
    ``Dispatch``; slot c of expert e holds its (c + 1)-th assignment in priority order: all
    first choices of the group in token order, then all second choices, and so on.
  """
  g, s, k = experts.shape
  chosen = jax.nn.one_hot(experts, num_experts, dtype=jnp.int32)  # [G, S, k, E]
  by_priority = jnp.swapaxes(chosen, 1, 2).reshape(g, k * s, num_experts)
  ahead = jnp.cumsum(by_priority, axis=1) - by_priority  # earlier assignments to the expert
  position = jnp.swapaxes(jnp.sum(ahead * by_priority, -1).reshape(g, k, s), 1, 2)  # [G, S, k]
  kept = position < slots
  # one_hot of an index past the last slot is all zero: a dropped assignment fills no slot
  slot = jnp.where(kept, experts * slots + position, num_experts * slots)  # [G, S, k]
  masks = [jax.nn.one_hot(slot[..., j], num_experts * slots, dtype=jnp.float32)
           for j in range(k)]  # k of [G, S, E * C]; at most one 1 each
  shape = (g, s, num_experts, slots)
  return Dispatch(sum(masks).reshape(shape).astype(dtype),
                  sum(m * weights[..., j, None].astype(jnp.float32)
                      for j, m in enumerate(masks)).reshape(shape),
                  jnp.sum(~kept, dtype=jnp.int32))


class CapacityMoeMlp(Bf16MoeMlp):
  """``Bf16MoeMlp``'s parameters and routing (the same values from one seed), the experts run
  by capacity: h [..., S, D] (each row of S tokens, a sequence, one routing group) -> [..., S,
  D] in ``dtype``. ``capacity_factor`` > 0 sets C (``expert_capacity``); ``fp8``: the experts'
  two einsums through ``fp8_ops.Fp8Einsum`` (submodules "w_in_einsum", "w_out_einsum"), else in
  ``dtype``. Sows the load-balancing loss and, as ``DROPPED``, the int32 count of the call's
  dropped assignments in "intermediates". ValueError: a capacity factor that is no positive
  number, h without a sequence axis."""

  capacity_factor: float = CAPACITY_FACTOR
  fp8: bool = False

  @nn.compact
  def __call__(self, h):
    name = type(self).__name__
    factor = checks.number(self.capacity_factor, f"{name}.capacity_factor")
    if factor <= 0:
      raise ValueError(f"{name}.capacity_factor must be > 0, got {self.capacity_factor!r}")
    if checks.boolean(self.fp8, f"{name}.fp8"):
      w_in_einsum = fp8_ops.Fp8Einsum(name="w_in_einsum")
      w_out_einsum = fp8_ops.Fp8Einsum(name="w_out_einsum")
    else:
      w_in_einsum = w_out_einsum = jnp.einsum
    if h.ndim < 2:
      raise ValueError(f"{name} takes h [..., S, D] (a routing group a sequence), got "
                       f"{list(h.shape)}")
    s, d, e = h.shape[-2], h.shape[-1], self.num_experts
    tokens, w_in, w_out, routing = self.route(h)
    groups = tokens.shape[0] // s
    c = expert_capacity(s, self.top_k, e, factor)
    route = dispatch(routing.experts.reshape(groups, s, -1),
                     routing.weights.reshape(groups, s, -1), e, c, self.dtype)
    self.sow("intermediates", DROPPED, route.dropped)
    rows = jnp.einsum("gsec,gsd->egcd", route.dispatch, tokens.reshape(groups, s, d))
    y = w_in_einsum("end,edf->enf", rows.reshape(e, groups * c, d), w_in)  # [E, G * C, F]
    y = w_out_einsum("enh,ehd->end", activations.apply(y, self.activation).astype(self.dtype),
                     w_out)
    y = jnp.einsum("gsec,egcd->gsd", route.combine.astype(self.dtype),
                   y.reshape(e, groups, c, d), preferred_element_type=jnp.float32)
    return y.astype(self.dtype).reshape(h.shape)
