"""The random Hadamard transform (RHT) of the NVFP4 recipe's wgrad operands (NVIDIA's NVFP4
pretraining report, arXiv 2509.25149): each group of ``RHT_SIZE`` elements along the quantized
axis is multiplied by ``diag(signs) . H16 / 4`` (H16 the Sylvester Hadamard matrix, the signs
drawn with Philox4x32-10 from a seed), an orthogonal matrix, before the columnwise
quantization, so that outliers spread over their group.

The C++ twin, for the CPU handler and the CUDA kernels: ``hadamard16`` in ``csrc/nvfp4.h``,
which takes the signs ``rht_signs`` computes. Users: ``jax_fp8.ops.nvfp4`` (the signs, and the
transformed copy's amax), the NVFP4 recipe (its seed's check) and its linear,
``jax_fp8.reference.nvfp4_quantize``; tests: ``tests/test_hadamard.py``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from .formats import amax, as_f32
from .philox import philox4x32

RHT_SIZE = 16


def rht_signs(seed: int, name: str = "the Hadamard transform's seed") -> np.ndarray:
  """The transform's signs, f32 [16]: ``s_i = -1`` where bit i of word 0 of
  Philox4x32-10(counter 0, key (seed mod 2^32, seed >> 32)) is set, else 1. ``seed`` is a
  Python int in [0, 2^64) (not traced: the signs are constants of the compiled program);
  TypeError for another kind of value, ValueError for an int out of that range, each naming
  the seed ``name``."""
  if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
    raise TypeError(f"{name} must be an int in [0, 2^64), got {type(seed).__name__} {seed!r}")
  if not 0 <= seed < 2**64:
    raise ValueError(f"{name} must be an int in [0, 2^64), got {seed!r}")
  return _signs(int(seed)).copy()


@functools.lru_cache(maxsize=None)
def _signs(seed: int) -> np.ndarray:
  """``rht_signs`` of a checked seed, computed once a process: Philox's rounds run as eager
  jnp operations (constants, also when called under a trace), each dispatched on its own."""
  with jax.ensure_compile_time_eval():
    word = np.uint32(philox4x32(jnp.zeros(4, jnp.uint32),
                                jnp.array([seed & 0xFFFFFFFF, seed >> 32], jnp.uint32))[0])
  return np.where((word >> np.arange(RHT_SIZE, dtype=np.uint32)) & 1, -1.0, 1.0).astype(np.float32)


def hadamard_transform(x: jax.Array, seed: int, axis: int = -1) -> jax.Array:
  """Each 16-element group along ``axis`` of f32 ``x`` as the row vector
  ``g @ diag(s) @ H16 / 4`` (``s = rht_signs(seed)``, ``H16[i, j] = (-1)^popcount(i & j)``):
  the products ``g_i * s_i / 4`` (exact), then the fast Walsh-Hadamard butterfly, stages of
  distance 1, 2, 4, 8, each pair (a, b) becoming (a + b, a - b) in f32: the order of the sums
  that every implementation follows, so the bytes agree. Subnormal products and sums are
  flushed to zero on every backend (XLA's CPU does; a GPU would keep them). Orthogonal: the
  transpose of its matrix undoes it. f32, x's shape (``axis`` a multiple of 16 long); along
  axis 0 of [R, C] it equals the transform of x.T's rows, transposed, without moving x.
  ValueError for an axis out of range or not a multiple of 16 long."""
  v, axis = _hadamard_outputs(x, seed, axis, "hadamard_transform")
  return jnp.stack(v, axis=axis + 1).reshape(x.shape)


def hadamard_amax(x: jax.Array, seed: int, axis: int = -1) -> jax.Array:
  """``amax(hadamard_transform(x, seed, axis))``, the same f32 bits (NaN where the transform
  holds one), without forming the transform: the 16 outputs of each group are first reduced
  to their largest magnitude, elementwise, so XLA evaluates each group's butterfly once. From
  the formed transform its fused reduction evaluated the whole butterfly for every output
  element, 16 times a group. ValueError as ``hadamard_transform``."""
  def larger(a, b):  # the larger magnitude, NaN if either is (whatever XLA's max does)
    return jnp.where(jnp.isnan(a) | (a > b), a, b)
  outputs, _ = _hadamard_outputs(x, seed, axis, "hadamard_amax")
  return amax(functools.reduce(larger, map(jnp.abs, outputs)))


def _hadamard_outputs(x: jax.Array, seed: int, axis: int, name: str) -> tuple[list, int]:
  """The transform's 16 outputs of every group along ``axis`` as 16 arrays (x's shape with that
  axis 16 times shorter), so that each stage is elementwise and XLA fuses the transform (or
  an amax of it) into one pass over x; and the axis, nonnegative."""
  shape = x.shape
  if not -x.ndim <= axis < x.ndim or shape[axis] % RHT_SIZE:
    raise ValueError(f"{name} takes groups of {RHT_SIZE} along an axis of x whose "
                     f"length is a multiple of {RHT_SIZE}: got axis {axis} of shape {shape}")
  axis %= x.ndim
  groups = x.reshape(*shape[:axis], shape[axis] // RHT_SIZE, RHT_SIZE, *shape[axis + 1:])
  signs = rht_signs(seed) / 4
  v = [as_f32(jnp.take(groups, i, axis=axis + 1) * signs[i]) for i in range(RHT_SIZE)]
  h = 1
  while h < RHT_SIZE:
    for t in (t for j in range(0, RHT_SIZE, 2 * h) for t in range(j, j + h)):
      v[t], v[t + h] = as_f32(v[t] + v[t + h]), as_f32(v[t] - v[t + h])
    h *= 2
  return v, axis
