"""The main job's smallest preset, end to end (data, the models, report, exit status)."""

import json
import re

import jax
import numpy as np
import pytest

from jax_fp8.demo import data
from jax_fp8.demo.__main__ import main
from jax_fp8.demo.model import LLAMA, Config, Transformer, _fp8_kw
from jax_fp8.demo.train import PRESETS, init_variables


def test_demo_smoke(tmp_path):
  # main raises SystemExit(1) if a recipe strays from BF16's validation loss. Two recipes: the
  # default and a block-scaled one (the others train this model in test_demo_resumes_a_stopped_run
  # and tests/test_benchmarks.py's model step; each run compiles its own steps)
  recipes = ["delayed", "mxfp8"]
  main(["--preset", "smoke", "--recipe", *recipes, "--out", str(tmp_path)])
  res = json.loads((tmp_path / "results.json").read_text())
  assert res["recipes"] == recipes and set(res["speedup"]) == set(recipes)
  assert (tmp_path / "loss_curves.png").stat().st_size > 0
  assert list(res["runs"]) == ["bf16", *recipes] and all(res["passed"].values())
  for run in res["runs"].values():
    assert len(run["train_losses"]) == 10 and run["val_loss"] < run["train_losses"][0]


def test_demo_moe_smoke(tmp_path):
  """The MoE preset's smallest size end to end: FP8's MoeMlp (delayed) beside its BF16 ragged_dot
  twin on real text, the settings recording the experts; at step 0 (the same parameters and
  batch) FP8's training loss, load-balancing term included, is BF16's within FP8's error."""
  main(["--preset", "moe_smoke", "--out", str(tmp_path)])
  res = json.loads((tmp_path / "results.json").read_text())
  assert list(res["runs"]) == ["bf16", "delayed"] and res["passed"] == {"delayed": True}
  assert (res["config"]["moe_experts"], res["config"]["moe_top_k"]) == (4, 2)
  bf16, fp8 = (res["runs"][r]["train_losses"] for r in ("bf16", "delayed"))
  assert len(bf16) == len(fp8) == PRESETS["moe_smoke"].steps
  assert abs(fp8[0] - bf16[0]) < 0.02 * bf16[0], (fp8[0], bf16[0])
  assert all(np.isfinite(bf16 + fp8))


def test_demo_moe_preset_rejects_other_recipes(capsys):
  """The MoE presets run the per-tensor recipes (MoeMlp's): another is refused at the command
  line with the model's rule (the demo-step benchmark's: tests/test_benchmarks.py); the dense
  presets record no MoE fields (the runs saved before them still match)."""
  with pytest.raises(SystemExit):
    main(["--preset", "moe_smoke", "--recipe", "delayed", "block"])
  assert re.search(r"--recipe block with --preset moe_smoke: moe_experts > 0 runs .* not recipe "
                   r"'block'", capsys.readouterr().err)
  assert "moe_experts" not in PRESETS["smoke"].record()
  assert PRESETS["moe"].record()["moe_hidden"] == 4096


def test_demo_split_runs(tmp_path, capsys):
  # --only trains one run; a later job compares the runs whose files match its settings
  out = str(tmp_path)
  main(["--preset", "smoke", "--recipe", "delayed", "--only", "delayed", "--out", out])
  assert not (tmp_path / "results.json").exists()
  assert "run again with --only bf16" in capsys.readouterr().out
  main(["--preset", "smoke", "--only", "bf16", "--seed", "1", "--out", out])  # another seed
  assert not (tmp_path / "results.json").exists()
  assert "run again with --only delayed" in capsys.readouterr().out
  main(["--preset", "smoke", "--only", "bf16", "--out", out])
  res = json.loads((tmp_path / "results.json").read_text())
  fp8 = json.loads((tmp_path / "run-delayed.json").read_text())
  assert res["runs"]["delayed"]["train_losses"] == fp8["train_losses"]
  assert res["seed"] == 0 and list(res["runs"]) == ["bf16", "delayed"] and res["passed"]


