"""What jax_fp8's NNX layers share: the ``Fp8State`` variable type, the fused norm's parameters,
the stochastic rounding stream and its keys. The layers: ``jax_fp8.nnx`` (re-exported there)."""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from ._layer import SR_STREAM, check_norm_attr


class Fp8State(nnx.Variable):
  """The FP8 scale rings of one layer (its ``LinearState``, ``MultiLinearState``, ``MlpState``
  or ``MoeState``) as an NNX variable: ``nnx.state(model, Fp8State)`` selects every layer's, an
  optimizer over ``nnx.Param`` leaves them alone, and ``update_fp8_state`` advances them."""


def _init_norm(module: nnx.Module, name: str, norm, epsilon, k: int, param_dtype) -> None:
  """The fused input norm's attributes and parameters: "gamma" [K] (ones) and, for LayerNorm,
  "beta" [K] (zeros), each None where the norm has none."""
  centered = check_norm_attr(name, norm, epsilon)
  module.norm, module.norm_epsilon = norm, epsilon
  module.gamma = None if norm is None else nnx.Param(jnp.ones((k,), param_dtype))
  module.beta = nnx.Param(jnp.zeros((k,), param_dtype)) if centered else None


def sr_stream(recipe, rngs: nnx.Rngs):
  """The rng stream a layer draws its stochastic rounding keys from, forked (as
  ``nnx.Dropout`` forks its own) from ``rngs``' "stochastic_rounding" stream (or its default):
  each layer its own stream, and layers made under ``nnx.vmap`` from split ``rngs`` one a
  layer. None where ``recipe`` draws none; ValueError where ``rngs`` has neither."""
  if not recipe.draws_key:
    return None
  try:
    return getattr(rngs, SR_STREAM).fork()
  except AttributeError:
    raise ValueError(f"rngs has neither a {SR_STREAM!r} nor a 'default' stream, which "
                     f"{type(recipe).__name__}'s stochastic rounding draws its keys from: "
                     f"pass e.g. nnx.Rngs(0) or nnx.Rngs(params=0, {SR_STREAM}=1)") from None


def _key(module: nnx.Module):
  """The next key of the layer's stochastic rounding stream, or None."""
  return None if module.rngs is None else module.rngs()


def _norm_args(module: nnx.Module):
  """(norm, gamma, beta, epsilon) for ``call_layer`` / ``call_mlp``."""
  value = lambda p: None if p is None else p.get_value()  # noqa: E731
  return module.norm, value(module.gamma), value(module.beta), module.norm_epsilon
