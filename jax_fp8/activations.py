"""The MLP activations that jax_fp8 fuses into its cast-transposes, in jnp (f32): the twins of
``csrc/activation.h``, used by ``jax_fp8.reference`` and by ``jax_fp8.mlp`` where it runs
without FP8.

Names: ``"silu"`` (x * sigmoid(x); Elfwing et al. 2017, ``jax.nn.silu``), ``"gelu"`` (the tanh
approximation of Hendrycks & Gimpel 2016, ``jax.nn.gelu``'s default), and their gated forms
``"swiglu"`` / ``"geglu"`` (Shazeer 2020, arXiv 2002.05202): the pre-activation is
``[gate | up]`` along its last axis and the output ``act(gate) * up``, half as wide.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _ffi, checks
from .formats import as_f32

# name -> (the kernels' activation id, gated)
ACTIVATIONS = {
    "silu": (_ffi.CONSTANTS["activation_silu"], False),
    "gelu": (_ffi.CONSTANTS["activation_gelu"], False),
    "swiglu": (_ffi.CONSTANTS["activation_silu"], True),
    "geglu": (_ffi.CONSTANTS["activation_gelu"], True),
}
_GELU_K0, _GELU_K1 = 0.7978845608028654, 0.044715  # sqrt(2 / pi); the cubic's coefficient


def check(activation, name: str = "activation") -> tuple[int, bool]:
  """(the kernels' id, gated) of an activation name; TypeError (not a string) or ValueError
  naming the choices."""
  return ACTIVATIONS[checks.one_of(activation, name, sorted(ACTIVATIONS))]


def _act(x, gelu: bool):
  if gelu:
    return 0.5 * x * (1.0 + jnp.tanh(_GELU_K0 * (x + _GELU_K1 * x * x * x)))
  return x * (1.0 / (1.0 + jnp.exp(-x)))


def _act_grad(x, gelu: bool):
  if gelu:
    t = jnp.tanh(_GELU_K0 * (x + _GELU_K1 * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_K0 * (1.0 + 3.0 * _GELU_K1 * x * x)
  s = 1.0 / (1.0 + jnp.exp(-x))
  return s * (1.0 + x * (1.0 - s))


def _split(y, gated: bool):
  return jnp.split(as_f32(y), 2, axis=-1) if gated else (as_f32(y), None)


def apply(y: jax.Array, activation: str) -> jax.Array:
  """The activation of ``y [..., C]`` (gated: ``[..., 2C]``, [gate | up]) in f32: [..., C].
  Raises ValueError for an unknown activation name."""
  act, gated = check(activation)
  gelu = act == _ffi.CONSTANTS["activation_gelu"]
  g, u = _split(y, gated)
  return _act(g, gelu) * u if gated else _act(g, gelu)


def grad(dh: jax.Array, y: jax.Array, activation: str) -> jax.Array:
  """The gradient through the activation in f32, from ``dh [..., C]`` (the output's gradient)
  and the pre-activation ``y``: ``dh * act'(y)`` [..., C]; gated, ``[dh * up * act'(gate) |
  dh * act(gate)]`` [..., 2C]. Raises ValueError for an unknown activation name."""
  act, gated = check(activation)
  gelu = act == _ffi.CONSTANTS["activation_gelu"]
  d = as_f32(dh)
  g, u = _split(y, gated)
  if not gated:
    return d * _act_grad(g, gelu)
  return jnp.concatenate([d * u * _act_grad(g, gelu), d * _act(g, gelu)], axis=-1)
