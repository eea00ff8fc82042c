"""The model: a byte-level decoder-only transformer (GPT style, pre-LayerNorm) in Flax linen.

With ``fp8=True`` every matmul inside the blocks is FP8 under ``recipe`` ("delayed": per-tensor
delayed scaling, HYBRID; "current": per-tensor current scaling, HYBRID; "block": DeepSeek-style
block scaling; "mxfp8": MXFP8 blocks; "nvfp4": the NVFP4 report's recipe, its last
``NVFP4_BF16_SHARE`` of the blocks in BF16 as the report keeps them; MXFP8 and NVFP4 GEMMs
emulated on Hopper): the fused q/k/v projection and
the attention output projection are ``jax_fp8.flax.Dense``, the MLP a ``jax_fp8.flax.Mlp``;
the LayerNorms before q/k/v and the MLP are those layers' own (``norm="layernorm"``), and
under the per-tensor recipes they and the MLP's GELU are computed inside the FP8
cast-transposes.
With ``fp8=False`` the same layers compute in bf16 (``Bf16Dense``, ``Bf16Mlp``, the LayerNorm
by ``jax_fp8.norms``). Both variants name their parameters the same and create them in the same
order, so one seed gives both exactly the same initial parameters.

Dtypes: parameters f32; the residual stream f32; LayerNorm outputs, matmuls and attention in
bf16 (softmax in f32); logits f32.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp

import jax_fp8
import jax_fp8.flax
from jax_fp8.formats import DIM_MULTIPLE

from .data import VOCAB

COMPUTE = jnp.bfloat16
RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.CurrentScaling(),
           "block": jax_fp8.BlockScaling(), "mxfp8": jax_fp8.MXFP8BlockScaling(),
           "nvfp4": jax_fp8.NVFP4BlockScaling()}
PER_TENSOR = ("delayed", "current")  # the recipes with one scale a tensor (and fast_accum_gemms)
# The share of the last blocks that the NVFP4 report (arXiv 2509.25149) keeps in higher
# precision (about 15% of the linear layers), rounded to whole blocks.
NVFP4_BF16_SHARE = 0.15
INIT = nn.initializers.normal(0.02)
ATTENTION = ("cudnn", "xla")  # the implementations of jax.nn.dot_product_attention it runs


def default_attention(platform: str) -> str:
  """The attention the model runs on devices of ``platform`` ("gpu", "cpu", ...) unless told:
  cuDNN's fused attention on a GPU, XLA's elsewhere."""
  return "cudnn" if platform == "gpu" else "xla"


@dataclasses.dataclass(frozen=True)
class Config:
  """Model size and FP8 recipe. ``d_model`` must be a multiple of 16 (FP8 GEMM alignment; 128
  under the block recipe, whose groups are 128 wide, 32 under MXFP8) and of ``n_heads``."""

  d_model: int
  n_heads: int
  n_layers: int
  seq_len: int
  vocab: int = VOCAB
  fp8: bool = True
  recipe: str = "delayed"
  amax_axis_name: str | None = None  # the data-parallel axis, under shard_map (per-tensor)
  # jax.nn.dot_product_attention's implementation, "cudnn" or "xla"; None: cuDNN's fused
  # attention on a GPU backend (as training stacks run it), XLA's on any other. XLA's is
  # deterministic on a GPU too, where cuDNN's backward adds in no fixed order.
  attention: str | None = None
  # The per-tensor recipes' GEMMs with fast accumulation (DelayedScaling.fast_accum_gemms).
  fast_accum_gemms: tuple[str, ...] = ()

  @property
  def d_ff(self) -> int:
    return 4 * self.d_model

  @property
  def bf16_blocks(self) -> int:
    """How many of the last blocks run in BF16 under an FP8 recipe (NVFP4's, see
    ``NVFP4_BF16_SHARE``; none under the others)."""
    return round(NVFP4_BF16_SHARE * self.n_layers) if self.fp8 and self.recipe == "nvfp4" else 0

  def recipe_object(self):
    """The jax_fp8 recipe the FP8 layers take: ``RECIPES[recipe]``, with ``fast_accum_gemms``."""
    recipe = RECIPES[self.recipe]
    if self.fast_accum_gemms:
      recipe = dataclasses.replace(recipe, fast_accum_gemms=self.fast_accum_gemms)
    return recipe

  @property
  def attention_implementation(self) -> str:
    return self.attention or default_attention(jax.default_backend())

  def __post_init__(self):
    if self.recipe not in RECIPES:
      raise ValueError(f"recipe must be one of {sorted(RECIPES)}, got {self.recipe!r}")
    if self.attention not in (None, *ATTENTION):
      raise ValueError(f"attention must be None or one of {ATTENTION}, got {self.attention!r}")
    if self.fast_accum_gemms:
      if self.recipe not in PER_TENSOR:
        raise ValueError(f"fast_accum_gemms applies to the per-tensor recipes {PER_TENSOR}, not "
                         f"to recipe {self.recipe!r}")
      self.recipe_object()  # the recipe checks the GEMM names
    align = self.recipe_object().dim_multiple if self.fp8 else DIM_MULTIPLE
    if self.d_model % align or self.d_model % self.n_heads:
      raise ValueError(f"d_model={self.d_model} must be a multiple of {align} and of "
                       f"n_heads={self.n_heads}")


def _fp8_kw(cfg: Config, norm: bool) -> dict:
  # BlockScaling's and MXFP8's scales are device-local: no amax to reduce (NVFP4's global
  # scales are per tensor)
  axis = cfg.amax_axis_name if cfg.recipe in (*PER_TENSOR, "nvfp4") else None
  return dict(recipe=cfg.recipe_object(), amax_axis_name=axis,
              norm="layernorm" if norm else None)


def _layer_norm(module: nn.Module, x, norm: bool):
  """x through a LayerNorm whose "gamma" and "beta" the module creates, as jax_fp8's layers
  with ``norm="layernorm"`` name them (after their kernels and biases), in bf16; x itself
  without a norm."""
  if not norm:
    return x
  d = x.shape[-1]
  gamma = module.param("gamma", nn.initializers.ones_init(), (d,), jnp.float32)
  beta = module.param("beta", nn.initializers.zeros_init(), (d,), jnp.float32)
  return jax_fp8.norms.normalize(x, gamma, beta, norm="layernorm", epsilon=1e-6).astype(COMPUTE)


class Bf16Dense(nn.Module):
  """``nn.Dense`` in bf16 with f32 parameters, optionally after a LayerNorm of its input, its
  output cut into ``parts`` equal parts (a tuple) where more than one: the parameters of
  ``jax_fp8.flax.Dense(features, norm=...)``, named and created in its order. The parts are
  indexed out of the output viewed as [..., parts, features / parts], as the model did before
  its FP8 layer took ``split``: XLA fuses that indexing's backward into the bias gradient's
  reduction, where ``jnp.split``'s (a concatenation) ran as passes of their own."""

  features: int
  norm: bool = False
  parts: int = 1

  @nn.compact
  def __call__(self, x):
    kernel = self.param("kernel", INIT, (x.shape[-1], self.features), jnp.float32)
    bias = self.param("bias", nn.initializers.zeros_init(), (self.features,), jnp.float32)
    y = _layer_norm(self, x, self.norm) @ kernel.astype(COMPUTE) + bias.astype(COMPUTE)
    if self.parts == 1:
      return y
    y = y.reshape(*y.shape[:-1], self.parts, self.features // self.parts)
    return tuple(y[..., i, :] for i in range(self.parts))


def dense(cfg: Config, features: int, name: str, norm: bool = False, parts: int = 1) -> nn.Module:
  """A bf16-compute linear layer with f32 parameters, its input LayerNorm fused where ``norm``
  and its output cut into ``parts`` equal parts (a tuple) where more than one: FP8 (jax_fp8,
  ``split=``, so the parts' gradients reach its backward separately) or plain, per
  ``cfg.fp8``."""
  if cfg.fp8:
    split = (features // parts,) * parts if parts > 1 else None
    return jax_fp8.flax.Dense(features, dtype=COMPUTE, param_dtype=jnp.float32, kernel_init=INIT,
                              name=name, split=split, **_fp8_kw(cfg, norm))
  return Bf16Dense(features, norm, parts, name=name)


class Bf16Mlp(nn.Module):
  """The MLP ``gelu(ln(h) @ kernel_in + bias_in) @ kernel_out + bias_out`` in bf16 with f32
  parameters, named and created in the order of ``jax_fp8.flax.Mlp(norm="layernorm")``'s.
  h: [B, T, D]."""

  d_ff: int

  @nn.compact
  def __call__(self, h):
    d = h.shape[-1]
    k_in = self.param("kernel_in", INIT, (d, self.d_ff), jnp.float32)
    k_out = self.param("kernel_out", INIT, (self.d_ff, d), jnp.float32)
    b_in = self.param("bias_in", nn.initializers.zeros_init(), (self.d_ff,), jnp.float32)
    b_out = self.param("bias_out", nn.initializers.zeros_init(), (d,), jnp.float32)
    h = nn.gelu(_layer_norm(self, h, True) @ k_in.astype(COMPUTE) + b_in.astype(COMPUTE))
    return h @ k_out.astype(COMPUTE) + b_out.astype(COMPUTE)


def mlp(cfg: Config, name: str) -> nn.Module:
  """The block's MLP with its input LayerNorm, d_model -> d_ff -> d_model with GELU: FP8
  (jax_fp8) or plain."""
  if cfg.fp8:
    return jax_fp8.flax.Mlp(cfg.d_ff, activation="gelu", dtype=COMPUTE,
                            param_dtype=jnp.float32, kernel_init=INIT, name=name,
                            **_fp8_kw(cfg, True))
  return Bf16Mlp(cfg.d_ff, name=name)


def causal_attention(q, k, v, implementation: str):
  """Softmax attention with a causal mask, by ``jax.nn.dot_product_attention``.

  Args:
    q, k, v: bf16 [B, T, H, Dh].
    implementation: "cudnn" or "xla" (``Config.attention``).
  Returns:
    bf16 [B, T, H, Dh].
  """
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=implementation)


class Block(nn.Module):
  """Pre-LN block: ``x + attn(ln(x))`` then ``x + mlp(ln(x))``, each LayerNorm inside the
  layer after it. x: f32 [B, T, D] -> same."""

  cfg: Config

  @nn.compact
  def __call__(self, x):
    cfg = self.cfg
    b, t, d = x.shape
    # q, k and v as parts of one projection's output, so that their gradients reach its FP8
    # backward separately (jax_fp8.linear's split)
    q, k, v = (y.reshape(b, t, cfg.n_heads, d // cfg.n_heads)
               for y in dense(cfg, 3 * d, "qkv", norm=True, parts=3)(x))
    a = causal_attention(q, k, v, cfg.attention_implementation).reshape(b, t, d)
    x = x + dense(cfg, d, "attn_out")(a).astype(x.dtype)
    return x + mlp(cfg, "mlp")(x).astype(x.dtype)


class Transformer(nn.Module):
  """Byte-level decoder-only language model.

  Input: int [B, T] byte values with T <= ``cfg.seq_len``. Output: f32 [B, T, vocab] logits
  for the next byte.
  """

  cfg: Config

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab, cfg.d_model, embedding_init=INIT, name="tok_embed")(tokens)
    pos = nn.Embed(cfg.seq_len, cfg.d_model, embedding_init=INIT, name="pos_embed")
    x = x + pos(jnp.arange(tokens.shape[1]))[None]  # f32 residual stream [B, T, D]
    for i in range(cfg.n_layers):
      high = i >= cfg.n_layers - cfg.bf16_blocks
      x = Block(dataclasses.replace(cfg, fp8=False) if high else cfg, name=f"block_{i}")(x)
    x = nn.LayerNorm(dtype=COMPUTE, name="ln_final")(x)
    # The LM head stays a plain bf16 nn.Dense in both variants: the logits feed the softmax
    # directly and are the most precision-sensitive matmul, as in common FP8 recipes.
    logits = nn.Dense(cfg.vocab, dtype=COMPUTE, kernel_init=INIT, name="lm_head")(x)
    return logits.astype(jnp.float32)
