"""A whole jitted train step timed and profiled, and its rows reported: the method of
``benchmarks.model_step`` and ``benchmarks.demo_step`` (their steps: ``jax_fp8.demo.train``).

Each step is one jitted call with its carried buffers (parameters, optimizer and FP8 state)
donated. Time: the median of ``windows`` windows of ``steps`` back-to-back steps (dispatch is
asynchronous and a step lasts far longer than its dispatch, so the device never waits for the
host); compile seconds and temp bytes from the compiled step. A profile traces steps of the
step compiled again with XLA's command buffers off (the profiler does not see the kernels
inside CUDA graphs) and sums the device's work by kind (GEMMs, attention, our kernels, XLA's
fusions) and its idle time (``benchmarks.profiling``).
"""

from __future__ import annotations

import statistics
import time

import jax

from .common import environment, write_results
from .profiling import summarize, trace_events


def measure(step, carried: tuple, inputs: tuple, tokens: int, steps: int, windows: int,
            profile_steps: int, report=None) -> dict:
  """The row of ``step(*carried, *inputs) -> (*carried, loss)`` (jitted, ``carried`` donated;
  ``tokens`` a step): ``step_ms``, ``window_ms`` (each window's), ``tokens_per_s``,
  ``compile_s``, ``temp_bytes``, ``peak_bytes`` (arguments, outputs and temporaries the
  compiled step plans, donated buffers counted once), ``loss`` (after the timed steps), and
  with ``profile_steps`` > 0 ``profile`` (``profiling.summarize``'s rows). ``report``: None, or
  ``report(carried) -> dict`` of the carried buffers after the timed steps, joined to the
  row."""
  t0 = time.perf_counter()
  compiled = step.lower(*carried, *inputs).compile()
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  *carried, loss = compiled(*carried, *inputs)  # warm up
  jax.block_until_ready(loss)
  times = []
  for _ in range(windows):
    t0 = time.perf_counter()
    for _ in range(steps):
      *carried, loss = compiled(*carried, *inputs)
    jax.block_until_ready(loss)
    times.append((time.perf_counter() - t0) / steps)
  step_s = statistics.median(times)
  extra = {} if report is None else report(tuple(carried))
  row = {"step_ms": step_s * 1e3, "tokens_per_s": tokens / step_s, "compile_s": compile_s,
         "temp_bytes": mem.temp_size_in_bytes,
         "peak_bytes": (mem.argument_size_in_bytes + mem.output_size_in_bytes
                        + mem.temp_size_in_bytes - mem.alias_size_in_bytes),
         "loss": float(loss), "window_ms": [t * 1e3 for t in times], **extra}
  if profile_steps:
    options = ({"xla_gpu_enable_command_buffer": ""} if jax.default_backend() == "gpu"
               else None)
    profiled = step.lower(*carried, *inputs).compile(compiler_options=options)

    def traced_step(*inputs):  # donated buffers: each traced call takes the last one's outputs
      *carried[:], loss = profiled(*carried, *inputs)
      return loss  # waited for: the step's last result (a variant's state may be empty)
    row["profile"] = summarize(trace_events(traced_step, inputs, profile_steps),
                               profile_steps, top=10)
  return row


# How XLA's message begins when a step's buffers do not fit the device's memory.
OUT_OF_MEMORY = "RESOURCE_EXHAUSTED"
FASTEST = "fastest_peer"  # the peer name that stands for the fastest of a run's peers


def add_speedups(rows: list[dict], peers: tuple[str, ...], fastest_of: tuple[str, ...] = (),
                 time: str = "step_ms") -> str | None:
  """Each row's ``speedup_vs_<peer>``: the peer row's ``time`` over its own (None where either
  has none: that variant did not run or was not timed); with ``fastest_of``,
  ``speedup_vs_fastest_peer`` likewise over the fastest of those variants that have a time,
  whose name it returns (None: none)."""
  by_name = {r["variant"]: r[time] for r in rows if time in r}
  fastest = min((v for v in fastest_of if v in by_name), key=by_name.get, default=None)
  for r in rows:
    for peer in peers + ((FASTEST,) if fastest_of else ()):
      name = fastest if peer == FASTEST else peer
      r[f"speedup_vs_{peer}"] = by_name[name] / r[time] if name in by_name and time in r else None
  return fastest


def _width(variants) -> int:
  """The variant column's width: the longest name and two spaces, at least 24."""
  return max([len(v) + 2 for v in variants] + [24])


