"""Stochastic rounding to E2M1, the rounding of gradients in NVIDIA's NVFP4 pretraining report
(arXiv 2509.25149): each element rounds up or down at random with the probabilities that make
it unbiased, from 16 random bits an element drawn with Philox4x32-10 (``jax_fp8.philox``) from
a counter made of the element's block coordinates, so any implementation reproduces them from
the key alone.

The C++ twin, for the CPU handler and the CUDA kernels: ``csrc/nvfp4.h``
(``sr_bits_of_block``, ``e2m1_magnitude_stochastic_biased``). Users: ``jax_fp8.reference``'s
``nvfp4_quantize`` (the specification of the kernels' bytes); tests:
``tests/test_stochastic_rounding.py``, ``tests/test_nvfp4.py`` (the bits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .formats import NVFP4_BLOCK
from .philox import philox4x32

SR_BITS = 16


def sr_bits(key_words: jax.Array, rows: int, blocks: int, direction: int) -> jax.Array:
  """The random integers of stochastic rounding for rows x (blocks x 16) elements quantized in
  1 x 16 blocks along their rows: block b of row r draws Philox4x32-10 under ``key_words`` with
  counters (b, r, direction, 0) and (b, r, direction, 1), eight words w0..w7, and its element
  i takes bits ``(w[i // 2] >> (16 * (i % 2))) & 0xFFFF``. ``direction``: 0 for the rowwise
  copy, 1 for the columnwise one (rows then are x's columns). uint32 [rows, blocks * 16]."""
  b, r, j = jnp.meshgrid(jnp.arange(blocks, dtype=jnp.uint32), jnp.arange(rows, dtype=jnp.uint32),
                         jnp.arange(2, dtype=jnp.uint32), indexing="xy")
  counter = jnp.stack([b, r, jnp.full_like(b, direction), j], axis=-1)  # [rows, blocks, 2, 4]
  words = philox4x32(counter, key_words).reshape(rows, blocks, 8)
  halves = jnp.stack([words & 0xFFFF, words >> 16], axis=-1)  # element 2w + h
  return halves.reshape(rows, blocks * NVFP4_BLOCK)


def e2m1_round_stochastic(y: jax.Array, bits: jax.Array) -> jax.Array:
  """E2M1 values of f32 ``y`` in [-6, 6], each magnitude rounded up to the next E2M1 value with
  probability (|y| - lo) / gap (lo the E2M1 value at or below |y|, gap the distance to the next:
  0.5 below 2, 1 below 4, 2 below 6): up exactly when ``bits`` (uniform 16-bit integers) is
  below (|y| - lo) / gap * 2^16, which is exact in f32: probability ceil(2^16 t) / 2^16 for
  t = (|y| - lo) / gap, biased up by less than 2^-16 of a gap; an E2M1 value never moves. A
  subnormal |y| counts as 0 (as XLA's CPU runtime flushes it), and the sign is kept (a negative
  value that rounds to zero gives -0). f32, same shape."""
  a = jnp.abs(y)
  a = jnp.where(a < jnp.finfo(jnp.float32).tiny, 0.0, a)  # subnormals are zero everywhere
  gap = jnp.where(a < 2, 0.5, jnp.where(a < 4, 1.0, 2.0)).astype(jnp.float32)
  lo = jnp.floor(a / gap) * gap
  up = bits.astype(jnp.float32) < (a - lo) / gap * jnp.float32(1 << SR_BITS)
  return jnp.copysign(jnp.where(up, lo + gap, lo), y)
