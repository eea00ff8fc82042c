"""The peers jax_fp8 is measured against, written in plain JAX.

- ``bf16_linear``: ``x @ kernel + bias`` in bf16 (XLA's cuBLAS GEMMs), autodiff backward.
- ``xla_fp8_linear``: the pure-XLA FP8 path available to JAX users today (as Flax's
  ``Fp8DirectDotGeneralOp``): jnp quantization with per-tensor current scaling, FP8 operands
  straight into ``dot_general`` (XLA emits cuBLASLt FP8 GEMMs), E5M2 gradients.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_fp8 import reference
from jax_fp8.formats import fp8_max


def bf16_linear(x, kernel, bias):
  return x @ kernel + bias


def _q(v, fmt):
  amax = jnp.max(jnp.abs(v.astype(jnp.float32)))
  scale = jnp.maximum(amax, 1e-12) / fp8_max(fmt)
  return reference.quantize(v, scale, fmt).data, scale


def _dot(a, b, sa, sb, dims):
  y = jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.bfloat16)
  return y * (sa * sb).astype(jnp.bfloat16)


@jax.custom_vjp
def xla_fp8_linear(x, kernel, bias):
  qx, sx = _q(x, "e4m3")
  qk, sk = _q(kernel, "e4m3")
  return _dot(qx, qk, sx, sk, (((1,), (0,)), ((), ()))) + bias


def _fwd(x, kernel, bias):
  qx, sx = _q(x, "e4m3")
  qk, sk = _q(kernel, "e4m3")
  y = _dot(qx, qk, sx, sk, (((1,), (0,)), ((), ()))) + bias
  return y, (qx, sx, qk, sk)


def _bwd(res, g):
  qx, sx, qk, sk = res
  qg, sg = _q(g, "e5m2")
  dx = _dot(qg, qk, sg, sk, (((1,), (1,)), ((), ())))  # [M, K]
  dk = _dot(qx, qg, sx, sg, (((0,), (0,)), ((), ())))  # [K, N]
  return dx, dk, jnp.sum(g, axis=0, dtype=jnp.float32).astype(g.dtype)


xla_fp8_linear.defvjp(_fwd, _bwd)
