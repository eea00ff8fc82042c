"""The demo transformer's non-FP8 layers (``jax_fp8.demo.model`` picks them by ``Config.linear``):
``Bf16Dense`` and ``Bf16Mlp``, the bf16 twins of ``jax_fp8.flax.Dense`` / ``Mlp``;
``KernelCopyDense``, the kernel-copy twin; ``Bf16MoeMlp``, the bf16 twin of
``jax_fp8.flax.MoeMlp``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

import jax_fp8
import jax_fp8.flax
from jax_fp8 import activations, moe_routing, norms

COMPUTE = jnp.bfloat16
LOAD_BALANCING = "load_balancing_loss"  # the name a MoE layer sows its auxiliary loss under


def _normalized(module: nn.Module, x, norm: str | None):
  """x through the norm ``norm`` whose "gamma" (and LayerNorm's "beta") the module creates, as
  jax_fp8's layers with ``norm=`` name them (after their kernels and biases), in bf16; x itself
  without a norm."""
  if norm is None:
    return x
  d = x.shape[-1]
  gamma = module.param("gamma", nn.initializers.ones_init(), (d,), jnp.float32)
  beta = (module.param("beta", nn.initializers.zeros_init(), (d,), jnp.float32)
          if norms.centered(norm) else None)
  return norms.normalize(x, gamma, beta, norm=norm, epsilon=1e-6).astype(COMPUTE)


class _Projection(nn.Module):
  """The fields of a projection layer, as ``nn.Dense`` names them."""

  features: int
  use_bias: bool = True
  dtype: type = COMPUTE
  param_dtype: type = jnp.float32
  kernel_init: object = nn.initializers.lecun_normal()

  def kernel_and_bias(self, k: int):
    """The kernel [k, features] and the bias [features] (None without), in that order."""
    kernel = self.param("kernel", self.kernel_init, (k, self.features), self.param_dtype)
    bias = (self.param("bias", nn.initializers.zeros_init(), (self.features,), self.param_dtype)
            if self.use_bias else None)
    return kernel, bias


class Bf16Dense(_Projection):
  """The bf16 twin of ``jax_fp8.flax.Dense(features, norm=..., split=...)``: its parameters,
  named and created in its order, its input normalized first where ``norm``, its output cut
  into ``parts`` equal parts (a tuple) where more than one. The parts are indexed out of the
  output viewed as [..., parts, features / parts]: XLA fuses that indexing's backward into the
  bias gradient's reduction, where ``jnp.split``'s (a concatenation) ran as passes of their
  own."""

  norm: str | None = None
  parts: int = 1

  @nn.compact
  def __call__(self, x):
    kernel, bias = self.kernel_and_bias(x.shape[-1])
    y = _normalized(self, x, self.norm) @ kernel.astype(self.dtype)
    if bias is not None:
      y = y + bias.astype(self.dtype)
    if self.parts == 1:
      return y
    y = y.reshape(*y.shape[:-1], self.parts, self.features // self.parts)
    return tuple(y[..., i, :] for i in range(self.parts))


class Bf16Mlp(nn.Module):
  """The bf16 twin of ``jax_fp8.flax.Mlp(d_ff, activation="gelu", norm=...)``:
  ``gelu(norm(h) @ kernel_in + bias_in) @ kernel_out + bias_out``, its parameters named and
  created in that layer's order. h: [B, T, D]."""

  d_ff: int
  norm: str | None = None
  use_bias: bool = True
  dtype: type = COMPUTE
  param_dtype: type = jnp.float32
  kernel_init: object = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, h):
    d = h.shape[-1]
    k_in = self.param("kernel_in", self.kernel_init, (d, self.d_ff), self.param_dtype)
    k_out = self.param("kernel_out", self.kernel_init, (self.d_ff, d), self.param_dtype)
    zeros = nn.initializers.zeros_init()
    b_in, b_out = ((self.param("bias_in", zeros, (self.d_ff,), self.param_dtype),
                    self.param("bias_out", zeros, (d,), self.param_dtype))
                   if self.use_bias else (None, None))
    h = _normalized(self, h, self.norm) @ k_in.astype(self.dtype)
    h = nn.gelu(h if b_in is None else h + b_in.astype(self.dtype)) @ k_out.astype(self.dtype)
    return h if b_out is None else h + b_out.astype(self.dtype)


