"""Flax (linen) layers backed by jax_fp8.linear, mlp and moe_mlp, and the state classes registered
with flax.serialization (so ``flax.serialization.to_bytes`` / ``from_bytes`` and Flax checkpoints
carry the FP8 state). Needs the ``flax`` extra (``pip install jax_fp8[flax]``); importing this
module registers the state classes."""

from __future__ import annotations

from typing import Any, Callable

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import serialization

from . import _names, activations, checks, norms
from ._flax_cast import cast_kernels
from ._layer import (SR_STREAM, call_layer, call_mlp, call_moe, check_layer, check_moe_layer,
                     check_norm_attr, create_state, linen_key)
from .inference import Fp8Weight
from .cast_kernel import CastKernel
from .layer_state import (MLP_RINGS, GroupedLinearState, GroupedMlpState, LinearState, MlpState,
                          MultiLinearState)
from .moe import MoeState, expert_init, local_experts
from .recipes import DelayedScaling, Recipe
from .state import ScaleRing

__all__ = ["SR_STREAM", "STATE_COLLECTION", "Dense", "Mlp", "MoeMlp", "MultiDense", "cast_kernels",
           "fp8_state_variable"]

STATE_COLLECTION = "fp8_state"


def _register(cls, fields):
  """State dicts hold the array fields; the static ones (format, margin, ...) come from the
  restore target, as Flax restores do."""
  serialization.register_serialization_state(
      cls,
      lambda obj: {f: serialization.to_state_dict(getattr(obj, f)) for f in fields},
      lambda target, state: dataclasses.replace(target, **{
          f: serialization.from_state_dict(getattr(target, f), state[f]) for f in fields}))


_register(ScaleRing, ("amax_history", "scale", "steps"))
_register(LinearState, ("x", "kernel", "grad"))
_register(MultiLinearState, ("x", "kernels", "grads"))
_register(MlpState, MLP_RINGS)
_register(GroupedLinearState, ("x", "kernels", "grad"))
_register(GroupedMlpState, MLP_RINGS)
_register(MoeState, ("experts",))


def _kernel(module: nn.Module, name: str, shape):
  """The module's kernel parameter ``name``: a stored ``Fp8Weight`` (inference) or
  ``CastKernel`` (``cast_kernels``) as it is, else ``module.param`` of ``shape``."""
  if module.has_variable("params", name):
    stored = module.get_variable("params", name)
    held = (jnp.shape(stored.kernel) if isinstance(stored, CastKernel) else
            jnp.shape(stored.q)[::-1] if isinstance(stored, Fp8Weight) else None)  # q is [N, K]
    if held is not None and held != tuple(shape):
      kind = "an Fp8Weight" if isinstance(stored, Fp8Weight) else "a CastKernel"
      raise ValueError(f"{type(module).__name__}'s {name} is {kind} of a {list(held)} kernel; "
                       f"the layer's is {list(shape)}")
    if held is not None:
      return stored
  return module.param(name, module.kernel_init, shape, module.param_dtype)


def _norm_args(module: nn.Module, name: str, k: int):
  """(norm, gamma, beta, epsilon) of a layer's fused input norm: its "gamma" [K] (ones) and,
  for LayerNorm, "beta" [K] (zeros) parameters, made inside the module's compact call."""
  centered = check_norm_attr(name, module.norm, module.norm_epsilon)
  if module.norm is None:
    return None, None, None, module.norm_epsilon
  gamma = module.param("gamma", nn.initializers.ones_init(), (k,), module.param_dtype)
  beta = (module.param("beta", nn.initializers.zeros_init(), (k,), module.param_dtype)
          if centered else None)
  return module.norm, gamma, beta, module.norm_epsilon


def fp8_state_variable(module: nn.Module, name: str, create, *args):
  """The layer's ``name`` variable in the "fp8_state" collection (its ``DelayedScaling``
  rings), made by ``create(*args)`` where the collection is mutable. A ValueError saying how to
  pass the collection where the call can neither read nor create it (Flax's own error names
  the collection but not the remedy)."""
  if (not module.has_variable(STATE_COLLECTION, name)
      and not module.is_mutable_collection(STATE_COLLECTION)):
    raise ValueError(f"{type(module).__name__} under DelayedScaling keeps its scale rings in "
                     f"the \"{STATE_COLLECTION}\" collection, and this call has no variable "
                     f"\"{name}\" there for the layer at {module.scope.path_text}: apply with "
                     f"the variables init returned (params and {STATE_COLLECTION}); under "
                     f"nn.scan list \"{STATE_COLLECTION}\" in variable_axes")
  return module.variable(STATE_COLLECTION, name, create, *args).value


