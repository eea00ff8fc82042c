"""The transformer that the demo trains and the benchmarks time: one decoder-only language
model in Flax linen whose ``Config`` fields cover every caller's variant.

The demo's (the defaults): byte-level, GPT style: learned position embeddings, pre-LayerNorm
blocks, q / k / v the split parts of one projection, a GELU MLP, biases, an f32 residual
stream, weights N(0, 0.02). ``LLAMA``: the options of ``benchmarks.model_step`` (and of one
block, ``benchmarks.block``): pre-RMSNorm, rotary positions, a SwiGLU MLP, no biases, a bf16
residual stream, Flax's initializers, the blocks under ``nn.scan``.

``linear``: "fp8", ``jax_fp8.flax`` layers under ``recipe`` (a key of ``RECIPES``; under
"nvfp4" the last ``nvfp4_bf16_share`` of the blocks in BF16, as the NVFP4 report keeps them;
MXFP8 and NVFP4 GEMMs emulated on Hopper); "bf16", their bf16 twins here (``Bf16Dense``,
``Bf16Mlp``: the demo's baseline); "flax", ``flax.linen.Dense`` (the benchmarks' baseline);
"flax_fp8", Flax's FP8 ``nn.Dense`` (``Fp8DirectDotGeneralOp``); "fp8_bf16_kernel_copy",
``KernelCopyDense``.
``moe_experts`` > 0: every block's MLP a mixture of experts (top-``moe_top_k`` of
``moe_experts``, each expert ``moe_hidden`` wide, ``cfg.activation`` between; its norm an
unfused module "mlp_norm", no biases). Dropless (``moe_capacity_factor`` None):
``jax_fp8.flax.MoeMlp`` (grouped FP8 GEMMs) for the per-tensor recipes, its BF16 twin
``Bf16MoeMlp`` (``jax.lax.ragged_dot``) for "bf16" and "flax". With a capacity factor, the
peers' einsum MoE that drops what overflows an expert's slots (``CapacityMoeMlp``): in BF16
for "flax", its experts through Flax's ``Fp8Einsum`` for "flax_fp8". Each sows its
load-balancing loss in "intermediates", which the train step adds, times ``moe_aux_weight``,
to the loss. 0 (the default): the dense MLP of ``mlp``.
``fuse_norm``: the norms before q / k / v and the MLP inside those layers (``norm=``; under the
per-tensor and block recipes inside the FP8 cast-transposes). One rule names the parameters
and one order creates them, so one seed gives a ``Config``'s FP8 and BF16 models the same ones.

Dtypes: parameters ``param_dtype``; the residual stream ``residual_dtype``; norm outputs,
matmuls and attention in bf16 (softmax in f32); logits f32.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import fp8_ops

import jax_fp8
import jax_fp8.flax

from .data import VOCAB
from .capacity_moe import CapacityMoeMlp
from .twins import COMPUTE, Bf16Dense, Bf16Mlp, Bf16MoeMlp, KernelCopyDense

RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.CurrentScaling(),
           "block": jax_fp8.BlockScaling(), "mxfp8": jax_fp8.MXFP8BlockScaling(),
           "nvfp4": jax_fp8.NVFP4BlockScaling()}
PER_TENSOR = ("delayed", "current")  # the recipes with one scale a tensor (and fast_accum_gemms)
# The share of the last blocks that the NVFP4 report (arXiv 2509.25149) keeps in higher
# precision (about 15% of the linear layers), rounded to whole blocks.
NVFP4_BF16_SHARE = 0.15
ATTENTION = ("cudnn", "xla")  # the implementations of jax.nn.dot_product_attention it runs
LINEAR = ("fp8", "bf16", "flax", "flax_fp8", "fp8_bf16_kernel_copy")
QKV = ("split", "shared_input", "separate", "fused")
MLP = ("fused", "shared_input", "separate")
MOE_LINEAR = ("fp8", "bf16", "flax")  # the linears with a dropless MoE MLP ("flax": BF16 twin)
CAPACITY_LINEAR = ("flax", "flax_fp8")  # the linears with a capacity-factor MoE MLP (BF16, FP8)
NORMS = {"layernorm": nn.LayerNorm, "rmsnorm": nn.RMSNorm}
POSITION = ("learned", "rope", None)
FLAX_FP8_COLLECTION = "_overwrite_with_gradient"  # Flax's FP8 scales and amax histories
# The Llama-style decoder of benchmarks.model_step (the projections each a layer of their own).
LLAMA = dict(norm="rmsnorm", fuse_norm=False, qkv="separate", mlp="separate",
             activation="swiglu", position="rope", use_bias=False, init_std=None,
             residual_dtype="bfloat16", scan=True, nvfp4_bf16_share=0.0)


def default_attention(platform: str) -> str:
  """The attention the model runs on devices of ``platform`` ("gpu", "cpu", ...) unless told:
  cuDNN's fused attention on a GPU, XLA's elsewhere."""
  return "cudnn" if platform == "gpu" else "xla"


def _choice(name: str, value, choices) -> None:  # a ValueError naming the field
  if value not in choices:
    raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class Config:
  """Model size, architecture and FP8 recipe (the module docstring says what each choice
  computes). ``d_model`` must be a multiple of ``n_heads``, and of 16 for the FP8 GEMMs (128
  under the block recipe, 32 under MXFP8: the layers say so at trace time)."""

  d_model: int
  n_heads: int
  n_layers: int
  seq_len: int
  vocab: int = VOCAB
  d_ff: int | None = None  # the MLP's hidden size; None: 4 * d_model
  linear: str = "fp8"  # one of LINEAR
  recipe: str = "delayed"  # a key of RECIPES, under linear="fp8"
  # The per-tensor recipes' GEMMs with fast accumulation (DelayedScaling.fast_accum_gemms).
  fast_accum_gemms: tuple[str, ...] = ()
  amax_axis_name: str | None = None  # the data-parallel axis, under shard_map (per-tensor, NVFP4)
  # jax.nn.dot_product_attention's implementation, "cudnn" or "xla"; None: cuDNN's fused
  # attention on a GPU backend (as training stacks run it), XLA's on any other. XLA's is
  # deterministic on a GPU too, where cuDNN's backward adds in no fixed order.
  attention: str | None = None
  norm: str = "layernorm"  # a key of NORMS
  fuse_norm: bool = True  # the norms inside the layers after them (their "gamma", "beta")
  qkv: str = "split"  # one of QKV: one layer split in three, MultiDense, three, one cut by jnp
  mlp: str = "fused"  # one of MLP: one Mlp, gate / up one MultiDense, gate / up / down each one
  activation: str = "gelu"  # the fused MLP's; "swiglu" (the only one of the unfused MLPs)
  position: str | None = "learned"  # one of POSITION: learned embeddings, rotary, none
  use_bias: bool = True
  init_std: float | None = 0.02  # kernels and embeddings N(0, init_std); None: Flax's defaults
  param_dtype: str = "float32"
  residual_dtype: str = "float32"
  scan: bool = False  # the blocks under nn.scan (one "layers" module) or each its own
  nvfp4_bf16_share: float = NVFP4_BF16_SHARE  # of the last blocks in BF16 under NVFP4
  moe_experts: int = 0  # > 0: the MLPs mixtures of this many experts; 0: dense
  moe_top_k: int = 2  # experts per token
  moe_hidden: int | None = None  # each expert's hidden size; None: d_ff
  moe_aux_weight: float = 0.01  # the load-balancing loss's weight (mean over the blocks)
  # None: the dropless MoE; a number > 0: the einsum MoE of that capacity factor (the peers')
  moe_capacity_factor: float | None = None

  def __post_init__(self):
    if self.d_ff is None:
      object.__setattr__(self, "d_ff", 4 * self.d_model)
    _choice("recipe", self.recipe, RECIPES)
    _choice("attention", self.attention, (None, *ATTENTION))
    for name, choices in (("linear", LINEAR), ("qkv", QKV), ("mlp", MLP), ("norm", NORMS),
                          ("position", POSITION), ("activation", ("gelu", "swiglu"))):
      _choice(name, getattr(self, name), choices)
    if self.fast_accum_gemms:
      if self.recipe not in PER_TENSOR:
        raise ValueError(f"fast_accum_gemms applies to the per-tensor recipes {PER_TENSOR}, not "
                         f"to recipe {self.recipe!r}")
      self.recipe_object()  # the recipe checks the GEMM names
    if self.d_model % self.n_heads:
      raise ValueError(f"d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
    fused = self.fuse_norm or self.qkv in ("split", "shared_input") or self.mlp != "separate"
    if self.linear not in ("fp8", "bf16") and fused:
      raise ValueError(f"linear={self.linear!r} has no fused norm, split or MLP: give "
                       f"fuse_norm=False, qkv 'separate' or 'fused', mlp 'separate'")
    if self.linear == "bf16" and (self.qkv == "shared_input" or self.mlp == "shared_input"):
      raise ValueError("linear='bf16' has no MultiDense: give qkv and mlp other than "
                       "'shared_input'")
    if self.activation != ("swiglu" if self.mlp != "fused" else
                           "gelu" if self.linear == "bf16" else self.activation):
      raise ValueError(f"activation={self.activation!r} with mlp={self.mlp!r} and linear="
                       f"{self.linear!r}: the unfused MLPs are SwiGLU, BF16's fused one GELU")
    if self.moe_experts:
      self._check_moe()
    elif self.moe_capacity_factor is not None:
      raise ValueError(f"moe_capacity_factor={self.moe_capacity_factor!r} applies with "
                       f"moe_experts > 0")
    if self.scan and self.bf16_blocks:
      raise ValueError(f"under scan every block runs alike: {self.bf16_blocks} BF16 blocks "
                       f"need scan=False (or nvfp4_bf16_share=0)")

  def _check_moe(self) -> None:
    if self.moe_experts < 0 or not 1 <= self.moe_top_k <= self.moe_experts:
      raise ValueError(f"moe_top_k must be in [1, moe_experts={self.moe_experts}], got "
                       f"{self.moe_top_k}")
    if self.moe_hidden is None:
      object.__setattr__(self, "moe_hidden", self.d_ff)
    if self.moe_hidden < 1:
      raise ValueError(f"moe_hidden must be >= 1, got {self.moe_hidden}")
    if self.moe_capacity_factor is not None:
      if not self.moe_capacity_factor > 0:
        raise ValueError(f"moe_capacity_factor must be > 0, got {self.moe_capacity_factor!r}")
      if self.linear not in CAPACITY_LINEAR:
        raise ValueError(f"moe_capacity_factor runs the einsum MoE of linear "
                         f"{list(CAPACITY_LINEAR)} (BF16, Flax's Fp8Einsum), not linear "
                         f"{self.linear!r}: jax_fp8's MoeMlp and its twin are dropless")
    elif self.linear not in MOE_LINEAR or (self.fp8 and self.recipe not in PER_TENSOR):
      what = f"recipe {self.recipe!r}" if self.fp8 else f"linear {self.linear!r}"
      raise ValueError(f"moe_experts > 0 runs linear {list(MOE_LINEAR)}, FP8 under the per-tensor "
                       f"recipes {list(PER_TENSOR)} (the demo's MoE blocks: "
                       f"jax_fp8.flax.MoeMlp), not {what} (or "
                       f"a moe_capacity_factor with linear {list(CAPACITY_LINEAR)})")

  @property
  def moe(self) -> bool:
    """Whether the blocks' MLPs are mixtures of experts."""
    return self.moe_experts > 0

  @property
  def fp8(self) -> bool:
    """Whether the blocks' layers are jax_fp8's."""
    return self.linear == "fp8"

  @property
  def bf16_blocks(self) -> int:
    """How many of the last blocks run in BF16 (NVFP4's, ``nvfp4_bf16_share``; none under
    the other recipes)."""
    if self.fp8 and self.recipe == "nvfp4":
      return round(self.nvfp4_bf16_share * self.n_layers)
    return 0

  def recipe_object(self):
    """The jax_fp8 recipe the FP8 layers take: ``RECIPES[recipe]``, with ``fast_accum_gemms``."""
    recipe = RECIPES[self.recipe]
    if self.fast_accum_gemms:
      recipe = dataclasses.replace(recipe, fast_accum_gemms=self.fast_accum_gemms)
    return recipe

  @property
  def attention_implementation(self) -> str:
    return self.attention or default_attention(jax.default_backend())


