"""Scaling policy: FP8 formats, the scale ring for delayed scaling, and recipes.

Convention used everywhere in jax_fp8: **scale is the dequantization step**,
``x ~= q * scale`` with ``q = saturate(round_nearest_even(x * (1 / scale)))`` (as in
``jax.nn.scaled_matmul`` and DeepGEMM). No API takes a ``scale_inv``.

Delayed scaling (Micikevicius et al., "FP8 Formats for Deep Learning", 2022; the recipe of
NVIDIA TransformerEngine): the scale used at step t comes from the amax history up to step
t - 1. This module is pure and is the only authority on how a scale follows from an amax;
``csrc/numerics.h`` mirrors it bit for bit for the fused CUDA and CPU ring finalize.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

Fmt = Literal["e4m3", "e5m2"]
FORMATS: dict[str, jnp.dtype] = {
    "e4m3": jnp.dtype(jnp.float8_e4m3fn),
    "e5m2": jnp.dtype(jnp.float8_e5m2),
}
ALGOS = ("max", "most_recent")
LINEAR_GEMMS = ("fprop", "dgrad", "wgrad")  # a linear's three GEMMs (DelayedScaling.fast_accum)
MAX_HISTORY = 1024  # one CUDA block finalizes the ring


def fp8_dtype(fmt: str) -> jnp.dtype:
  """The JAX dtype of an FP8 format name: "e4m3" -> float8_e4m3fn, "e5m2" -> float8_e5m2."""
  if fmt not in FORMATS:
    raise ValueError(f"fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
  return FORMATS[fmt]


def fp8_max(fmt: str) -> float:
  """Largest finite value of the format (448 for e4m3, 57344 for e5m2), from the dtype."""
  return float(jnp.finfo(fp8_dtype(fmt)).max)


def scale_from_amax(amax: jax.Array, prev_scale: jax.Array, fmt: str, margin: int) -> jax.Array:
  """Scale that maps ``amax`` onto the format's maximum with ``2**margin`` of headroom.

  ``scale = amax * f32(2**margin / fmt_max)`` (one rounding), clamped to ``[FLT_MIN,
  FLT_MAX]`` so that the scale and its reciprocal are finite and positive. An amax of 0 (an
  all-zero tensor), below FLT_MIN (f32 subnormals, which XLA's CPU runtime flushes to zero, so
  they count as zero on every platform) or not finite carries no information: ``prev_scale``
  is returned.

  Args:
    amax: f32 scalar, max |x| (>= 0 or NaN).
    prev_scale: f32 scalar, the scale to keep when amax is uninformative.
    fmt: "e4m3" or "e5m2".
    margin: integer power-of-two headroom (TransformerEngine's ``margin``).
  Returns:
    f32 scalar.
  """
  amax = jnp.asarray(amax, jnp.float32)
  tiny, big = np.finfo(np.float32).tiny, np.finfo(np.float32).max
  s = jnp.clip(amax * np.float32(2.0**margin / fp8_max(fmt)), tiny, big)
  return jnp.where(informative(amax), s, jnp.asarray(prev_scale, jnp.float32))


def informative(amax: jax.Array) -> jax.Array:
  """Whether an amax can set a scale: finite and at least FLT_MIN (bool, amax's shape)."""
  return (amax >= np.finfo(np.float32).tiny) & (amax <= np.finfo(np.float32).max)


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["amax_history", "scale", "steps"],
    meta_fields=["fmt", "margin", "algo"],
)
@dataclasses.dataclass(frozen=True)
class ScaleRing:
  """Delayed-scaling state of one tensor: a pytree, jit-safe and checkpointable.

  Attributes:
    amax_history: f32 [L], newest amax first; zeros before any step.
    scale: f32 [], the scale (dequantization step) the next quantize will use.
    steps: f32 [], how many steps have set the scale from an informative window (nonzero,
      finite). While 0 the ring is fresh: a quantize uses the current amax instead of the
      history, so a ring whose first steps saw only zeros (a zero-initialized layer) keeps
      current scaling until it sees data. Kept as f32 so the ring can travel as a gradient.
    fmt, margin, algo: static; the format, the power-of-two headroom, and how the window is
      reduced ("max" over the history or "most_recent").

  Non-finite amax policy: a step whose amax is NaN or inf leaves the ring unchanged (the
  quantized output still shows the NaN / saturates the inf), so the state is never poisoned.
  """

  amax_history: jax.Array
  scale: jax.Array
  steps: jax.Array
  fmt: str = "e4m3"
  margin: int = 0
  algo: str = "max"

  def __post_init__(self):  # the static fields only: leaves may be tracers or sentinels here
    check_ring_params(None, self.fmt, self.margin, self.algo)

  @classmethod
  def create(cls, history_len: int = 16, fmt: str = "e4m3", margin: int = 0,
             algo: str = "max") -> "ScaleRing":
    """A fresh ring: zero history, scale 1 (unused: step 0 scales from the current amax)."""
    check_ring_params(history_len, fmt, margin, algo)
    return cls(jnp.zeros((history_len,), jnp.float32), jnp.ones((), jnp.float32),
               jnp.zeros((), jnp.float32), fmt, int(margin), algo)


MAX_MARGIN = 64


def check_ring_params(history_len, fmt, margin, algo) -> None:
  """Raises ValueError / TypeError for ring parameters jax_fp8 cannot honour (history_len None:
  not checked). Allocates nothing, so recipes can be built at import time without starting a JAX backend."""
  fp8_dtype(fmt)
  if history_len is not None and (not isinstance(history_len, (int, np.integer))
                                  or not 1 <= history_len <= MAX_HISTORY):
    raise ValueError(f"history_len must be an int in [1, {MAX_HISTORY}], got {history_len!r}")
  if algo not in ALGOS:
    raise ValueError(f"algo must be one of {ALGOS}, got {algo!r}")
  if isinstance(margin, bool) or not isinstance(margin, (int, np.integer)):
    raise TypeError(f"margin must be an int (a power-of-two exponent), got {margin!r}")
  if not -MAX_MARGIN <= margin <= MAX_MARGIN:
    raise ValueError(f"margin must be in [-{MAX_MARGIN}, {MAX_MARGIN}], got {margin}")


def scale_for_step(ring: ScaleRing, current_amax: jax.Array) -> jax.Array:
  """The scale a delayed-scaling quantize uses now: the ring's, or on a fresh ring the one
  from the current amax (current scaling for step 0, not a default of 1)."""
  first = scale_from_amax(current_amax, ring.scale, ring.fmt, ring.margin)
  return jnp.where(ring.steps == 0, first, ring.scale)


def next_ring(ring: ScaleRing, amax: jax.Array) -> ScaleRing:
  """Record this step's amax: push it at the front of the history, reduce the window with
  ``ring.algo``, publish the next scale and, if the window was informative, count the step.
  Non-finite amax: ring unchanged."""
  amax = jnp.asarray(amax, jnp.float32)
  history = jnp.concatenate([amax[None], ring.amax_history[:-1]])  # [L], newest first
  window = jnp.max(history) if ring.algo == "max" else amax
  scale = scale_from_amax(window, ring.scale, ring.fmt, ring.margin)
  finite = jnp.isfinite(amax)
  return dataclasses.replace(
      ring,
      amax_history=jnp.where(finite, history, ring.amax_history),
      scale=jnp.where(finite, scale, ring.scale),
      steps=jnp.where(finite & informative(window), ring.steps + 1, ring.steps),
  )


def check_fp8_min_intensity(recipe) -> None:
  """Validate a recipe's ``fp8_min_intensity``: a linear whose GEMM does fewer multiply-adds
  per element of x, kernel and output than this, ``M*N*K / (M*K + K*N + M*N)``, runs in the
  input's dtype through XLA (BF16 GEMMs), because there the quantization passes cost more
  than the FP8 GEMMs save; its rings are then untouched (no observation this step). M counts
  the rows the call sees: under shard_map, one device's. On one H200 the per-tensor FP8
  linear overtook BF16 between intensities 819 (0.96x) and 910 (1.11-1.15x over two runs),
  so 900 is the measured crossover there (benchmarks "linear crossover", README). The FP8
  shape rules (K, N multiples of 16, or 128 under BlockScaling) apply only to FP8 layers.
  Raises ValueError unless it is a finite float >= 0."""
  v = recipe.fp8_min_intensity
  if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
    raise ValueError(f"{type(recipe).__name__}.fp8_min_intensity must be a finite number >= 0, "
                     f"got {v!r}")


@dataclasses.dataclass(frozen=True)
class DelayedScaling:
  """Per-tensor delayed-scaling recipe (TransformerEngine's ``DelayedScaling``).

  Attributes:
    fmt: "hybrid" (E4M3 for activations and weights, E5M2 for gradients) or "e4m3" (E4M3 for
      all three).
    history_len: amax history length L, 1..1024.
    margin: power-of-two headroom in the scale.
    algo: "max" (max over the history window) or "most_recent".
    fp8_min_intensity: see ``check_fp8_min_intensity``; 0 (default): always FP8.
    fast_accum: the linear's GEMMs, among "fprop" (y = x @ kernel), "dgrad" (dx) and "wgrad"
      (dkernel), that let Hopper's FP8 tensor cores accumulate without promotion to f32
      (``gemm``'s ``fast_accum``): faster, less accurate as K grows. () (default): none.
      ("fprop",) is TransformerEngine's default (split accumulators for dgrad and wgrad);
      all three is what XLA's own FP8 dot does at default precision (the pure-JAX FP8 path).
      Stored as a tuple in that canonical order, so recipes that name the same GEMMs are
      equal (and hashable, as jit's static arguments need). On the H200 the benchmark's
      "gemm" rows give each GEMM's speed and accumulation error with and without it;
      "linear fwd+bwd" and "block train step" time ("fprop",) and all three.
  """

  fmt: Literal["hybrid", "e4m3"] = "hybrid"
  history_len: int = 16
  margin: int = 0
  algo: Literal["max", "most_recent"] = "max"
  fp8_min_intensity: float = 0.0
  fast_accum: tuple[str, ...] = ()

  def __post_init__(self):
    if self.fmt not in ("hybrid", "e4m3"):
      raise ValueError(f"DelayedScaling.fmt must be 'hybrid' or 'e4m3', got {self.fmt!r}")
    check_ring_params(self.history_len, "e4m3", self.margin, self.algo)
    check_fp8_min_intensity(self)
    v = self.fast_accum
    if (not isinstance(v, (tuple, list, set, frozenset)) or not all(g in LINEAR_GEMMS for g in v)
        or len(set(v)) != len(v)):
      raise ValueError(f"DelayedScaling.fast_accum must be a tuple (or list or set) of distinct "
                       f"names from {LINEAR_GEMMS}, got {v!r}")
    object.__setattr__(self, "fast_accum", tuple(g for g in LINEAR_GEMMS if g in v))

  @property
  def fwd_fmt(self) -> str:
    return "e4m3"

  @property
  def bwd_fmt(self) -> str:
    return "e5m2" if self.fmt == "hybrid" else "e4m3"

  def ring(self, fmt: str) -> ScaleRing:
    return ScaleRing.create(self.history_len, fmt, self.margin, self.algo)


# How the next state leaves a training step (the pattern of Flax's fp8_ops and TransformerEngine:
# state updates delivered as the gradient with respect to the state). jax_fp8.linear defines the
# gradient of a ScaleRing as its *observation* of the step, `observe(ring, amax)`: the history
# shifted with this step's amax in front (NaN or inf recorded as +inf), `steps + 1`, and scale 0.
# Observations of one ring in one step differ only in that front amax, so they combine exactly
# by an elementwise max (a zero gradient, from a ring that did not run, is neutral), and
# `update_state` turns the combined observation into the next ring, deriving the scale there.


def observe(ring: ScaleRing, amax: jax.Array) -> ScaleRing:
  """The gradient a ring receives from one use in a step: see the comment above."""
  amax = jnp.asarray(amax, jnp.float32)
  front = jnp.where(jnp.isfinite(amax), amax, jnp.inf)[None]  # non-finite -> +inf marker
  return dataclasses.replace(ring, amax_history=jnp.concatenate([front, ring.amax_history[:-1]]),
                             scale=jnp.zeros_like(ring.scale), steps=ring.steps + 1)


def _is_ring(x) -> bool:
  return isinstance(x, ScaleRing)


def update_state(state, state_grads):
  """The state for the next step from the gradient with respect to the state.

  Args:
    state: any pytree holding ScaleRings (a LinearState, a Flax "fp8_state" collection).
    state_grads: the gradient of the loss with respect to ``state`` (same structure).
  Returns:
    ``state`` with every ring advanced as ``next_ring(ring, amax)`` would, amax being the max
    over the ring's uses this step. A ring that did not run (zero gradient) is kept, so its
    history does not roll; a step with a NaN or inf amax leaves the ring as it was.

  A ring used n times in one differentiation without ``share`` (e.g. under ``vmap``) has its
  observations summed by JAX; that shows as ``steps`` = n * (old steps + 1). The front entry
  is then the sum of the n amaxes, an upper bound of their max, and is recorded as such: the
  scale errs towards headroom, never towards overflow. Rings stacked on leading axes (a Flax
  ``nn.scan`` over layers) are advanced one by one.
  """
  def advance(ring, obs):
    front = obs.amax_history[0]
    history = jnp.concatenate([front[None], ring.amax_history[:-1]])
    window = jnp.max(history) if ring.algo == "max" else front
    nxt = dataclasses.replace(ring, amax_history=history,
                              scale=scale_from_amax(window, ring.scale, ring.fmt, ring.margin),
                              steps=ring.steps + informative(window).astype(jnp.float32))
    keep = (obs.steps == 0) | ~jnp.isfinite(front)
    return jax.tree.map(lambda old, new: jnp.where(keep, old, new), ring, nxt)

  def advance_stacked(ring, obs):  # rings stacked by a scan over layers: [..., L]
    fn = advance
    for _ in range(jnp.ndim(ring.steps)):
      fn = jax.vmap(fn)
    return fn(ring, obs)
  return jax.tree.map(advance_stacked, state, state_grads, is_leaf=_is_ring)


def combine_updates(a, b):
  """Combine two state gradients of the same step (e.g. two microbatches' gradients computed
  from the same state in a ``lax.scan``) by an elementwise max, which is exact for
  observations; use it for the state where parameter gradients would be summed."""
  return jax.tree.map(jnp.maximum, a, b)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def share(state, n: int):
  """``n`` copies of ``state`` stacked on a new leading axis, whose gradients combine by max.

  Use it when one state feeds several uses inside one differentiation, where JAX would sum the
  gradients: scan over the stacked copies (``lax.scan(body, carry, (microbatches, share(state,
  n)))``), or take ``jax.tree.map(lambda v: v[i], shared)`` for the i-th use of a tied layer.

  Args:
    state: pytree of arrays (typically a LinearState or an "fp8_state" collection).
    n: number of uses, >= 1.
  Returns:
    The pytree with every leaf broadcast to ``[n, *leaf.shape]``.
  """
  return jax.tree.map(lambda v: jnp.broadcast_to(v, (n,) + jnp.shape(v)), state)


def _share_fwd(state, n):
  return share(state, n), None


def _share_bwd(n, _, g):
  return (jax.tree.map(lambda v: jnp.max(v, axis=0), g),)


share.defvjp(_share_fwd, _share_bwd)
