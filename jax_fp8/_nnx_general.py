"""NNX ``LinearGeneral`` and ``Einsum`` in FP8: drop-ins for Flax's, each contraction run as one
GEMM through ``jax_fp8._contraction`` (exported by ``jax_fp8.nnx``)."""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from . import checks
from ._contraction import contract, dense_general_plan, einsum_plan
from ._layer import check_layer, create_state
from .recipes import DelayedScaling
from ._nnx_base import Fp8State, _key, sr_stream


def _init_contraction(module: nnx.Module, name: str, n: int, use_bias, dtype, param_dtype,
                      recipe, amax_axis_name, rngs) -> bool:
  """What ``LinearGeneral`` and ``Einsum`` hold besides their parameters (dtype, recipe, rings),
  checked as ``Linear``'s; whether the layer has a bias. (The stochastic rounding stream is
  forked after the parameters are drawn, as ``Linear`` does.)"""
  _, use_bias = check_layer(name, n, use_bias, recipe, False, dtype, param_dtype)
  if not isinstance(rngs, nnx.Rngs):
    raise TypeError(f"{name}.rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}")
  module.dtype, module.param_dtype, module.recipe = dtype, param_dtype, recipe
  module.amax_axis_name = amax_axis_name
  module.fp8_state = Fp8State(create_state(recipe, None)) if recipe.stateful else None
  return use_bias


def _contract(module: nnx.Module, inputs, plan, out_sharding):
  """A ``LinearGeneral`` / ``Einsum``'s output for ``plan`` (a ``Contraction``, or the reason
  its contraction does not map: ValueError)."""
  name = type(module).__name__
  if isinstance(plan, str):
    raise ValueError(f"{name}: {plan}, which jax_fp8's GEMM cannot run (it runs contractions "
                     f"of the input's trailing axes with the kernel's)")
  state = None if module.fp8_state is None else module.fp8_state.get_value()
  return contract(inputs, module.kernel.get_value(),
                  None if module.bias is None else module.bias.get_value(), plan, state,
                  module.recipe, module.dtype, module.amax_axis_name, _key(module), out_sharding)


def _flat_init(init, flat_shape):
  """``init`` drawn at ``flat_shape`` and reshaped to the parameter's shape, as
  ``nnx.LinearGeneral`` / ``nn.DenseGeneral`` initialize (fan-in from the flat kernel)."""
  return lambda key, shape, dtype: jnp.reshape(init(key, flat_shape, dtype), shape)


class LinearGeneral(nnx.Module):
  """Drop-in for ``flax.nnx.LinearGeneral`` (e.g. ``nnx.MultiHeadAttention``'s query / key /
  value / out projections) whose matmuls run in FP8: the input's trailing axes (``axis``, each
  negative or within the input's rank, together its trailing axes) are contracted as one K
  with the kernel's, the output features flattened to one N, through ``jax_fp8.linear``.

  Parameters as ``nnx.LinearGeneral``'s without ``batch_axis``: "kernel" [*in_features,
  *out_features], "bias" [*out_features] (None without ``use_bias``), initialized from the
  flat [K, N] / [N] shapes as Flax does. K = prod(in_features) and N = prod(out_features)
  multiples of 16 (128 under BlockScaling, 32 under MXFP8BlockScaling). ``recipe``,
  ``amax_axis_name``, the "fp8_state" ``Fp8State`` and the "rngs" stream as ``Linear``'s.
  Input ``[..., *in_features]``; output ``[..., *out_features]`` in ``dtype``;
  ``__call__(inputs, out_sharding=None)`` as ``Linear``'s. Raises TypeError / ValueError for
  bad arguments, at construction or at the call (axes that are not the input's trailing
  ones). ``cast_kernels`` casts [K, N] kernels: leave a ``LinearGeneral``'s or ``Einsum``'s
  multi-axis kernel out with its ``select`` (the layer raises a TypeError for such a cast).
  """

  def __init__(self, in_features, out_features, *, axis=-1, use_bias: bool = True,
               dtype: Any = None, param_dtype: Any = jnp.float32,
               kernel_init: Callable = nnx.initializers.lecun_normal(),
               bias_init: Callable = nnx.initializers.zeros_init(),
               recipe=DelayedScaling(), amax_axis_name=None, rngs: nnx.Rngs):
    tup = lambda v: tuple(int(a) for a in (v if isinstance(v, (tuple, list)) else (v,)))  # noqa: E731
    self.in_features, self.out_features, self.axis = (tup(in_features), tup(out_features),
                                                      tup(axis))
    if len(self.in_features) != len(self.axis):
      raise ValueError(f"LinearGeneral: in_features {self.in_features} and axis {self.axis} "
                       f"must have the same length")
    k, n = math.prod(self.in_features), math.prod(self.out_features)
    checks.integer(k, "LinearGeneral.in_features (their product)", lo=1)
    self.use_bias = _init_contraction(self, "LinearGeneral", n, use_bias, dtype, param_dtype,
                                      recipe, amax_axis_name, rngs)
    self.kernel = nnx.Param(_flat_init(kernel_init, (k, n))(
        rngs.params(), (*self.in_features, *self.out_features), param_dtype))
    self.bias = (nnx.Param(_flat_init(bias_init, (n,))(rngs.params(), self.out_features,
                                                        param_dtype))
                 if self.use_bias else None)
    self.rngs = sr_stream(recipe, rngs)

  def __call__(self, inputs: jax.Array, out_sharding=None) -> jax.Array:
    shape = jnp.shape(inputs)
    plan = dense_general_plan(self.axis, shape, self.out_features)
    if not isinstance(plan, str) and shape[len(shape) - plan.n_contract:] != self.in_features:
      raise ValueError(f"LinearGeneral inputs must be [..., {', '.join(map(str, self.in_features))}]"
                       f" (in_features) on axis {self.axis}, got shape {shape}")
    return _contract(self, inputs, plan, out_sharding)


