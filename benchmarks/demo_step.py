"""The demo's train step, BF16 beside FP8 variants, all in one process: the demo's speedup
without a training run, and with ``--profile`` where each variant's step spends its time.

The step is ``python -m jax_fp8.demo``'s own (its model, optimizer and jitted step of a
preset, default ``gpu`` on a GPU backend, else ``cpu``: ``jax_fp8.demo.train``), on one batch
of random bytes placed on the device once and one step key, the same every step. Variants:
``bf16`` (the demo's BF16 twin); each recipe of the demo by name (``delayed``, ``current``,
``block``, ``mxfp8``, ``nvfp4``); ``delayed_fast_fprop`` and ``delayed_fast_all``: delayed
scaling with fast accumulation in the forward GEMM / in all three (the demo's
``--fast-accum``). Timing and profile as ``benchmarks.train_step``'s.

    python -m benchmarks.demo_step [--preset auto|gpu|cpu|smoke|moe|moe_smoke] [--variants NAME ...]
        [--profile [NAME ...]] [--steps 10] [--windows 3] [--profile-steps 5] [--out PATH]

Writes ``benchmarks/results/<gpu>-demo_step.json`` (or ``--out``): ``env`` (GPU, versions,
date), ``preset``, ``steps``, ``windows`` and a list ``rows``, one per variant, with
``benchmarks.train_step.measure``'s figures, ``variant`` and ``speedup_vs_bf16`` (None without
a ``bf16`` row).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np

from jax_fp8.demo.model import RECIPES, Transformer
from jax_fp8.demo.train import (PRESETS, init_variables, make_optimizer, make_train_step,
                                preset_name, step_key)

from . import train_step

# name -> the demo's Preset.config keywords
VARIANTS = {"bf16": dict(fp8=False), **{r: dict(fp8=True, recipe=r) for r in RECIPES},
            "delayed_fast_fprop": dict(fp8=True, fast_accum_gemms=("fprop",)),
            "delayed_fast_all": dict(fp8=True, fast_accum_gemms=("fprop", "dgrad", "wgrad"))}
PEERS = ("bf16",)


def measure(preset_name: str, name: str, steps: int, windows: int, profile_steps: int) -> dict:
  """One variant's figures (``benchmarks.train_step.measure``'s)."""
  preset = PRESETS[preset_name]
  cfg = preset.config(**VARIANTS[name])
  model, tx = Transformer(cfg), make_optimizer(preset, preset.steps)
  params, collections = init_variables(model, 0)
  batch = jax.device_put(np.random.default_rng(0).integers(
      0, cfg.vocab, (preset.batch, preset.seq_len + 1), dtype=np.uint8))
  return train_step.measure(make_train_step(model, tx),
                            (params, tx.init(params), collections), (batch, step_key(0, 0)),
                            preset.batch * preset.seq_len, steps, windows, profile_steps)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--preset", choices=["auto", *PRESETS], default="auto",
                 help="the demo's preset; auto (default) = gpu on a GPU backend, else cpu")
  train_step.add_arguments(p, VARIANTS, ["bf16", "delayed", "delayed_fast_fprop"], steps=10,
                           profile_steps=5, out="demo_step")
  args = p.parse_args(argv)
  preset = preset_name(args.preset)
  for variant in args.variants:
    try:
      PRESETS[preset].config(**VARIANTS[variant])
    except ValueError as e:  # what the model has no layers for (the MoE presets' recipes)
      p.error(f"--variants {variant} with --preset {preset}: {e}")
  return train_step.run(p, args, lambda variant, profile_steps: measure(
      preset, variant, args.steps, args.windows, profile_steps),
      {"preset": {"name": preset, **dataclasses.asdict(PRESETS[preset])}}, "demo_step", PEERS)


if __name__ == "__main__":
  main()