class _Layer(nn.Module):
  """The fields and body shared by ``Dense`` and ``MultiDense`` (which set ``features``)."""

  features: Any
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros_init()
  recipe: Recipe = DelayedScaling()
  amax_axis_name: str | None = None
  norm: str | None = None
  norm_epsilon: float = norms.EPSILON

  def outputs(self, inputs: jax.Array, multi: bool, split=None) -> tuple[jax.Array, ...]:
    """The layer's checks, parameters, state and op call (``multi`` False: ``linear`` on the
    one kernel, its output cut as ``split`` says), inside the subclass's compact
    ``__call__``."""
    name = type(self).__name__
    features, use_bias = check_layer(name, self.features, self.use_bias, self.recipe, multi,
                                     self.dtype, self.param_dtype)
    if jnp.ndim(inputs) < 1:
      raise ValueError(f"{name} inputs must be [..., K], got a scalar")
    names = _names.suffixes(len(features), multi)
    kernels = tuple(_kernel(self, f"kernel{sfx}", (jnp.shape(inputs)[-1], f))
                    for sfx, f in zip(names, features))
    biases = tuple(self.param(f"bias{sfx}", self.bias_init, (f,), self.param_dtype)
                   if use_bias else None for sfx, f in zip(names, features))
    state = (fp8_state_variable(self, "linear", create_state, self.recipe,
                        len(features) if multi else None)
             if self.recipe.stateful else None)
    # init usually runs outside the pmap / shard_map whose axis is named; the axis serves the
    # backward only, and init takes no gradient.
    axis = None if self.is_initializing() else self.amax_axis_name
    return call_layer(inputs, kernels, biases, state, self.recipe, self.dtype, axis, multi,
                      _norm_args(self, name, jnp.shape(inputs)[-1]), linen_key(self, self.recipe),
                      split)


class Dense(_Layer):
  """Drop-in for ``flax.linen.Dense`` whose matmuls run in FP8 (``jax_fp8.linear``).

  Same parameters as ``nn.Dense`` ("kernel" [K, N], "bias" [N]) with the same default
  initializers. The kernel is quantized from its parameter dtype (f32 master weights straight
  to FP8, with no copy in ``dtype``); inputs and output are in ``dtype``. Under
  ``DelayedScaling`` the layer's scale rings live in the "fp8_state" variable collection as a
  ``LinearState`` named "linear": pass that collection to ``apply``, differentiate with
  respect to it, and pass that gradient to ``jax_fp8.update_state`` for the next rings. Under
  the other recipes the layer has no state. Under ``NVFP4BlockScaling`` with stochastic
  rounding the gradient's rounding draws ``make_rng("stochastic_rounding")`` each call: pass
  ``rngs={"stochastic_rounding": key}`` to ``apply``, a fresh key each step (``SR_STREAM``;
  under ``nn.scan`` / ``nn.vmap`` also in ``split_rngs``); a forward without it runs, a
  gradient without it raises ValueError.

  Attributes:
    features: N, a multiple of 16 (128 under BlockScaling, 32 under MXFP8BlockScaling).
    use_bias, dtype, param_dtype, kernel_init, bias_init: as in ``nn.Dense``.
    recipe: ``DelayedScaling`` (per-tensor, default), ``CurrentScaling`` (per-tensor,
      stateless), ``BlockScaling`` (DeepSeek-V3), ``MXFP8BlockScaling`` or
      ``NVFP4BlockScaling``.
    amax_axis_name: replica axis for amax reduction under pmap / shard_map (the per-tensor
      recipes and NVFP4's global amaxes).
    norm: None (default), "rmsnorm" or "layernorm": the input is normalized first, in its own
      dtype (as ``nn.LayerNorm`` reads an f32 residual stream), the norm fused into its FP8
      quantization (``jax_fp8.linear``'s ``norm``; TransformerEngine's
      LayerNormDenseGeneral), with parameters "gamma" [K] (ones) and, for LayerNorm, "beta"
      [K] (zeros). LayerNorm's variance is ``E[x^2] - mu^2``, as ``nn.LayerNorm``'s default.
    norm_epsilon: the norm's epsilon (default 1e-6, as ``nn.RMSNorm`` / ``nn.LayerNorm``).
    split: None (default), or sizes (N_0, ..., N_{n-1}) that cut the output along N, as
      ``jax_fp8.linear``'s ``split``: 1 to 4 positive multiples of 16 that sum to
      ``features``, e.g. (d, d, d) for a fused q / k / v projection; under the per-tensor
      recipes the parts' gradients then reach the FP8 backward without being concatenated.

  Input ``[..., K]`` with K a multiple of 16 (128 under BlockScaling, 32 under
  MXFP8BlockScaling); output ``[..., N]``, or with ``split`` a tuple of n arrays
  ``[..., N_i]``.
  """

  features: int
  split: tuple[int, ...] | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
    ys = self.outputs(inputs, multi=False, split=self.split)
    return ys[0] if self.split is None else ys


