"""The suite's transformer block train step, FP8 (``jax_fp8.flax.Dense``) against BF16
(``flax.linen.Dense``): one ``jax_fp8.demo.model.Block`` of the Llama-style options
(``LLAMA``), pre-RMSNorm, q / k / v one projection cut by ``jnp.split`` (``qkv="fused"``), no
position embedding, a SwiGLU MLP of gate, up and down projections, bf16 attention
(``jax.nn.dot_product_attention``: cuDNN's fused attention on a GPU, as training stacks use,
XLA's elsewhere), parameters in bf16; its step the gradients of mean(block(x)^2) and the next
FP8 state (``jax_fp8.demo.train.make_grad_step``), at the shape of the block-step anchor in
docs/performance.md (``BLOCK``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_fp8
from jax_fp8.demo.model import LLAMA, Block, Config
from jax_fp8.demo.train import make_grad_step

BLOCK = dict(d_model=4096, ffn=14336, heads=32, seq=2048, batch=8)
QUICK_BLOCK = dict(d_model=128, ffn=256, heads=2, seq=64, batch=2)


def config(recipe: jax_fp8.DelayedScaling | None, d_model: int, ffn: int, heads: int,
           seq: int) -> Config:
  """The block's model options: FP8 under ``recipe`` (delayed scaling, any
  ``fast_accum_gemms``), or BF16 (``flax.linen.Dense``) for None."""
  fp8 = (dict(linear="flax") if recipe is None else
         dict(recipe="delayed", fast_accum_gemms=recipe.fast_accum_gemms))
  cfg = Config(d_model, heads, 1, seq, d_ff=ffn, **dict(LLAMA, position=None, qkv="fused",
                                                          scan=False), **fp8)
  if recipe is not None and cfg.recipe_object() != recipe:
    raise ValueError(f"the block runs DelayedScaling with fast_accum_gemms only, got {recipe}")
  return cfg


def setup(recipe: jax_fp8.DelayedScaling | None, d_model: int, ffn: int, heads: int, seq: int,
          batch: int):
  """The block (FP8 under ``recipe``, or BF16 for None), its variables (params in bf16, the
  other collections: a warm FP8 state), an input and its step ``(params, collections, x) ->
  (grads, collections)``."""
  block = Block(config(recipe, d_model, ffn, heads, seq))
  x = jax.random.normal(jax.random.key(0), (batch, seq, d_model), jnp.bfloat16)
  variables = dict(jax.jit(block.init)(jax.random.key(1), x))
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), variables.pop("params"))
  step = make_grad_step(block)
  if recipe is not None:  # past the rings' first step
    variables = jax.jit(step)(params, variables, x)[1]
  return step, params, variables, x
