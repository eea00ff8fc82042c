"""Inference with FP8 weights: one linear's forward at decode-like (M = 1-64) and prefill-like
(M >= 4096) sizes, the Llama-style layer shapes of ``benchmarks.model_step``, BF16 weights
against ``jax_fp8.Fp8Weight`` ones.

    python -m benchmarks.inference [--quick] [--out PATH]

Variants per shape, each x [M, K] bf16 -> y [M, N] bf16, timed on the device
(``timing.device_time``):

- ``bf16``: ``x @ w`` with a bf16 weight (XLA's GEMM);
- ``fp8``: ``jax_fp8.linear`` on the per-tensor ``Fp8Weight`` under ``DelayedScaling()``
  (always the FP8 GEMM, x quantized with its ring);
- ``fp8_auto``: the same under ``DelayedScaling(fp8_min_intensity=CROSSOVER_INTENSITY)``:
  below the crossover the FP8 weight is dequantized inside XLA's GEMM fusion;
- ``block``: the 128 x 128-block ``Fp8Weight`` under ``BlockScaling()``.

Also the weight bytes (FP8 with its scales against bf16) and the copy-bandwidth ceiling of
the same run. Writes ``benchmarks/results/<gpu>-inference.json`` (or ``--out``): ``env``,
``ceilings`` and ``rows`` (``shape`` [M, N, K], ``<variant>_us``, ``<variant>_vs_bf16``,
``weight_bytes_vs_bf16``).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

import jax_fp8
from jax_fp8.recipes import CROSSOVER_INTENSITY

from .common import ceilings, environment, rand, write_results
from .timing import device_time

LAYERS = [(4096, 4096), (4096, 14336), (14336, 4096)]  # (K, N): attention, up / gate, down
TOKENS = [1, 16, 64, 4096, 16384]
QUICK_LAYERS, QUICK_TOKENS = [(256, 128)], [1, 128]


def variants():
  delayed = jax_fp8.DelayedScaling()
  auto = jax_fp8.DelayedScaling(fp8_min_intensity=CROSSOVER_INTENSITY)
  block = jax_fp8.BlockScaling()
  return {"fp8": (delayed, jax_fp8.LinearState.create(delayed)),
          "fp8_auto": (auto, jax_fp8.LinearState.create(auto)),
          "block": (block, None)}


def bench(layers, tokens):
  rows = []
  for k, n in layers:
    w = rand(1, (k, n), jnp.float32, k ** -0.5)
    w16 = w.astype(jnp.bfloat16)
    for m in tokens:
      x = rand(2, (m, k), jnp.bfloat16)
      row = {"case": "linear forward", "shape": [m, n, k],
             "bf16_us": device_time(lambda x, w: x @ w, x, w16) * 1e6}
      for name, (recipe, state) in variants().items():
        w8 = jax_fp8.quantize_weight(w, recipe)
        row[f"{name}_us"] = device_time(
            lambda x, w8, state, recipe=recipe: jax_fp8.linear(x, w8, state=state,
                                                               recipe=recipe),
            x, w8, state) * 1e6
        row[f"{name}_vs_bf16"] = row["bf16_us"] / row[f"{name}_us"]
        nbytes = sum(v.size * v.dtype.itemsize for v in jax.tree.leaves(w8))
        row[f"{name}_weight_bytes_vs_bf16"] = nbytes / (w16.size * 2)
      rows.append(row)
      print(f"M={m:<6} N={n:<6} K={k:<6} bf16 {row['bf16_us']:9.1f} us  " + "  ".join(
          f"{name} {row[f'{name}_us']:9.1f} us ({row[f'{name}_vs_bf16']:.2f}x)"
          for name in variants()), flush=True)
  return rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
  p.add_argument("--out", help="JSON path (default: benchmarks/results/<gpu>-inference.json)")
  args = p.parse_args(argv)
  env = environment()
  results = {"env": env, "ceilings": ceilings(args.quick),
             "rows": bench(*((QUICK_LAYERS, QUICK_TOKENS) if args.quick else (LAYERS, TOKENS)))}
  write_results(results, args.out, "-inference")
  return results


if __name__ == "__main__":
  main()
