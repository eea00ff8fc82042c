"""Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3",
SC 2011; the generator of Random123 and cuRAND) in jnp: counter-based random bits, so that
every element's bits follow from its coordinates and a key alone, the same in the reference,
the CPU handlers and the CUDA kernels. jax_fp8 draws the random bits of stochastic rounding
(``jax_fp8.stochastic_rounding.sr_bits``) and the Hadamard transform's signs
(``jax_fp8.hadamard.rht_signs``) with it.

Plain uint32 arithmetic: the 32 x 32 -> 64-bit products are built from 16-bit halves, so no
64-bit integers (JAX's x64 mode) are needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .checks import array, describe

ROUNDS = 10
MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)
WEYL = (0x9E3779B9, 0xBB67AE85)  # the key's increments between rounds


def _mulhilo(a: jax.Array, b: int) -> tuple[jax.Array, jax.Array]:
  """(high, low) 32-bit words of the 64-bit product of uint32 ``a`` and the constant ``b``."""
  u32 = jnp.uint32
  al, ah = a & u32(0xFFFF), a >> 16
  bl, bh = u32(b & 0xFFFF), u32(b >> 16)
  ll, lh, hl, hh = al * bl, al * bh, ah * bl, ah * bh
  mid = (ll >> 16) + (lh & u32(0xFFFF)) + (hl & u32(0xFFFF))
  return hh + (lh >> 16) + (hl >> 16) + (mid >> 16), a * u32(b)


def philox4x32(counter: jax.Array, key: jax.Array) -> jax.Array:
  """Philox4x32-10 of each counter under one key.

  Args:
    counter: uint32 [..., 4], the counter words (c0, c1, c2, c3).
    key: uint32 [2], the key words (k0, k1).
  Returns:
    uint32 [..., 4], four random words per counter.
  """
  counter = jnp.asarray(counter, jnp.uint32)
  key = jnp.asarray(key, jnp.uint32)
  c = [counter[..., i] for i in range(4)]
  k0, k1 = key[0], key[1]
  for r in range(ROUNDS):
    if r:
      k0, k1 = k0 + jnp.uint32(WEYL[0]), k1 + jnp.uint32(WEYL[1])
    hi0, lo0 = _mulhilo(c[0], MULTIPLIERS[0])
    hi1, lo1 = _mulhilo(c[2], MULTIPLIERS[1])
    c = [hi1 ^ c[1] ^ k0, lo1, hi0 ^ c[3] ^ k1, lo0]
  return jnp.stack(c, axis=-1)


def key_words(key) -> jax.Array:
  """The two uint32 key words of a JAX PRNG key (a typed key of the default threefry
  implementation, or a raw uint32 [2] key); TypeError for a value that is no array (a str, say),
  ValueError for an array of another shape or dtype."""
  wanted = ("key must be a JAX PRNG key of two uint32 words (jax.random.key(seed) or "
            f"jax.random.PRNGKey(seed), threefry), got {describe(key)}")
  if isinstance(key, jax.Array) and jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  try:
    words = array(key, "key")
  except TypeError:
    raise TypeError(wanted) from None
  if words.shape != (2,) or words.dtype != jnp.uint32:
    raise ValueError(wanted)
  return words
