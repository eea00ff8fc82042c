"""The main job's smallest preset, end to end (data, both models, report, exit status)."""

import json

import pytest

from jax_fp8.demo.__main__ import main


@pytest.mark.parametrize("recipe", ["delayed", "current", "block", "mxfp8"])
def test_demo_smoke(tmp_path, recipe):
  # main raises SystemExit(1) if FP8 strays from BF16's validation loss
  main(["--preset", "smoke", "--recipe", recipe, "--out", str(tmp_path)])
  res = json.loads((tmp_path / "results.json").read_text())
  assert res["recipe"] == recipe
  assert (tmp_path / "loss_curves.png").stat().st_size > 0
  assert set(res["runs"]) == {"fp8", "bf16"} and res["passed"]
  for run in res["runs"].values():
    assert len(run["train_losses"]) == 10 and run["val_loss"] < run["train_losses"][0]


def test_demo_split_runs(tmp_path, capsys):
  # --only trains one run; the second job compares with the first's file when the settings match
  out = str(tmp_path)
  main(["--preset", "smoke", "--only", "fp8", "--out", out])
  assert not (tmp_path / "results.json").exists()
  assert "run again with --only bf16" in capsys.readouterr().out
  main(["--preset", "smoke", "--only", "bf16", "--seed", "1", "--out", out])  # another seed
  assert not (tmp_path / "results.json").exists()
  assert "run again with --only fp8" in capsys.readouterr().out
  main(["--preset", "smoke", "--only", "bf16", "--out", out])
  res = json.loads((tmp_path / "results.json").read_text())
  fp8 = json.loads((tmp_path / "run-fp8.json").read_text())
  assert res["runs"]["fp8"]["train_losses"] == fp8["train_losses"] and res["passed"]
  assert res["seed"] == 0 and set(res["runs"]) == {"fp8", "bf16"}