class MultiDense(_Layer):
  """Several dense layers on one input, their FP8 quantization of the input shared
  (``jax_fp8.multi_linear``): q / k / v projections, or an MLP's gate and up projections, with
  one quantization of x for all, where separate ``Dense`` layers quantize it once each.

  Parameters "kernel_i" [K, N_i] and "bias_i" [N_i], i = 0 .. n-1, with ``nn.Dense``'s
  initializers; under ``DelayedScaling`` a ``MultiLinearState`` named "linear" in the
  "fp8_state" collection (handled as ``Dense``'s state is).

  Attributes:
    features: (N_0, ..., N_{n-1}), each a multiple of 16 (128 under BlockScaling, 32 under
      MXFP8BlockScaling).
    use_bias, dtype, param_dtype, kernel_init, bias_init, recipe, amax_axis_name, norm,
      norm_epsilon: as in ``Dense`` (the norm, fused once, feeds every output).

  Input ``[..., K]``; output a tuple of n arrays ``[..., N_i]``.
  """

  features: tuple[int, ...]

  @nn.compact
  def __call__(self, inputs: jax.Array) -> tuple[jax.Array, ...]:
    return self.outputs(inputs, multi=True)


class Mlp(nn.Module):
  """An MLP block, up projection, activation, down projection, in FP8 with the activation and
  its gradient fused into the cast-transposes (``jax_fp8.mlp``): where ``Dense`` layers around
  a jnp activation write the activation (and, in the backward, its gradient) in ``dtype`` and
  quantize it again, this layer never stores either.

  Parameters "kernel_in" [K, N] (N = hidden_features, or 2 * hidden_features for a gated
  activation: gate and up side by side, one GEMM), "kernel_out" [hidden_features, D],
  "bias_in" [N] and "bias_out" [D] with ``use_bias``, each with ``nn.Dense``'s initializers;
  under ``DelayedScaling`` an ``MlpState`` named "mlp" in the "fp8_state" collection (handled
  as ``Dense``'s state is).

  Attributes:
    hidden_features: F, a multiple of 16 (128 under BlockScaling, 32 under MXFP8BlockScaling).
    activation: "swiglu" (default), "geglu", "silu" or "gelu" (``jax_fp8.activations``).
    out_features: D; None (default) gives the input's K.
    use_bias, dtype, param_dtype, kernel_init, bias_init, recipe, amax_axis_name, norm,
      norm_epsilon: as in ``Dense`` (with a norm, TransformerEngine's LayerNormMLP).

  Input ``[..., K]``; output ``[..., D]`` in ``dtype``.
  """

  hidden_features: int
  activation: str = "swiglu"
  out_features: int | None = None
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros_init()
  recipe: Recipe = DelayedScaling()
  amax_axis_name: str | None = None
  norm: str | None = None
  norm_epsilon: float = norms.EPSILON

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    (f,), use_bias = check_layer("Mlp", self.hidden_features, self.use_bias, self.recipe, False,
                                 self.dtype, self.param_dtype, "hidden_features")
    _, gated = activations.check(self.activation, "Mlp.activation")
    if jnp.ndim(inputs) < 1:
      raise ValueError("Mlp inputs must be [..., K], got a scalar")
    k = jnp.shape(inputs)[-1]
    d = k if self.out_features is None else checks.integer(self.out_features,
                                                           "Mlp.out_features", lo=1)
    n = 2 * f if gated else f
    kernel_in, kernel_out = _kernel(self, "kernel_in", (k, n)), _kernel(self, "kernel_out", (f, d))
    biases = ((self.param("bias_in", self.bias_init, (n,), self.param_dtype),
               self.param("bias_out", self.bias_init, (d,), self.param_dtype))
              if use_bias else (None, None))
    state = (fp8_state_variable(self, "mlp", MlpState.create, self.recipe)
             if self.recipe.stateful else None)
    axis = None if self.is_initializing() else self.amax_axis_name
    return call_mlp(inputs, (kernel_in, kernel_out), biases, state, self.recipe, self.dtype,
                    self.activation, axis, _norm_args(self, "Mlp", k),
                    linen_key(self, self.recipe))


