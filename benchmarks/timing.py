"""Device timing: many calls inside one jitted loop, the loop's own cost subtracted.

``fn`` runs ``iters`` times in a ``fori_loop`` inside one jit (an optimization barrier on the
loop-carried inputs stops XLA from hoisting the loop-invariant work), so host dispatch is paid
once per measurement, not per call (per-call host timing hid up to 45% of a GEMM's rate,
DESIGN.md). The loop's control costs about 20 us an iteration on the H200 (measured
2026-11-29 with jax 0.11.2), a quarter of a quantize kernel's time, so the time of the same
loop around a one-element kernel, measured once per process, is subtracted. That baseline
includes the tiny kernel itself (a few microseconds at most), so short cases read slightly fast.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np


def _loop_time(fn, args, iters, repeats):
  def body(_, carry):
    ins, _ = carry
    ins = jax.lax.optimization_barrier(ins)
    return ins, fn(*ins)

  @jax.jit
  def loop(ins):
    out0 = jax.eval_shape(fn, *ins)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out0)
    return jax.lax.fori_loop(0, iters, body, (ins, zeros))[1]

  jax.block_until_ready(loop(args))  # compile and warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(args))
    times.append((time.perf_counter() - t0) / iters)
  return float(np.median(times))


@functools.cache
def loop_overhead(iters: int = 20, repeats: int = 5) -> float:
  """Seconds per iteration of the timing loop around a one-element kernel."""
  return _loop_time(lambda v: v + 1, (jnp.ones((1,), jnp.float32),), iters, repeats)


def device_time(fn, *args, iters: int = 20, repeats: int = 5) -> float:
  """Seconds per call of ``fn(*args)`` on the device: the median over ``repeats`` runs of a
  loop of ``iters`` calls, minus ``loop_overhead``. Raises RuntimeError when nothing is left
  after the subtraction."""
  t = _loop_time(fn, args, iters, repeats)
  net = t - loop_overhead(iters, repeats)
  if net <= 0:
    raise RuntimeError(f"{t * 1e6:.1f} us per iteration is within the timing loop's own "
                       f"{loop_overhead(iters, repeats) * 1e6:.1f} us: too short to time this way")
  return net
