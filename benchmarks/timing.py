"""Device timing: many calls inside one jitted loop, the loop's own cost cancelled.

``fn`` runs inside a ``fori_loop`` in one jit, so host dispatch is paid once per measurement,
not per call (per-call host timing hid up to 45% of a GEMM's rate, DESIGN.md). The loop's
control costs about 20 us an iteration on the H200 (jax 0.11.2), as much as a small kernel,
and subtracting a separately measured loop overhead read small GEMMs faster than the chip's
peak (session 3), so each case is timed twice: with one call and with two calls of ``fn`` per
iteration. The difference of the two is one call's cost, launch gaps included, with the loop
control cancelled exactly. Every call's output is loop-carried, so none is dead code, and
each call's inputs pass through an optimization barrier together with the earlier calls'
outputs, so XLA neither hoists the calls out of the loop nor overlaps them. A run lasts at
least 50 ms (short calls get more iterations): with a fixed 20 iterations, one H200 run in
session 5 read a quantize at 1.7x the copy bandwidth and the loop control at -9.7 us.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np


def _loop_time(fn, args, calls, iters, repeats, min_seconds):
  """Seconds per loop iteration of ``calls`` chained calls of ``fn``, over at least ``iters``
  iterations and at least ``min_seconds`` a run (more iterations for short calls, so the
  host's launch and synchronization jitter is spread thin)."""
  def body(_, carry):
    ins, outs = carry[0], []
    for _ in range(calls):
      ins, _ = jax.lax.optimization_barrier((ins, outs))
      outs.append(fn(*ins))
    return ins, tuple(outs)

  # n is static: a loop of known trip count runs on the device; a traced one makes XLA:GPU
  # copy the loop condition to the host every iteration.
  @functools.partial(jax.jit, static_argnums=1)
  def loop(ins, n):
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn, *ins))
    return jax.lax.fori_loop(0, n, body, (ins, (zeros,) * calls))[1]

  def run(n):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(args, n))
    return (time.perf_counter() - t0) / n

  jax.block_until_ready(loop(args, iters))  # compile and warm up
  n = int(min(100_000, max(iters, np.ceil(min_seconds / run(iters)))))
  if n != iters:
    jax.block_until_ready(loop(args, n))  # compile for n iterations
  return float(np.median([run(n) for _ in range(repeats)]))


def device_time(fn, *args, iters: int = 20, repeats: int = 5, min_seconds: float = 0.05) -> float:
  """Seconds per call of ``fn(*args)`` on the device: the median time of a loop iteration
  with two chained calls minus that with one (medians over ``repeats`` runs of at least
  ``iters`` iterations and ``min_seconds`` each). On XLA:CPU, whose runtime overlaps the two
  calls, the one-call time (the CPU figures only exercise the suite). Raises RuntimeError
  when the difference is not positive (a call too short to resolve against the timing
  noise)."""
  one = _loop_time(fn, args, 1, iters, repeats, min_seconds)
  if jax.default_backend() == "cpu":
    return one  # XLA:CPU runs independent thunks concurrently: no difference to take
  two = _loop_time(fn, args, 2, iters, repeats, min_seconds)
  if two <= one:
    raise RuntimeError(f"two calls per iteration ({two * 1e6:.1f} us) were not slower than one "
                       f"({one * 1e6:.1f} us): too short to time this way")
  return two - one


def loop_overhead(iters: int = 20, repeats: int = 5, min_seconds: float = 0.05) -> float:
  """Seconds per iteration of the timing loop itself around a one-element kernel (reported
  beside the results; cancelled, not subtracted, by ``device_time``)."""
  one = jnp.ones((1,), jnp.float32)
  return (_loop_time(lambda v: v + 1, (one,), 1, iters, repeats, min_seconds)
          - device_time(lambda v: v + 1, one, iters=iters, repeats=repeats,
                        min_seconds=min_seconds))
