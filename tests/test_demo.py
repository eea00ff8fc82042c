"""The main job's smallest preset, end to end (data, both models, report, exit status)."""

import json

from jax_fp8.demo.__main__ import main


def test_demo_smoke(tmp_path):
  main(["--preset", "smoke", "--out", str(tmp_path)])  # raises SystemExit(1) if FP8 strays
  res = json.loads((tmp_path / "results.json").read_text())
  assert (tmp_path / "loss_curves.png").stat().st_size > 0
  assert set(res["runs"]) == {"fp8", "bf16"} and res["passed"]
  for run in res["runs"].values():
    assert len(run["train_losses"]) == 10 and run["val_loss"] < run["train_losses"][0]
