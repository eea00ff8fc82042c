"""A transformer block train step, FP8 (jax_fp8.flax.Dense) against BF16 (flax.linen.Dense):
attention projections (fused q/k/v, output) and a SwiGLU MLP, bf16 attention
(``jax.nn.dot_product_attention``: cuDNN's fused attention on a GPU, as training stacks use,
XLA's elsewhere), pre-RMSNorm, at the shape of the block-step anchor in docs/performance.md
(d_model 4096, ffn 14336, seq 2048, batch 8)."""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

import jax_fp8
from jax_fp8.flax import Dense


class Block(nn.Module):
  """x [B, T, D] bf16 -> [B, T, D] bf16; every matmul through ``dense``."""

  heads: int
  ffn: int
  dense: type
  attention: str | None = None  # jax.nn.dot_product_attention's implementation

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    layer = functools.partial(self.dense, use_bias=False, dtype=jnp.bfloat16)
    h = nn.RMSNorm(dtype=jnp.bfloat16)(x)
    q, k, v = jnp.split(layer(3 * d, name="qkv")(h).reshape(b, t, 3, self.heads, -1), 3, axis=2)
    a = jax.nn.dot_product_attention(q[:, :, 0], k[:, :, 0], v[:, :, 0], is_causal=True,
                                     implementation=self.attention)
    x = x + layer(d, name="out")(a.reshape(b, t, d))
    h = nn.RMSNorm(dtype=jnp.bfloat16)(x)
    gate, up = layer(self.ffn, name="w1")(h), layer(self.ffn, name="w3")(h)
    return x + layer(d, name="w2")(jax.nn.silu(gate) * up)


def train_step_fn(block: Block):
  """``(params, fp8_state, x) -> (grads, next fp8_state)`` for loss = mean(block(x)^2)."""
  def loss(params, state, x):
    y = block.apply({"params": params, "fp8_state": state}, x)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))

  def step(params, state, x):
    grads, state_grads = jax.grad(loss, argnums=(0, 1))(params, state, x)
    return grads, jax_fp8.update_state(state, state_grads)
  return step


def setup(recipe: jax_fp8.DelayedScaling | None, d_model: int, ffn: int, heads: int, seq: int,
          batch: int):
  """The block (FP8 under ``recipe``, or BF16 for None), its variables (params in bf16, a
  warm FP8 state) and an input."""
  fp8 = recipe is not None
  block = Block(heads, ffn, functools.partial(Dense, recipe=recipe) if fp8 else nn.Dense,
                attention="cudnn" if jax.default_backend() == "gpu" else None)
  x = jax.random.normal(jax.random.key(0), (batch, seq, d_model), jnp.bfloat16)
  variables = jax.jit(block.init)(jax.random.key(1), x)
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), variables["params"])
  state = variables.get("fp8_state", {})
  if fp8:  # past the rings' first step
    state = jax.jit(train_step_fn(block))(params, state, x)[1]
  return block, params, state, x
