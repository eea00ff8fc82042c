"""jax_fp8.hadamard: the random Hadamard transform against its definition (signs from Philox,
the Sylvester matrix), along any axis, and the amax of it without forming it. Its use in NVFP4
quantization (the columnwise copy): test_nvfp4.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import block_scaled_data

from jax_fp8.formats import NVFP4_BLOCK, amax
from jax_fp8.hadamard import hadamard_amax, hadamard_transform, rht_signs
from jax_fp8.philox import philox4x32


def hadamard_matrix(seed):
  """diag(s) @ H16 / 4 built here from the definition: s from Philox by hand."""
  word = int(philox4x32(jnp.zeros(4, jnp.uint32),
                        jnp.array([seed % 2**32, seed >> 32], jnp.uint32))[0])
  s = np.array([-1.0 if word >> i & 1 else 1.0 for i in range(16)])
  h = np.array([[(-1.0) ** bin(i & j).count("1") for j in range(16)] for i in range(16)])
  return s[:, None] * h / 4


@pytest.mark.parametrize("seed", [0, 5, 2**32 + 7, 2**64 - 1])
def test_hadamard_transform_is_its_definition(rng, seed):
  """The butterfly equals g @ diag(s) @ H16 / 4 (signs from the documented Philox word), is
  orthogonal, and the transpose undoes it; seeds differ."""
  m = hadamard_matrix(seed)
  np.testing.assert_array_equal(np.asarray(rht_signs(seed)), 4 * m[:, 0])  # H16's column 0: 1s
  np.testing.assert_array_equal(np.asarray(hadamard_transform(jnp.eye(16), seed)), m)
  np.testing.assert_array_equal(m @ m.T, np.eye(16))  # entries +-1/4: the products are exact
  g = rng.standard_normal((8, 32)).astype(np.float32)
  got = np.asarray(hadamard_transform(jnp.asarray(g), seed), np.float64)
  np.testing.assert_allclose(got, (g.astype(np.float64).reshape(16, 16) @ m).reshape(8, 32),
                             rtol=0, atol=2.0**-20 * np.abs(g).max())
  assert np.any(np.asarray(rht_signs(seed)) != np.asarray(rht_signs(seed + 1 if seed < 9 else 1)))
  for bad, error in ((-1, ValueError), (2**64, ValueError), (1.0, TypeError), (True, TypeError),
                     ("0", TypeError)):
    with pytest.raises(error, match="seed must be an int in"):
      rht_signs(bad)


def test_hadamard_transform_along_any_axis(rng):
  """Groups along axis 0 of [R, C] (or a middle axis) are those of the transposed array's rows,
  bit for bit, subnormal flushes included; an axis out of range or not a multiple of 16 long
  raises."""
  x = block_scaled_data(rng, (64, 48), NVFP4_BLOCK, 38, jnp.float32)  # subnormal sums too
  np.testing.assert_array_equal(np.asarray(hadamard_transform(x, 9, axis=0)),
                                np.asarray(hadamard_transform(x.T, 9)).T)
  y = jnp.asarray(rng.standard_normal((3, 32, 5)), jnp.float32)
  np.testing.assert_array_equal(
      np.asarray(hadamard_transform(y, 9, axis=1)),
      np.asarray(hadamard_transform(jnp.swapaxes(y, 1, 2), 9)).swapaxes(1, 2))
  for axis in (2, -3, 0):
    with pytest.raises(ValueError, match="groups of 16 along an axis"):
      hadamard_transform(jnp.ones((8, 32)), 9, axis=axis)


def test_hadamard_transform_flushes_every_product_and_sum(platform, rng):
  """Under jit and eagerly, on any platform, the transform's bits are those of the butterfly in
  NumPy's f32 with every product and every sum flushed to (signed) zero where subnormal, for
  values whose products and sums fall below f32's normal range (where a fused multiply-add
  would skip a product's flush)."""
  x = (rng.standard_normal((64, 32)) * 1e-37).astype(np.float32)  # products near f32's tiny

  def flush(v):
    return np.where(np.abs(v) < np.finfo(np.float32).tiny, v * np.float32(0), v)
  s = np.asarray(rht_signs(3)) / np.float32(4)
  v = [flush(x.reshape(64, 2, 16)[..., i] * s[i]) for i in range(16)]
  for h in (1, 2, 4, 8):
    for t in (t for j in range(0, 16, 2 * h) for t in range(j, j + h)):
      v[t], v[t + h] = flush(v[t] + v[t + h]), flush(v[t] - v[t + h])
  want = np.stack(v, axis=-1).reshape(64, 32).view(np.uint32)
  for f in (jax.jit(hadamard_transform, static_argnums=1), hadamard_transform):
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x), 3)).view(np.uint32), want)


def test_hadamard_amax_is_the_transforms_amax(platform, rng):
  """hadamard_amax gives amax(hadamard_transform(.)) bit for bit under jit, along either axis:
  subnormal sums flushed, a NaN or an infinity anywhere, all zeros; NaN where only some of a
  group's outputs are (two infinities: inf - inf in the outputs where their signs differ);
  the same error for a bad axis."""
  shape = (64, 48)  # every case one shape: one compilation per function and axis
  x = block_scaled_data(rng, shape, NVFP4_BLOCK, 38, jnp.float32)  # subnormal sums too
  big = jnp.asarray(rng.standard_normal(shape) * 1e37, jnp.float32)  # sums overflow to inf
  # +inf at rows 0 and j of one column: along axis 0 the group's output k is
  # s_0 inf + s_j (-1)^popcount(k & j) inf, NaN where the two signs differ. With s_j != s_0 and
  # popcount(j) odd, output 0 is NaN and output 15 is not: a reduction that kept its last
  # operand over a NaN would miss it.
  signs = np.asarray(rht_signs(9))
  j = next(j for j in range(1, 16) if signs[j] != signs[0] and bin(j).count("1") % 2)
  two_infs = jnp.zeros(shape).at[0, 3].set(jnp.inf).at[j, 3].set(jnp.inf)
  cases = [x, x * 2.0**100, big, x.at[17, 5].set(jnp.nan), x.at[3, 40].set(jnp.inf),
           two_infs, jnp.zeros(shape)]
  ours = jax.jit(hadamard_amax, static_argnums=1, static_argnames="axis")
  theirs = jax.jit(lambda v, seed, axis: amax(hadamard_transform(v, seed, axis=axis)),
                   static_argnums=(1, 2))
  for v in cases:
    for axis in (0, -1):
      got, want = ours(v, 9, axis=axis), theirs(v, 9, axis)
      got, want = np.asarray(got), np.asarray(want)
      assert got.dtype == want.dtype == np.float32 and got.shape == want.shape == ()
      assert np.isnan(got) == np.isnan(want) and (np.isnan(got) or got.view(np.uint32) ==
                                                    want.view(np.uint32)), (axis, got, want)
  assert np.isnan(np.asarray(hadamard_amax(cases[3], 9, axis=0)))
  assert np.isnan(np.asarray(hadamard_amax(two_infs, 9, axis=0)))
  with pytest.raises(ValueError, match="hadamard_amax takes groups of 16 along an axis"):
    hadamard_amax(jnp.ones((8, 32)), 9, axis=0)
