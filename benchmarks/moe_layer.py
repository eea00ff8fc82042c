"""A mixture-of-experts layer's forward and backward: jax_fp8's MoeMlp against BF16 ragged_dot and
the capacity-factor peers.

Issue 47's item 4, the layer (target: fwd+bwd >= 1.6x BF16 ``ragged_dot``), at the cases of
``benchmarks.moe_cases`` (Mixtral-like and DeepSeek-V3-like): one layer's forward and backward
(``jax.vjp`` of its output, pulled back with a fixed bf16 cotangent: the gradients of the input,
the parameters and the FP8 state), timed on the device (``timing.device_time``). Variants:

- ``delayed``, ``current``: ``jax_fp8.flax.MoeMlp`` under ``DelayedScaling()`` /
  ``CurrentScaling()`` (dropless; the experts' linears grouped FP8 GEMMs);
- ``bf16``: its BF16 twin ``jax_fp8.demo.twins.Bf16MoeMlp`` (``jax.lax.ragged_dot``) as XLA
  compiles it by default; on a GPU ``bf16_cudnn`` too: the same with XLA's cuDNN grouped GEMM
  (``moe_cases.CUDNN_RAGGED_DOT``). Each records the path XLA took (``path``); a dense rewrite
  (every row against every expert) whose work would take over ``--peer-max-ms`` a call at
  this run's BF16 GEMM rate is not timed (``skipped``), nor ``bf16_cudnn`` where XLA took
  ``bf16``'s path with the option too;
- ``bf16_capacity``, ``flax_fp8_capacity``: ``jax_fp8.demo.capacity_moe.CapacityMoeMlp``, the
  einsum MoE that drops what overflows an expert's slots, in BF16 / its experts' two einsums
  through Flax's ``Fp8Einsum``; capacity factor ``--capacity-factor``, each ``--seq`` tokens a
  routing group.

Every variant has the same parameters (one seed; SwiGLU experts of ``ffn``, router in f32,
top-k weights normalized), in ``--param-dtype`` (bfloat16 by default: with f32 master weights
the DeepSeek-V3-like layer's 11 G parameters and their gradients alone take 90 GB), compute in
bf16, on x [tokens / seq, seq, d_model] bf16 N(0, 1). With 16384 tokens that case needs about
70 GB of device memory (parameters, two calls' gradients in the timing loop, activations):
an H200. TFLOP/s count the routed tokens' expert FLOPs, the same for every variant: three
GEMMs (forward, dgrad, wgrad) of 2 x tokens x top_k x 3 x d_model x ffn FLOPs each (gate, up
and down); the router, the capacity peers' dispatch and combine einsums and their empty
slots are not counted, nor their dropped assignments left out.

    python -m benchmarks.moe_layer [--tokens 16384] [--seq 2048] [--cases mixtral deepseek_v3]
        [--variants NAME ...] [--capacity-factor 1.25] [--param-dtype bfloat16|float32]
        [--peer-max-ms 500] [--quick] [--out PATH]

Writes ``benchmarks/results/<gpu>-moe_layer.json`` (or ``--out``): ``env``, ``ceilings`` (copy
bandwidth, BF16 GEMM rate), ``config`` (tokens, seq, cases, capacity factor, parameter dtype,
peer limit, flops: each case's counted FLOPs a call), ``fastest_peer`` (per case, the fastest of
the peers timed) and ``rows``, one per case and variant: ``case``, ``variant``, ``us``,
``TFLOPs``, ``speedup_vs_bf16`` and ``speedup_vs_bf16_cudnn`` (that ragged-dot peer's time over
this one's; None where it was not timed), ``speedup_vs_fastest_peer`` (likewise against the
fastest of ``bf16``, ``bf16_cudnn``, ``bf16_capacity`` and ``flax_fp8_capacity``: the target's
BF16 ragged_dot is the faster of the first two), ``path`` and ``skipped`` (the ragged-dot
peers), ``error`` (a variant that failed, e.g. out of memory), and for the capacity peers
``slots`` (C, each expert's a group), ``dropped_assignments`` and ``routed_assignments`` (of
their forward on these inputs). Exits 1 if a jax_fp8 variant failed (after writing the JSON).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp

import jax_fp8
import jax_fp8.flax
from jax_fp8.demo.capacity_moe import CAPACITY_FACTOR, DROPPED, CapacityMoeMlp, expert_capacity
from jax_fp8.demo.train import INTERMEDIATES, sown
from jax_fp8.demo.twins import Bf16MoeMlp
from jax_fp8.moe_routing import permuted_rows

from .common import ceilings, environment
from .moe_cases import (CASES, CUDNN_RAGGED_DOT, QUICK_CASES, QUICK_TOKENS, TOKENS, Case,
                        error_text, finish, time_ragged)
from .timing import device_time
from .train_step import FASTEST, add_speedups

FP8 = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.CurrentScaling()}
RAGGED = {"bf16": None, "bf16_cudnn": CUDNN_RAGGED_DOT}  # name -> XLA's compiler options
CAPACITY = {"bf16_capacity": False, "flax_fp8_capacity": True}  # name -> Fp8Einsum experts
VARIANTS = (*FP8, *RAGGED, *CAPACITY)
PEERS = (*RAGGED, *CAPACITY)
SEQ, QUICK_SEQ = 2048, 32


def layer(variant: str, case: Case, capacity_factor: float, param_dtype):
  """The Flax module of ``variant`` at ``case``'s sizes (SwiGLU experts, bf16 compute)."""
  kw = dict(activation="swiglu", dtype=jnp.bfloat16, param_dtype=param_dtype)
  sizes = (case.experts, case.top_k, case.ffn)
  if variant in FP8:
    return jax_fp8.flax.MoeMlp(*sizes, recipe=FP8[variant], **kw)
  if variant in RAGGED:
    return Bf16MoeMlp(*sizes, **kw)
  return CapacityMoeMlp(*sizes, capacity_factor=capacity_factor, fp8=CAPACITY[variant], **kw)


