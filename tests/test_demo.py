"""The main job's smallest preset, end to end (data, both models, report, exit status)."""

import json

import pytest

from jax_fp8.demo.__main__ import main


@pytest.mark.parametrize("recipe", ["delayed", "block"])
def test_demo_smoke(tmp_path, recipe):
  # main raises SystemExit(1) if FP8 strays from BF16's validation loss
  main(["--preset", "smoke", "--recipe", recipe, "--out", str(tmp_path)])
  res = json.loads((tmp_path / "results.json").read_text())
  assert res["recipe"] == recipe
  assert (tmp_path / "loss_curves.png").stat().st_size > 0
  assert set(res["runs"]) == {"fp8", "bf16"} and res["passed"]
  for run in res["runs"].values():
    assert len(run["train_losses"]) == 10 and run["val_loss"] < run["train_losses"][0]
