"""Delayed-scaling state: the scale ring of one tensor, its rules, and how it leaves a step.

Delayed scaling (Micikevicius et al., "FP8 Formats for Deep Learning", 2022; the recipe of
NVIDIA TransformerEngine): the scale used at step t comes from the amax history up to step
t - 1. This module is the one jnp definition of the ring rules; ``csrc/numerics.h`` holds the
one C++ definition, which the fused CUDA and CPU kernels apply bit for bit.

How the next state leaves a training step (the pattern of Flax's ``fp8_ops`` and
TransformerEngine: state updates delivered as the gradient with respect to the state): the
gradient of a ring is its *observation* of the step, ``observe(ring, amax)``: the history
shifted with this step's amax in front (NaN or inf recorded as +inf), ``steps + 1`` and scale 0.
Observations of one ring in one step differ only in that front amax, so they combine exactly by
an elementwise max (a zero gradient, from a ring that did not run, is neutral), and
``update_state`` advances every ring by its combined observation. ``next_ring(ring, amax)`` is
``advance(ring, observe(ring, amax))``: the fused kernels' finalize.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, checks
from .formats import fp8_dtype, fp8_max

ALGOS = ("max", "most_recent")  # ids in csrc/constants.h (algo_max, algo_most_recent)
MAX_MARGIN = 64
HISTORY_LEN = 16  # the default amax history length


def scale_from_amax(amax: jax.Array, prev_scale: jax.Array, fmt: str, margin: int) -> jax.Array:
  """Scale that maps ``amax`` onto the format's maximum with ``2**margin`` of headroom.

  ``scale = amax * f32(2**margin / fmt_max)`` (one rounding), clamped to ``[FLT_MIN,
  FLT_MAX]`` so that the scale and its reciprocal are finite and positive. An amax of 0 (an
  all-zero tensor), below FLT_MIN (f32 subnormals count as zero) or not finite carries no
  information: ``prev_scale`` is returned.

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


def check_history_len(history_len, owner: str = "") -> int:
  """An int in [1, 1024] (one CUDA block finalizes the ring); TypeError / ValueError else,
  naming it ``owner`` + "history_len" (``owner``: e.g. "DelayedScaling.")."""
  return checks.integer(history_len, f"{owner}history_len", 1, _ffi.CONSTANTS["max_history"])


def check_ring_params(fmt, margin, algo, owner: str = "") -> None:
  """Raises ValueError / TypeError for a ring's static parameters that jax_fp8 cannot honour,
  each named after ``owner`` as in ``check_history_len``. Allocates nothing, so recipes can be
  built before a JAX backend starts."""
  fp8_dtype(fmt)
  checks.one_of(algo, f"{owner}algo", ALGOS)
  checks.integer(margin, f"{owner}margin", -MAX_MARGIN, MAX_MARGIN)


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
    check_ring_params(self.fmt, self.margin, self.algo)

  @classmethod
  def create(cls, history_len: int = HISTORY_LEN, fmt: str = "e4m3", margin: int = 0,
             algo: str = "max") -> "ScaleRing":
    """A fresh ring: zero history, scale 1 (unused: step 0 scales from the current amax).

    Raises:
      TypeError / ValueError: history_len not an int in [1, 1024], an unknown fmt or algo,
        margin not an int in [-64, 64].
    """
    check_history_len(history_len)
    check_ring_params(fmt, margin, algo)
    return cls(jnp.zeros((history_len,), jnp.float32), jnp.ones((), jnp.float32),
               jnp.zeros((), jnp.float32), fmt, int(margin), algo)


def scale_for_step(ring: ScaleRing, current_amax: jax.Array) -> jax.Array:
  """The scale a delayed-scaling quantize uses now: the ring's, or on a fresh ring the one
  from the current amax (current scaling for step 0, not a default of 1)."""
  first = scale_from_amax(current_amax, ring.scale, ring.fmt, ring.margin)
  return jnp.where(ring.steps == 0, first, ring.scale)


def current(ring: ScaleRing, amax: jax.Array) -> ScaleRing:
  """``ring`` set to quantize with the scale of ``amax``, this step's (current scaling,
  ``jax_fp8.CurrentScaling``): ``scale_from_amax(amax, 1, ...)``, and steps 1, so that a ring op
  takes that scale as it is rather than its first-step amax of its own (device-local) input."""
  one = jnp.ones((), jnp.float32)
  return dataclasses.replace(ring, scale=scale_from_amax(amax, one, ring.fmt, ring.margin),
                             steps=one)


