"""Expert parallelism: a mixture-of-experts layer's experts split over a mesh axis, tokens sent
to the devices that hold their experts and back with two all-to-alls, inside ``shard_map``
(GShard, Lepikhin et al., 2020; DeepSeek-V3's expert parallelism).

Device i of an axis of n holds experts ``[i * E / n, (i + 1) * E / n)``. Each device routes its
own tokens, sends each assignment to its expert's device in a slab of ``capacity`` rows per
destination, runs its local experts on what it received (``jax_fp8.moe_routing.permute``'s
grouped layout), and sends the results back, where each token combines its k results with its
routing weights. All sizes are static; which rows are used is a device value.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from . import checks
from .formats import ROW_ALIGN
from .moe_routing import Routing, permute, unpermute


def expert_parallel(x: jax.Array, routing: Routing, num_experts: int, axis_name: str,
                    experts: Callable[[jax.Array, jax.Array], jax.Array], *,
                    capacity: int | None = None, align: int = ROW_ALIGN) -> jax.Array:
  """The mixture's output for this device's tokens, its experts spread over ``axis_name``.

  Call inside ``shard_map`` (or ``pmap``) with ``axis_name`` bound; every device passes its own
  tokens and routing and the same ``num_experts``.

  Args:
    x: [T, D] this device's tokens.
    routing: their ``Routing`` (expert ids global, in [0, num_experts)).
    num_experts: E, a multiple of the axis size n.
    axis_name: the mesh axis the experts are split over.
    experts: ``experts(rows [R, D], group_sizes [E / n] int32) -> [R, N]``, this device's
      experts on the grouped layout of what it received (e.g. a grouped FP8 MLP).
    capacity: rows per destination device (static). None: T * k, so no assignment is ever
      dropped (memory grows with n); a smaller capacity drops a device's assignments to one
      destination past the first ``capacity`` (in token order), whose results are then zero.
    align: each local expert block's first row is a multiple of this (``permute``).
  Returns:
    [T, N] in the experts' output dtype: ``sum_j weights[t, j] * expert_j(x[t])``.
  Raises:
    ValueError: num_experts not a multiple of the axis size, capacity out of range.
  """
  n = jax.lax.axis_size(axis_name)
  num_experts = checks.integer(num_experts, "num_experts", 1)
  if num_experts % n:
    raise ValueError(f"num_experts ({num_experts}) must be a multiple of the size of axis "
                     f"'{axis_name}' ({n}): each device holds the same number of experts")
  t, k = routing.experts.shape
  capacity = t * k if capacity is None else checks.integer(capacity, "capacity", 1, t * k)
  local = num_experts // n
  flat = routing.experts.reshape(-1)
  dest = flat // local
  # rank of each assignment among those to its destination, in token order
  order = jnp.argsort(dest, stable=True)
  counts = jnp.zeros((n,), jnp.int32).at[dest].add(1, mode="drop")
  rank = jnp.zeros_like(flat).at[order].set(
      jnp.arange(t * k, dtype=jnp.int32) - (jnp.cumsum(counts) - counts)[dest[order]])
  slot = jnp.where(rank < capacity, dest * capacity + rank, n * capacity)  # n*capacity: dropped
  send = jnp.zeros((n * capacity, x.shape[1]), x.dtype).at[slot].set(
      jnp.repeat(x, k, axis=0), mode="drop")
  send_ids = jnp.full((n * capacity,), -1, jnp.int32).at[slot].set(flat % local, mode="drop")
  recv = jax.lax.all_to_all(send.reshape(n, capacity, -1), axis_name, 0, 0)
  recv_ids = jax.lax.all_to_all(send_ids.reshape(n, capacity), axis_name, 0, 0)
  perm = permute(recv.reshape(n * capacity, -1), recv_ids.reshape(-1, 1), local, align=align)
  out = experts(perm.rows, perm.group_sizes)
  done = unpermute(out, perm, jnp.ones((n * capacity, 1), jnp.float32))  # [n * capacity, N]
  back = jax.lax.all_to_all(done.reshape(n, capacity, -1), axis_name, 0, 0)
  picked = jnp.take(back.reshape(n * capacity, -1), slot.reshape(t, k), axis=0, mode="fill",
                    fill_value=0)  # [T, k, N]
  y = jnp.einsum("tkn,tk->tn", picked.astype(jnp.float32),
                 routing.weights.astype(jnp.float32))
  return y.astype(out.dtype)