def forward_backward(module):
  """``(params, collections, x, dy) -> the gradients of (params, collections, x)``: the
  module's forward, then its backward pulled back from the cotangent ``dy``."""
  def run(params, collections, x, dy):
    _, pullback = jax.vjp(lambda p, c, x: module.apply({"params": p, **c}, x),
                          params, collections, x)
    return pullback(dy)
  return run


def layer_flops(case: Case, tokens: int) -> int:
  """The routed tokens' expert FLOPs of one forward and backward: 3 GEMMs x 2 x tokens x top_k
  x (d_model x 2 ffn + ffn x d_model)."""
  return 3 * 2 * tokens * case.top_k * 3 * case.d_model * case.ffn


def dropped(module, variables, x) -> int:
  """The assignments a capacity peer dropped in its forward on x."""
  _, state = jax.jit(lambda v, x: module.apply(v, x, mutable=[INTERMEDIATES]))(variables, x)
  return int(sum(jnp.sum(v) for v in sown(state[INTERMEDIATES], DROPPED)))


def bench_variant(variant: str, case: Case, x, dy, s: argparse.Namespace, rate: float,
                  timed_path: str | None) -> dict:
  """One row: ``variant``'s figures at ``case`` (``us``, ``TFLOPs``; a ragged peer's path, a
  capacity peer's dropped assignments; ``skipped`` or ``error``). ``rate``: the BF16 GEMM
  rate that estimates a dense rewrite's time; ``timed_path``: the path ``bf16`` was timed on."""
  module = layer(variant, case, s.capacity_factor, jnp.dtype(s.param_dtype))
  tokens = x.shape[0] * x.shape[1]
  flops = layer_flops(case, tokens)
  row = {}
  try:
    # the variables alone, the forward not run (at the DeepSeek-V3-like case its activations
    # would sit beside the parameters; at the quick shapes its compilation takes longest)
    variables = dict(module.lazy_init(jax.random.key(0), jax.ShapeDtypeStruct(x.shape, x.dtype)))
    params = variables.pop("params")
    args = (params, variables, x, dy)
    if variant in RAGGED:  # the dense rewrite runs every padded row against every expert
      rows = permuted_rows(tokens, case.top_k, case.experts)
      row.update(time_ragged(forward_backward(module), args, RAGGED[variant], flops,
                             flops * case.experts * rows / (tokens * case.top_k), rate,
                             s.peer_max_ms / 1e3, timed_path))
      return row
    if variant in CAPACITY:
      row.update(slots=expert_capacity(x.shape[1], case.top_k, case.experts, s.capacity_factor),
                 dropped_assignments=dropped(module, {"params": params, **variables}, x),
                 routed_assignments=tokens * case.top_k)
    t = device_time(forward_backward(module), *args)
    row.update(us=t * 1e6, TFLOPs=flops / t / 1e12)
  except Exception as e:  # noqa: BLE001 (out of memory, an unsupported path: recorded)
    row["error"] = error_text(e)
  return row


