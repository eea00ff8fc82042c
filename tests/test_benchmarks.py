"""The benchmark suite's quick mode runs end to end and writes every case (so the suite does
not rot between runs on a GPU)."""

import argparse
import dataclasses
import functools
import json
import pathlib
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

from benchmarks import (data_parallel, demo_step, inference, model_step, moe,  # noqa: E402
                        moe_layer, profiling, run, timing, train_step)
from jax_fp8.demo.model import Transformer  # noqa: E402


def test_quick_suite(tmp_path):
  out = tmp_path / "bench.json"
  run.main(["--quick", "--out", str(out)])
  res = json.loads(out.read_text())
  cases = {r["case"] for r in res["rows"]}
  assert cases == {"quantize", "quantize_delayed", "jnp quantize", "cast_transpose",
                   "cast_transpose+dbias", "cast_transpose+dbias of 3 parts",
                   *(f"{source}_{kind}cast_transpose"
                     for source in ("swiglu", "swiglu_grad", "gelu", "gelu_grad", "rmsnorm",
                                    "layernorm") for kind in ("", "group_")),
                   "mxfp8_quantize rowwise", "mxfp8_quantize both",
                   *(f"nvfp4_quantize {case}{given}"
                     for case in ("rowwise", "rowwise sr", "both", "both rht+sr")
                     for given in ("", ", amax given")),
                   "gemm", "linear fwd+bwd", "block train step",
                   "group_quantize", "block_quantize", "group_cast_transpose", "block gemm",
                   "block gemm 1x128", "block gemm kernels", "block gemm 1x128 kernels",
                   "block linear fwd+bwd", "pdl chain", "linear stack peak memory",
                   "linear crossover"}
  assert all(r["us"] > 0 for r in res["rows"] if "us" in r)
  mem = next(r for r in res["rows"] if r["case"] == "linear stack peak memory")
  assert mem["fp8_MiB"] > 0 and mem["bf16_MiB"] > 0
  assert res["ceilings"]["copy_TBps"] > 0


def test_per_call_takes_more_calls_until_resolved():
  """device_time's difference method on made-up loop timings: a call of 0.5 us against runs
  that spread by 2 us (two calls faster than one, as on the H200 at the quick shapes) is
  resolved with 1 + 8 calls; a call that never stands out raises."""
  asked = []

  def times(calls):  # seconds per iteration of each run; the median's noise in the middle run
    asked.append(calls)
    base = 10e-6 + 0.5e-6 * (calls - 1)
    return [base - 1e-6, base - (1e-6 if calls == 2 else 0.0), base + 1e-6]

  assert abs(timing.per_call(times) - 0.5e-6) < 1e-12
  assert asked == [1, 2, 3, 5, 9]
  with pytest.raises(RuntimeError, match=r"33 calls per iteration .* not slower than one"):
    timing.per_call(lambda calls: [10e-6 + 1e-9 * calls, 12e-6, 8e-6])


def test_train_step_run_goes_on_past_a_variant_out_of_memory(tmp_path, capsys):
  """A variant whose step runs out of the device's memory gets a row with XLA's message and no
  figures; the others are timed and compared with the peers that ran; any other error
  propagates."""
  p = argparse.ArgumentParser()
  train_step.add_arguments(p, {"bf16": {}, "fp8": {}, "big": {}}, ["big", "bf16", "fp8"],
                           steps=1, profile_steps=1, out="fake")
  args = p.parse_args(["--out", str(tmp_path / "fake.json")])
  oom = "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 32.84GiB"

  def measure(variant, profile_steps):
    if variant == "big":
      raise jax.errors.JaxRuntimeError(oom + "\nmore of XLA's message")
    ms = {"bf16": 2.0, "fp8": 1.0}[variant]
    return {"step_ms": ms, "tokens_per_s": 1.0, "compile_s": 0.0, "temp_bytes": 0, "loss": 1.0}

  res = train_step.run(p, args, measure, {}, "fake", peers=("bf16", "big"))
  assert [r["variant"] for r in res["rows"]] == ["big", "bf16", "fp8"]
  assert res["rows"][0]["error"] == oom and "step_ms" not in res["rows"][0]
  assert res["rows"][2]["speedup_vs_bf16"] == 2.0 and res["rows"][2]["speedup_vs_big"] is None
  assert json.loads((tmp_path / "fake.json").read_text())["rows"][0]["error"] == oom
  assert capsys.readouterr().out.count(oom) == 2  # its line as it ran, and in the table
  with pytest.raises(jax.errors.JaxRuntimeError, match="INTERNAL"):
    train_step.run(p, args, lambda v, _: (_ for _ in ()).throw(
        jax.errors.JaxRuntimeError("INTERNAL: a failed kernel")), {}, "fake", peers=())