class KernelCopyDense(_Projection):
  """``jax_fp8.flax.Dense`` (delayed scaling) with its kernel cast to the compute dtype before
  the quantization, as the layer did before it quantized f32 master weights directly: the
  ``benchmarks.model_step`` variant that shows that fusion's gain."""

  @nn.compact
  def __call__(self, x):
    kernel, bias = self.kernel_and_bias(x.shape[-1])
    state = self.variable(jax_fp8.flax.STATE_COLLECTION, "linear",
                          jax_fp8.LinearState.create).value
    return jax_fp8.linear(x, kernel.astype(self.dtype),
                          None if bias is None else bias.astype(self.dtype), state=state)


class Bf16MoeMlp(nn.Module):
  """The bf16 twin of ``jax_fp8.flax.MoeMlp(num_experts, top_k, hidden_features, activation)``
  (no shared expert, one device): its parameters "router" [D, E], "w_in" [E, D, F] and "w_out"
  [E, H, D], created in its order; the router in f32, ``jax_fp8.moe_routing``'s top-k routing
  and permutation, the experts through ``jax.lax.ragged_dot`` in ``dtype`` (the activation in
  f32 between, as ``moe_mlp``), the load-balancing loss sown as ``LOAD_BALANCING`` in
  "intermediates". h: [..., D] -> [..., D] in ``dtype``. Its parameters and routing
  (``route``) are the capacity-factor peers' too (``jax_fp8.demo.capacity_moe``)."""

  num_experts: int
  top_k: int
  hidden_features: int
  activation: str = "swiglu"
  dtype: type = COMPUTE
  param_dtype: type = jnp.float32
  kernel_init: object = nn.initializers.lecun_normal(batch_axis=(0,))
  router_init: object = nn.initializers.lecun_normal()

  def route(self, h):
    """The parameters and the routing of h [..., D], from the module's ``__call__``: (tokens
    [T, D], w_in, w_out, all in ``dtype``; ``moe_routing.Routing`` of the T tokens), the
    load-balancing loss sown."""
    d, e, f = h.shape[-1], self.num_experts, self.hidden_features
    _, gated = activations.check(self.activation, f"{type(self).__name__}.activation")
    router = self.param("router", self.router_init, (d, e), self.param_dtype)
    w_in = self.param("w_in", self.kernel_init, (e, d, 2 * f if gated else f), self.param_dtype)
    w_out = self.param("w_out", self.kernel_init, (e, f, d), self.param_dtype)
    tokens = h.reshape(-1, d).astype(self.dtype)
    logits = jnp.dot(tokens.astype(jnp.float32), router.astype(jnp.float32),
                     precision=jax.lax.Precision.HIGHEST)
    routing = moe_routing.top_k_routing(logits, self.top_k)
    self.sow("intermediates", LOAD_BALANCING, moe_routing.load_balancing_loss(routing))
    return tokens, w_in.astype(self.dtype), w_out.astype(self.dtype), routing

  @nn.compact
  def __call__(self, h):
    tokens, w_in, w_out, routing = self.route(h)
    perm = moe_routing.permute(tokens, routing.experts, self.num_experts)
    y = jax.lax.ragged_dot(perm.rows, w_in, perm.group_sizes)
    y = activations.apply(y, self.activation).astype(self.dtype)
    y = jax.lax.ragged_dot(y, w_out, perm.group_sizes)
    return moe_routing.unpermute(y, perm, routing.weights).reshape(h.shape)