def test_training_batches():
  """Each batch is cut from the bytes when indexed: windows of seq_len + 1 consecutive bytes at
  the seeded offsets, the same for the same seed; an index that is no int is refused."""
  corpus = np.arange(200, dtype=np.uint8)
  batches = data.train_batches(corpus, steps=5, batch=3, seq_len=7, seed=1)
  assert len(batches) == 5 and [b.shape for b in batches] == [(3, 8)] * 5
  for b, starts in zip(batches, batches.starts):  # the corpus counts up: a window does too
    assert np.all(b[:, 0] == starts) and np.all(np.diff(b.astype(int), axis=1) == 1)
  np.testing.assert_array_equal(batches[4], data.train_batches(corpus, 5, 3, 7, seed=1)[4])
  with pytest.raises(TypeError):
    batches[1:3]


def test_demo_config_rejects_an_unknown_attention():
  with pytest.raises(ValueError, match=r"attention must be one of \[None, 'cudnn', 'xla'\], got "
                                       "'flash'"):
    Config(128, 2, 1, 32, attention="flash")


def test_demo_fast_accumulation(tmp_path, capsys):
  # --fast-accum reaches the per-tensor recipe's layers and the records, in canonical order
  out = str(tmp_path)
  main(["--preset", "smoke", "--recipe", "delayed", "--fast-accum", "wgrad", "--fast-accum",
        "fprop", "--out", out])
  res = json.loads((tmp_path / "results.json").read_text())
  settings = lambda run: json.loads((tmp_path / f"run-{run}.json").read_text())["settings"]  # noqa: E731
  assert res["fast_accum_gemms"] == settings("delayed")["fast_accum_gemms"] == ["fprop", "wgrad"]
  assert "fast_accum_gemms" not in settings("bf16")
  cfg = Config(128, 2, 1, 32, recipe="current", fast_accum_gemms=("fprop", "wgrad"))
  assert _fp8_kw(cfg, norm=None)["recipe"].fast_accum_gemms == ("fprop", "wgrad")
  assert _fp8_kw(Config(128, 2, 1, 32), norm=None)["recipe"].fast_accum_gemms == ()
  # without the flag the settings have no such key (as the runs saved before it), and the
  # exact run says that it replaces the fast one
  capsys.readouterr()
  main(["--preset", "smoke", "--only", "delayed", "--out", out])
  assert "run-delayed.json ran under other settings: this delayed run replaces it" in (
      capsys.readouterr().out)
  assert "fast_accum_gemms" not in settings("delayed")


def test_demo_fast_accumulation_rejects_other_recipes(capsys):
  with pytest.raises(SystemExit):
    main(["--preset", "smoke", "--recipe", "delayed", "block", "--fast-accum", "fprop"])
  assert ("--fast-accum applies to the per-tensor recipes (delayed, current), not to block"
          in capsys.readouterr().err)
  with pytest.raises(ValueError, match="fast_accum_gemms applies to the per-tensor recipes"):
    Config(128, 2, 1, 32, recipe="mxfp8", fast_accum_gemms=("fprop",))
  with pytest.raises(ValueError, match="fast_accum_gemms must be .* got \\('fwd',\\)"):
    Config(128, 2, 1, 32, fast_accum_gemms=("fwd",))


def test_demo_rejects_an_unknown_run(capsys):
  with pytest.raises(SystemExit):
    main(["--preset", "smoke", "--recipe", "current", "--only", "fp8"])
  assert "--only must be bf16 or one of --recipe (current), got 'fp8'" in capsys.readouterr().err


@pytest.mark.parametrize("tolerance", ["-1", "nan"])
def test_demo_rejects_a_negative_tolerance(capsys, tolerance):
  """Refused before any training (a negative one would fail every run at the end)."""
  with pytest.raises(SystemExit):
    main(["--preset", "smoke", "--tolerance", tolerance])
  assert f"--tolerance must be a number >= 0 (a relative excess), got {tolerance}" in (
      capsys.readouterr().err)


