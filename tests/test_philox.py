"""jax_fp8.philox: Philox4x32-10 against Random123's known-answer vectors, and the keys it takes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp8.philox import key_words, philox4x32

# Random123's kat_vectors, philox4x32 with 10 rounds: (counter, key, result).
KNOWN_ANSWERS = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("counter,key,want", KNOWN_ANSWERS)
def test_known_answers(counter, key, want):
  got = philox4x32(jnp.array(counter, jnp.uint32), jnp.array(key, jnp.uint32))
  assert [int(v) for v in got] == list(want)


def test_batched_counters_are_independent_calls():
  counters = jnp.array([k[0] for k in KNOWN_ANSWERS[:2]], jnp.uint32).reshape(2, 1, 4)
  got = philox4x32(counters, jnp.zeros(2, jnp.uint32))
  assert got.shape == (2, 1, 4)
  np.testing.assert_array_equal(got[0, 0], np.array(KNOWN_ANSWERS[0][2], np.uint32))
  np.testing.assert_array_equal(
      got[1, 0], philox4x32(jnp.array(KNOWN_ANSWERS[1][0], jnp.uint32), jnp.zeros(2, jnp.uint32)))


def test_key_words():
  np.testing.assert_array_equal(key_words(jax.random.key(7)), key_words(jax.random.PRNGKey(7)))
  for bad in (jax.random.key(0, impl="rbg"), jnp.zeros(3, jnp.uint32), jnp.zeros(2, jnp.int32)):
    with pytest.raises(ValueError, match="key must be a JAX PRNG key of two uint32 words"):
      key_words(bad)
  for bad in ("seed", b"\x00" * 8, None, object()):  # no array: named, not JAX's message
    with pytest.raises(TypeError, match="key must be a JAX PRNG key of two uint32 words.*got "):
      key_words(bad)