class MoeMlp(nn.Module):
  """A mixture-of-experts MLP block with FP8 experts (``jax_fp8.moe.moe_mlp``): a router in f32,
  top-k routing, every expert an MLP (``hidden_features`` wide, gated by default) run as
  grouped FP8 GEMMs forward and backward with the activation inside their cast-transposes
  (``grouped_mlp``), and an optional shared expert that every token
  passes through (a ``jax_fp8.flax.Mlp``, DeepSeek-V3's shared expert).

  Parameters: "router" [D, E]; "w_in" [E, D, F] (F = 2 * hidden_features for a gated
  activation: gate and up side by side) and "w_out" [E, hidden_features, D], each expert's
  initialised as ``nn.Dense``'s kernel; with ``shared_hidden_features`` the submodule "shared".
  Under ``DelayedScaling`` a ``MoeState`` named "moe" in the "fp8_state" collection (as
  ``Dense``'s state). The load-balancing loss is sown as "load_balancing_loss" in the
  "intermediates" collection (``apply(..., mutable=["intermediates"])`` returns it).

  Attributes:
    num_experts: E, 1 to 1024 (the grouped GEMM's most groups).
    top_k: experts per token.
    hidden_features: each expert's H, a multiple of the recipe's ``dim_multiple`` (16, 128
      under ``BlockScaling``).
    activation: "swiglu" (default), "geglu", "silu" or "gelu".
    shared_hidden_features: None (default), or the shared expert's hidden size (a multiple
      of the recipe's ``dim_multiple`` too).
    normalize_weights: routing weights rescaled to sum to 1 (default True).
    recipe: ``DelayedScaling`` (default), ``CurrentScaling`` or ``BlockScaling`` (each
      expert's rows padded to its ``grouped_row_align``).
    amax_axis_name: as ``Dense``'s (data-parallel devices sharing the scales).
    expert_axis: None, or a mesh axis of n devices each holding E / n experts (expert
      parallelism, ``moe_parallel``): then init and apply run inside ``shard_map`` over that
      axis (each device makes and holds its own experts' "w_in" / "w_out"; out_specs
      ``P(expert_axis)`` gathers them into [E, ...]); stateless recipes only.
    capacity: with ``expert_axis``, rows per destination device (None: dropless).
    dtype: the compute dtype (None: the input's), float32, bfloat16 or float16;
      param_dtype: the parameters', one of those three (float64 under x64).
    kernel_init, router_init: initializers.

  Input ``[..., D]``; output ``[..., D]`` in the compute dtype. Raises TypeError / ValueError
  naming the attribute (``MoeMlp.num_experts`` ...); with ``expert_axis``, TypeError under a
  stateful recipe and ValueError where no enclosing shard_map binds the axis.
  """

  num_experts: int
  top_k: int
  hidden_features: int
  activation: str = "swiglu"
  shared_hidden_features: int | None = None
  normalize_weights: bool = True
  recipe: Recipe = DelayedScaling()
  amax_axis_name: str | None = None
  expert_axis: str | None = None
  capacity: int | None = None
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.lecun_normal(batch_axis=(0,))
  router_init: Callable = nn.initializers.lecun_normal()

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    e, h, gated = check_moe_layer(self.recipe, self.num_experts, self.top_k,
                                  self.hidden_features, self.activation,
                                  self.shared_hidden_features, self.normalize_weights,
                                  self.dtype, self.param_dtype)
    if np.ndim(inputs) < 1:
      raise ValueError("MoeMlp inputs must be [..., D], got a scalar")
    d = np.shape(inputs)[-1]
    local = local_experts(e, self.expert_axis, self.recipe, "MoeMlp")
    router = self.param("router", self.router_init, (d, e), self.param_dtype)
    init = expert_init(self.kernel_init, e, self.expert_axis)
    w_in = self.param("w_in", init, (local, d, 2 * h if gated else h), self.param_dtype)
    w_out = self.param("w_out", init, (local, h, d), self.param_dtype)
    state = None
    if self.recipe.stateful:
      state = fp8_state_variable(self, "moe", MoeState.create, local, self.recipe)
    # init usually runs outside the pmap / shard_map whose axis is named (as Dense's)
    axis = None if self.is_initializing() else self.amax_axis_name
    y, aux = call_moe(inputs, router, w_in, w_out, self.dtype, top_k=self.top_k,
                      recipe=self.recipe, state=state, activation=self.activation,
                      normalize_weights=self.normalize_weights, amax_axis_name=axis,
                      expert_axis=self.expert_axis, capacity=self.capacity)
    self.sow("intermediates", "load_balancing_loss", aux)
    if self.shared_hidden_features is not None:
      shared = Mlp(self.shared_hidden_features, activation=self.activation, dtype=self.dtype,
                   param_dtype=self.param_dtype, recipe=self.recipe, amax_axis_name=axis,
                   name="shared")(inputs)
      y = y + shared.astype(y.dtype)
    return y
