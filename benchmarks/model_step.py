"""The headline benchmark: a Llama-style decoder's whole train step, BF16 against Flax's FP8 and
jax_fp8's recipes, all in one process.

The model: token embedding, ``layers`` pre-RMSNorm decoder layers under ``nn.scan`` (separate
q, k, v, o projections, rotary position embedding, causal attention through
``jax.nn.dot_product_attention``, a SwiGLU MLP of gate, up and down projections), a final
RMSNorm and a bf16 LM head (a plain ``nn.Dense`` in every variant, as FP8 recipes keep it).
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
  cost of the quantizations. NVFP4's stochastic rounding draws each step's key from a key
  carried beside the state and folded once per step.

With ``--microbatches`` n the step scans over n microbatches of ``--batch`` / n sequences,
accumulating the gradients (jax_fp8's state ``jax_fp8.share``d among them). Each variant's
step is timed as ``benchmarks.train_step`` times one: the median of ``--windows`` windows of
``--steps`` donated steps, and with ``--profile`` (the named variants, or every variant run if
none is named) ``--profile-steps`` steps traced with the JAX profiler, the device's work summed
by kind and its idle time.

    python -m benchmarks.model_step [--d-model 4096] [--heads 32] [--ffn 14336] [--layers 4]
        [--seq 2048] [--batch 8] [--vocab 32000] [--microbatches 1]
        [--param-dtype float32|bfloat16]
        [--attention cudnn|xla|default] [--variants NAME ...] [--profile [NAME ...]]
        [--steps 8] [--windows 3] [--profile-steps 3] [--quick] [--out PATH]

Writes ``benchmarks/results/<gpu>-model_step.json`` (or ``--out``): ``env`` (GPU, versions,
date), ``config``, ``steps``, ``windows`` and a list ``rows``, one per variant, with
``variant``, ``step_ms``, ``window_ms`` (each window's), ``tokens_per_s``, ``compile_s``,
``temp_bytes``, ``peak_bytes`` (arguments, outputs and temporaries the compiled step plans,
donated buffers counted once), ``loss`` (after the timed steps), ``speedup_vs_bf16`` and
``speedup_vs_flax_fp8`` (None without that peer), and with ``--profile`` ``profile``
(``benchmarks.step_profile.summarize``'s rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.linen import fp8_ops

import jax_fp8
from jax_fp8.flax import STATE_COLLECTION, Dense, Mlp, MultiDense

from . import train_step

COMPUTE = jnp.bfloat16
FLAX_FP8_COLLECTION = "_overwrite_with_gradient"  # Flax's FP8 scales and amax histories
PEERS = ("bf16", "flax_fp8")  # the variants every row's speedup is taken against
FAST_ALL = jax_fp8.DelayedScaling(fast_accum_gemms=("fprop", "dgrad", "wgrad"))
FAST_FPROP = jax_fp8.DelayedScaling(fast_accum_gemms=("fprop",))
CURRENT, MXFP8 = jax_fp8.CurrentScaling(), jax_fp8.MXFP8BlockScaling()
NVFP4 = jax_fp8.NVFP4BlockScaling()
SR_KEY = "stochastic_rounding_key"  # the entry of the carried collections that holds the key
CURRENT_FAST_ALL = jax_fp8.CurrentScaling(fast_accum_gemms=("fprop", "dgrad", "wgrad"))


class KernelCopyDense(nn.Module):
  """``jax_fp8.flax.Dense`` (delayed scaling) with its kernel cast to the compute dtype before
  the quantization, as the layer did before it quantized f32 master weights directly: the
  variant shows that fusion's gain."""

  features: int
  use_bias: bool
  dtype: type
  param_dtype: type

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features),
                        self.param_dtype)
    bias = (self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype)
            if self.use_bias else None)
    state = self.variable(STATE_COLLECTION, "linear", jax_fp8.LinearState.create).value
    return jax_fp8.linear(x, kernel.astype(self.dtype),
                          None if bias is None else bias.astype(self.dtype), state=state)


def split_dense(recipe):
  """Several projections of one input as one ``jax_fp8.flax.Dense`` of all their features, its
  output split into them (``split=``): one GEMM for q, k and v, the parts' gradients quantized
  where they lie; called as ``MultiDense`` is (features, name, norm and the layer kwargs)."""
  return lambda features, **kw: Dense(sum(features), split=features, recipe=recipe, **kw)


