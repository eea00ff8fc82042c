"""Device timing: many calls inside one jitted loop, the loop's own cost cancelled (the method
and its history: docs/performance.md).

``fn`` runs inside a ``fori_loop`` in one jit, so host dispatch is paid once per measurement,
not per call (per-call host timing hid up to 45% of a GEMM's rate). The loop's control costs
about 20 us an iteration on the H200 (jax 0.11.2), as much as a small kernel, and subtracting a
separately measured loop overhead read small GEMMs faster than the chip's peak, so each case is
timed with one call and with 1 + n chained calls of ``fn`` per iteration: the difference over n
is one call's cost, launch gaps included, with the loop control cancelled exactly. n is 1
unless that difference does not stand out of the timing noise; then it doubles, up to a limit
(at the quick shapes the H200 read two chained calls faster than one, 7.5 against 10.4 us an
iteration). Every call's output is loop-carried, so none is dead code, and each call's inputs pass
through an optimization barrier together with the earlier calls' outputs, so XLA neither
hoists the calls out of the loop nor overlaps them. A run lasts at least 50 ms (short calls get
more iterations): with a fixed 20 iterations, an H200 run read a quantize at 1.7x the copy
bandwidth and the loop control at -9.7 us.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _loop_times(fn, args, calls, iters, repeats, min_seconds,
                compiler_options=None) -> list[float]:
  """Seconds per loop iteration of ``calls`` chained calls of ``fn``, one figure per run:
  ``repeats`` runs of at least ``iters`` iterations and at least ``min_seconds`` each (more
  iterations for short calls, so the host's launch and synchronization jitter is spread
  thin); the loop compiled with XLA's ``compiler_options``."""
  def body(_, carry):
    ins, outs = carry[0], []
    for _ in range(calls):
      ins, _ = jax.lax.optimization_barrier((ins, outs))
      outs.append(fn(*ins))
    return ins, tuple(outs)

  # n is static: a loop of known trip count runs on the device; a traced one makes XLA:GPU
  # copy the loop condition to the host every iteration.
  @functools.partial(jax.jit, static_argnums=1, compiler_options=compiler_options)
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
  return [run(n) for _ in range(repeats)]


def _loop_time(fn, args, calls, iters, repeats, min_seconds, compiler_options=None) -> float:
  """The median of ``_loop_times``."""
  return float(np.median(_loop_times(fn, args, calls, iters, repeats, min_seconds,
                                     compiler_options)))


def per_call(times: Callable[[int], Sequence[float]], max_calls: int = 32) -> float:
  """One call's seconds from loop timings; ``times(c)`` gives the runs' seconds per iteration
  with ``c`` chained calls. The difference between the medians with 1 + n calls and with one,
  divided by n, for the first n of 1, 2, 4, ..., ``max_calls`` where that difference is larger
  than the spread (largest minus smallest run) of either timing. Raises RuntimeError when no n
  up to ``max_calls`` gives one."""
  one = times(1)
  n = 1
  while True:
    more = times(1 + n)
    diff = float(np.median(more) - np.median(one))
    noise = float(max(np.ptp(one), np.ptp(more)))
    if diff > noise:
      return diff / n
    if 2 * n > max_calls:
      raise RuntimeError(
          f"{1 + n} calls per iteration ({np.median(more) * 1e6:.1f} us) were not slower than "
          f"one ({np.median(one) * 1e6:.1f} us) by more than the runs' spread "
          f"({noise * 1e6:.1f} us): too short to time this way")
    n *= 2


def device_time(fn, *args, iters: int = 20, repeats: int = 5, min_seconds: float = 0.05,
                max_calls: int = 32, compiler_options: dict | None = None) -> float:
  """Seconds per call of ``fn(*args)`` on the device: the median time of a loop iteration
  with 1 + n chained calls minus that with one, divided by n (medians over ``repeats`` runs of
  at least ``iters`` iterations and ``min_seconds`` each). n is the first of 1, 2, 4, ...,
  ``max_calls`` whose difference is larger than the spread of either loop's runs (``per_call``).
  On XLA:CPU, whose runtime overlaps chained calls, the one-call loop's time over one run of
  one iteration, compiled once (the CPU figures only exercise the suite).
  ``compiler_options``: XLA options for this case's compilations alone (e.g. a GPU pass to try).
  Raises RuntimeError when no n up to ``max_calls`` resolves the call against the timing
  noise."""
  if jax.default_backend() == "cpu":  # XLA:CPU runs independent thunks concurrently
    return _loop_time(fn, args, 1, iters=1, repeats=1, min_seconds=0.0,
                      compiler_options=compiler_options)
  return per_call(lambda calls: _loop_times(fn, args, calls, iters, repeats, min_seconds,
                                            compiler_options), max_calls)


def loop_overhead(iters: int = 20, repeats: int = 5, min_seconds: float = 0.05) -> float:
  """Seconds per iteration of the timing loop itself around a one-element kernel (reported
  beside the results; cancelled, not subtracted, by ``device_time``)."""
  one = jnp.ones((1,), jnp.float32)
  return (_loop_time(lambda v: v + 1, (one,), 1, iters, repeats, min_seconds)
          - device_time(lambda v: v + 1, one, iters=iters, repeats=repeats,
                        min_seconds=min_seconds))