@pytest.mark.parametrize("recipe", ["delayed", "nvfp4"])
def test_data_parallel_benchmark(tmp_path, recipe):
  """The multi-device training benchmark end to end on two of the virtual CPU devices,
  whatever the default backend (delayed scaling threads its scale rings; NVFP4 reduces its
  amaxes over the data axis before quantizing and draws each step's key)."""
  out = tmp_path / "dp.json"
  res = data_parallel.main(["--preset", "smoke", "--steps", "4", "--max-devices", "2",
                            "--platform", "cpu", "--recipe", recipe, "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(res))
  assert [r["devices"] for r in res["rows"]] == [1, 2]
  assert res["rows"][1]["global_batch"] == 2 * res["rows"][0]["global_batch"]
  for r in res["rows"]:
    assert r["fp8_step_ms"] > 0 and r["bf16_step_ms"] > 0
  assert res["rows"][0]["fp8_scaling_efficiency"] == 1.0
  assert res["env"]["platform"] == "cpu" and res["env"]["device_count"] == 8
  assert res["attention"] == "xla"  # of the CPU devices it ran on, whatever the backend


def test_command_buffer_benchmark(tmp_path):
  """The CUDA-graph comparison end to end (on CPU XLA ignores the flags: only the plumbing and
  the bit comparison run): the first child dumps the autotuning results, and every leaf of
  both steps is compared; two modes of the four (each child is a process of its own)."""
  from benchmarks import command_buffer
  out = tmp_path / "cb.json"
  res = command_buffer.main(["--quick", "--steps", "2", "--modes", "with_custom_calls",
                             "--out", str(out)])
  assert [r["mode"] for r in res["rows"]] == ["off", "with_custom_calls"]
  assert res["rows"][0]["autotune_flag"] == "--xla_gpu_dump_autotune_results_to"
  assert res["leaves"]["fp8"] > res["leaves"]["bf16"] > 0  # the FP8 step adds its rings
  assert all(r["bit_identical_to_off"] and r["differing_leaves"] == [] and r["fp8_step_ms"] > 0
             and r["bf16_step_ms"] > 0 for r in res["rows"])


def test_step_profile(tmp_path):
  """The step profile end to end on the CPU (its threads' times add up by kind), and the self
  times of nested events."""
  from benchmarks import step_profile
  res = step_profile.main(["--quick", "--steps", "2", "--out", str(tmp_path / "sp.json")])
  assert res["rows"] and json.loads((tmp_path / "sp.json").read_text())["recipe"] == "delayed"
  for r in res["rows"]:
    assert abs(sum(r["kinds_us"].values()) - r["us_per_step"]) <= 1e-6 * r["us_per_step"] + 1e-9
  spans = [("t", 0.0, 10.0, "parent"), ("t", 2.0, 3.0, "a"), ("t", 6.0, 2.0, "b"),
           ("t", 10.0, 2.0, "next"), ("t", 11.0, 3.0, "overlaps next"),
           ("u", 1.0, 4.0, "other thread")]
  assert profiling.self_times(spans) == [("t", "parent", 5.0), ("t", "a", 3.0),
                                            ("t", "b", 2.0), ("t", "next", 2.0),
                                            ("t", "overlaps next", 2.0),
                                            ("u", "other thread", 4.0)]
  # A span launched early through PDL, inside the one before it, counts from that one's end;
  # children overlapping each other cover their parent once.
  assert profiling.self_times([("t", 0.0, 100.0, "p"), ("t", 0.0, 80.0, "x"),
                                  ("t", 20.0, 80.0, "y")]) == [("t", "p", 0.0), ("t", "x", 80.0),
                                                               ("t", "y", 20.0)]
  assert profiling.self_times([("t", 0.0, 10.0, "gemm"), ("t", 8.0, 5.0, "quantize"),
                                  ("t", 9.0, 2.0, "inside quantize")]) == [
      ("t", "gemm", 10.0), ("t", "quantize", 2.0), ("t", "inside quantize", 1.0)]
  # Two steps: the longest gap (15) is the host's round trip between them, nested and
  # overlapping events leave no gap.
  spans = [("t", 0.0, 10.0, "a"), ("t", 1.0, 2.0, "nested"), ("t", 12.0, 3.0, "b"),
           ("t", 30.0, 1.0, "c"), ("t", 30.5, 1.5, "overlapping"), ("t", 34.0, 1.0, "d")]
  assert profiling.idle_us(spans, steps=2) == (2.0 + 2.0) / 2
  assert profiling.idle_us(spans, steps=1) == 2.0 + 15.0 + 2.0
  assert all(r["idle_us_per_step"] >= 0 for r in res["rows"])
  assert profiling.kind("void jax_fp8::cast_transpose_kernel<...>") == "jax_fp8 quantize"
  assert profiling.kind("sm90_xmma_gemm_e4m3e4m3_bf16") == "GEMM"


def test_model_step_benchmark(tmp_path):
  """The whole-model benchmark end to end on its tiny model: a row per variant with the
  figures the issue asks for, the ratios against both peers, a profile where asked, and the
  JSON as returned."""
  out = tmp_path / "model_step.json"
  variants = ["bf16", "flax_fp8", "delayed_shared_input", "block_fused_norm_mlp",
              "current_fused_norm_mlp", "nvfp4_shared_input", "delayed_split_qkv_fused_norm_mlp"]
  res = model_step.main(["--quick", "--steps", "1", "--windows", "1", "--variants", *variants,
                         "--profile", "delayed_shared_input", "--profile-steps", "1",
                         "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(res))
  assert [r["variant"] for r in res["rows"]] == variants
  for r in res["rows"]:
    assert r["step_ms"] > 0 and r["compile_s"] > 0 and r["temp_bytes"] > 0
    assert r["peak_bytes"] >= r["temp_bytes"] and r["tokens_per_s"] > 0
    assert 0 < r["loss"] < 10  # cross-entropy over a 512-token vocabulary: log 512 = 6.2 at start
    assert r["speedup_vs_bf16"] == res["rows"][0]["step_ms"] / r["step_ms"]
    assert r["speedup_vs_flax_fp8"] == res["rows"][1]["step_ms"] / r["step_ms"]
    assert ("profile" in r) == (r["variant"] == "delayed_shared_input")
  assert res["rows"][2]["profile"][0]["us_per_step"] > 0


def test_model_step_microbatches(tmp_path):
  """With microbatches, the variant whose kernels are cast once per step trains as the one
  quantizing them per microbatch (the same loss: the same bits); BF16's model, which has no
  jax_fp8 state to carry through the microbatches, trains beside them."""
  variants = ["bf16", "delayed_fused_norm_mlp", "delayed_fused_norm_mlp_cast_kernels"]
  res = model_step.main(["--quick", "--microbatches", "2", "--steps", "1", "--windows", "1",
                         "--variants", *variants, "--out", str(tmp_path / "model_step.json")])
  assert res["config"]["microbatches"] == 2
  losses = {r["variant"]: r["loss"] for r in res["rows"]}
  assert all(0 < v < 10 for v in losses.values())
  assert losses["delayed_fused_norm_mlp_cast_kernels"] == losses["delayed_fused_norm_mlp"]


def test_model_step_moe(tmp_path):
  """With --moe-experts the model-step benchmark times a MoE decoder's train step: MoeMlp under
  delayed scaling beside a capacity-factor peer (Flax's FP8 einsums; the BF16 peer is the same
  module, tests/test_capacity_moe.py): the JSON as returned, finite losses, TFLOP/s of the
  stated FLOPs, the speedups over the fastest peer that ran, the peer's dropped assignments;
  one load-balancing loss (and one count of dropped assignments) a layer, stacked by nn.scan.
  (FP8's loss against its BF16 twin's at step 0: tests/test_demo.py's MoE preset.)"""
  out = tmp_path / "model_step.json"
  res = model_step.main(["--quick", "--moe-experts", "4", "--steps", "1", "--windows", "1",
                         "--variants", "delayed", "flax_fp8_capacity", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(res))
  assert res["config"]["moe_experts"] == 4 and res["config"]["moe_top_k"] == 2
  assert res["config"]["moe_capacity_factor"] == 1.25 and res["fastest_peer"] == "flax_fp8_capacity"
  rows = {r["variant"]: r for r in res["rows"]}
  assert list(rows) == ["delayed", "flax_fp8_capacity"]
  s = dataclasses.replace(model_step.QUICK, moe_experts=4)
  # 3 x the forward's 2 x tokens x (layers x (q k v o + attention + router + 2 SwiGLU experts)
  # + the LM head), d_model 256, ffn 512, seq 128, batch 2, vocab 512
  assert res["step_flops"] == 3 * 2 * 256 * (s.layers * (4 * 256**2 + 2 * 128 * 256 + 256 * 4
                                                         + 2 * 3 * 256 * 512) + 256 * 512)
  for r in rows.values():
    assert 0 < r["loss"] < 10 and r["step_ms"] > 0
    assert r["TFLOPs"] == pytest.approx(res["step_flops"] / r["step_ms"] / 1e9)
    assert r["speedup_vs_bf16"] is None and "speedup_vs_flax_fp8" not in r
    assert r["speedup_vs_fastest_peer"] == rows["flax_fp8_capacity"]["step_ms"] / r["step_ms"]
  peer = rows["flax_fp8_capacity"]
  assert peer["routed_assignments"] == s.layers * s.batch * s.seq * s.moe_top_k
  for when in ("first", "last"):
    assert 0 <= peer[f"dropped_{when}"] < peer["routed_assignments"] / 2
  assert "dropped_first" not in rows["delayed"]
  model = Transformer(model_step.model_config(s, "bf16_capacity"))
  tokens = jax.ShapeDtypeStruct((s.batch, s.seq), jnp.int32)
  variables = jax.eval_shape(model.init, jax.random.key(1), tokens)
  sown = jax.eval_shape(functools.partial(model.apply, mutable=["intermediates"]), variables,
                        tokens)[1]["intermediates"]["layers"]["moe"]
  assert jax.tree.map(lambda v: v.shape, sown) == {
      "load_balancing_loss": ((s.layers,),), "dropped_assignments": ((s.layers,),)}


@pytest.mark.parametrize("argv,message", [
    (["--quick", "--moe-experts", "4", "--variants", "block"], "no MoE form of .'block'."),
    (["--quick", "--moe-experts", "2", "--moe-top-k", "3"], "--moe-top-k must be in .1, "),
    (["--moe-top-k", "1"], "--moe-top-k, --moe-hidden and --moe-capacity-factor apply with "
                           "--moe-experts"),
    (["--moe-capacity-factor", "2"], "--moe-top-k, --moe-hidden and --moe-capacity-factor "
                                     "apply with --moe-experts"),
    (["--quick", "--moe-experts", "4", "--moe-capacity-factor", "0"],
     "--moe-capacity-factor must be > 0, got 0.0"),
    (["--quick", "--variants", "bf16", "bf16_capacity"],
     r"\['bf16_capacity'\] \(the capacity-factor MoE\) run with --moe-experts"),
    (["--heads", "0"], "--heads must be >= 1, got 0"),
    (["--layers", "-1"], "--layers must be >= 1, got -1"),
    (["--quick", "--microbatches", "0"], "--microbatches must be >= 1, got 0"),
    (["--d-model", "100", "--heads", "8"], r"--d-model \(100\) must be a multiple of --heads"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
])
def test_model_step_bad_flags(capsys, argv, message):
  """Bad sizes and counts stop the model-step benchmark at its command line, before a model
  is built, with the flag named."""
  with pytest.raises(SystemExit):
    model_step.main(argv)
  assert re.search(message, capsys.readouterr().err)


def test_demo_step_benchmark(tmp_path):
  """The demo-step benchmark end to end on the demo's smoke preset: a row per variant, the
  ratio against BF16, a profile where asked, the JSON as returned; on a CPU, whose GEMMs sum in
  f32 either way, the fast-accumulation variant's loss after a step with a learning rate above
  0 (the schedule's first is 0) is exact delayed scaling's."""
  out = tmp_path / "demo_step.json"
  variants = ["bf16", "delayed", "delayed_fast_fprop", "block"]
  res = demo_step.main(["--preset", "smoke", "--steps", "2", "--windows", "1", "--variants",
                        *variants, "--profile", "delayed", "--profile-steps", "1",
                        "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(res))
  assert res["preset"]["name"] == "smoke" and [r["variant"] for r in res["rows"]] == variants
  for r in res["rows"]:
    assert r["step_ms"] > 0 and r["compile_s"] > 0 and r["tokens_per_s"] > 0
    assert 0 < r["loss"] < 10  # next-byte cross-entropy: log 256 = 5.5 at the start
    assert r["speedup_vs_bf16"] == res["rows"][0]["step_ms"] / r["step_ms"]
    assert ("profile" in r) == (r["variant"] == "delayed")
  assert res["rows"][1]["profile"][0]["us_per_step"] > 0
  if jax.default_backend() == "cpu":
    assert res["rows"][1]["loss"] == res["rows"][2]["loss"]


def test_demo_step_moe_preset_rejects_other_recipes(capsys):
  """The demo-step benchmark refuses a variant the MoE preset's model has no layer for, before
  building any, with the model's rule."""
  with pytest.raises(SystemExit):
    demo_step.main(["--preset", "moe_smoke", "--variants", "bf16", "mxfp8"])
  assert "--variants mxfp8 with --preset moe_smoke: moe_experts > 0" in capsys.readouterr().err


def test_inference_benchmark(tmp_path):
  """The FP8-weights inference benchmark end to end at its quick shapes."""
  out = tmp_path / "inference.json"
  res = inference.main(["--quick", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(res))
  assert [r["shape"][0] for r in res["rows"]] == inference.QUICK_TOKENS
  for r in res["rows"]:
    for name in inference.variants():
      assert r[f"{name}_us"] > 0 and r[f"{name}_vs_bf16"] == r["bf16_us"] / r[f"{name}_us"]
      assert 0.5 < r[f"{name}_weight_bytes_vs_bf16"] < 0.51


def test_moe_benchmark(tmp_path):
  """The grouped-GEMM MoE benchmark end to end at its quick shapes (the DeepSeek-V3-like
  case's down projection, both routings, the three GEMMs): a row each with its FP8 rate, the
  dense limits, the BF16 ragged-dot peer and the ratios; the routings' groups padded to whole
  16-row blocks within the capacity; the JSON as returned."""
  out = tmp_path / "moe.json"
  res = moe.main(["--quick", "--cases", "deepseek_v3", "--linears", "down", "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(res))
  assert [(r["linear"], r["routing"], r["gemm"]) for r in res["rows"]] == [
      ("down", routing, gemm) for gemm in moe.GEMMS for routing in moe.ROUTINGS]
  for r in res["rows"]:
    assert "error" not in r and r["us"] > 0 and r["dense_fp8_TFLOPs"] > 0
    assert r["TFLOPs"] == pytest.approx(2 * np.prod(r["shape"]) / r["us"] / 1e6)
    assert r["of_dense_fp8"] == r["TFLOPs"] / r["dense_fp8_TFLOPs"]
    assert r["bf16_path"] in ("dense", "ragged-dot", "cudnn")
    assert r["vs_bf16"] == pytest.approx(r["bf16_us"] / r["us"])
    assert ("vs_balanced" in r) == (r["routing"] == "skewed")
  for case, routings in res["routing"].items():
    top_k = res["config"]["cases"][case]["top_k"]
    for g in routings.values():
      padded = np.array(g["padded"])
      assert sum(g["sizes"]) == g["rows"] == moe.QUICK_TOKENS * top_k
      assert np.all(padded % 16 == 0) and np.all(padded - g["sizes"] < 16)
      assert padded.sum() <= g["capacity"]
    assert routings["skewed"]["max_group"] > routings["balanced"]["max_group"]


def test_moe_layer_benchmark(tmp_path):
  """The MoE layer benchmark end to end at the quick Mixtral-like case: jax_fp8's MoeMlp, the
  ragged_dot twin (XLA's path recorded) and the BF16 capacity peer (its dropped assignments;
  the FP8 one's layer runs in test_model_step_moe): TFLOP/s of the routed tokens' expert FLOPs,
  the speedups over BF16 and the fastest peer, the JSON as returned."""
  out = tmp_path / "moe_layer.json"
  variants = ["delayed", "bf16", "bf16_capacity"]
  res = moe_layer.main(["--quick", "--cases", "mixtral", "--variants", *variants,
                        "--out", str(out)])
  assert json.loads(out.read_text()) == json.loads(json.dumps(res))
  rows = {r["variant"]: r for r in res["rows"]}
  assert list(rows) == variants and all("error" not in r for r in rows.values())
  case = moe_layer.QUICK_CASES["mixtral"]  # d 128, ffn 64, 4 experts, top 2; 64 tokens
  flops = 3 * 2 * 64 * 2 * 3 * 128 * 64
  assert res["config"]["flops"] == {"mixtral": flops} and res["config"]["seq"] == 32
  fastest = min(("bf16", "bf16_capacity"), key=lambda v: rows[v]["us"])
  assert res["fastest_peer"] == {"mixtral": fastest}
  for r in rows.values():
    assert r["TFLOPs"] == pytest.approx(flops / r["us"] / 1e6)
    assert r["speedup_vs_bf16"] == rows["bf16"]["us"] / r["us"]
    assert r["speedup_vs_fastest_peer"] == rows[fastest]["us"] / r["us"]
    assert r["speedup_vs_bf16_cudnn"] is None  # not run
  assert rows["bf16"]["path"] in ("dense", "ragged-dot", "cudnn")
  peer = rows["bf16_capacity"]  # C = 1.25 x 32 x 2 / 4 of each 32-token group
  assert peer["slots"] == 20 and peer["routed_assignments"] == 64 * case.top_k
  assert 0 <= peer["dropped_assignments"] < 64


@pytest.mark.parametrize("argv,message", [
    (["--quick", "--tokens", "48"], r"--tokens \(48\) must be a positive multiple of --seq "
                                    r"\(32\)"),
    (["--quick", "--capacity-factor", "0"], "--capacity-factor must be > 0, got 0.0"),
    (["--quick", "--variants", "bf16_cudnn"], "bf16_cudnn .* runs on a GPU only"),
])
def test_moe_layer_bad_flags(capsys, argv, message):
  """Bad flags stop the MoE layer benchmark before anything is built, the flag named."""
  if "bf16_cudnn" in argv and jax.default_backend() == "gpu":
    pytest.skip("bf16_cudnn runs on a GPU")
  with pytest.raises(SystemExit):
    moe_layer.main(argv)
  assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("gemm", moe.GEMMS)
def test_moe_peer_computes_the_same_gemm(gemm):
  """Each FP8 grouped GEMM of the MoE benchmark and its BF16 ragged-dot peer compute the same
  product (within the FP8 operands' rounding, far below a wrong layout's error), zero on the
  padding rows and past the groups."""
  case = moe.QUICK_CASES["deepseek_v3"]
  k, n = case.linear("gate_up")
  groups = moe.Groups(moe.route("skewed", moe.QUICK_TOKENS, case, 0),
                      moe.capacity(moe.QUICK_TOKENS, case))
  spec = moe.gemm_spec(gemm, k, n, int(groups.sizes.sum()), jnp.float32)
  fp8_fn, fp8_args, bf16_fn, bf16_args = moe.operands(spec, k, n, groups)
  got = np.asarray(jax.jit(fp8_fn)(*fp8_args), np.float32)
  want = np.asarray(jax.jit(bf16_fn)(*bf16_args), np.float32)
  if gemm != "wgrad":  # b_scale's per-expert steps (the peer's weights are unscaled)
    scale = np.repeat(np.append(np.asarray(fp8_args[2]), 1.0),
                      np.append(groups.padded, groups.capacity - groups.padded.sum()))
    want = want * scale[:, None]
    assert np.all(got[~groups.real_rows()] == 0)
  assert np.all(np.isfinite(got))
  assert np.linalg.norm(got - want) <= 0.15 * np.linalg.norm(want)


def test_no_module_imports_an_entry_point():
  """The benchmarks and the demo share their model, train step and helpers through modules
  that are no entry point: none imports a module with a ``main()``, nor ``__main__``."""
  import ast
  root = pathlib.Path(__file__).resolve().parent.parent
  files = {f: package for package, folder in (("benchmarks", "benchmarks"),
                                              ("jax_fp8.demo", "jax_fp8/demo"))
           for f in sorted((root / folder).glob("*.py"))}
  entry = {f"{package}.{f.stem}" for f, package in files.items()
           if f.stem == "__main__" or re.search(r"^def main\(", f.read_text(), re.M)}
  assert {"benchmarks.run", "benchmarks.model_step", "jax_fp8.demo.__main__"} <= entry
  for f, package in files.items():
    for node in ast.walk(ast.parse(f.read_text())):
      if isinstance(node, ast.ImportFrom):
        base = (package + (f".{node.module}" if node.module else "")) if node.level else node.module
        names = {base} | {f"{base}.{a.name}" for a in node.names}
      elif isinstance(node, ast.Import):
        names = {a.name for a in node.names}
      else:
        continue
      assert not names & entry, f"{f.name} imports the entry point {names & entry}"
