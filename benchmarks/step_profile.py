"""Where a transformer block train step's time goes, per device stream and kind of work.

The step is traced with the JAX profiler and the trace's events are summed per thread of the
device (``benchmarks.profiling``: on a GPU its streams, which carry the kernels by name, and
XLA's op lines; on a CPU XLA's thunk names, which cannot be sorted by kind).

    python -m benchmarks.step_profile [--recipe delayed|fast_fprop|fast_all|bf16] [--steps N]
                                      [--quick] [--out PATH]

Prints, per thread, the work time per step and the share of each kind of work (our
quantization kernels, GEMMs, attention, the rest), its idle time inside the steps (on a
device stream, waiting for the host or for another stream), then the events that take the
most time; writes the same as JSON (default
``benchmarks/results/<gpu>-step_profile-<recipe>.json``). The block and its sizes are
the suite's ``block train step`` case (``benchmarks.block``).
"""

from __future__ import annotations

import argparse

import jax

import jax_fp8

from . import block
from .common import FAST_ACCUM, environment, write_results
from .profiling import summarize, trace_events

RECIPES = {"delayed": jax_fp8.DelayedScaling(), **FAST_ACCUM, "bf16": None}


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--recipe", choices=list(RECIPES), default="delayed",
                 help="delayed: DelayedScaling(); fast_fprop / fast_all: with fast accumulation in "
                      "the forward GEMM / all three; bf16: flax.linen.Dense (default: delayed)")
  p.add_argument("--steps", type=int, default=5, help="traced steps, >= 1 (default: 5)")
  p.add_argument("--quick", action="store_true", help="the suite's tiny block (CPU smoke run)")
  p.add_argument("--out", help="JSON path (default: benchmarks/results/<gpu>-step_profile-"
                               "<recipe>.json)")
  args = p.parse_args(argv)
  if args.steps < 1:
    p.error(f"--steps must be >= 1, got {args.steps}")
  cfg = block.QUICK_BLOCK if args.quick else block.BLOCK
  step, params, collections, x = block.setup(RECIPES[args.recipe], **cfg)
  rows = summarize(trace_events(jax.jit(step), (params, collections, x), args.steps),
                   args.steps)
  env = environment()
  print(f"{env['device']}  jax {env['jax']}  {env['date']}  recipe {args.recipe}  block {cfg}  "
        f"{args.steps} steps traced")
  for r in rows:
    print(f"\n{r['thread']}: {r['us_per_step']:.0f} us of work per step, "
          f"{r['idle_us_per_step']:.0f} us idle between its events")
    for k, us in r["kinds_us"].items():
      print(f"  {k:<20}{us:>12.0f} us  {us / r['us_per_step']:6.1%}")
    for name, us in r["top_events_us"].items():
      print(f"    {us:>10.0f} us  {name[:100]}")
  results = {"env": env, "recipe": args.recipe, "block": cfg, "steps": args.steps, "rows": rows}
  write_results(results, args.out, f"-step_profile-{args.recipe}")
  return results


if __name__ == "__main__":
  main()
