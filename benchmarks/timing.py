"""Device timing: run a function many times inside one jit and divide.

Host dispatch is paid once per measurement, not per iteration (DESIGN.md: per-call host timing
hid up to 45% of a GEMM's rate). An optimization barrier on the loop-carried inputs stops XLA
from hoisting the loop-invariant work out of the loop without copying anything.
"""

from __future__ import annotations

import time

import jax
import numpy as np


def device_time(fn, *args, iters: int = 20, repeats: int = 5) -> float:
  """Median seconds per call of ``fn(*args)`` over ``repeats`` runs of ``iters`` calls each,
  all inside one jitted ``fori_loop`` per run."""

  def body(_, carry):
    ins, _ = carry
    ins = jax.lax.optimization_barrier(ins)
    return ins, fn(*ins)

  @jax.jit
  def loop(ins):
    out0 = jax.eval_shape(fn, *ins)
    zeros = jax.tree.map(lambda s: jax.numpy.zeros(s.shape, s.dtype), out0)
    return jax.lax.fori_loop(0, iters, body, (ins, zeros))[1]

  jax.block_until_ready(loop(args))  # compile and warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(loop(args))
    times.append((time.perf_counter() - t0) / iters)
  return float(np.median(times))
