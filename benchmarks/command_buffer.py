"""CUDA graphs: step time and bits with XLA's command buffers on, off, and without ours.

The transformer block train step of ``benchmarks/block.py``, FP8 (``jax_fp8.flax.Dense``) and
BF16 (``flax.linen.Dense``), is compiled and run in one child process per
``--xla_gpu_enable_command_buffer`` setting (XLA reads its flags once per process): XLA's
default, an explicit list with ``CUSTOM_CALL``, the same list without it, and command buffers
off. Each child reports the step time of a training loop (steps dispatched back to back, one
sync at the end) and saves the steps' outputs, which must be bit-identical to those with
command buffers off. XLA (jax 0.11) forms command buffers from its thunks, after the HLO, so
the evidence is the FP8 step time moving with ``CUSTOM_CALL`` alone while the BF16 step (none
of our calls) does not. Our handlers are marked ``kCmdBufferCompatible``
(csrc/ffi/*_cuda.*).

    python -m benchmarks.command_buffer [--quick] [--steps 50] [--out PATH]

Writes ``benchmarks/results/<gpu>-<date>-command-buffer.json``.
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
from .run import QUICK_BLOCK, environment, write_results

TYPES = "FUSION,CUBLAS,CUBLASLT,CUDNN"
MODES = {  # name -> XLA_FLAGS addition (None: XLA's default)
    "default": None,
    "with_custom_calls": f"--xla_gpu_enable_command_buffer={TYPES},CUSTOM_CALL",
    "without_custom_calls": f"--xla_gpu_enable_command_buffer={TYPES}",
    "off": "--xla_gpu_enable_command_buffer=",
}
# Small enough that launch overheads show: 4 x 512 tokens, d_model 1024.
CONFIG = dict(d_model=1024, ffn=3584, heads=8, seq=512, batch=4)


def child(cfg: dict, steps: int, out_npz: str) -> dict:
  times, leaves = {}, []
  for fp8 in (True, False):
    blk, params, state, x = block.setup(jax_fp8.DelayedScaling() if fp8 else None, **cfg)
    step = jax.jit(block.train_step_fn(blk))
    res = jax.block_until_ready(step(params, state, x))  # compile and warm up
    t0 = time.perf_counter()
    for _ in range(steps):
      res = step(params, state, x)
    jax.block_until_ready(res)
    times["fp8_step_ms" if fp8 else "bf16_step_ms"] = (time.perf_counter() - t0) / steps * 1e3
    leaves += [np.asarray(v) for v in jax.tree.leaves(res)]
  np.savez(out_npz, *leaves)
  return times


def run_mode(mode: str, args, out_npz: str) -> dict:
  env = dict(os.environ)
  if MODES[mode] is not None:
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + MODES[mode]).strip()
  cmd = [sys.executable, "-m", "benchmarks.command_buffer", "--child", out_npz,
         "--steps", str(args.steps)] + (["--quick"] if args.quick else [])
  p = subprocess.run(cmd, env=env, capture_output=True, text=True,
                     cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  if p.returncode:
    raise RuntimeError(f"mode {mode} failed:\n{p.stderr[-3000:]}")
  return json.loads(p.stdout.strip().splitlines()[-1])


def same_bits(f1: str, f2: str) -> bool:
  a, b = np.load(f1), np.load(f2)
  return a.files == b.files and all(
      a[k].tobytes() == b[k].tobytes() and a[k].dtype == b[k].dtype for k in a.files)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny block (a smoke run on CPU)")
  p.add_argument("--steps", type=int, default=50)
  p.add_argument("--out", help="JSON path")
  p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one mode, outputs here
  args = p.parse_args(argv)
  cfg = QUICK_BLOCK if args.quick else CONFIG
  if args.child:
    print(json.dumps(child(cfg, args.steps, args.child)))
    return None
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for mode in MODES:
      r = run_mode(mode, args, os.path.join(tmp, f"{mode}.npz"))
      rows.append({"mode": mode, "xla_flag": MODES[mode] or "(XLA default)", **r})
    off = os.path.join(tmp, "off.npz")
    for r in rows:
      r["bit_identical_to_off"] = same_bits(os.path.join(tmp, f"{r['mode']}.npz"), off)
      for k in ("fp8", "bf16"):
        r[f"{k}_speedup_vs_off"] = rows[-1][f"{k}_step_ms"] / r[f"{k}_step_ms"]
  env = environment()
  results = {"env": env, "config": cfg, "steps": args.steps, "rows": rows}
  print(f"\n{env['device']}  jax {env['jax']}  {env['date']}  block {cfg}")
  print(f"{'mode':<22}{'FP8 ms':>9}{'vs off':>8}{'BF16 ms':>9}{'vs off':>8}{'identical':>11}")
  for r in rows:
    print(f"{r['mode']:<22}{r['fp8_step_ms']:>9.3f}{r['fp8_speedup_vs_off']:>8.3f}"
          f"{r['bf16_step_ms']:>9.3f}{r['bf16_speedup_vs_off']:>8.3f}"
          f"{str(r['bit_identical_to_off']):>11}")
  write_results(results, args.out, f"{env['device'].replace(' ', '_')}-{env['date']}-command-buffer")
  return results


if __name__ == "__main__":
  main()
