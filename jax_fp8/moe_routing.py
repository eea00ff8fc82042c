"""Mixture-of-experts routing and token permutation, in plain jnp (differentiable by JAX): top-k
routing of router logits, the load-balancing loss, and the permutation of tokens into one
block of rows per expert — the layout the grouped FP8 GEMMs (``jax_fp8.grouped_gemm``) take —
and back.

Dropless: every token reaches its k experts, whatever the imbalance, because the grouped GEMMs
take group sizes on the device; only the row count is static. Each expert's block starts at a
row that is a multiple of ``align`` (16, the grouped wgrad's rule; 128 where 1 x 128 scale
groups must not straddle two experts), padded with zero rows that no token reads back.

Sources: top-k gating (Shazeer et al., "Outrageously Large Neural Networks", 2017); the
load-balancing loss of Switch Transformer (Fedus et al., 2021, eq. 4); dropless grouped
experts (MegaBlocks, Gale et al., 2022).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import checks
from .formats import ROW_ALIGN


class Routing(NamedTuple):
  """What the router chose for each of T tokens: ``weights`` [T, k] f32 (the combine weights),
  ``experts`` [T, k] int32 (distinct expert ids, best first) and ``probs`` [T, E] f32 (the
  softmax over all experts, for the load-balancing loss)."""
  weights: jax.Array
  experts: jax.Array
  probs: jax.Array


class Permutation(NamedTuple):
  """Tokens laid out by expert: ``rows`` [R, D] (expert e's block at rows ``[start_e, start_e
  + group_sizes[e])``, blocks consecutive, each start a multiple of the alignment, padding rows
  zero), ``group_sizes`` [E] int32 (each block's size, padding included, as the grouped GEMMs
  read them), ``slots`` [T, k] int32 (the row holding token t's copy for its j-th expert)."""
  rows: jax.Array
  group_sizes: jax.Array
  slots: jax.Array


def top_k_routing(logits: jax.Array, top_k: int, *, normalize: bool = True) -> Routing:
  """Softmax over the experts in f32, then each token's ``top_k`` most probable experts.

  Args:
    logits: [T, E] router logits (any float dtype).
    top_k: experts per token, 1 <= top_k <= E.
    normalize: a bool; the k weights rescaled to sum to 1 (Mixtral, Qwen3-MoE), or the raw
      softmax probabilities (Switch, GShard's top-1).
  Returns:
    ``Routing``.
  Raises:
    TypeError / ValueError: logits not a 2-D float array of E >= 1 experts, top_k out of
      range, normalize not a bool.
  """
  logits = checks.array(logits, "logits")
  if logits.ndim != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
    raise TypeError(f"logits must be a float [T, E] array, got {checks.describe(logits)}")
  if logits.shape[1] < 1:
    raise ValueError(f"logits must be [T, E] with E >= 1 experts, got {list(logits.shape)}")
  top_k = checks.integer(top_k, "top_k", 1, logits.shape[1])
  normalize = checks.boolean(normalize, "normalize")
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, experts = jax.lax.top_k(probs, top_k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return Routing(weights, experts.astype(jnp.int32), probs)


def load_balancing_loss(routing: Routing) -> jax.Array:
  """Switch Transformer's auxiliary loss, ``E * sum_e f_e * P_e``: f_e the fraction of the
  T * k assignments that went to expert e, P_e the mean router probability of e. 1 when both
  are uniform; it grows as routing concentrates; 0 for no tokens. f32 scalar; its gradient
  flows through P (the assignment counts are constants). TypeError for anything but a
  ``Routing``."""
  if not isinstance(routing, Routing):
    raise TypeError(f"routing must be a jax_fp8.moe_routing.Routing (top_k_routing's), got "
                    f"{type(routing).__name__}")
  t, e = routing.probs.shape
  counts = jnp.zeros((e,), jnp.float32).at[routing.experts.reshape(-1)].add(1.0)
  fraction = counts / max(routing.experts.size, 1)  # no tokens: a loss of 0, not NaN
  return e * jnp.sum(fraction * jnp.sum(routing.probs, axis=0) / max(t, 1))


def _check_align(align) -> int:
  """A block alignment: a positive multiple of ``ROW_ALIGN`` (TypeError / ValueError)."""
  align = checks.integer(align, "align", ROW_ALIGN)
  if align % ROW_ALIGN:
    raise ValueError(f"align must be a multiple of {ROW_ALIGN}, got {align}")
  return align


def permuted_rows(tokens: int, top_k: int, num_experts: int, align: int = ROW_ALIGN) -> int:
  """R, the static row count of a permutation: every assignment plus the most padding the
  blocks can need (align - 1 rows each), rounded up to ``align``. TypeError / ValueError for
  tokens not an int >= 0, top_k or num_experts not an int >= 1, align not a positive multiple
  of 16."""
  tokens = checks.integer(tokens, "tokens", 0)
  top_k = checks.integer(top_k, "top_k", 1)
  num_experts = checks.integer(num_experts, "num_experts", 1)
  align = _check_align(align)
  r = tokens * top_k + num_experts * (align - 1)
  return -(-r // align) * align


def permute(x: jax.Array, experts: jax.Array, num_experts: int, *,
            align: int = ROW_ALIGN) -> Permutation:
  """Copies token t's row of ``x`` to the block of each of its experts (stable: within a block,
  tokens keep their order).

  Args:
    x: [T, D] tokens.
    experts: [T, k] int32 expert ids in [0, num_experts) (``Routing.experts``); an id out of
      range is a device value that cannot be checked: its copy lands in no block and reads back
      as zero.
    num_experts: E, the number of blocks.
    align: each block's first row is a multiple of this (a positive multiple of 16).
  Returns:
    ``Permutation`` with R = ``permuted_rows(T, k, E, align)`` rows.
  Raises:
    TypeError / ValueError: shapes, dtypes, or align not a positive multiple of 16.
  """
  x, experts = checks.array(x, "x"), checks.array(experts, "experts")
  if x.ndim != 2:
    raise ValueError(f"x must be [T, D], got {list(x.shape)}")
  if experts.ndim != 2 or experts.shape[0] != x.shape[0] or experts.dtype != jnp.int32:
    raise TypeError(f"experts must be int32 [T, k] with T = {x.shape[0]}, got "
                    f"{checks.describe(experts)}")
  num_experts = checks.integer(num_experts, "num_experts", 1)
  align = _check_align(align)
  t, k = experts.shape
  rows = permuted_rows(t, k, num_experts, align)
  flat = experts.reshape(-1)  # assignment i = t * k + j
  valid = (flat >= 0) & (flat < num_experts)
  counts = jnp.zeros((num_experts,), jnp.int32).at[flat].add(valid.astype(jnp.int32), mode="drop")
  sizes = -(-counts // align) * align
  block_start = jnp.cumsum(sizes) - sizes
  order = jnp.argsort(jnp.where(valid, flat, num_experts), stable=True)  # assignments by expert
  sorted_expert = jnp.where(valid, flat, 0)[order]
  count_start = jnp.cumsum(counts) - counts
  rank = jnp.arange(t * k, dtype=jnp.int32) - count_start[sorted_expert]
  slot_sorted = jnp.where(valid[order], block_start[sorted_expert] + rank, rows)
  slots = jnp.zeros((t * k,), jnp.int32).at[order].set(slot_sorted)
  source = jnp.full((rows,), t, jnp.int32).at[slots].set(
      jnp.arange(t * k, dtype=jnp.int32) // k, mode="drop")  # row -> token, T for padding
  padded = jnp.concatenate([x, jnp.zeros((1, x.shape[1]), x.dtype)])
  return Permutation(padded[source], sizes, slots.reshape(t, k))


def unpermute(rows: jax.Array, permutation: Permutation, weights: jax.Array) -> jax.Array:
  """Each token's output: its k expert rows combined with its routing weights,
  ``y[t] = sum_j weights[t, j] * rows[slots[t, j]]`` (in f32, returned in rows' dtype). A slot
  past the last row (an out-of-range expert id) reads zero.

  Args:
    rows: [R, N] expert outputs in the permutation's layout.
    permutation: the ``Permutation`` the rows came from.
    weights: [T, k] combine weights (``Routing.weights``).
  Returns:
    [T, N] in rows' dtype.
  Raises:
    TypeError / ValueError: permutation not a ``Permutation``, rows or weights not floats,
      rows not [R, N] with the permutation's R, weights not [T, k] as its slots.
  """
  if not isinstance(permutation, Permutation):
    raise TypeError(f"permutation must be a jax_fp8.moe_routing.Permutation (permute's), got "
                    f"{type(permutation).__name__}")
  rows, weights = checks.array(rows, "rows"), checks.array(weights, "weights")
  for name, v in (("rows", rows), ("weights", weights)):
    if not jnp.issubdtype(v.dtype, jnp.floating):
      raise TypeError(f"{name} must be a float array, got {checks.describe(v)}")
  r = permutation.rows.shape[0]
  if rows.ndim != 2 or rows.shape[0] != r:
    raise ValueError(f"rows must be [R, N] with the permutation's R={r}, got "
                     f"{checks.describe(rows)}")
  if weights.shape != permutation.slots.shape:
    raise ValueError(f"weights must be [T, k] as the permutation's slots "
                     f"{list(permutation.slots.shape)}, got {checks.describe(weights)}")
  picked = jnp.take(rows, permutation.slots, axis=0, mode="fill", fill_value=0)  # [T, k, N]
  y = jnp.einsum("tkn,tk->tn", picked.astype(jnp.float32), weights.astype(jnp.float32))
  return y.astype(rows.dtype)
