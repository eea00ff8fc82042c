"""CUDA graphs: step time and bits with XLA's command buffers on, off, and without ours.

The transformer block train step of ``benchmarks/block.py``, FP8 (``jax_fp8.flax.Dense``) and
BF16 (``flax.linen.Dense``), is compiled and run in one child process per
``--xla_gpu_enable_command_buffer`` setting (XLA reads its flags once per process): command
buffers off, XLA's default, an explicit list with ``CUSTOM_CALL``, and the same list without
it. Each child reports the step time of a training loop (steps dispatched back to back, one
sync at the end) and saves the steps' outputs, which must be bit-identical to those with
command buffers off. Each process would autotune its GEMM and cuDNN algorithms by timing, and
could pick other algorithms (so other bits) whatever its command buffers: the first child
("off") writes XLA's autotuning results (``--xla_gpu_dump_autotune_results_to``) and the others
load them (``--xla_gpu_load_autotune_results_from``), so every child runs the same algorithms.
The JSON names, per mode, the output leaves (of the FP8 or the BF16 step) that differ from
those with command buffers off. XLA (jax 0.11) forms command buffers from its thunks, after the
HLO, so the evidence is the FP8 step time moving with ``CUSTOM_CALL`` alone while the BF16 step
(none of our calls) does not. Our handlers are marked ``kCmdBufferCompatible``
(csrc/ffi/*_cuda.*). On the CPU, XLA ignores all these flags (only the plumbing runs).

    python -m benchmarks.command_buffer [--quick] [--steps 50] [--modes MODE...] [--out PATH]

Writes ``benchmarks/results/<gpu>-command_buffer.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

import jax_fp8

from . import block
from .common import environment, write_results

TYPES = "FUSION,CUBLAS,CUBLASLT,CUDNN"
MODES = {  # name -> XLA_FLAGS addition (None: XLA's default); "off", the baseline, runs first
    "off": "--xla_gpu_enable_command_buffer=",
    "default": None,
    "with_custom_calls": f"--xla_gpu_enable_command_buffer={TYPES},CUSTOM_CALL",
    "without_custom_calls": f"--xla_gpu_enable_command_buffer={TYPES}",
}
STEPS = ("fp8", "bf16")
# Small enough that launch overheads show: 4 x 512 tokens, d_model 1024.
CONFIG = dict(d_model=1024, ffn=3584, heads=8, seq=512, batch=4)


def child(cfg: dict, steps: int, out_npz: str) -> dict:
  """Times both steps and saves their outputs to ``out_npz``, one array per leaf (bf16 as its
  exact f32 value), named ``<step>:<path>`` (``fp8:[0]['qkv']['kernel']``: the gradients,
  then the collections)."""
  times, leaves = {}, {}
  for name in STEPS:
    step, params, collections, x = block.setup(
        jax_fp8.DelayedScaling() if name == "fp8" else None, **cfg)
    step = jax.jit(step)
    res = jax.block_until_ready(step(params, collections, x))  # compile and warm up
    t0 = time.perf_counter()
    for _ in range(steps):
      res = step(params, collections, x)
    jax.block_until_ready(res)
    times[f"{name}_step_ms"] = (time.perf_counter() - t0) / steps * 1e3
    for path, v in jax.tree_util.tree_flatten_with_path(res)[0]:
      v = np.asarray(v)  # npz keeps no ml_dtypes (bf16 would load as raw bytes): f32, exactly
      leaves[f"{name}:{jax.tree_util.keystr(path)}"] = v if v.dtype.isbuiltin == 1 else v.astype(
          np.float32)
  np.savez(out_npz, **leaves)
  return times


def autotune_flag(mode: str, results: str) -> str | None:
  """The first mode dumps XLA's autotuning results to ``results``; the others load them when
  they exist (XLA fails on a missing file; none is written where nothing was autotuned)."""
  if mode == next(iter(MODES)):
    return f"--xla_gpu_dump_autotune_results_to={results}"
  return f"--xla_gpu_load_autotune_results_from={results}" if os.path.exists(results) else None


def run_mode(mode: str, args, out_npz: str, autotune: str | None) -> dict:
  env = dict(os.environ)
  for flag in (MODES[mode], autotune):
    if flag is not None:
      env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flag).strip()
  cmd = [sys.executable, "-m", "benchmarks.command_buffer", "--child", out_npz,
         "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
  p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if p.returncode:
    raise RuntimeError(f"mode {mode} failed:\n{p.stderr[-3000:]}")
  return json.loads(p.stdout.strip().splitlines()[-1])


def differing_leaves(f1: str, f2: str) -> list[dict]:
  """The leaves of two children's outputs whose bits differ (or that only one has), each with
  its step, path, and where both exist the count of differing elements and the largest
  absolute difference."""
  a, b = np.load(f1), np.load(f2)
  out = []
  for key in sorted(set(a.files) | set(b.files)):
    step, path = key.split(":", 1)
    if key not in a.files or key not in b.files:
      out.append({"step": step, "leaf": path, "only_in": "first" if key in a.files else "second"})
      continue
    u, v = a[key], b[key]
    if u.dtype == v.dtype and u.shape == v.shape and u.tobytes() == v.tobytes():
      continue
    row = {"step": step, "leaf": path, "dtype": f"{u.dtype} / {v.dtype}",
           "shape": f"{list(u.shape)} / {list(v.shape)}"}
    if u.shape == v.shape and u.dtype == v.dtype and u.size:
      bytes_u, bytes_v = (w.reshape(-1).view(np.uint8).reshape(w.size, -1) for w in (u, v))
      with np.errstate(invalid="ignore"):
        diff = np.abs(u.astype(np.float64) - v.astype(np.float64))
      row.update(dtype=str(u.dtype), shape=list(u.shape), of=int(u.size),
                 elements_differing=int(np.any(bytes_u != bytes_v, axis=1).sum()),
                 max_abs_diff=float(np.nanmax(diff)) if not np.all(np.isnan(diff)) else None)
    out.append(row)
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny block (a smoke run on CPU)")
  p.add_argument("--steps", type=int, default=50)
  others = [m for m in MODES if m != "off"]
  p.add_argument("--modes", nargs="+", choices=others, default=others,
                 help="the modes compared with 'off', which always runs first (default: all)")
  p.add_argument("--out", help="JSON path")
  p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one mode, outputs here
  args = p.parse_args(argv)
  cfg = block.QUICK_BLOCK if args.quick else CONFIG
  if args.child:
    print(json.dumps(child(cfg, args.steps, args.child)))
    return None
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    autotune = os.path.join(tmp, "autotune.textproto")
    for mode in ["off", *dict.fromkeys(args.modes)]:
      flag = autotune_flag(mode, autotune)
      r = run_mode(mode, args, os.path.join(tmp, f"{mode}.npz"), flag)
      rows.append({"mode": mode, "xla_flag": MODES[mode] or "(XLA default)",
                   "autotune_flag": (flag or "(none: no results dumped)").split("=")[0], **r})
    off = os.path.join(tmp, "off.npz")
    n_leaves = {k: sum(f.startswith(f"{k}:") for f in np.load(off).files) for k in STEPS}
    base = next(r for r in rows if r["mode"] == "off")
    for r in rows:
      r["differing_leaves"] = differing_leaves(off, os.path.join(tmp, f"{r['mode']}.npz"))
      r["bit_identical_to_off"] = not r["differing_leaves"]
      for k in STEPS:
        r[f"{k}_speedup_vs_off"] = base[f"{k}_step_ms"] / r[f"{k}_step_ms"]
  env = environment()
  results = {"env": env, "config": cfg, "steps": args.steps, "leaves": n_leaves, "rows": rows}
  print(f"\n{env['device']}  jax {env['jax']}  {env['date']}  block {cfg}")
  print(f"{'mode':<22}{'FP8 ms':>9}{'vs off':>8}{'BF16 ms':>9}{'vs off':>8}{'identical':>11}")
  for r in rows:
    print(f"{r['mode']:<22}{r['fp8_step_ms']:>9.3f}{r['fp8_speedup_vs_off']:>8.3f}"
          f"{r['bf16_step_ms']:>9.3f}{r['bf16_speedup_vs_off']:>8.3f}"
          f"{str(r['bit_identical_to_off']):>11}")
    for d in r["differing_leaves"]:
      print(f"  differs from off: {d['step']} step {d['leaf']} "
            f"({d.get('elements_differing', '?')} of {d.get('of', '?')} elements, "
            f"max |diff| {d.get('max_abs_diff')})")
  write_results(results, args.out, "-command_buffer")
  return results


if __name__ == "__main__":
  main()