def _init(cfg: Config, key: str = "kernel_init") -> dict:
  """The initializer keyword of a layer: N(0, init_std), or none (the layer's default)."""
  return {} if cfg.init_std is None else {key: nn.initializers.normal(cfg.init_std)}


def _layer_kw(cfg: Config, name: str) -> dict:
  """What every projection of the block takes: bias, dtypes, name, initializer."""
  return dict(use_bias=cfg.use_bias, dtype=COMPUTE, param_dtype=jnp.dtype(cfg.param_dtype),
              name=name, **_init(cfg))


def _fp8_kw(cfg: Config, norm: str | None) -> dict:
  """A jax_fp8 layer's recipe, amax axis and fused norm (None: none)."""
  # BlockScaling's and MXFP8's scales are device-local: no amax to reduce (NVFP4's global
  # scales are per tensor)
  axis = cfg.amax_axis_name if cfg.recipe in (*PER_TENSOR, "nvfp4") else None
  return dict(recipe=cfg.recipe_object(), amax_axis_name=axis, norm=norm)


def dense(cfg: Config, features: int, name: str, norm: str | None = None,
          parts: int = 1) -> nn.Module:
  """One projection to ``features`` in bf16 compute, of the kind ``cfg.linear``, its input norm
  fused where ``norm`` and its output cut into ``parts`` equal parts (a tuple) where more than
  one (jax_fp8: ``split=``, so the parts' gradients reach its backward separately)."""
  kw = _layer_kw(cfg, name)
  if cfg.fp8:
    split = (features // parts,) * parts if parts > 1 else None
    return jax_fp8.flax.Dense(features, split=split, **kw, **_fp8_kw(cfg, norm))
  if cfg.linear == "bf16":
    return Bf16Dense(features, norm=norm, parts=parts, **kw)
  if cfg.linear == "flax":
    return nn.Dense(features, **kw)
  if cfg.linear == "flax_fp8":
    return nn.Dense(features, dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp, **kw)
  return KernelCopyDense(features, **kw)


def rope(x, base=10000.0):
  """Rotary position embedding (Su et al. 2021, arXiv 2104.09864), halves rotated.
  x: [B, T, H, Dh] -> same shape and dtype; angles in f32."""
  t, dh = x.shape[1], x.shape[-1]
  freq = base ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2 / dh)
  angle = jnp.arange(t, dtype=jnp.float32)[:, None] * freq  # [T, Dh/2]
  cos, sin = jnp.cos(angle)[None, :, None], jnp.sin(angle)[None, :, None]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


