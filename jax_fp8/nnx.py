"""Flax NNX layers backed by ``jax_fp8.linear``, ``multi_linear``, ``mlp`` and ``moe_mlp``, with
the FP8 state in its own variable type. Needs the ``flax`` extra (``pip install jax_fp8[flax]``).

A train step differentiates with respect to the parameters and the FP8 state, updates the
parameters with the optimizer and the state with ``update_fp8_state``::

    diff = nnx.DiffState(0, (nnx.Param, Fp8State))
    loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model, batch)
    optimizer.update(model, nnx.filter_state(grads, nnx.Param))
    update_fp8_state(model, grads)

The state follows ``jax_fp8.state``'s protocol: the gradient with respect to a layer's
``Fp8State`` is its rings' observations of the step. Gradients of several microbatches of one
step combine by ``jax_fp8.combine_updates`` (an elementwise max) where parameter gradients add;
or one differentiated function scans over the microbatches with ``nnx.merge``, its kernels
quantized once by ``cast_kernels``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import _names, activations, checks, norms
from ._contraction import constrain
from ._layer import (call_layer, call_mlp, call_moe, cast_leaf, check_cast_kernels, check_layer,
                     check_moe_layer, create_state, kernel_ring)
from ._nnx_base import Fp8State, _init_norm, _key, _norm_args, sr_stream
from ._nnx_general import Einsum, LinearGeneral
from .layer_checks import check_split
from .layer_state import MlpState
from .moe import MoeState, expert_init, local_experts
from .recipes import DelayedScaling, Recipe
from .state import update_state

__all__ = ["Einsum", "Fp8State", "Linear", "LinearGeneral", "Mlp", "MoeMlp", "MultiLinear",
           "cast_kernels", "sr_stream", "update_fp8_state"]


class _Layer(nnx.Module):
  """The constructor and body shared by ``Linear`` and ``MultiLinear`` (``_multi``: one layer
  of several outputs)."""

  _multi = False
  split = None  # Linear's: its output's cut (jax_fp8.linear's split)

  def __init__(self, in_features: int, out_features, *, use_bias: bool = True,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Callable = nnx.initializers.lecun_normal(),
               bias_init: Callable = nnx.initializers.zeros_init(),
               recipe=DelayedScaling(), amax_axis_name=None, norm: str | None = None,
               norm_epsilon: float = norms.EPSILON, rngs: nnx.Rngs):
    name, multi = type(self).__name__, self._multi
    features, use_bias = check_layer(name, out_features, use_bias, recipe, multi, dtype,
                                     param_dtype, "out_features")
    in_features = checks.integer(in_features, f"{name}.in_features", lo=1)
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"{name}.rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}")
    self.in_features, self.out_features = in_features, out_features
    self.use_bias, self.dtype, self.param_dtype = use_bias, dtype, param_dtype
    self.recipe, self.amax_axis_name = recipe, amax_axis_name
    self._suffixes = _names.suffixes(len(features), multi)
    for sfx, f in zip(self._suffixes, features):
      setattr(self, f"kernel{sfx}",
              nnx.Param(kernel_init(rngs.params(), (in_features, f), param_dtype)))
      setattr(self, f"bias{sfx}",
              nnx.Param(bias_init(rngs.params(), (f,), param_dtype)) if use_bias else None)
    self.fp8_state = (Fp8State(create_state(recipe, len(features) if multi else None))
                      if recipe.stateful else None)
    self.rngs = sr_stream(recipe, rngs)
    _init_norm(self, name, norm, norm_epsilon, in_features, param_dtype)

  def _outputs(self, inputs):
    name = type(self).__name__
    if jnp.ndim(inputs) < 1 or jnp.shape(inputs)[-1] != self.in_features:
      raise ValueError(f"{name} inputs must be [..., {self.in_features}] (in_features), got "
                       f"shape {jnp.shape(inputs)}")
    # get_value(): a kernel may hold an Fp8Weight (inference), which [...] cannot index.
    kernels = tuple(getattr(self, f"kernel{sfx}").get_value() for sfx in self._suffixes)
    biases = tuple(None if getattr(self, f"bias{sfx}") is None else
                   getattr(self, f"bias{sfx}").get_value() for sfx in self._suffixes)
    state = None if self.fp8_state is None else self.fp8_state.get_value()
    return call_layer(inputs, kernels, biases, state, self.recipe, self.dtype,
                      self.amax_axis_name, self._multi, _norm_args(self), _key(self),
                      self.split)


class Linear(_Layer):
  """Drop-in for ``flax.nnx.Linear`` whose matmuls run in FP8 (``jax_fp8.linear``).

  Same constructor arguments as ``nnx.Linear`` less ``precision``, ``dot_general``,
  ``promote_dtype`` and ``preferred_element_type`` (the FP8 GEMMs decide them), plus
  ``recipe`` (``DelayedScaling``, default, or any of ``linear``'s), ``amax_axis_name`` (as in
  ``jax_fp8.linear``), and ``norm`` (None, "rmsnorm" or "layernorm") with ``norm_epsilon``
  (1e-6): the input's norm fused into its FP8 quantization, as ``jax_fp8.flax.Dense``'s, with
  the parameters "gamma" [in] (ones) and, for LayerNorm, "beta" [in] (zeros), else None. Same
  parameters ("kernel" [in, out], "bias" [out]) and initializers.
  Under ``DelayedScaling`` the rings are the ``Fp8State`` "fp8_state" (a ``LinearState``);
  under the other recipes it is None. Under ``NVFP4BlockScaling`` with stochastic rounding
  each call draws its key from ``rngs``' "stochastic_rounding" stream (its default stream
  where it has none), kept as the attribute "rngs" (None otherwise). The kernel is quantized
  from its parameter dtype (f32 master weights straight to FP8); inputs and outputs are in
  ``dtype``.

  ``split`` (None, default, or sizes (N_0, ..., N_{n-1}), as ``jax_fp8.linear``'s) cuts the
  output along out_features into a tuple of n arrays, e.g. a fused q / k / v projection's;
  under the per-tensor recipes the parts' gradients then reach the FP8 backward without being
  concatenated.

  Input ``[..., in_features]``; output ``[..., out_features]`` (with ``split``, a tuple of
  arrays ``[..., N_i]``); in and out multiples of 16 (128 under BlockScaling, 32 under
  MXFP8BlockScaling). ``__call__(inputs, out_sharding=None)`` takes what ``nnx.Linear``'s does:
  ``out_sharding`` (a ``jax.sharding.Sharding``, or a ``PartitionSpec`` of the mesh
  ``jax.set_mesh`` made current) is the output's sharding, applied as a sharding constraint
  (jax_fp8's ops run on meshes of Auto axes; ``MultiLinear``, ``Mlp``, ``LinearGeneral`` and
  ``Einsum`` take it too). Raises TypeError / ValueError for bad arguments, at construction or
  at the call.
  """

  def __init__(self, in_features: int, out_features: int, *, split=None, **kwargs):
    super().__init__(in_features, out_features, **kwargs)
    self.split = check_split(split, self.out_features)

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array | tuple[jax.Array, ...]:
    ys = tuple(constrain(y, out_sharding) for y in self._outputs(inputs))
    return ys[0] if self.split is None else ys


class MultiLinear(_Layer):
  """Several linear layers on one input, the FP8 quantization of the input shared
  (``jax_fp8.multi_linear``): q / k / v, or an MLP's gate and up projections.

  ``out_features`` is a tuple (N_0, ..., N_{n-1}); parameters "kernel_i" [in, N_i] and
  "bias_i" [N_i]; under ``DelayedScaling`` the ``Fp8State`` "fp8_state" holds a
  ``MultiLinearState``. Other arguments as ``Linear``'s. Input ``[..., in_features]``; output
  a tuple of n arrays ``[..., N_i]``.
  """

  _multi = True

  def __call__(self, inputs: jax.Array, out_sharding=None) -> tuple[jax.Array, ...]:
    return tuple(constrain(y, out_sharding) for y in self._outputs(inputs))


class Mlp(nnx.Module):
  """An MLP block in FP8 with the activation and its gradient fused into the cast-transposes
  (``jax_fp8.mlp``; the linen twin is ``jax_fp8.flax.Mlp``).

  Parameters "kernel_in" [in_features, N] (N = hidden_features, or twice it for a gated
  activation: gate and up side by side), "kernel_out" [hidden_features, out_features],
  "bias_in" [N] and "bias_out" [out_features] with ``use_bias`` (else None), with
  ``nnx.Linear``'s initializers; under ``DelayedScaling`` the ``Fp8State`` "fp8_state" holds
  an ``MlpState`` (None under the other recipes); "rngs" as ``Linear``'s.

  Args: in_features (K), hidden_features (F), out_features (D; None: K), activation ("swiglu",
  default, "geglu", "silu" or "gelu"), and ``Linear``'s use_bias, dtype, param_dtype,
  kernel_init, bias_init, recipe, amax_axis_name, norm, norm_epsilon, rngs. Input ``[..., in_features]``; output
  ``[..., out_features]`` in ``dtype``. Raises TypeError / ValueError for bad arguments, at
  construction or at the call.
  """

  def __init__(self, in_features: int, hidden_features: int, out_features: int | None = None,
               *, activation: str = "swiglu", use_bias: bool = True, dtype: Any = None,
               param_dtype: Any = jnp.float32,
               kernel_init: Callable = nnx.initializers.lecun_normal(),
               bias_init: Callable = nnx.initializers.zeros_init(),
               recipe=DelayedScaling(), amax_axis_name=None, norm: str | None = None,
               norm_epsilon: float = norms.EPSILON, rngs: nnx.Rngs):
    (f,), use_bias = check_layer("Mlp", hidden_features, use_bias, recipe, False, dtype,
                                 param_dtype, "hidden_features")
    _, gated = activations.check(activation, "Mlp.activation")
    k = checks.integer(in_features, "Mlp.in_features", lo=1)
    d = k if out_features is None else checks.integer(out_features, "Mlp.out_features", lo=1)
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"Mlp.rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}")
    n = 2 * f if gated else f
    self.in_features, self.hidden_features, self.out_features = k, f, d
    self.activation, self.dtype, self.recipe = activation, dtype, recipe
    self.amax_axis_name = amax_axis_name
    self.kernel_in = nnx.Param(kernel_init(rngs.params(), (k, n), param_dtype))
    self.kernel_out = nnx.Param(kernel_init(rngs.params(), (f, d), param_dtype))
    self.bias_in = nnx.Param(bias_init(rngs.params(), (n,), param_dtype)) if use_bias else None
    self.bias_out = nnx.Param(bias_init(rngs.params(), (d,), param_dtype)) if use_bias else None
    self.fp8_state = (Fp8State(MlpState.create(recipe)) if recipe.stateful
                      else None)
    self.rngs = sr_stream(recipe, rngs)
    _init_norm(self, "Mlp", norm, norm_epsilon, k, param_dtype)

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    if jnp.ndim(inputs) < 1 or jnp.shape(inputs)[-1] != self.in_features:
      raise ValueError(f"Mlp inputs must be [..., {self.in_features}] (in_features), got "
                       f"shape {jnp.shape(inputs)}")
    biases = tuple(None if b is None else b.get_value() for b in (self.bias_in, self.bias_out))
    state = None if self.fp8_state is None else self.fp8_state.get_value()
    return constrain(call_mlp(inputs, (self.kernel_in.get_value(),
                                       self.kernel_out.get_value()), biases,
                              state, self.recipe, self.dtype, self.activation,
                              self.amax_axis_name, _norm_args(self), _key(self)), out_sharding)


class MoeMlp(nnx.Module):
  """A mixture-of-experts MLP block with FP8 experts (``jax_fp8.moe.moe_mlp``; the linen twin
  is ``jax_fp8.flax.MoeMlp``, whose docstring describes the layer).

  Parameters "router" [in_features, num_experts], "w_in" [E, in_features, F] (F = 2 *
  hidden_features when gated) and "w_out" [E, hidden_features, in_features], each expert's
  initialised as ``nnx.Linear``'s kernel; "shared" an ``Mlp`` with ``shared_hidden_features``
  (else None); under ``DelayedScaling`` the ``Fp8State`` "fp8_state" holds a ``MoeState``.
  Under ``nnx.capture`` each call sows its load-balancing loss as the ``nnx.Intermediate``
  "load_balancing_loss" (the latest call's, f32 []): ``y, intermediates = nnx.capture(model,
  nnx.Intermediate)(x)`` returns it. A call outside a capture sows nothing (Flax 0.12 deprecates
  sowing there, which would store the loss on the module).

  Args: in_features (D), num_experts (E), top_k, hidden_features (H), and
  ``jax_fp8.flax.MoeMlp``'s activation, shared_hidden_features, normalize_weights, recipe,
  amax_axis_name, expert_axis (with it, construct and call inside ``shard_map`` over that axis:
  each device makes its E / n experts), capacity, dtype, param_dtype, kernel_init, router_init;
  rngs. Input ``[..., in_features]``; output ``[..., in_features]``.
  """

  def __init__(self, in_features: int, num_experts: int, top_k: int, hidden_features: int, *,
               activation: str = "swiglu", shared_hidden_features: int | None = None,
               normalize_weights: bool = True, recipe=DelayedScaling(), amax_axis_name=None,
               expert_axis: str | None = None, capacity: int | None = None, dtype: Any = None,
               param_dtype: Any = jnp.float32,
               kernel_init: Callable = nnx.initializers.lecun_normal(batch_axis=(0,)),
               router_init: Callable = nnx.initializers.lecun_normal(), rngs: nnx.Rngs):
    e, h, gated = check_moe_layer(recipe, num_experts, top_k, hidden_features, activation,
                                  shared_hidden_features, normalize_weights, dtype,
                                  param_dtype, in_features)
    d = int(in_features)
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"MoeMlp.rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}")
    local = local_experts(e, expert_axis, recipe, "MoeMlp")
    self.in_features, self.num_experts, self.top_k = d, e, top_k
    self.activation, self.normalize_weights, self.recipe = activation, normalize_weights, recipe
    self.amax_axis_name, self.expert_axis = amax_axis_name, expert_axis
    self.capacity, self.dtype = capacity, dtype
    init = expert_init(kernel_init, e, expert_axis)
    self.router = nnx.Param(router_init(rngs.params(), (d, e), param_dtype))
    self.w_in = nnx.Param(init(rngs.params(), (local, d, 2 * h if gated else h), param_dtype))
    self.w_out = nnx.Param(init(rngs.params(), (local, h, d), param_dtype))
    self.fp8_state = Fp8State(MoeState.create(local, recipe)) if recipe.stateful else None
    self.shared = (Mlp(d, shared_hidden_features, activation=activation, dtype=dtype,
                       param_dtype=param_dtype, recipe=recipe, amax_axis_name=amax_axis_name,
                       rngs=rngs)
                   if shared_hidden_features is not None else None)

  def __call__(self, inputs: jax.Array) -> jax.Array:
    if np.ndim(inputs) < 1 or np.shape(inputs)[-1] != self.in_features:
      raise ValueError(f"MoeMlp inputs must be [..., {self.in_features}] (in_features), got "
                       f"shape {np.shape(inputs)}")
    state = None if self.fp8_state is None else self.fp8_state.get_value()
    y, aux = call_moe(inputs, self.router.get_value(), self.w_in.get_value(),
                      self.w_out.get_value(), self.dtype, top_k=self.top_k, recipe=self.recipe,
                      state=state, activation=self.activation,
                      normalize_weights=self.normalize_weights,
                      amax_axis_name=self.amax_axis_name, expert_axis=self.expert_axis,
                      capacity=self.capacity)
    # Only inside nnx.capture, which marks each module it runs with "__captures__" (the test
    # Module.sow itself makes); the latest call's loss, not a tuple that would retrace a step.
    if hasattr(self, "__captures__"):
      self.sow(nnx.Intermediate, "load_balancing_loss", aux, reduce_fn=lambda _, new: new,
               init_fn=lambda: jnp.zeros((), jnp.float32))
    return y if self.shared is None else y + self.shared(inputs).astype(y.dtype)


def update_fp8_state(model: nnx.Module, grads: nnx.State) -> None:
  """Advance every ``Fp8State`` of ``model`` in place by its gradient in ``grads`` (what
  ``nnx.grad`` returns for a ``DiffState`` that includes ``Fp8State``): ``jax_fp8.update_state``
  applied to the model's FP8 state. Raises TypeError when ``grads`` is no ``nnx.State``,
  ValueError when it holds no FP8 state of the model's structure (e.g. ``Fp8State`` left out
  of the ``DiffState``)."""
  if not isinstance(grads, nnx.State):
    raise TypeError(f"grads must be the nnx.State that nnx.grad returns, got "
                    f"{type(grads).__name__}")
  state = nnx.state(model, Fp8State)
  state_grads = nnx.filter_state(grads, Fp8State)
  if jax.tree.structure(state_grads) != jax.tree.structure(state):
    raise ValueError("grads holds no gradient for the model's Fp8State variables (or not all "
                     "of them): differentiate with argnums=nnx.DiffState(0, (nnx.Param, "
                     "Fp8State))")
  nnx.update(model, update_state(state, state_grads))


def cast_kernels(params: nnx.State, fp8_state: nnx.State | None = None,
                 recipe: Recipe = DelayedScaling(), *,
                 amax_axis_name: str | tuple[str, ...] | None = None,
                 select: Callable = lambda path, kernel: True) -> nnx.State:
  """``params`` (the model's ``nnx.Param`` state) with the kernels of jax_fp8's layers holding
  their ``jax_fp8.CastKernel`` (``jax_fp8.cast_kernel``), which the layers then use without
  quantizing them again. For a step that runs several microbatches in a ``lax.scan``: split
  the model (``graphdef, params, fp8, rest = nnx.split(model, nnx.Param, Fp8State, ...)``),
  and inside the differentiated function call this once, outside the scan, then
  ``nnx.merge(graphdef, cast, fp8_i, rest)`` in the scan's body with ``fp8_i`` the
  microbatch's slice of ``jax_fp8.share(fp8, n)``, differentiated by ``jax.grad`` (inside it
  the model's stacked layers run under ``jax.lax.scan`` over their ``nnx.split`` state: NNX's
  own transforms refuse variables that an outer JAX transform traces). The gradients with
  respect to ``params`` and ``fp8`` are those of the uncast model (except the kernel ring of
  a layer run twice in a microbatch, or of layers with states of their own on one kernel: the
  cast observes the kernel once, ``jax_fp8.cast_kernel``); the kernels are quantized once per
  step instead of once per microbatch.

  Args:
    params: an ``nnx.State`` of ``nnx.Param`` variables whose kernels are named "kernel"
      (``Linear``), "kernel_<i>" (``MultiLinear``) or "kernel_in" / "kernel_out" (``Mlp``),
      [K, N], or [L, ..., K, N] for layers made by ``nnx.vmap`` (cast layer by layer).
    fp8_state: under ``DelayedScaling`` the ``Fp8State`` state (unshared): a kernel is cast
      where its layer's ``Fp8State`` holds its ring, other kernels (e.g. a
      ``flax.nnx.Linear``'s) stay as they are. Under ``CurrentScaling`` and ``BlockScaling``:
      None, and every kernel so named is cast: leave out the layers that do not run through
      jax_fp8 with ``select``.
    recipe: the layers' recipe: ``DelayedScaling``, ``CurrentScaling`` or ``BlockScaling``.
    amax_axis_name: as in ``jax_fp8.cast_kernel``.
    select: ``select(path, kernel) -> bool`` (path: the keys joined by "/"): False keeps that
      kernel as it is.
  Returns:
    ``params`` with those variables holding their ``CastKernel``.
  Raises:
    TypeError / ValueError: params or fp8_state not an ``nnx.State`` or holding other variables
    than ``nnx.Param`` / ``Fp8State``, a kernel cast already, select not callable or not
    returning a bool, fp8_state missing under DelayedScaling or given under a stateless
    recipe, no kernel finding its ring in fp8_state under DelayedScaling, and
    ``jax_fp8.cast_kernel``'s errors for a kernel, prefixed with its path.
  """
  delayed = check_cast_kernels(recipe, fp8_state, select,
                               "the model's Fp8State (nnx.state(model, Fp8State))")
  is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
  # nnx.State, or the plain dict Flax means to replace it with: a mapping of variables.
  if not isinstance(params, Mapping):
    raise TypeError(f"params must be an nnx.State (nnx.state(model, nnx.Param), or nnx.split's), "
                    f"got {type(params).__name__}")
  if delayed and not isinstance(fp8_state, Mapping):
    raise TypeError(f"fp8_state must be an nnx.State (nnx.state(model, Fp8State), or "
                    f"nnx.split's), got {type(fp8_state).__name__}")
  def variables(state, kind, name, filter_name):  # (path keys, variable) of state, each a kind
    for path, var in jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)[0]:
      keys = _names.path_keys(path)
      if not isinstance(var, kind):
        what = type(var).__name__ if is_var(var) else f"bare {checks.describe(var)}"
        raise TypeError(f"{name} holds a {what} at {'/'.join(keys)}: pass "
                        f"nnx.state(model, {filter_name})")
      yield keys, var
  # A layer's path -> its LinearState, MultiLinearState or MlpState.
  layer_states = ({tuple(keys[:-1]): var.get_value()
                   for keys, var in variables(fp8_state, Fp8State, "fp8_state", "Fp8State")}
                  if delayed else {})
  found = []

  def one(keys, var):
    if not keys or not _names.is_kernel(keys[-1]):
      return var
    ring = kernel_ring(layer_states.get(tuple(keys[:-1])), keys[-1]) if delayed else None
    found.append(ring is not None)
    cast = cast_leaf("/".join(keys), var.get_value(), ring, recipe, amax_axis_name, select)
    return var if cast is None else var.replace(cast)
  leaves = [one(keys, var) for keys, var in variables(params, nnx.Param, "params", "nnx.Param")]
  out = jax.tree.unflatten(jax.tree.structure(params, is_leaf=is_var), leaves)
  if delayed and not any(found):
    raise ValueError("no kernel of params found its ring in fp8_state: pass "
                     "nnx.state(model, nnx.Param) and nnx.state(model, Fp8State) of a model with "
                     "jax_fp8 layers")
  return out
