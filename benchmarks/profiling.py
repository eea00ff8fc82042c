"""A traced step's device time, per device stream and kind of work: the profile that
``benchmarks.step_profile`` prints and ``benchmarks.train_step`` adds to a row.

The calls are traced with the JAX profiler and the trace's events summed per thread of the
device (on a GPU its streams, which carry the kernels by name, and XLA's op lines). On a CPU
the events are XLA's thunk names (ffi_call.N, fusions), which cannot be sorted by kind.
"""

from __future__ import annotations

import collections
import gzip
import json
import pathlib
import re
import tempfile

import jax

# Kinds of work by event name (kernel names on a GPU stream, op names on XLA's lines); the
# first match wins, the rest is "other" (XLA's fusions: norms, activations, the optimizer).
KINDS = (("jax_fp8 quantize", r"jax_fp8|quantize|cast_transpose"),
         ("GEMM", r"gemm|xmma|nvjet|cutlass|cublas|matmul"),
         ("attention", r"flash|fmha|attention|cudnn|softmax"),
         ("memcpy / memset", r"memcpy|memset"))


def kind(name: str) -> str:
  return next((k for k, pattern in KINDS if re.search(pattern, name, re.I)), "other")


def trace_events(fn, args, steps: int):
  """The complete events ("X") of ``steps`` calls of ``fn`` under the profiler, as spans
  ((process, thread), start, duration, name), times in us."""
  jax.block_until_ready(fn(*args))  # compile and warm up outside the trace
  with tempfile.TemporaryDirectory() as tmp:
    with jax.profiler.trace(tmp, create_perfetto_trace=True):
      for _ in range(steps):
        jax.block_until_ready(fn(*args))
    path = next(pathlib.Path(tmp).rglob("perfetto_trace.json.gz"))
    with gzip.open(path) as f:
      data = json.load(f)
  events = data["traceEvents"] if isinstance(data, dict) else data
  names = {}
  for e in events:
    if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name"):
      key = e["pid"] if e["name"] == "process_name" else (e["pid"], e["tid"])
      names[key] = e["args"]["name"]
  return [((names.get(e["pid"], ""), names.get((e["pid"], e["tid"]), "")), float(e["ts"]),
           float(e.get("dur", 0.0)), e["name"]) for e in events if e.get("ph") == "X"]


def self_times(spans):
  """[(key, name, self time)] of spans (key, start, duration, name) on threads (keys): each
  span's duration less the time its direct children cover, and less the time it shares with
  an earlier span of its level (a parent's earlier children, or a thread's earlier top-level
  spans) that it starts inside and outlives. That is a kernel launched early by programmatic
  dependent launch (PDL, as ours and cuBLAS's are): it waits for the kernel before it to finish,
  so the shared time is the earlier kernel's. The self times of a thread add up to the time it
  is occupied."""
  out, enclosing, last_key = [], [], None  # enclosing: [end, index in out, covered until]
  for key, ts, dur, name in sorted(spans, key=lambda s: (s[0], s[1], -s[2])):
    if key != last_key:
      enclosing, last_key, top = [], key, [float("inf"), None, float("-inf")]
    while enclosing and (enclosing[-1][0] <= ts or enclosing[-1][0] < ts + dur):
      enclosing.pop()
    level = enclosing[-1] if enclosing else top
    start = max(ts, level[2])  # the shared time before it is the earlier span's
    own = max(0.0, ts + dur - start)
    if level[1] is not None:
      out[level[1]][2] -= own
    level[2] = max(level[2], ts + dur)
    out.append([key, name, own])
    enclosing.append([ts + dur, len(out) - 1, start])
  return [tuple(o) for o in out]


def idle_us(spans, steps: int) -> float:
  """Microseconds per step that one thread's ``spans`` (key, start, duration, name) leave idle
  between its first and last event, less the ``steps - 1`` longest gaps (the host's round
  trips between the traced steps, each of which waits for the last)."""
  gaps, end = [], None
  for _, ts, dur, _ in sorted(spans, key=lambda s: s[1]):
    if end is not None and ts > end:
      gaps.append(ts - end)
    end = ts + dur if end is None else max(end, ts + dur)
  return sum(sorted(gaps)[:max(0, len(gaps) - (steps - 1))]) / steps


def summarize(spans, steps: int, top: int = 15):
  """Per thread of the device processes ("/device:...", else the host's XLA threads):
  microseconds of work per step, by kind and by event name (the ``top`` largest overall and
  of each kind; ``self_times``, which add up to the thread's occupied time), and idle inside
  the steps."""
  device = any(key[0].startswith("/device:") for key, *_ in spans)
  keep = [s for s in spans if (s[0][0].startswith("/device:") if device else s[0][1] != "python")]
  per_thread = collections.defaultdict(collections.Counter)
  for key, name, us in self_times(keep):
    per_thread[key][name] += us / steps
  rows = []
  for key, times in sorted(per_thread.items()):
    kinds, by_kind = collections.Counter(), collections.defaultdict(collections.Counter)
    for name, us in times.items():
      kinds[kind(name)] += us
      by_kind[kind(name)][name] = us
    rows.append({"thread": " ".join(key).strip(), "us_per_step": sum(times.values()),
                 "idle_us_per_step": idle_us([s for s in keep if s[0] == key], steps),
                 "kinds_us": dict(kinds.most_common()),
                 "top_events_us": dict(times.most_common(top)),
                 "top_events_by_kind_us": {k: dict(by_kind[k].most_common(top)) for k in kinds}})
  return rows