def causal_attention(q, k, v, implementation: str):
  """Softmax attention with a causal mask, by ``jax.nn.dot_product_attention``'s
  ``implementation`` ("cudnn" or "xla"). q, k, v: bf16 [B, T, H, Dh] -> bf16 [B, T, H, Dh]."""
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


def _norm_input(cfg: Config, x, name: str):
  """(the input of the layer after a norm, the norm that layer fuses): x and ``cfg.norm`` where
  it fuses it, else the norm module ``name``'s output and None."""
  if cfg.fuse_norm:
    return x, cfg.norm
  return NORMS[cfg.norm](dtype=COMPUTE, name=name)(x), None


def _qkv(cfg: Config, h, norm: str | None):
  """q, k, v of h [B, T, D], each [B, T, H, Dh], by the layers ``cfg.qkv`` names."""
  b, t, d = h.shape
  if cfg.qkv == "fused":  # one projection, cut by jnp.split
    y = dense(cfg, 3 * d, "qkv", norm)(h).reshape(b, t, 3, cfg.n_heads, -1)
    return tuple(part[:, :, 0] for part in jnp.split(y, 3, axis=2))
  if cfg.qkv == "separate":
    ys = tuple(dense(cfg, d, name, norm)(h) for name in ("q", "k", "v"))
  elif cfg.qkv == "shared_input":
    ys = jax_fp8.flax.MultiDense((d, d, d), **_layer_kw(cfg, "qkv"), **_fp8_kw(cfg, norm))(h)
  else:  # "split": the parts of one projection
    ys = dense(cfg, 3 * d, "qkv", norm, parts=3)(h)
  return tuple(y.reshape(b, t, cfg.n_heads, d // cfg.n_heads) for y in ys)


def _moe(cfg: Config, h):
  """The block's mixture-of-experts MLP of h [B, T, D] (normalized) -> [B, T, D]: FP8's
  ``MoeMlp``, its BF16 twin, or the capacity-factor peer (each sequence a routing group); the
  same parameters from one seed."""
  if cfg.init_std is None:
    init = {}
  else:
    init = dict(kernel_init=nn.initializers.normal(cfg.init_std),
                router_init=nn.initializers.normal(cfg.init_std))
  kw = dict(activation=cfg.activation, dtype=COMPUTE, param_dtype=jnp.dtype(cfg.param_dtype),
            name="moe", **init)
  if cfg.fp8:
    return jax_fp8.flax.MoeMlp(cfg.moe_experts, cfg.moe_top_k, cfg.moe_hidden,
                               recipe=cfg.recipe_object(),
                               amax_axis_name=_fp8_kw(cfg, None)["amax_axis_name"], **kw)(h)
  if cfg.moe_capacity_factor is not None:
    return CapacityMoeMlp(cfg.moe_experts, cfg.moe_top_k, cfg.moe_hidden,
                          capacity_factor=cfg.moe_capacity_factor,
                          fp8=cfg.linear == "flax_fp8", **kw)(h)
  return Bf16MoeMlp(cfg.moe_experts, cfg.moe_top_k, cfg.moe_hidden, **kw)(h)


def _mlp(cfg: Config, h, norm: str | None):
  """The block's MLP of h [B, T, D] -> [B, T, D], d_model -> d_ff -> d_model."""
  if cfg.mlp == "fused":
    if cfg.fp8:
      return jax_fp8.flax.Mlp(cfg.d_ff, activation=cfg.activation, **_layer_kw(cfg, "mlp"),
                              **_fp8_kw(cfg, norm))(h)
    return Bf16Mlp(cfg.d_ff, norm, **_layer_kw(cfg, "mlp"))(h)
  if cfg.mlp == "shared_input":
    gate, up = jax_fp8.flax.MultiDense((cfg.d_ff, cfg.d_ff), **_layer_kw(cfg, "gate_up"),
                                       **_fp8_kw(cfg, norm))(h)
  else:
    gate, up = (dense(cfg, cfg.d_ff, name, norm)(h) for name in ("gate", "up"))
  return dense(cfg, h.shape[-1], "down")(jax.nn.silu(gate) * up)


class Block(nn.Module):
  """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``. (x [B, T, D] of
  ``cfg.residual_dtype``, ignored) -> (same, None): a ``nn.scan`` body."""

  cfg: Config

  @nn.compact
  def __call__(self, x, _=None):
    cfg = self.cfg
    b, t, d = x.shape
    h, norm = _norm_input(cfg, x, "attention_norm")
    q, k, v = _qkv(cfg, h, norm)
    if cfg.position == "rope":
      q, k = rope(q), rope(k)
    a = causal_attention(q, k, v, cfg.attention_implementation).reshape(b, t, d)
    x = x + dense(cfg, d, "attn_out")(a).astype(x.dtype)
    if cfg.moe:  # the norm a module of its own: MoeMlp fuses none
      h = NORMS[cfg.norm](dtype=COMPUTE, name="mlp_norm")(x)
      return x + _moe(cfg, h).astype(x.dtype), None
    h, norm = _norm_input(cfg, x, "mlp_norm")
    return x + _mlp(cfg, h, norm).astype(x.dtype), None


class Transformer(nn.Module):
  """Decoder-only language model: int [B, T] tokens, T <= ``cfg.seq_len`` -> f32 [B, T,
  vocab] logits for the next token."""

  cfg: Config

  @nn.compact
  def __call__(self, tokens):
    cfg, pdt = self.cfg, jnp.dtype(self.cfg.param_dtype)
    embed = dict(param_dtype=pdt, **_init(cfg, "embedding_init"))
    x = nn.Embed(cfg.vocab, cfg.d_model, name="tok_embed", **embed)(tokens)
    if cfg.position == "learned":
      x = x + nn.Embed(cfg.seq_len, cfg.d_model, name="pos_embed", **embed)(
          jnp.arange(tokens.shape[1]))[None]
    x = x.astype(cfg.residual_dtype)  # the residual stream [B, T, D]
    if cfg.scan:
      layers = nn.scan(Block, variable_axes={True: 0},
                       split_rngs={"params": True, jax_fp8.flax.SR_STREAM: True},
                       length=cfg.n_layers)
      x, _ = layers(cfg, name="layers")(x, None)
    else:
      for i in range(cfg.n_layers):
        high = i >= cfg.n_layers - cfg.bf16_blocks
        x, _ = Block(dataclasses.replace(cfg, linear="bf16") if high else cfg,
                     name=f"block_{i}")(x)
    x = NORMS[cfg.norm](dtype=COMPUTE, name="ln_final")(x)
    # The LM head stays a plain bf16 nn.Dense in every variant: the logits feed the softmax
    # directly and are the most precision-sensitive matmul, as in common FP8 recipes.
    logits = nn.Dense(cfg.vocab, use_bias=cfg.use_bias, dtype=COMPUTE, param_dtype=pdt,
                      name="lm_head", **_init(cfg))(x)
    return logits.astype(jnp.float32)