DELAYED, BLOCK = jax_fp8.DelayedScaling(), jax_fp8.BlockScaling()
# name -> (the projections' class, the class of several projections of one input or None for
# one layer each, the recipe of a fused jax_fp8.flax.Mlp or None for gate / up / down
# projections around jax.nn.silu, whether the RMSNorms before q / k / v and the MLP are fused
# into those layers); the classes are called with features, name and the kwargs of Layer.
VARIANTS = {
    "bf16": (nn.Dense, None, None, False),
    "flax_fp8": (functools.partial(nn.Dense, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp),
                 None, None, False),
    "delayed_bf16_kernel_copy": (KernelCopyDense, None, None, False),
    "delayed": (functools.partial(Dense, recipe=DELAYED), None, None, False),
    "delayed_shared_input": (functools.partial(Dense, recipe=DELAYED),
                             functools.partial(MultiDense, recipe=DELAYED), None, False),
    "delayed_shared_input_fast_all": (
        functools.partial(Dense, recipe=FAST_ALL), functools.partial(MultiDense, recipe=FAST_ALL),
        None, False),
    "delayed_fused_mlp": (functools.partial(Dense, recipe=DELAYED),
                          functools.partial(MultiDense, recipe=DELAYED), DELAYED, False),
    "delayed_fused_mlp_fast_all": (
        functools.partial(Dense, recipe=FAST_ALL), functools.partial(MultiDense, recipe=FAST_ALL),
        FAST_ALL, False),
    "delayed_fused_norm_mlp": (functools.partial(Dense, recipe=DELAYED),
                               functools.partial(MultiDense, recipe=DELAYED), DELAYED, True),
    "delayed_fused_norm_mlp_fast_all": (
        functools.partial(Dense, recipe=FAST_ALL), functools.partial(MultiDense, recipe=FAST_ALL),
        FAST_ALL, True),
    "delayed_fused_norm_mlp_fast_fprop": (
        functools.partial(Dense, recipe=FAST_FPROP),
        functools.partial(MultiDense, recipe=FAST_FPROP), FAST_FPROP, True),
    "delayed_split_qkv_fused_norm_mlp": (functools.partial(Dense, recipe=DELAYED),
                                         split_dense(DELAYED), DELAYED, True),
    "delayed_fused_norm_mlp_cast_kernels": (
        functools.partial(Dense, recipe=DELAYED), functools.partial(MultiDense, recipe=DELAYED),
        DELAYED, True),
    "current_fused_norm_mlp": (functools.partial(Dense, recipe=CURRENT),
                               functools.partial(MultiDense, recipe=CURRENT), CURRENT, True),
    "current_fused_norm_mlp_fast_all": (
        functools.partial(Dense, recipe=CURRENT_FAST_ALL),
        functools.partial(MultiDense, recipe=CURRENT_FAST_ALL), CURRENT_FAST_ALL, True),
    "block": (functools.partial(Dense, recipe=BLOCK), None, None, False),
    "block_shared_input": (functools.partial(Dense, recipe=BLOCK),
                           functools.partial(MultiDense, recipe=BLOCK), None, False),
    "block_fused_norm_mlp": (functools.partial(Dense, recipe=BLOCK),
                             functools.partial(MultiDense, recipe=BLOCK), BLOCK, True),
    "mxfp8_shared_input": (functools.partial(Dense, recipe=MXFP8),
                           functools.partial(MultiDense, recipe=MXFP8), None, False),
    "nvfp4_shared_input": (functools.partial(Dense, recipe=NVFP4),
                           functools.partial(MultiDense, recipe=NVFP4), None, False),
}
KEYED = ("nvfp4_shared_input",)  # the variants whose recipe draws a key (stochastic rounding)
# The variants whose kernels are cast once per step (jax_fp8.flax.cast_kernels) -> recipe.
CAST_KERNELS = {"delayed_fused_norm_mlp_cast_kernels": DELAYED}


@dataclasses.dataclass(frozen=True)
class Config:
  d_model: int = 4096
  heads: int = 32
  ffn: int = 14336
  layers: int = 4
  seq: int = 2048
  batch: int = 8
  vocab: int = 32000
  microbatches: int = 1
  param_dtype: str = "float32"
  attention: str = "cudnn"  # jax.nn.dot_product_attention's implementation; "default": None


QUICK = Config(d_model=256, heads=4, ffn=512, layers=2, seq=128, batch=2, vocab=512,
               attention="default")


