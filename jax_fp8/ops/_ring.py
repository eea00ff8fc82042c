"""Delayed-scaling plumbing shared by the two ring ops, ``quantize_delayed`` and
``cast_transpose_delayed``: the ring's check, the kernel's ring attributes and results, and the
jnp path of a sharded jit (where the amax must be reduced over devices before the ring moves)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, checks, sharding
from ..formats import amax
from ..state import ALGOS, ScaleRing, next_ring, observe, scale_for_step

SCRATCH = jax.ShapeDtypeStruct((_ffi.CONSTANTS["quantize_scratch_words"],), jnp.uint32)
_ALGO_IDS = {algo: _ffi.CONSTANTS[f"algo_{algo}"] for algo in ALGOS}


def check_ring(ring, name: str = "ring") -> tuple[jax.Array, jax.Array, jax.Array]:
  """The ring's leaves (history [L], scale [], steps []), checked (``name``: how errors call
  the ring)."""
  if not isinstance(ring, ScaleRing):
    raise TypeError(f"{name} must be a jax_fp8.ScaleRing, got {type(ring).__name__}")
  hist = checks.array(ring.amax_history, f"{name}.amax_history")
  max_len = _ffi.CONSTANTS["max_history"]
  if hist.ndim != 1 or not 1 <= hist.shape[0] <= max_len or hist.dtype != jnp.float32:
    stacked = (" (a stacked state, from share or a scan over layers, is indexed or scanned "
               "before it reaches an op)" if hist.ndim > 1 else "")
    raise ValueError(f"{name}.amax_history must be float32 [L] with 1 <= L <= {max_len}, "
                     f"got {hist.dtype}{list(hist.shape)}{stacked}")
  return (hist, checks.scalar_f32(ring.scale, f"{name}.scale"),
          checks.scalar_f32(ring.steps, f"{name}.steps"))


def kernel_attrs(ring: ScaleRing, observe_: bool) -> dict:
  """The FFI attributes of a ring kernel."""
  return dict(margin=np.int64(ring.margin), algo=np.int64(_ALGO_IDS[ring.algo]),
              observe=bool(observe_))


def kernel_results(history_len: int) -> tuple:
  """Shapes of a ring kernel's scalar and ring results: scale used, amax, history, scale,
  steps."""
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  return f32(()), f32(()), f32((history_len,)), f32(()), f32(())


def sharded_scale(x, ring: ScaleRing, leaves, over, local_amax=amax) -> tuple[jax.Array, ScaleRing]:
  """Under a sharded jit: the scale every device quantizes with (the ring's, or on a fresh ring
  the one from the amax over all devices, computed on that step only), and the ring rebuilt
  from its local leaves. ``local_amax(x)``: the amax of this device's piece (x: an array or
  the arrays the kernel reads; by default the amax of x itself; a kernel computing its values,
  e.g. an activation, passes its own, so the scale is the one a single device's kernel would
  take)."""
  ring = rebuild(ring, leaves)
  first = jax.lax.cond(ring.steps == 0,
                       lambda x: sharding.pmax_keep_nan(local_amax(x), over),
                       lambda x: jnp.zeros((), jnp.float32), x)
  return scale_for_step(ring, first), ring


def moved(ring: ScaleRing, amax_: jax.Array, observe_: bool) -> tuple:
  """The ring results of a step whose (global) amax is ``amax_``: the next ring's leaves, or
  with ``observe_`` the observation's (what the kernels write)."""
  r = observe(ring, amax_) if observe_ else next_ring(ring, amax_)
  return r.amax_history, r.scale, r.steps


def rebuild(ring: ScaleRing, leaves) -> ScaleRing:
  """``ring`` with the leaves (history, scale, steps) a kernel or the sharded path wrote."""
  return dataclasses.replace(ring, amax_history=leaves[0], scale=leaves[1], steps=leaves[2])