def observe(ring: ScaleRing, amax: jax.Array) -> ScaleRing:
  """The gradient a ring receives from one use in a step (see the module docstring)."""
  amax = jnp.asarray(amax, jnp.float32)
  front = jnp.where(jnp.isfinite(amax), amax, jnp.inf)[None]  # non-finite -> +inf marker
  return dataclasses.replace(ring, amax_history=jnp.concatenate([front, ring.amax_history[:-1]]),
                             scale=jnp.zeros_like(ring.scale), steps=ring.steps + 1)


def advance(ring: ScaleRing, obs: ScaleRing) -> ScaleRing:
  """The ring after a step whose (combined) observation is ``obs``: the front amax pushed into
  the history, the window reduced with ``ring.algo``, the next scale published and, if the
  window was informative, the step counted. Kept as it is when the ring did not run
  (``obs.steps == 0``) or the front amax is not finite."""
  front = obs.amax_history[0]
  history = jnp.concatenate([front[None], ring.amax_history[:-1]])
  window = jnp.max(history) if ring.algo == "max" else front
  nxt = dataclasses.replace(ring, amax_history=history,
                            scale=scale_from_amax(window, ring.scale, ring.fmt, ring.margin),
                            steps=ring.steps + informative(window).astype(jnp.float32))
  keep = (obs.steps == 0) | ~jnp.isfinite(front)
  return jax.tree.map(lambda old, new: jnp.where(keep, old, new), ring, nxt)


def next_ring(ring: ScaleRing, amax: jax.Array) -> ScaleRing:
  """The ring after one use with this step's ``amax`` (what ``quantize_delayed`` returns)."""
  return advance(ring, observe(ring, amax))


def stacked(ring: ScaleRing, n: int) -> ScaleRing:
  """``n`` copies of ``ring`` stacked on a leading axis (amax_history [n, L], scale [n], steps
  [n]): one ring per expert kernel of a grouped layer, each observing its own kernel."""
  return jax.tree.map(lambda v: jnp.broadcast_to(v, (n,) + jnp.shape(v)), ring)


def _is_ring(x) -> bool:
  return isinstance(x, ScaleRing)


def _check_like(value, name: str, like, like_name: str) -> None:
  """``value`` has the pytree structure of ``like`` (rings of the same format, margin and algo)
  and the same leaf shapes and dtypes: it is a gradient of ``like``. ValueError (TypeError for
  a dtype) naming both otherwise."""
  tv, tl = jax.tree.structure(value), jax.tree.structure(like)
  if tv != tl:
    raise ValueError(f"{name} must have the structure of {like_name} (the gradient of the state "
                     f"with respect to itself, ring for ring), got {tv} against {tl}")
  for v, l in zip(jax.tree.leaves(value), jax.tree.leaves(like)):
    if jnp.shape(v) != jnp.shape(l):
      raise ValueError(f"{name} must have the leaf shapes of {like_name}, got {jnp.shape(v)} "
                       f"against {jnp.shape(l)}")
    if jnp.result_type(v) != jnp.result_type(l):  # a cast (to bf16, or int) rounds an amax
      raise TypeError(f"{name} must have the leaf dtypes of {like_name} (a gradient of the "
                      f"state, uncast), got {jnp.result_type(v)} against {jnp.result_type(l)}")


def _check_not_swapped(state, state_grads) -> None:
  """Where the scales are concrete and this process holds them whole (outside a jit): a ring's
  scale is a positive float and an observation's is 0, so a zero scale in ``state`` or a
  nonzero one in ``state_grads`` means the arguments were swapped. ValueError naming the ring
  then."""
  scales = []
  for name, tree in (("state", state), ("state_grads", state_grads)):
    for path, ring in jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_ring)[0]:
      scale = ring.scale if _is_ring(ring) else None
      if (scale is not None and not isinstance(scale, jax.core.Tracer)
          and getattr(scale, "is_fully_addressable", True)):
        scales.append((name + jax.tree_util.keystr(path), name == "state", scale))
  for (where, in_state, _), value in zip(scales, jax.device_get([v for *_, v in scales])):
    zero = np.asarray(value) == 0
    if np.any(zero) if in_state else not np.all(zero):
      raise ValueError(f"{where}.scale is {'0' if in_state else 'not 0'}: a ring's scale is "
                       f"positive and its observation's 0; call update_state(state, "
                       f"state_grads), the state first")