def print_rows(rows: list[dict], title: str, peers: tuple[str, ...]) -> None:
  """The rows as a table under ``title`` (step, TFLOP/s where the rows count FLOPs, the
  speedups over ``peers``, compile, temp), then each profiled row's busy device streams by
  kind of work and their largest events."""
  print(f"\n{title}")
  w = _width(r["variant"] for r in rows)
  flops = all("TFLOPs" in r for r in rows if "error" not in r)
  cols = {p: max(14, len(p) + 5) for p in peers}  # "vs <peer>" and two spaces
  print(f"{'variant':<{w}}{'step ms':>9}" + (f"{'TFLOP/s':>9}" if flops else "")
        + "".join(f"{'vs ' + p:>{cols[p]}}" for p in peers) + f"{'compile s':>11}{'temp GiB':>10}")
  fmt = lambda v: f"{v:.3f}x" if v is not None else "-"
  for r in rows:
    if "error" in r:
      print(f"{r['variant']:<{w}}{r['error']}")
      continue
    print(f"{r['variant']:<{w}}{r['step_ms']:9.1f}" + (f"{r['TFLOPs']:9.3g}" if flops else "")
          + "".join(f"{fmt(r[f'speedup_vs_{p}']):>{cols[p]}}" for p in peers)
          + f"{r['compile_s']:11.1f}{r['temp_bytes'] / 2**30:10.2f}")
  for r in rows:
    for t in r.get("profile", ()):
      if t["us_per_step"] > 0.05 * r["step_ms"] * 1e3:  # the streams that carry the step
        kinds = "  ".join(f"{k} {us / 1e3:.1f}" for k, us in t["kinds_us"].items())
        print(f"{r['variant']:<{w}}{t['thread'][:40]:<42}work {t['us_per_step'] / 1e3:.1f} ms, "
              f"idle {t['idle_us_per_step'] / 1e3:.1f} ms: {kinds}")
        for k, events in t["top_events_by_kind_us"].items():
          print(f"  {k}: " + "; ".join(f"{name[:60]} {us / 1e3:.2f}"
                                       for name, us in list(events.items())[:6]))


def add_arguments(p, variants, default: list[str], steps: int, profile_steps: int,
                  out: str) -> None:
  """The flags of a train-step benchmark: --variants (of ``variants``, default ``default``),
  --steps, --windows, --profile, --profile-steps and --out (its default file named ``out``)."""
  p.add_argument("--variants", nargs="+", choices=list(variants), default=default,
                 help=f"variants to run, in this order (default: {' '.join(default)})")
  p.add_argument("--steps", type=int, default=steps,
                 help=f"steps per timing window (default: {steps})")
  p.add_argument("--windows", type=int, default=3, help="timing windows (default: 3)")
  p.add_argument("--profile", nargs="*", choices=list(variants), metavar="VARIANT",
                 help="also trace these variants' steps (none named: every variant run) and "
                      "sum the device's work by kind")
  p.add_argument("--profile-steps", type=int, default=profile_steps,
                 help=f"traced steps (default: {profile_steps})")
  p.add_argument("--out", help=f"JSON path (default: benchmarks/results/<gpu>-{out}.json)")


def run(p, args, measure_variant, setting: dict, out: str, peers: tuple[str, ...],
        fastest_of: tuple[str, ...] = ()) -> dict:
  """Checks the flags of ``add_arguments`` (``p.error`` on bad ones), then runs each variant:
  its row, ``measure_variant(variant, profile_steps)`` (0: no profile), joins the results
  (``env``, the ``setting`` that all rows share, ``steps``, ``windows``, ``rows``), written
  after each row (a cut run keeps its rows); then the speedups over ``peers`` (and with
  ``fastest_of``, over the fastest of those: ``add_speedups``, its name the results'
  ``fastest_peer``), the table, and the results written again (to ``--out``, default
  ``benchmarks/results/<gpu>-<out>.json``) and returned. A variant that runs out of the
  device's memory gets a row with ``error`` (XLA's message) and no figures, and the run goes
  on (XLA's dense rewrite of BF16 ``ragged_dot`` did not fit an H100 at the MoE step's
  default size)."""
  for flag in ("steps", "windows", "profile_steps"):
    if getattr(args, flag) < 1:
      p.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
  profiled = (set() if args.profile is None else
              set(args.profile) if args.profile else set(args.variants))
  if profiled - set(args.variants):
    p.error(f"--profile names variants that --variants leaves out: "
            f"{sorted(profiled - set(args.variants))}")
  env, rows = environment(), []
  results = {"env": env, **setting, "steps": args.steps, "windows": args.windows, "rows": rows}
  name = f"-{out}"
  w = _width(args.variants)
  for variant in args.variants:
    try:
      rows.append({"variant": variant, **measure_variant(
          variant, args.profile_steps if variant in profiled else 0)})
    except jax.errors.JaxRuntimeError as e:  # the device's memory: the run goes on without it
      if not str(e).startswith(OUT_OF_MEMORY):
        raise
      rows.append({"variant": variant, "error": str(e).splitlines()[0]})
    write_results(results, args.out, name)
    r = rows[-1]
    print(f"{variant:<{w}}" + (f"{r['error']}" if "error" in r else
          f"{r['step_ms']:9.1f} ms  {r['tokens_per_s']:10.0f} tok/s  compile "
          f"{r['compile_s']:6.1f} s  temp {r['temp_bytes'] / 2**30:6.2f} GiB  loss "
          f"{r['loss']:.4f}"), flush=True)
  fastest = add_speedups(rows, peers, fastest_of)
  if fastest_of:
    results[FASTEST] = fastest
    peers = peers + (FASTEST,)
  print_rows(rows, f"{env['device']}  jax {env['jax']}  {env['date']}  {setting}", peers)
  write_results(results, args.out, name)
  return results
