"""Data-parallel training benchmark: the demo's transformer trained under ``shard_map`` on 1, 2,
4, ... devices, FP8 (``jax_fp8.flax.Dense``) against BF16 (``flax.linen.Dense``).

Weak scaling: every device takes the preset's batch, so the global batch grows with the device
count and the ideal step time stays constant; scaling efficiency is the one-device step time
over the n-device one. Parameters and optimizer state are replicated; the parameter gradients
are averaged over the devices and the FP8 amaxes max-reduced (``amax_axis_name``), as in
``examples/data_parallel.py``. Step times are wall-clock over the timed steps of a training
loop, the first two (compilation, first donated step) left out, as in the demo.

    python -m benchmarks.data_parallel [--preset gpu] [--steps 30]
        [--recipe delayed|current|block|mxfp8|nvfp4] [--max-devices N] [--platform cpu] [--out PATH]

The devices are the default backend's, or ``--platform``'s (``cpu``: the host's, eight virtual
ones under the tests' ``--xla_force_host_platform_device_count=8``).

Writes ``benchmarks/results/<gpu>x<N>-data_parallel-<recipe>.json``. NCCL's NVLink multicast
(NVLS) is turned off unless the environment sets NCCL_NVLS_ENABLE.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from jax_fp8.demo import data  # noqa: E402
from jax_fp8.demo.model import RECIPES, Transformer, default_attention  # noqa: E402
from jax_fp8.demo.train import (PRESETS, SKIP_STEPS, init_variables, make_optimizer,  # noqa: E402
                                make_train_step, step_key)

from .common import environment, write_results  # noqa: E402

AXIS = "data"


def step_time(preset, cfg, devices, batches, seed: int) -> float:
  """Seconds per training step of ``cfg`` data-parallel over ``devices`` (the demo's step
  under ``shard_map``: ``make_train_step``'s ``mesh``)."""
  mesh = Mesh(np.array(devices), (AXIS,))
  model = Transformer(cfg)
  tx = make_optimizer(preset, len(batches))
  train_step = make_train_step(model, tx, mesh=mesh, axis=AXIS)
  params, collections = init_variables(model, seed)
  opt_state = tx.init(params)
  replicated = jax.sharding.NamedSharding(mesh, P())
  params, opt_state, collections = jax.device_put((params, opt_state, collections), replicated)
  batch_sharding = jax.sharding.NamedSharding(mesh, P(AXIS))
  for i, batch in enumerate(batches):
    if i == SKIP_STEPS:
      jax.block_until_ready(params)
      t0 = time.perf_counter()
    params, opt_state, collections, loss = train_step(
        params, opt_state, collections, jax.device_put(batch, batch_sharding), step_key(seed, i))
  jax.block_until_ready((params, loss))
  return (time.perf_counter() - t0) / (len(batches) - SKIP_STEPS)


def device_counts(available: int, limit: int | None) -> list[int]:
  """1, 2, 4, ... up to the devices available (and the limit)."""
  top = min(available, limit or available)
  counts = [1]
  while counts[-1] * 2 <= top:
    counts.append(counts[-1] * 2)
  return counts


def main(argv=None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
  p.add_argument("--steps", type=int, default=30, help="steps per run (the first two untimed)")
  p.add_argument("--recipe", choices=list(RECIPES), default="delayed")
  p.add_argument("--max-devices", type=int, help="largest device count to run")
  p.add_argument("--platform", help="run on this platform's devices (cpu, cuda; default: the "
                                    "default backend's)")
  p.add_argument("--out", help="JSON path (default benchmarks/results/...)")
  args = p.parse_args(argv)
  if args.steps <= SKIP_STEPS:
    p.error(f"--steps must be more than {SKIP_STEPS}")
  devices = jax.devices(args.platform) if args.platform else jax.devices()
  preset = PRESETS[args.preset]
  attention = default_attention(devices[0].platform)  # of the devices it runs on
  corpus = data.load_corpus()
  rows = []
  for n in device_counts(len(devices), args.max_devices):
    batches = data.train_batches(corpus.train, args.steps, n * preset.batch, preset.seq_len, 0)
    times = {}
    for fp8 in (True, False):
      cfg = dataclasses.replace(preset.config(fp8=fp8, recipe=args.recipe, attention=attention),
                                amax_axis_name=AXIS)
      with jax.default_device(devices[0]):  # initialization too, not on the default backend
        times[fp8] = step_time(preset, cfg, devices[:n], batches, seed=0)
    rows.append({"devices": n, "global_batch": n * preset.batch,
                 "fp8_step_ms": times[True] * 1e3, "bf16_step_ms": times[False] * 1e3,
                 "fp8_speedup": times[False] / times[True]})
    print(f"{n} devices: FP8 {times[True] * 1e3:.1f} ms/step, BF16 {times[False] * 1e3:.1f} "
          f"ms/step, FP8 speedup {times[False] / times[True]:.2f}x", flush=True)
  for r in rows:  # weak scaling against one device
    r["fp8_scaling_efficiency"] = rows[0]["fp8_step_ms"] / r["fp8_step_ms"]
    r["bf16_scaling_efficiency"] = rows[0]["bf16_step_ms"] / r["bf16_step_ms"]
  env = {**environment(devices[0]), "device_count": len(devices),
         "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
  results = {"env": env, "preset": args.preset, "recipe": args.recipe, "steps": args.steps,
             "attention": attention, "rows": rows}
  write_results(results, args.out, f"x{len(devices)}-data_parallel-{args.recipe}")
  return results


if __name__ == "__main__":
  main()
