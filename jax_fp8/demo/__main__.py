"""``python -m jax_fp8.demo``: train one byte-level transformer in BF16 and under one or more
FP8 recipes, and compare.

Every run starts from the same parameters and sees the same batches of Python standard-library
source. An FP8 run puts the block matmuls through ``jax_fp8`` layers under its recipe
(``--recipe delayed`` (default), ``current``, ``block``, ``mxfp8``, ``nvfp4``, or several); the
BF16 run uses the same layers' bf16 twins. Reported per run: step time and tokens/s (compile
steps excluded), final train and validation loss, each recipe's speedup over BF16, one PNG of
all loss curves and ``results.json``. Exit status 1 when a recipe's validation loss is worse
than BF16's by more than ``--tolerance``.

Each finished run is also kept as ``run-<name>.json`` (``run-bf16.json``, ``run-delayed.json``,
...) beside them, with the settings it ran under; ``--only NAME`` trains that run alone and
compares the runs whose files ran under the same settings, so long runs can be split over
jobs. ``--stop-after MINUTES`` stops a run that is still training at that point and
checkpoints it (``checkpoint-<name>.msgpack`` in ``--out``). The same command
then resumes it, keeps the runs that already finished, and leaves each resumed segment's own
first steps out of the timing. ``--attention xla`` trains with XLA's attention in place of
cuDNN's on a GPU, whose backward adds in no fixed order: with it a GPU run is bit-reproducible.
``--fast-accum GEMM...`` gives the per-tensor recipes' GEMMs it names (fprop, dgrad, wgrad)
fast accumulation (``DelayedScaling.fast_accum_gemms``). ``--preset moe`` (``moe_smoke``: its
test-suite size) trains the model with every MLP a dropless mixture of experts: FP8's
``jax_fp8.flax.MoeMlp`` (the per-tensor recipes) beside its BF16 twin (``jax.lax.ragged_dot``);
its validation loss is the cross-entropy alone (its training loss adds the load-balancing loss).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import flax.serialization
import jax
import numpy as np
from tqdm import tqdm

import jax_fp8
from jax_fp8.demo import data
from jax_fp8.demo.model import (ATTENTION, PER_TENSOR, RECIPES, Config, Transformer,
                                 default_attention)
from jax_fp8.demo.train import (PRESETS, SKIP_STEPS, Preset, init_variables, make_eval,
                                make_optimizer, make_train_step, preset_name, step_key)

BF16 = "bf16"  # the baseline run's name; the FP8 runs are named by their recipe


def _checkpoint_path(out: str, name: str) -> str:
  """Run ``name``'s checkpoint in ``out``: its arrays and its progress in one msgpack file."""
  return os.path.join(out, f"checkpoint-{name}.msgpack")


def _save_checkpoint(out, name, settings, arrays, progress) -> None:
  """Written whole or not at all: to a temporary file, then renamed over the last one."""
  path = _checkpoint_path(out, name)
  data = flax.serialization.msgpack_serialize({
      "arrays": flax.serialization.to_state_dict(arrays),
      "progress": json.dumps({"settings": settings, **progress})})
  with open(path + ".tmp", "wb") as f:
    f.write(data)
  os.replace(path + ".tmp", path)


def _load_checkpoint(out, name, settings, arrays):
  """(arrays, progress) of run ``name``'s checkpoint in ``out`` when it was saved under
  ``settings``, else None. ``arrays``: the target structure."""
  path = _checkpoint_path(out, name)
  if not os.path.exists(path):
    return None
  with open(path, "rb") as f:
    saved = flax.serialization.msgpack_restore(f.read())
  progress = json.loads(saved["progress"])
  if progress.pop("settings") != settings:
    return None
  return flax.serialization.from_state_dict(arrays, saved["arrays"]), progress