class Einsum(nnx.Module):
  """Drop-in for ``flax.nnx.Einsum`` whose matmul runs in FP8, for the einsums that are one GEMM:
  the input's trailing axes contracted with kernel axes, the output holding the input's other
  axes and the kernel's others (e.g. "btd,dnh->btnh", Gemma's "BTD,NDH->BTNH",
  "BTNH,NHD->BTD" and "BSD,CKDH->CBSKH", "...d,df->...f"); the kernel is transposed first
  where its axes lie in another order, the output after where its axes are not the input's
  followed by the kernel's.

  Parameters as ``nnx.Einsum``'s: "kernel" of ``kernel_shape``, "bias" of ``bias_shape`` (None:
  no bias; its N elements are added in the output's order of the kernel's free axes, as
  Flax's), with its initializers. K (the contracted sizes' product) and N (the output
  features') multiples of 16 (128 under BlockScaling, 32 under MXFP8BlockScaling). ``recipe``,
  ``amax_axis_name``, the "fp8_state" ``Fp8State`` and the "rngs" stream as ``Linear``'s.
  ``__call__(inputs, einsum_str=None, out_sharding=None)``: as ``nnx.Einsum``'s (an
  ``einsum_str`` given there replaces the layer's); ``out_sharding`` as ``Linear``'s. Raises
  TypeError / ValueError for bad arguments and for an einsum that is not one GEMM, at
  construction or at the call.
  """

  def __init__(self, einsum_str: str, kernel_shape, bias_shape=None, *, dtype: Any = None,
               param_dtype: Any = jnp.float32,
               kernel_init: Callable = nnx.initializers.lecun_normal(),
               bias_init: Callable = nnx.initializers.zeros_init(),
               recipe=DelayedScaling(), amax_axis_name=None, rngs: nnx.Rngs):
    if not isinstance(einsum_str, str):
      raise TypeError(f"Einsum.einsum_str must be a str, got {type(einsum_str).__name__}")
    self.kernel_shape = tuple(int(d) for d in kernel_shape)
    self.bias_shape = None if bias_shape is None else tuple(int(d) for d in bias_shape)
    plan = einsum_plan(einsum_str, self.kernel_shape)
    if isinstance(plan, str):
      raise ValueError(f"Einsum: {plan}, which jax_fp8's GEMM cannot run (it runs "
                       f"contractions of the input's trailing axes with the kernel's)")
    if self.bias_shape is not None and math.prod(self.bias_shape) != plan.n:
      raise ValueError(f"Einsum.bias_shape {self.bias_shape} must hold the {plan.n} output "
                       f"features of {einsum_str!r}")
    self.einsum_str = einsum_str.replace(" ", "")
    _init_contraction(self, "Einsum", plan.n, self.bias_shape is not None, dtype, param_dtype,
                      recipe, amax_axis_name, rngs)
    self.kernel = nnx.Param(kernel_init(rngs.params(), self.kernel_shape, param_dtype))
    self.bias = (None if self.bias_shape is None else
                 nnx.Param(bias_init(rngs.params(), self.bias_shape, param_dtype)))
    self.rngs = sr_stream(recipe, rngs)

  def __call__(self, inputs: jax.Array, einsum_str: str | None = None,
               out_sharding=None) -> jax.Array:
    spec = self.einsum_str if einsum_str is None else einsum_str
    return _contract(self, inputs, einsum_plan(spec, self.kernel_shape), out_sharding)
