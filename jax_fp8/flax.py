"""Flax (linen) layers backed by jax_fp8.linear, and the state classes registered with
flax.serialization (so ``flax.serialization.to_bytes`` / ``from_bytes`` and Flax checkpoints
carry the FP8 state). Needs the ``flax`` extra (``pip install jax_fp8[flax]``); importing this
module registers the state classes."""

from __future__ import annotations

from typing import Any, Callable

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import serialization

from . import checks
from .linear import LinearState, linear
from .recipes import BlockScaling, DelayedScaling
from .state import ScaleRing

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


class Dense(nn.Module):
  """Drop-in for ``flax.linen.Dense`` whose matmuls run in FP8 (``jax_fp8.linear``).

  Same parameters as ``nn.Dense`` ("kernel" [K, N], "bias" [N]) with the same default
  initializers. Under ``DelayedScaling`` the layer's scale rings live in the "fp8_state"
  variable collection as a ``LinearState`` named "linear": pass that collection to ``apply``,
  differentiate with respect to it, and pass that gradient to ``jax_fp8.update_state`` for the
  next rings. Under ``BlockScaling`` the layer has no state.

  Attributes:
    features: N, a multiple of 16 (128 under BlockScaling).
    use_bias, dtype, param_dtype, kernel_init, bias_init: as in ``nn.Dense``.
    recipe: ``DelayedScaling`` (per-tensor, default) or ``BlockScaling`` (DeepSeek-V3).
    amax_axis_name: replica axis for amax reduction under pmap / shard_map (DelayedScaling).

  Input ``[..., K]`` with K a multiple of 16 (128 under BlockScaling); output ``[..., N]``.
  """

  features: int
  use_bias: bool = True
  dtype: Any = None
  param_dtype: Any = jnp.float32
  kernel_init: Callable = nn.initializers.lecun_normal()
  bias_init: Callable = nn.initializers.zeros_init()
  recipe: DelayedScaling | BlockScaling = DelayedScaling()
  amax_axis_name: str | None = None

  @nn.compact
  def __call__(self, inputs: jax.Array) -> jax.Array:
    if not isinstance(self.recipe, (DelayedScaling, BlockScaling)):
      raise TypeError(f"Dense.recipe must be a DelayedScaling or a BlockScaling, got "
                      f"{type(self.recipe).__name__}")
    features = checks.integer(self.features, "Dense.features", lo=1)
    use_bias = checks.boolean(self.use_bias, "Dense.use_bias")
    if jnp.ndim(inputs) < 1:
      raise ValueError("Dense inputs must be [..., K], got a scalar")
    kernel = self.param("kernel", self.kernel_init, (jnp.shape(inputs)[-1], features),
                        self.param_dtype)
    bias = (self.param("bias", self.bias_init, (features,), self.param_dtype)
            if use_bias else None)
    state = (None if isinstance(self.recipe, BlockScaling) else
             self.variable(STATE_COLLECTION, "linear", LinearState.create, self.recipe).value)
    inputs, kernel, bias = nn.dtypes.promote_dtype(inputs, kernel, bias, dtype=self.dtype)
    # init usually runs outside the pmap / shard_map whose axis is named; the axis serves the
    # backward only, and init takes no gradient.
    axis = None if self.is_initializing() else self.amax_axis_name
    return linear(inputs, kernel, bias, state=state, recipe=self.recipe, amax_axis_name=axis)
