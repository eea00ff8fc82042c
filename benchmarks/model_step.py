"""The headline benchmark: a Llama-style decoder's whole train step, BF16 against Flax's FP8 and
jax_fp8's recipes, all in one process.

The model (``jax_fp8.demo.model.Transformer`` with the options ``LLAMA``; its step
``jax_fp8.demo.train.make_train_step``): token embedding, ``layers`` pre-RMSNorm decoder layers
under ``nn.scan`` (separate q, k, v, o projections, rotary position embedding, causal attention
through ``jax.nn.dot_product_attention``, a SwiGLU MLP of gate, up and down projections), a
final RMSNorm and a bf16 LM head (a plain ``nn.Dense`` in every variant, as FP8 recipes keep
it).
Compute in bf16, master weights in ``--param-dtype`` (f32 by default), AdamW (optax),
cross-entropy in f32 on one batch of random tokens, the same every step (its loss after the
timed steps, memorized by then, shows that every variant trains; the demo compares
convergence). The variants differ only in the layers of the seven
projections of each layer (and, in the fused variants, the SwiGLU between them):

- ``bf16``: ``flax.linen.Dense``;
- ``flax_fp8``: ``flax.linen.Dense(dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)`` (Flax's
  delayed scaling in jnp, which XLA fuses into the neighbouring ops; its state collection is
  overwritten by its gradient, as Flax prescribes);
- ``delayed`` and ``block``: ``jax_fp8.flax.Dense`` under ``DelayedScaling()`` (its state
  advanced by ``jax_fp8.update_state``) and ``BlockScaling()``; each kernel quantized straight
  from the f32 master weights;
- ``delayed_bf16_kernel_copy``: each kernel cast to bf16 before its quantization (the layer's
  behaviour before it quantized f32 weights directly: the gain of that fusion);
- ``delayed_shared_input``, ``block_shared_input``: q / k / v and gate / up each one
  ``jax_fp8.flax.MultiDense``, so each normalized input is quantized once;
- ``delayed_shared_input_fast_all``: the same with fast accumulation in all three GEMMs;
- ``delayed_fused_mlp`` (and ``_fast_all``): as ``delayed_shared_input`` (and its fast
  variant), the MLP one ``jax_fp8.flax.Mlp``: gate and up in one GEMM, SwiGLU computed inside
  the cast-transpose of the down projection's input, its gradient inside the cast-transpose of
  the up projection's output gradient;
- ``delayed_fused_norm_mlp`` (and ``_fast_all``): as ``delayed_fused_mlp`` (and its fast
  variant), the RMSNorms before q / k / v and the MLP fused into those layers' input
  cast-transposes (``norm="rmsnorm"``); ``_fast_fprop``: fast accumulation in fprop only
  (TransformerEngine's default on Hopper);
- ``delayed_split_qkv_fused_norm_mlp``: as ``delayed_fused_norm_mlp``, q / k / v one
  ``jax_fp8.flax.Dense`` of 3 d features whose output is split (``split=``): one GEMM where
  ``MultiDense`` runs three, the parts' gradients read by one cast-transpose where they lie;
- ``delayed_fused_norm_mlp_cast_kernels``: as ``delayed_fused_norm_mlp``, its kernels
  quantized once per step (``jax_fp8.flax.cast_kernels``) rather than once per microbatch: the
  same as ``delayed_fused_norm_mlp`` at one microbatch;
- ``current_fused_norm_mlp`` (and ``_fast_all``): the same layers under ``CurrentScaling()``
  (each tensor's scale from its amax of this step, XLA's reduction before each quantization);
- ``block_fused_norm_mlp``: the same layers under ``BlockScaling()``, the norms, SwiGLU and its
  gradient inside the group cast-transposes;
- ``mxfp8_shared_input``, ``nvfp4_shared_input``: as ``block_shared_input`` under
  ``MXFP8BlockScaling()`` and ``NVFP4BlockScaling()`` (every projection in NVFP4: no layer kept
  in higher precision here), their GEMMs emulated (BF16 GEMMs of the dequantized operands): the
  cost of the quantizations. NVFP4's stochastic rounding takes one key, the same every step
  (as ``benchmarks.demo_step``'s).

With ``--moe-experts`` E (0, the default: dense MLPs) every layer's MLP is a mixture of E
experts, top ``--moe-top-k``, each a SwiGLU MLP of ``--moe-hidden`` (0: ``--ffn``) behind an
RMSNorm of its own (``Config.moe_experts``): dropless, ``jax_fp8.flax.MoeMlp`` (grouped FP8
GEMMs) in the delayed and current variants, in ``bf16`` its BF16 twin (``jax.lax.ragged_dot``);
the loss adds the load-balancing loss (weight 0.01). The peers that MoE runs only
(``CAPACITY_VARIANTS``): ``bf16_capacity``, the capacity-factor MoE through dense einsums
(``jax_fp8.demo.capacity_moe``: GShard's dispatch and combine einsums, each sequence a routing
group, capacity factor ``--moe-capacity-factor``, the assignments past an expert's slots
dropped) beside ``bf16``'s ``nn.Dense`` projections; ``flax_fp8_capacity``, the same with the
experts' einsums through Flax's ``Fp8Einsum``, beside ``flax_fp8``'s FP8 projections. The other
variants have no MoE layer (an error names them), nor ``_cast_kernels`` (its experts would be
quantized per microbatch anyway); the variants that differ only in their MLP then differ in
q / k / v and the attention's norm. Without ``--variants``: every variant that runs. A MoE
run's peers are ``bf16`` (ragged_dot) and the fastest of ``MOE_PEERS`` that ran.

With ``--microbatches`` n the step scans over n microbatches of ``--batch`` / n sequences,
accumulating the gradients (jax_fp8's state ``jax_fp8.share``d among them). Each variant's
step is timed as ``benchmarks.train_step`` times one: the median of ``--windows`` windows of
``--steps`` donated steps, and with ``--profile`` (the named variants, or every variant run if
none is named) ``--profile-steps`` steps traced with the JAX profiler, the device's work summed
by kind and its idle time.

    python -m benchmarks.model_step [--d-model 4096] [--heads 32] [--ffn 14336] [--layers 4]
        [--seq 2048] [--batch 8] [--vocab 32000] [--microbatches 1]
        [--param-dtype float32|bfloat16] [--moe-experts 0] [--moe-top-k 2] [--moe-hidden 0]
        [--moe-capacity-factor 1.25]
        [--attention cudnn|xla|default] [--variants NAME ...] [--profile [NAME ...]]
        [--steps 8] [--windows 3] [--profile-steps 3] [--quick] [--out PATH]

Writes ``benchmarks/results/<gpu>-model_step.json`` (or ``--out``): ``env`` (GPU, versions,
date), ``config``, ``steps``, ``windows`` and a list ``rows``, one per variant, with
``variant``, ``step_ms``, ``window_ms`` (each window's), ``tokens_per_s``, ``compile_s``,
``temp_bytes``, ``peak_bytes`` (arguments, outputs and temporaries the compiled step plans,
donated buffers counted once), ``loss`` (after the timed steps), ``TFLOPs`` (``step_flops``
over the step time), ``speedup_vs_bf16`` and ``speedup_vs_flax_fp8`` (None without that peer),
and with ``--profile`` ``profile`` (``benchmarks.profiling.summarize``'s rows); a variant
that ran out of the device's memory has ``error`` (XLA's message) and no figures. A MoE run has
no ``speedup_vs_flax_fp8`` but ``speedup_vs_fastest_peer`` (the results' ``fastest_peer``), and
its capacity peers' rows ``dropped_first`` / ``dropped_last``: the assignments (token,
expert) past their expert's slots in a forward pass of the step's batch at the first step's
parameters / after the timed steps, summed over the layers, of ``routed_assignments`` (layers x
tokens x top_k). The results' ``step_flops``: the FLOPs a step counts, the same for every
variant (``step_flops``).
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import jax.numpy as jnp
import optax

from jax_fp8.demo.capacity_moe import CAPACITY_FACTOR, DROPPED
from jax_fp8.demo.model import LLAMA, PER_TENSOR, Config, Transformer
from jax_fp8.demo.train import INTERMEDIATES, init_variables, make_train_step, sown

from . import train_step

PEERS = ("bf16", "flax_fp8")  # the variants every row's speedup is taken against
FAST_ALL = ("fprop", "dgrad", "wgrad")
# The projections' layers (Config fields over LLAMA's, whose projections are each a layer of
# their own around nn.RMSNorms): q / k / v and gate / up each one MultiDense (shared input);
# the MLP one jax_fp8.flax.Mlp too; the RMSNorms fused into the layers after them too.
SHARED = dict(qkv="shared_input", mlp="shared_input")
FUSED_MLP = dict(qkv="shared_input", mlp="fused")
FUSED_NORM_MLP = dict(FUSED_MLP, fuse_norm=True)
VARIANTS = {  # name -> the Config fields it sets
    "bf16": dict(linear="flax"),
    "flax_fp8": dict(linear="flax_fp8"),
    "delayed_bf16_kernel_copy": dict(linear="fp8_bf16_kernel_copy"),
    "delayed": {},
    "delayed_shared_input": SHARED,
    "delayed_shared_input_fast_all": dict(SHARED, fast_accum_gemms=FAST_ALL),
    "delayed_fused_mlp": FUSED_MLP,
    "delayed_fused_mlp_fast_all": dict(FUSED_MLP, fast_accum_gemms=FAST_ALL),
    "delayed_fused_norm_mlp": FUSED_NORM_MLP,
    "delayed_fused_norm_mlp_fast_all": dict(FUSED_NORM_MLP, fast_accum_gemms=FAST_ALL),
    "delayed_fused_norm_mlp_fast_fprop": dict(FUSED_NORM_MLP, fast_accum_gemms=("fprop",)),
    "delayed_split_qkv_fused_norm_mlp": dict(FUSED_NORM_MLP, qkv="split"),
    "delayed_fused_norm_mlp_cast_kernels": FUSED_NORM_MLP,
    "current_fused_norm_mlp": dict(FUSED_NORM_MLP, recipe="current"),
    "current_fused_norm_mlp_fast_all": dict(FUSED_NORM_MLP, recipe="current",
                                            fast_accum_gemms=FAST_ALL),
    "block": dict(recipe="block"),
    "block_shared_input": dict(SHARED, recipe="block"),
    "block_fused_norm_mlp": dict(FUSED_NORM_MLP, recipe="block"),
    "mxfp8_shared_input": dict(SHARED, recipe="mxfp8"),
    "nvfp4_shared_input": dict(SHARED, recipe="nvfp4"),
}
# The variants whose kernels are cast once per step (jax_fp8.flax.cast_kernels).
CAST_KERNELS = ("delayed_fused_norm_mlp_cast_kernels",)
# The MoE runs' peers of the capacity-factor MoE (their projections those of bf16, flax_fp8).
CAPACITY_VARIANTS = {"bf16_capacity": dict(linear="flax"),
                     "flax_fp8_capacity": dict(linear="flax_fp8")}
MOE_PEERS = ("bf16", *CAPACITY_VARIANTS)  # a MoE run's fastest peer is the fastest of these


@dataclasses.dataclass(frozen=True)
class Settings:
  """The command line's sizes and options (the results' ``config``)."""

  d_model: int = 4096
  heads: int = 32
  ffn: int = 14336
  layers: int = 4
  seq: int = 2048
  batch: int = 8
  vocab: int = 32000
  microbatches: int = 1
  param_dtype: str = "float32"
  attention: str = "cudnn"  # jax.nn.dot_product_attention's; "default": the platform's
  moe_experts: int = 0  # > 0: the MLPs mixtures of this many experts
  moe_top_k: int = 2
  moe_hidden: int = 0  # each expert's hidden size; 0: ffn
  moe_capacity_factor: float = CAPACITY_FACTOR  # the capacity peers'


# the fields --quick keeps (with microbatches)
MOE = ("moe_experts", "moe_top_k", "moe_hidden", "moe_capacity_factor")
QUICK = Settings(d_model=256, heads=4, ffn=512, layers=1, seq=128, batch=2, vocab=512,
                 attention="default")


def moe_variants() -> list[str]:
  """The variants with a MoE form: BF16 and jax_fp8's per-tensor recipes, kernels not cast;
  then the capacity-factor peers."""
  return [v for v in VARIANTS if v not in CAST_KERNELS and VARIANTS[v].get("linear", "fp8") in
          ("flax", "fp8") and VARIANTS[v].get("recipe", "delayed") in PER_TENSOR
          ] + list(CAPACITY_VARIANTS)


def model_config(s: Settings, variant: str) -> Config:
  """The model of ``variant`` at the sizes of ``s``."""
  moe = {}
  if s.moe_experts:
    moe = dict(moe_experts=s.moe_experts, moe_top_k=s.moe_top_k,
               moe_hidden=s.moe_hidden or s.ffn)
  if variant in CAPACITY_VARIANTS:
    moe["moe_capacity_factor"] = s.moe_capacity_factor
  return Config(s.d_model, s.heads, s.layers, s.seq, vocab=s.vocab, d_ff=s.ffn,
                param_dtype=s.param_dtype,
                attention=None if s.attention == "default" else s.attention,
                **{**LLAMA, **{**VARIANTS, **CAPACITY_VARIANTS}[variant]}, **moe)


def step_flops(s: Settings) -> float:
  """The FLOPs of one train step: three times the forward's (the backward's dgrad and wgrad),
  the forward's the matmuls' 2 x tokens x, per layer, 4 d^2 (q, k, v, o) + 2 seq d (q k^T
  and the weighted sum of v, the causal mask's skipped half counted) + the MLP's 3 d ffn, or a
  MoE's d E (the router) + top_k 3 d H (each routed token's SwiGLU expert, whether a
  capacity peer kept or dropped it; no padding), then d vocab (the LM head)."""
  d = s.d_model
  mlp = d * s.moe_experts + s.moe_top_k * 3 * d * (s.moe_hidden or s.ffn) if s.moe_experts else (
      3 * d * s.ffn)
  forward = 2 * s.batch * s.seq * (s.layers * (4 * d * d + 2 * s.seq * d + mlp) + d * s.vocab)
  return 3.0 * forward


def dropped_counter(model):
  """``count(params, collections, tokens) -> int``: the assignments the capacity MoE layers of
  ``model`` dropped in a forward pass of ``tokens`` [B, seq + 1] (its first seq), summed over
  the layers (the forward compiled once)."""
  apply = jax.jit(lambda p, c, t: model.apply({"params": p, **c}, t, mutable=[INTERMEDIATES]))

  def count(params, collections, tokens):
    _, state = apply(params, collections, tokens[:, :-1])
    return int(sum(jnp.sum(v) for v in sown(state[INTERMEDIATES], DROPPED)))
  return count


def setup(s: Settings, variant: str, tx):
  """The model of ``variant``, its jitted train step ``(params, opt_state, collections,
  tokens, key) -> (params, opt_state, collections, loss)`` (buffers donated) and the step's
  first arguments: the carried ones and the inputs, one batch of random tokens and the
  stochastic-rounding key (None where the recipe draws none)."""
  cfg = model_config(s, variant)
  model = Transformer(cfg)
  step = make_train_step(model, tx, microbatches=s.microbatches, cast_kernels=(
      cfg.recipe_object() if variant in CAST_KERNELS else None))
  params, collections = init_variables(model, 1)
  tokens = jax.random.randint(jax.random.key(0), (s.batch, s.seq + 1), 0, s.vocab)
  key = jax.random.key(2) if cfg.fp8 and cfg.recipe == "nvfp4" else None
  return model, step, (params, tx.init(params), collections), (tokens, key)


def measure(s: Settings, name: str, steps: int, windows: int, profile_steps: int):
  """One variant's figures (``benchmarks.train_step.measure``'s, ``TFLOPs``, and a capacity
  peer's dropped assignments)."""
  model, step, carried, inputs = setup(s, name, optax.adamw(1e-4, weight_decay=0.1))
  row, report = {}, None
  if name in CAPACITY_VARIANTS:
    count = dropped_counter(model)
    row = {"dropped_first": count(carried[0], carried[2], inputs[0]),
           "routed_assignments": s.layers * s.batch * s.seq * s.moe_top_k}
    report = lambda c: {"dropped_last": count(c[0], c[2], inputs[0])}  # noqa: E731
  row.update(train_step.measure(step, carried, inputs, s.batch * s.seq, steps, windows,
                                profile_steps, report))
  row["TFLOPs"] = step_flops(s) / row["step_ms"] / 1e9
  return row


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  d = Settings()
  for f in dataclasses.fields(Settings):
    flag = "--" + f.name.replace("_", "-")
    if f.name == "param_dtype":
      p.add_argument(flag, choices=["float32", "bfloat16"], default=d.param_dtype)
    elif f.name == "attention":
      p.add_argument(flag, choices=["cudnn", "xla", "default"], default=d.attention,
                     help="jax.nn.dot_product_attention's implementation; default: the "
                          "platform's (cudnn on a GPU, else xla) (default: cudnn)")
    else:
      p.add_argument(flag, type=type(getattr(d, f.name)), default=getattr(d, f.name),
                     help=f"(default: {getattr(d, f.name)})")
  train_step.add_arguments(p, {**VARIANTS, **CAPACITY_VARIANTS}, list(VARIANTS), steps=8,
                           profile_steps=3, out="model_step")
  p.add_argument("--quick", action="store_true", help="a tiny model (a CPU smoke run)")
  p.set_defaults(variants=None)
  args = p.parse_args(argv)
  cfg = Settings(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)})
  if args.quick:
    kept = {f: getattr(cfg, f) for f in ("microbatches", *MOE)}
    if cfg != dataclasses.replace(Settings(), **kept):
      p.error("--quick runs its own tiny model: give no model flags but --microbatches and the "
              "--moe ones with it")
    cfg = dataclasses.replace(QUICK, **kept)
  for name in ("moe_experts", "moe_hidden"):
    if getattr(cfg, name) < 0:
      p.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(cfg, name)}")
  if not cfg.moe_experts and any(getattr(cfg, f) != getattr(d, f) for f in MOE[1:]):
    p.error("--moe-top-k, --moe-hidden and --moe-capacity-factor apply with --moe-experts")
  if not cfg.moe_capacity_factor > 0:
    p.error(f"--moe-capacity-factor must be > 0, got {cfg.moe_capacity_factor}")
  if cfg.moe_experts and not 1 <= cfg.moe_top_k <= cfg.moe_experts:
    p.error(f"--moe-top-k must be in [1, --moe-experts ({cfg.moe_experts})], got "
            f"{cfg.moe_top_k}")
  for f in dataclasses.fields(Settings):
    if f.name not in MOE and f.type in (int, "int") and getattr(cfg, f.name) < 1:
      p.error(f"--{f.name.replace('_', '-')} must be >= 1, got {getattr(cfg, f.name)}")
  if cfg.batch % cfg.microbatches:
    p.error(f"--microbatches ({cfg.microbatches}) must divide --batch ({cfg.batch})")
  if cfg.d_model % cfg.heads or (cfg.d_model // cfg.heads) % 2:
    p.error(f"--d-model ({cfg.d_model}) must be a multiple of --heads ({cfg.heads}) with an even "
            f"head size")
  if cfg.moe_experts:
    if args.variants is None:
      args.variants = moe_variants()
    elif [v for v in args.variants if v not in moe_variants()]:
      p.error(f"--moe-experts: no MoE form of "
              f"{[v for v in args.variants if v not in moe_variants()]} (the demo model's MoeMlp "
              f"runs the per-tensor recipes, kernels not cast; BF16 its ragged_dot twin): "
              f"choose among {moe_variants()}")
  elif args.variants is None:
    args.variants = list(VARIANTS)
  elif [v for v in args.variants if v in CAPACITY_VARIANTS]:
    p.error(f"{[v for v in args.variants if v in CAPACITY_VARIANTS]} (the capacity-factor MoE) "
            f"run with --moe-experts")
  return train_step.run(p, args, lambda variant, profile_steps: measure(
      cfg, variant, args.steps, args.windows, profile_steps),
      {"config": dataclasses.asdict(cfg), "step_flops": step_flops(cfg)}, "model_step",
      ("bf16",) if cfg.moe_experts else PEERS, MOE_PEERS if cfg.moe_experts else ())


if __name__ == "__main__":
  main()