def train(name: str, cfg: Config, preset: Preset, batches: data.TrainBatches, val: np.ndarray,
          seed: int, out: str, settings: dict, deadline: float | None = None) -> dict | None:
  """Train one variant on ``batches`` (``steps`` of uint8 [B, T + 1]); return its figures, or None
  when ``deadline`` (a ``time.perf_counter()`` value) passed first: the run's state is then
  checkpointed in ``out`` and a later call under the same ``settings`` resumes it (each
  resumed segment leaves its own first ``SKIP_STEPS`` steps out of the timing)."""
  model = Transformer(cfg)
  steps = len(batches)
  tx = make_optimizer(preset, steps)
  step_fn = make_train_step(model, tx)
  params, collections = init_variables(model, seed)
  opt_state = tx.init(params)
  n_params = sum(p.size for p in jax.tree.leaves(params))
  progress = {"step": 0, "train_losses": [], "timed_s": 0.0, "timed_steps": 0,
              "first_step_s": None}
  kept = _load_checkpoint(out, name, settings, (params, opt_state, collections))
  if kept is not None:
    (params, opt_state, collections), progress = kept
    print(f"{name} resumed at step {progress['step']} from {_checkpoint_path(out, name)}")

  start = progress["step"]
  losses = list(progress["train_losses"])
  bar = tqdm(range(start, steps), desc=f"{name:>4}", unit="step", dynamic_ncols=True,
             initial=start, total=steps)
  t_start = time.perf_counter()
  t_timed = None
  for i in bar:
    params, opt_state, collections, loss = step_fn(params, opt_state, collections, batches[i],
                                                   step_key(seed, i))
    losses.append(loss)
    if i < start + SKIP_STEPS:  # untimed; the clock starts once the last of them has finished
      jax.block_until_ready(loss)
      t_timed = time.perf_counter()
      if i == 0:
        progress["first_step_s"] = t_timed - t_start  # compilation + one step
    if i % 10 == 0 or i == steps - 1:
      bar.set_postfix(loss=f"{float(loss):.4f}")
    if (deadline is not None and i >= start + SKIP_STEPS and i < steps - 1
        and time.perf_counter() > deadline):
      jax.block_until_ready((params, loss))
      progress["timed_s"] += time.perf_counter() - t_timed
      progress["timed_steps"] += i + 1 - start - SKIP_STEPS
      progress["step"] = i + 1
      progress["train_losses"] = [float(v) for v in jax.device_get(losses)]
      _save_checkpoint(out, name, settings, (params, opt_state, collections), progress)
      bar.close()
      print(f"{name} stopped at step {i + 1} of {steps} (--stop-after): its state is in "
            f"{_checkpoint_path(out, name)}; the same command resumes it")
      return None
  jax.block_until_ready((params, loss))
  if t_timed is not None and steps - start > SKIP_STEPS:
    progress["timed_s"] += time.perf_counter() - t_timed
    progress["timed_steps"] += steps - start - SKIP_STEPS
  bar.close()
  if os.path.exists(_checkpoint_path(out, name)):
    os.remove(_checkpoint_path(out, name))

  train_losses = [float(v) for v in jax.device_get(losses)]
  val_loss = float(make_eval(model)(params, collections, val))
  step_s = progress["timed_s"] / progress["timed_steps"]
  return {
      "params": n_params,
      "first_step_s": progress["first_step_s"],
      "step_ms": 1e3 * step_s,
      "timed_steps": progress["timed_steps"],
      "tokens_per_s": preset.batch * preset.seq_len / step_s,
      "final_train_loss": float(np.mean(train_losses[-10:])),
      "val_loss": val_loss,
      "train_losses": train_losses,
  }