def print_row(r: dict) -> None:
  """One table line: the case, the variant, its time and rate, its speedups, and its notes
  (the path XLA took, the dropped assignments, why it was skipped or failed)."""
  ratio = lambda v: "-" if v is None else f"{v:.3f}x"  # noqa: E731
  note = r.get("error") or r.get("skipped") or (
      f"path {r['path']}" if "path" in r else
      f"{r['dropped_assignments']} of {r['routed_assignments']} dropped (C {r['slots']})"
      if "slots" in r else "")
  print(f"{r['case']:<12}{r['variant']:<20}"
        + (f"{r['us']:12.1f}{r['TFLOPs']:9.3g}" if "us" in r else f"{'-':>12}{'-':>9}")
        + "".join(f"{ratio(r[f'speedup_vs_{p}']):>10}" for p in (*RAGGED, FASTEST)) + f"  {note}",
        flush=True)


def run(cases: dict, s: argparse.Namespace, rate: float) -> tuple[dict, list[dict]]:
  """The rows of every case and variant, and each case's fastest peer."""
  rows, fastest = [], {}
  for name, case in cases.items():
    shape = (s.tokens // s.seq, s.seq, case.d_model)
    x = jax.random.normal(jax.random.key(1), shape, jnp.bfloat16)
    dy = jax.random.normal(jax.random.key(2), shape, jnp.bfloat16)
    case_rows = []
    for v in s.variants:
      timed = next((r.get("path") for r in case_rows if r["variant"] == "bf16"), None)
      case_rows.append({"case": name, "variant": v,
                        **bench_variant(v, case, x, dy, s, rate, timed)})
    fastest[name] = add_speedups(case_rows, tuple(RAGGED), PEERS, time="us")
    for r in case_rows:
      print_row(r)
    rows += case_rows
  return fastest, rows


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--tokens", type=int, help=f"tokens a call (default {TOKENS}; --quick: "
                 f"{QUICK_TOKENS}), a multiple of --seq")
  p.add_argument("--seq", type=int, help=f"tokens a routing group of the capacity peers "
                 f"(default {SEQ}; --quick: {QUICK_SEQ})")
  p.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
  p.add_argument("--variants", nargs="+", choices=VARIANTS,
                 help="default: all (bf16_cudnn on a GPU only)")
  p.add_argument("--capacity-factor", type=float, default=CAPACITY_FACTOR,
                 help=f"the capacity peers' (default {CAPACITY_FACTOR})")
  p.add_argument("--param-dtype", choices=["bfloat16", "float32"], default="bfloat16")
  p.add_argument("--peer-max-ms", type=float, default=500.0,
                 help="skip a ragged-dot peer that XLA lowers densely when that would take "
                      "longer a call (default 500)")
  p.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke run)")
  p.add_argument("--out", help="JSON path (default: benchmarks/results/<gpu>-moe_layer.json)")
  s = p.parse_args(argv)
  s.tokens = s.tokens if s.tokens is not None else QUICK_TOKENS if s.quick else TOKENS
  s.seq = s.seq if s.seq is not None else QUICK_SEQ if s.quick else SEQ
  gpu = jax.default_backend() == "gpu"
  s.variants = s.variants or [v for v in VARIANTS if gpu or v != "bf16_cudnn"]
  if s.seq < 1 or s.tokens < 1 or s.tokens % s.seq:
    p.error(f"--tokens ({s.tokens}) must be a positive multiple of --seq ({s.seq})")
  if not s.capacity_factor > 0:
    p.error(f"--capacity-factor must be > 0, got {s.capacity_factor}")
  if "bf16_cudnn" in s.variants and not gpu:
    p.error("bf16_cudnn (XLA's cuDNN grouped GEMM) runs on a GPU only")
  cases = {c: (QUICK_CASES if s.quick else CASES)[c] for c in s.cases}
  env, ceil = environment(), ceilings(s.quick)
  print(f"\n{env['device']}  jax {env['jax']}  {env['date']}  tokens {s.tokens}, seq {s.seq}, "
        f"capacity factor {s.capacity_factor}, params {s.param_dtype}; TFLOP/s of the routed "
        f"tokens' expert GEMMs")
  print(f"{'case':<12}{'variant':<20}{'us':>12}{'TFLOP/s':>9}{'vs bf16':>10}{'vs cudnn':>10}"
        f"{'vs peer':>10}")
  fastest, rows = run(cases, s, ceil["bf16_gemm_TFLOPs"])
  results = {"env": env, "ceilings": ceil,
             "config": {"tokens": s.tokens, "seq": s.seq,
                        "cases": {c: dataclasses.asdict(v) for c, v in cases.items()},
                        "capacity_factor": s.capacity_factor, "param_dtype": s.param_dtype,
                        "peer_max_ms": s.peer_max_ms, "quick": s.quick,
                        "flops": {c: layer_flops(v, s.tokens) for c, v in cases.items()}},
             "fastest_peer": fastest, "rows": rows}
  return finish(results, s.out, "moe_layer",
                sum(r["variant"] in FP8 and "error" in r for r in rows), "jax_fp8")


if __name__ == "__main__":
  main()
