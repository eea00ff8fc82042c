"""The normalizations that jax_fp8 fuses into its cast-transposes, in jnp (f32): the twins of
``csrc/norm.h``, used by ``jax_fp8.reference``, by the fused layers to compute the row
statistics the kernel reads, and where those layers run without the fused kernel.

Names: ``"rmsnorm"`` (Zhang & Sennrich 2019, arXiv 1910.07467; ``flax.linen.RMSNorm``):
``x * rsigma * gamma`` with ``rsigma = 1 / sqrt(mean(x^2) + epsilon)``; ``"layernorm"`` (Ba et
al. 2016, arXiv 1607.06450; ``flax.linen.LayerNorm``): ``(x - mu) * rsigma * gamma + beta``
with mu the row mean and ``rsigma = 1 / sqrt(mean(x^2) - mu^2 + epsilon)`` (the variance in one
pass over x, as Flax's default ``use_fast_variance=True``). Rows are the last
axis; gamma (and LayerNorm's beta) are [C].
"""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi, checks
from .formats import FLOAT_DTYPES, as_f32

EPSILON = 1e-6  # the default epsilon, as flax.linen.RMSNorm / LayerNorm
NORMS = {"rmsnorm": _ffi.CONSTANTS["norm_rmsnorm"], "layernorm": _ffi.CONSTANTS["norm_layernorm"]}


def check(norm, name: str = "norm") -> int:
  """The kernels' id of a norm name; TypeError (not a string) or ValueError naming the
  choices."""
  return NORMS[checks.one_of(norm, name, sorted(NORMS))]


def centered(norm: str) -> bool:
  """Whether the norm subtracts the row mean and adds beta (LayerNorm)."""
  return check(norm) == NORMS["layernorm"]


def check_params(norm, gamma, beta, k: int):
  """(gamma, beta) of a norm over rows of K, checked: gamma [K] and, for LayerNorm only, beta
  [K], each float32 / bfloat16 / float16. TypeError / ValueError naming the argument."""
  check(norm, "norm")
  if gamma is None:
    raise TypeError(f"norm={norm!r} needs gamma, its [K] scale, got None")
  gamma = checks.array(gamma, "gamma")
  want_beta = centered(norm)
  if want_beta != (beta is not None):
    raise TypeError(f"beta must be {'a [K] array' if want_beta else 'None'} under "
                    f"{norm!r}, got {'None' if beta is None else type(beta).__name__}")
  arrays = {"gamma": gamma}
  if want_beta:
    arrays["beta"] = checks.array(beta, "beta")
  for name, v in arrays.items():
    if v.dtype not in FLOAT_DTYPES:
      raise TypeError(f"{name} must be float32, bfloat16 or float16, got {v.dtype}")
    if v.shape != (k,):
      raise ValueError(f"{name} must be [{k}] (x's last axis), got {list(v.shape)}")
  return gamma, arrays.get("beta")


def check_epsilon(epsilon, name: str = "epsilon") -> float:
  """epsilon as a Python float: a real number (Python or NumPy, not a bool) that f32 holds as a
  finite normal number (the kernels add it in f32 with subnormals flushed, so a smaller one is
  0 there and a row of zeros would get an infinite rsigma). TypeError / ValueError naming it."""
  if isinstance(epsilon, (bool, np.bool_)) or not isinstance(epsilon, numbers.Real):
    raise TypeError(f"{name} must be a float > 0, got {type(epsilon).__name__} {epsilon!r}")
  try:
    value = float(epsilon)
  except OverflowError:  # an int beyond float's range
    value = math.inf
  with np.errstate(over="ignore"):
    e32 = np.float32(value)
  if not (np.isfinite(e32) and e32 >= np.finfo(np.float32).tiny):
    raise ValueError(f"{name} must be a finite float > 0 that is a normal f32 (at least "
                     f"{np.finfo(np.float32).tiny:.4g}; the kernels add it in f32), got "
                     f"{epsilon!r}")
  return value


def stats(x: jax.Array, norm: str, epsilon: float) -> jax.Array:
  """The row statistics the kernels read, f32 [..., S]: RMSNorm ``[rsigma]`` (S = 1),
  LayerNorm ``[mu, rsigma]`` (S = 2), over the last axis of ``x`` (float32 / bfloat16 /
  float16 [..., C]).

  Raises:
    TypeError / ValueError at trace time: x not such an array, an unknown norm, an epsilon
    ``check_epsilon`` refuses.
  """
  x = checks.array(x, "x")
  if x.dtype not in FLOAT_DTYPES:
    raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
  if x.ndim < 1:
    raise ValueError("x must be [..., C], got a scalar")
  check(norm)
  epsilon = check_epsilon(epsilon)
  x = as_f32(x)
  if not centered(norm):
    return jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + epsilon)
  # One pass over x, as flax.linen.LayerNorm's default (use_fast_variance): E[x^2] - E[x]^2,
  # which loses precision where |mu| dwarfs the spread of the row.
  mu = jnp.mean(x, axis=-1, keepdims=True)
  var = jnp.maximum(jnp.mean(x * x, axis=-1, keepdims=True) - mu * mu, 0.0)
  return jnp.concatenate([mu, jax.lax.rsqrt(var + epsilon)], axis=-1)


def apply(x: jax.Array, row_stats: jax.Array, gamma: jax.Array, beta: jax.Array | None,
          norm: str) -> jax.Array:
  """The norm of ``x [..., C]`` from its ``stats`` in f32, in the kernels' order of operations:
  ``x * (rsigma * gamma)``, or ``(x - mu) * (rsigma * gamma) + beta``, every operand and result
  an f32 with subnormals flushed to zero (``formats.as_f32``, as the kernels flush them). The
  flush also keeps XLA from fusing LayerNorm's product and sum into one multiply-add, which the
  kernels round twice."""
  x, st = as_f32(x), as_f32(row_stats)
  m = as_f32(st[..., -1:] * as_f32(gamma))
  if not centered(norm):
    return as_f32(x * m)
  return as_f32(as_f32(as_f32(x - st[..., :1]) * m) + as_f32(beta))


def normalize(x: jax.Array, gamma: jax.Array, beta: jax.Array | None, *, norm: str,
              epsilon: float) -> jax.Array:
  """The norm of ``x [..., C]`` over its last axis, f32 [..., C] (``stats`` then ``apply``)."""
  return apply(x, stats(x, norm, epsilon), gamma, beta, norm)