def rope(x, base=10000.0):
  """Rotary position embedding (Su et al. 2021, arXiv 2104.09864), halves rotated.
  x: [B, T, H, Dh] -> same shape and dtype; angles in f32."""
  t, dh = x.shape[1], x.shape[-1]
  freq = base ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2 / dh)
  angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq  # [T, Dh/2]
  cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class Layer(nn.Module):
  """One pre-RMSNorm decoder layer, bf16 [B, T, D] -> same (a scan body: carry, None)."""

  cfg: Config
  variant: str

  def project(self, h, norm=None, **features):
    """The projections of h named by ``features`` (name=N): one layer each, or one layer of
    several outputs where the variant has one (``norm``: the norm it fuses)."""
    single, multi, _, _ = VARIANTS[self.variant]
    kw = dict(use_bias=False, dtype=COMPUTE, param_dtype=jnp.dtype(self.cfg.param_dtype))
    if multi is None or len(features) == 1:
      return tuple(single(n, name=name, **kw)(h) for name, n in features.items())
    return multi(tuple(features.values()), name="_".join(features), norm=norm, **kw)(h)

  def norm(self, x, name):
    """(the input of the layer after the norm, the norm it fuses): x itself and "rmsnorm"
    where the variant fuses the norm, else the norm of x and None."""
    if VARIANTS[self.variant][3]:
      return x, "rmsnorm"
    return nn.RMSNorm(dtype=COMPUTE, name=name)(x), None

  @nn.compact
  def __call__(self, x, _):
    cfg, (b, t, d) = self.cfg, x.shape
    heads = lambda y: y.reshape(b, t, cfg.heads, d // cfg.heads)
    h, norm = self.norm(x, "attention_norm")
    q, k, v = map(heads, self.project(h, norm=norm, q=d, k=d, v=d))
    a = jax.nn.dot_product_attention(
        rope(q), rope(k), v, is_causal=True,
        implementation=None if cfg.attention == "default" else cfg.attention)
    x = x + self.project(a.reshape(b, t, d), o=d)[0]
    h, norm = self.norm(x, "mlp_norm")
    mlp_recipe = VARIANTS[self.variant][2]
    if mlp_recipe is not None:
      return x + Mlp(cfg.ffn, activation="swiglu", use_bias=False, dtype=COMPUTE,
                     param_dtype=jnp.dtype(cfg.param_dtype), recipe=mlp_recipe, norm=norm,
                     name="mlp")(h), None
    gate, up = self.project(h, gate=cfg.ffn, up=cfg.ffn)
    return x + self.project(jax.nn.silu(gate) * up, down=d)[0], None


class Decoder(nn.Module):
  """tokens int32 [B, T] -> f32 [B, T, vocab] logits."""

  cfg: Config
  variant: str

  @nn.compact
  def __call__(self, tokens):
    cfg, pdt = self.cfg, jnp.dtype(self.cfg.param_dtype)
    x = nn.Embed(cfg.vocab, cfg.d_model, param_dtype=pdt, name="embed")(tokens).astype(COMPUTE)
    layers = nn.scan(Layer, variable_axes={True: 0},
                     split_rngs={"params": True, jax_fp8.flax.SR_STREAM: True},
                     length=cfg.layers)
    x, _ = layers(cfg, self.variant, name="layers")(x, None)
    x = nn.RMSNorm(dtype=COMPUTE, name="final_norm")(x)
    logits = nn.Dense(cfg.vocab, use_bias=False, dtype=COMPUTE, param_dtype=pdt,
                      name="lm_head")(x)
    return logits.astype(jnp.float32)


def next_collections(other, other_grads):
  """The non-parameter collections for the next step: jax_fp8's rings advanced by their
  observations, Flax's FP8 collection replaced by its gradient."""
  out = dict(other)
  if STATE_COLLECTION in other:
    out[STATE_COLLECTION] = jax_fp8.update_state(other[STATE_COLLECTION],
                                                 other_grads[STATE_COLLECTION])
  if FLAX_FP8_COLLECTION in other:
    out[FLAX_FP8_COLLECTION] = other_grads[FLAX_FP8_COLLECTION]
  return out


def setup(cfg: Config, variant: str, tx):
  """The model, its jitted train step ``(params, opt_state, other, tokens) -> (params,
  opt_state, other, loss)`` (buffers donated) and its first arguments."""
  model = Decoder(cfg, variant)
  tokens = jax.random.randint(jax.random.key(0), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)

  def micro_loss(params, other, tokens, key):
    rngs = {} if key is None else {jax_fp8.flax.SR_STREAM: key}
    logits = model.apply({"params": params, **other}, tokens[:, :-1], rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def loss_fn(params, other, tokens, key):
    """The mean loss of the microbatches, scanned over with jax_fp8's state shared among them
    (Flax's FP8 collection, closed over, combines its gradients by max itself)."""
    if variant in CAST_KERNELS:
      params = jax_fp8.flax.cast_kernels(params, other[STATE_COLLECTION], CAST_KERNELS[variant])
    mb = cfg.microbatches
    if mb == 1:
      return micro_loss(params, other, tokens, key)
    rest = {k: v for k, v in other.items() if k != STATE_COLLECTION}
    state = other.get(STATE_COLLECTION)

    def body(total, xs):
      part, shared, i = xs
      collections = rest if shared is None else {**rest, STATE_COLLECTION: shared}
      return total + micro_loss(params, collections, part,
                                None if key is None else jax.random.fold_in(key, i)), None
    xs = (tokens.reshape(mb, cfg.batch // mb, -1),
          None if state is None else jax_fp8.share(state, mb), jnp.arange(mb))
    return jax.lax.scan(body, 0.0, xs)[0] / mb

  @functools.partial(jax.jit, donate_argnums=(0, 1, 2))
  def step(params, opt_state, other, tokens):
    other = dict(other)
    key = other.pop(SR_KEY, None)
    loss, (grads, other_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, other,
                                                                             tokens, key)
    updates, opt_state = tx.update(grads, opt_state, params)
    other = next_collections(other, other_grads)
    if key is not None:
      other[SR_KEY] = jax.random.fold_in(key, 1)  # the next step's
    return optax.apply_updates(params, updates), opt_state, other, loss

  variables = jax.jit(model.init)(jax.random.key(1), tokens[:, :-1])
  params = variables.pop("params")
  other = dict(variables)
  if variant in KEYED:
    other[SR_KEY] = jax.random.key(2)
  return step, (params, tx.init(params), other, tokens)


def measure(cfg: Config, name: str, steps: int, windows: int, profile_steps: int):
  """One variant's figures (``benchmarks.train_step.measure``'s)."""
  step, (params, opt_state, other, tokens) = setup(cfg, name, optax.adamw(1e-4, weight_decay=0.1))
  return train_step.measure(step, (params, opt_state, other), (tokens,), cfg.batch * cfg.seq,
                            steps, windows, profile_steps)


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  d = Config()
  for f in dataclasses.fields(Config):
    flag = "--" + f.name.replace("_", "-")
    if f.name == "param_dtype":
      p.add_argument(flag, choices=["float32", "bfloat16"], default=d.param_dtype)
    elif f.name == "attention":
      p.add_argument(flag, choices=["cudnn", "xla", "default"], default=d.attention,
                     help="jax.nn.dot_product_attention's implementation (default: cudnn)")
    else:
      p.add_argument(flag, type=int, default=getattr(d, f.name),
                     help=f"(default: {getattr(d, f.name)})")
  train_step.add_arguments(p, VARIANTS, list(VARIANTS), steps=8, profile_steps=3,
                           out="model_step")
  p.add_argument("--quick", action="store_true", help="a tiny model (a CPU smoke run)")
  args = p.parse_args(argv)
  cfg = Config(**{f.name: getattr(args, f.name) for f in dataclasses.fields(Config)})
  if args.quick:
    if cfg != dataclasses.replace(Config(), microbatches=cfg.microbatches):
      p.error("--quick runs its own tiny model: give no model flags but --microbatches with it")
    cfg = dataclasses.replace(QUICK, microbatches=cfg.microbatches)
  for f in dataclasses.fields(Config):
    if f.type in (int, "int") and getattr(cfg, f.name) < 1:
      p.error(f"--{f.name.replace('_', '-')} must be >= 1, got {getattr(cfg, f.name)}")
  if cfg.batch % cfg.microbatches:
    p.error(f"--microbatches ({cfg.microbatches}) must divide --batch ({cfg.batch})")
  if cfg.d_model % cfg.heads or (cfg.d_model // cfg.heads) % 2:
    p.error(f"--d-model ({cfg.d_model}) must be a multiple of --heads ({cfg.heads}) with an even "
            f"head size")
  return train_step.run(p, args, lambda variant, profile_steps: measure(
      cfg, variant, args.steps, args.windows, profile_steps),
      {"config": dataclasses.asdict(cfg)}, "model_step", PEERS)


if __name__ == "__main__":
  main()