def plot(results: dict, path: str) -> None:
  """Every run's training-loss curve (raw and smoothed) and final validation loss, as a PNG."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(8, 5))
  for i, (name, r) in enumerate(results["runs"].items()):
    color = f"C{i}"
    y = np.asarray(r["train_losses"])
    w = max(1, len(y) // 20)
    smooth = np.convolve(y, np.ones(w) / w, mode="valid")
    ax.plot(np.arange(len(y)), y, color=color, alpha=0.2, lw=0.8)
    speedup = results["speedup"].get(name)
    ax.plot(np.arange(w - 1, len(y)), smooth, color=color, lw=2,
            label=f"{name} train (mean of {w})"
                  + ("" if speedup is None else f", {speedup:.2f}x BF16's speed"))
    ax.scatter([len(y) - 1], [r["val_loss"]], color=color, marker="*", s=150, zorder=3,
               edgecolor="black", label=f"{name} validation {r['val_loss']:.3f}")
  ax.set(xlabel="step", ylabel="cross-entropy (nats / byte)",
         title=f"jax_fp8 demo, preset {results['preset']} on {results['device']}")
  ax.grid(True, alpha=0.3)
  ax.legend(fontsize="small")
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def parse_args(argv):
  """The command line (``argv=None``: ``sys.argv[1:]``)."""
  p = argparse.ArgumentParser(prog="python -m jax_fp8.demo", description="Train one byte-level "
                              "transformer twice, FP8 and BF16, and compare them.")
  p.add_argument("--preset", choices=["auto", *PRESETS], default="auto",
                 help="model size; auto = gpu on a GPU backend, else cpu; moe (moe_smoke): "
                      "the gpu (smoke) model with mixtures of experts for MLPs")
  p.add_argument("--steps", type=int, help="training steps (overrides the preset)")
  p.add_argument("--out", default="demo_out", help="folder for results.json and the PNG")
  p.add_argument("--tolerance", type=float, default=0.05,
                 help="allowed relative excess of the FP8 validation loss over BF16's")
  p.add_argument("--seed", type=int, default=0, help="seed of the parameters and the batches")
  p.add_argument("--recipe", choices=list(RECIPES), nargs="+", default=["delayed"],
                 help="FP8 recipes, one run each: per-tensor delayed or current scaling "
                      "(HYBRID), block scaling (DeepSeek-V3: 1x128 groups, 128x128 weight "
                      "blocks), MXFP8 (1x32 E8M0 blocks) or NVFP4 (16-element blocks, the "
                      "report's recipe; the last blocks in BF16); MXFP8 and NVFP4 GEMMs are "
                      "emulated on Hopper")
  p.add_argument("--fast-accum", nargs="+", action="extend",
                 choices=list(jax_fp8.recipes.LINEAR_GEMMS), default=[], metavar="GEMM",
                 help="the per-tensor recipes' GEMMs (fprop, dgrad, wgrad) whose FP8 tensor-core "
                      "sums are not promoted to f32 (fast_accum_gemms): faster, less exact as "
                      "K grows; GPU only, the CPU's emulated GEMMs sum in f32 (default: none)")
  p.add_argument("--attention", choices=list(ATTENTION),
                 help="jax.nn.dot_product_attention's implementation (default: cudnn on a GPU "
                      "backend, else xla; xla's runs are bit-reproducible on a GPU too)")
  p.add_argument("--only", help="train this run only (bf16 or one of the --recipe names); "
                                "compare the runs whose run-*.json in --out ran under the same "
                                "settings")
  p.add_argument("--stop-after", type=float, metavar="MINUTES",
                 help="stop training once this job has run this long (after at least a few "
                      "steps), checkpointing the run in --out (the next run is not started); the "
                      "same command resumes it and keeps the runs that finished")
  args = p.parse_args(argv)
  if not args.tolerance >= 0:  # NaN fails too
    p.error(f"--tolerance must be a number >= 0 (a relative excess), got {args.tolerance}")
  if args.stop_after is not None and not args.stop_after > 0:
    p.error(f"--stop-after must be a positive number of minutes, got {args.stop_after}")
  args.recipe = list(dict.fromkeys(args.recipe))  # each once, in the order given
  if args.only not in (None, BF16, *args.recipe):
    p.error(f"--only must be {BF16} or one of --recipe ({', '.join(args.recipe)}), got "
            f"{args.only!r}")
  other = [r for r in args.recipe if r not in PER_TENSOR]
  for recipe in args.recipe if args.preset in PRESETS else ():  # "auto": a dense preset
    try:
      PRESETS[args.preset].config(fp8=True, recipe=recipe)
    except ValueError as e:  # what the model has no layers for (the MoE presets' recipes)
      p.error(f"--recipe {recipe} with --preset {args.preset}: {e}")
  if args.fast_accum and other:
    p.error(f"--fast-accum applies to the per-tensor recipes ({', '.join(PER_TENSOR)}), not "
            f"to {', '.join(other)}")
  # each once, in the recipes' canonical order
  canonical = jax_fp8.DelayedScaling(fast_accum_gemms=set(args.fast_accum)).fast_accum_gemms
  args.fast_accum = list(canonical)
  if args.steps is not None and args.steps <= SKIP_STEPS:
    p.error(f"--steps must be more than {SKIP_STEPS} (the untimed compile steps)")
  if not 0 <= args.seed < 2**63:
    p.error(f"--seed must be in [0, 2**63), got {args.seed}")
  if os.path.exists(args.out) and not os.path.isdir(args.out):
    p.error(f"--out must be a folder, got the file {args.out}")
  try:
    os.makedirs(args.out, exist_ok=True)
  except OSError as e:
    p.error(f"--out: cannot create the folder {args.out} ({e.strerror})")
  return args


def main(argv=None) -> None:
  """Run the demo; raises ``SystemExit(1)`` when FP8 misses the tolerance."""
  args = parse_args(argv)
  deadline = (None if args.stop_after is None else
              time.perf_counter() + 60 * args.stop_after)
  name = preset_name(args.preset)
  preset = PRESETS[name]
  if args.steps is not None:
    preset = dataclasses.replace(preset, steps=args.steps)
  device = jax.devices()[0].device_kind
  if jax.default_backend() == "gpu" and not jax_fp8.cuda_available():
    raise SystemExit(f"JAX runs on a GPU but jax_fp8's CUDA kernels did not load: "
                     f"{jax_fp8._ffi.CUDA_IMPORT_ERROR}")

  corpus = data.load_corpus()
  batches = data.train_batches(corpus.train, preset.steps, preset.batch, preset.seq_len,
                               args.seed)
  val = data.val_batches(corpus.val, preset.val_batches, preset.batch, preset.seq_len)
  moe = (f", MLPs of {preset.moe_experts} experts (top {preset.moe_top_k}, hidden "
         f"{preset.moe_hidden})" if preset.moe_experts else "")
  print(f"preset {name}: d_model {preset.d_model}, layers {preset.n_layers}, heads "
        f"{preset.n_heads}, seq {preset.seq_len}, batch {preset.batch}, steps {preset.steps}"
        f"{moe}, on {device}")
  print(f"data: {corpus.files} stdlib files, {len(corpus.train):,} train / {len(corpus.val):,} "
        f"validation bytes ({val.shape[0] * val.shape[1]} validation windows)")

  print(f"FP8 recipes: {', '.join(args.recipe)}" + (
      f" (fast accumulation in {', '.join(args.fast_accum)})" if args.fast_accum else ""))
  attention = args.attention or default_attention(jax.default_backend())
  settings = {"preset": name, "config": preset.record(), "seed": args.seed,
              "attention": attention, "device": device, "backend": jax.default_backend(),
              "jax_version": jax.__version__, "fp8_kernels_cuda": jax_fp8.cuda_available()}
  runs, stopped, trained = {}, False, False
  for run_name in (BF16, *args.recipe):
    run_settings = dict(settings)
    if run_name != BF16:
      run_settings["recipe"] = run_name
      if args.fast_accum:  # only then, so the runs saved without the key still match
        run_settings["fast_accum_gemms"] = args.fast_accum
    path = os.path.join(args.out, f"run-{run_name}.json")
    kept = None
    if os.path.exists(path):
      with open(path) as f:
        kept = json.load(f)
      kept = kept if kept.pop("settings") == run_settings else None
    train_it = args.only in (None, run_name)
    if train_it and kept is None and os.path.exists(path):
      print(f"{path} ran under other settings: this {run_name} run replaces it")
    if train_it and deadline is not None and kept is not None:
      train_it = False  # a resumable job keeps the runs it finished before
    if train_it and trained and deadline is not None and time.perf_counter() > deadline:
      print(f"{run_name} not started: --stop-after has passed")
      stopped = True
    elif train_it:
      trained = True  # a job trains at least one segment, however short --stop-after
      fp8 = run_name != BF16
      cfg = preset.config(fp8=fp8, recipe=run_name if fp8 else "delayed", attention=attention,
                          fast_accum_gemms=tuple(args.fast_accum) if fp8 else ())
      run = train(run_name, cfg, preset, batches, val, args.seed, args.out, run_settings,
                  deadline)
      if run is None:
        stopped = True
        continue
      runs[run_name] = run
      with open(path, "w") as f:
        json.dump({"settings": run_settings, **runs[run_name]}, f, indent=2)
    elif kept is not None:
      runs[run_name] = kept
      print(f"{run_name} run read from {path}")
  missing = [n for n in (BF16, *args.recipe) if n not in runs]
  if stopped:
    print(f"stopped before {', '.join(missing)} finished: run the same command again to go on")
    return
  if missing:
    print(f"no {', '.join(missing)} run under these settings in {args.out}: run again with "
          f"--only {missing[0]} to compare")
    return
  bf16 = runs[BF16]
  limit = bf16["val_loss"] * (1 + args.tolerance)
  passed = {r: bool(runs[r]["val_loss"] <= limit) for r in args.recipe}
  results = {
      **settings, "recipes": args.recipe, "fast_accum_gemms": args.fast_accum,
      "speedup": {r: bf16["step_ms"] / runs[r]["step_ms"] for r in args.recipe},
      "tolerance": args.tolerance, "val_loss_limit": limit, "passed": passed,
      "runs": runs,
  }

  with open(os.path.join(args.out, "results.json"), "w") as f:
    json.dump(results, f, indent=2)
  plot(results, os.path.join(args.out, "loss_curves.png"))

  print(f"\n{'run':<8} {'step ms':>9} {'tokens/s':>11} {'1st step s':>10} {'train loss':>10} "
        f"{'val loss':>9} {'speedup':>8}")
  for run_name, r in runs.items():
    speedup = results["speedup"].get(run_name)
    print(f"{run_name:<8} {r['step_ms']:>9.2f} {r['tokens_per_s']:>11,.0f} "
          f"{r['first_step_s']:>10.2f} {r['final_train_loss']:>10.4f} {r['val_loss']:>9.4f} "
          f"{'' if speedup is None else f'{speedup:.2f}x':>8}")
  print("speedup: bf16 step time / the recipe's"
        + ("" if results["fp8_kernels_cuda"] else
           " (no CUDA kernels: the FP8 GEMMs are emulated, so only the losses are meaningful)"))
  for r in args.recipe:
    print(f"rule: {r} val loss <= BF16 val loss x (1 + {args.tolerance:g}): "
          f"{runs[r]['val_loss']:.4f} <= {limit:.4f} -> {'PASS' if passed[r] else 'FAIL'}")
  print(f"wrote {args.out}/results.json and {args.out}/loss_curves.png")
  if not all(passed.values()):
    raise SystemExit(1)


if __name__ == "__main__":
  main()