def update_state(state, state_grads):
  """The state for the next step from the gradient with respect to the state.

  Args:
    state: any pytree holding ScaleRings (a LinearState, a Flax "fp8_state" collection).
    state_grads: the gradient of the loss with respect to ``state`` (same structure).
  Returns:
    ``state`` with every ring advanced by its observation (``advance``): as ``next_ring(ring,
    amax)`` would, amax being the max over the ring's uses this step. A ring that did not run
    (zero gradient) is kept, so its history does not roll; a step with a NaN or inf amax leaves
    the ring as it was.
  Raises:
    TypeError: a leaf of ``state`` that is no ScaleRing, or of ``state_grads`` in another
    dtype (a cast gradient: its amax rounded). ValueError: ``state_grads`` not of ``state``'s
    structure and leaf shapes; outside a jit, also a ring of ``state`` with a zero
    scale or one of ``state_grads`` with a nonzero one (the arguments swapped). That check
    reads the scales to the host, so an eager call waits for the step that computed them.

  A ring used n times in one differentiation without ``share`` (e.g. under ``vmap``) has its
  observations summed by JAX; that shows as ``steps`` = n * (old steps + 1). The front entry
  is then the sum of the n amaxes, an upper bound of their max, and is recorded as such: the
  scale errs towards headroom, never towards overflow. Rings stacked on leading axes (a Flax
  ``nn.scan`` over layers) are advanced one by one.
  """
  for leaf in jax.tree.leaves(state, is_leaf=_is_ring):
    if not _is_ring(leaf):
      raise TypeError(f"state must be a pytree of ScaleRings (a LinearState, a Flax "
                      f"\"fp8_state\" collection), got a leaf {checks.describe(leaf)}")
  _check_like(state_grads, "state_grads", state, "state")
  _check_not_swapped(state, state_grads)

  def advance_stacked(ring, obs):  # rings stacked by a scan over layers: [..., L]
    fn = advance
    for _ in range(jnp.ndim(ring.steps)):
      fn = jax.vmap(fn)
    return fn(ring, obs)
  return jax.tree.map(advance_stacked, state, state_grads, is_leaf=_is_ring)


def combine_updates(a, b):
  """Combine two state gradients of the same step (e.g. two microbatches' gradients computed
  from the same state in a ``lax.scan``) by an elementwise max, which is exact for
  observations; use it for the state where parameter gradients would be summed. Raises
  ValueError when a and b differ in structure or shapes. Method: jax_fp8's state protocol
  (docs/design.md, "The state protocol")."""
  _check_like(b, "b", a, "a")
  return jax.tree.map(jnp.maximum, a, b)


def share(state, n: int):
  """``n`` copies of ``state`` stacked on a new leading axis, whose gradients combine by max.

  Use it when one state feeds several uses inside one differentiation, where JAX would sum the
  gradients: scan over the stacked copies (``lax.scan(body, carry, (microbatches, share(state,
  n)))``), or take ``jax.tree.map(lambda v: v[i], shared)`` for the i-th use of a tied layer.

  Args:
    state: pytree of arrays (typically a LinearState or an "fp8_state" collection).
    n: number of uses, a static int >= 1.
  Returns:
    The pytree with every leaf broadcast to ``[n, *leaf.shape]``.
  Raises:
    TypeError / ValueError: n not a static int >= 1 (a float, a bool or a traced value).

  Method: jax_fp8's state protocol (docs/design.md, "The state protocol").
  """
  return _share(state, checks.integer(n, "n", 1))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _share(state, n):
  return jax.tree.map(lambda v: jnp.broadcast_to(v, (n,) + jnp.shape(v)), state)


def _share_fwd(state, n):
  return _share(state, n), None


def _share_bwd(n, _, g):
  return (jax.tree.map(lambda v: jnp.max(v, axis=0), g),)


_share.defvjp(_share_fwd, _share_bwd)