def test_demo_rejects_a_bad_seed_or_out(tmp_path, capsys):
  """A seed out of range and an --out that is a file or cannot be created are refused before
  the corpus is read."""
  a_file = tmp_path / "results.json"
  a_file.write_text("{}")
  for argv, message in ((["--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
                        (["--seed", str(2**64)], f"--seed must be in [0, 2**63), got {2**64}"),
                        (["--out", str(a_file)], f"--out must be a folder, got the file {a_file}"),
                        (["--out", str(a_file / "sub")], "--out: cannot create the folder")):
    with pytest.raises(SystemExit):
      main(["--preset", "smoke", *argv])
    assert message in capsys.readouterr().err


def test_demo_resumes_a_stopped_run(tmp_path, capsys):
  """--stop-after checkpoints a run in --out and the same command resumes it: a run trained in
  segments of a few steps has the uninterrupted run's losses, bit for bit (with XLA's attention:
  on a GPU cuDNN's backward adds in no fixed order); each segment leaves its own first two steps
  out of the timing; the checkpoint is gone once the run finishes."""
  whole, parts = tmp_path / "whole", tmp_path / "parts"
  args = ["--preset", "smoke", "--steps", "6", "--recipe", "nvfp4", "--only", "nvfp4",
          "--attention", "xla"]
  main([*args, "--out", str(whole)])
  calls = 0
  while not (parts / "run-nvfp4.json").exists():  # each segment stops after its 3rd step
    assert calls < 8, "the stopped run does not advance"
    main([*args, "--out", str(parts), "--stop-after", "1e-4"])
    calls += 1
  assert "nvfp4 resumed at step 3" in capsys.readouterr().out
  a, b = (json.loads((d / "run-nvfp4.json").read_text()) for d in (whole, parts))
  assert b["train_losses"] == a["train_losses"] and b["val_loss"] == a["val_loss"]
  assert a["settings"]["attention"] == "xla"
  assert b["timed_steps"] == 6 - 2 * 2  # two segments of 3 steps
  assert not list(parts.glob("checkpoint-*"))


@pytest.mark.parametrize("fields,message", [
    (dict(linear="flax_fp8"), "linear='flax_fp8' has no fused norm, split or MLP"),
    (dict(LLAMA, linear="bf16", qkv="shared_input"), "linear='bf16' has no MultiDense"),
    (dict(mlp="separate"), "the unfused MLPs are SwiGLU"),
    (dict(LLAMA, recipe="nvfp4", nvfp4_bf16_share=0.5), "under scan every block runs alike"),
    (dict(qkv="fused_split"), r"qkv must be one of \['split', 'shared_input', 'separate', "
                              r"'fused'\], got 'fused_split'"),
])
def test_model_config_rejects_what_no_layer_computes(fields, message):
  """The options the shared transformer has no layers for are refused when the Config is
  made, with the fields named."""
  with pytest.raises(ValueError, match=message):
    Config(128, 2, 2, 32, **fields)


def test_model_variants_name_parameters_alike():
  """One rule names the parameters: the demo's FP8 model and its BF16 twin have the same tree
  and the same initial values (one seed); so do the Llama-style FP8 model and its Flax BF16
  peer."""
  for fields, baseline in (({}, "bf16"), (LLAMA, "flax")):
    fp8, bf16 = (init_variables(Transformer(Config(128, 2, 2, 32, linear=linear, **fields)), 0)
                 for linear in ("fp8", baseline))
    assert jax.tree.structure(fp8[0]) == jax.tree.structure(bf16[0])
    # compared on the host: an eager == and .all() compile a program per leaf shape
    assert all(jax.tree.leaves(jax.tree.map(np.array_equal, fp8[0], bf16[0])))
    assert "fp8_state" in fp8[1] and bf16[1] == {}
