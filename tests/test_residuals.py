"""Residuals saved as 32-bit words: the same bytes come back, and a scanned layer stacks words."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seed_for

import jax_fp8
from jax_fp8._residuals import packed


def random_bits(shape, dtype, name):
  size = jnp.dtype(dtype).itemsize
  bits = np.random.default_rng(seed_for(name)).integers(0, 256, (*shape, size), np.uint8)
  return jax.lax.bitcast_convert_type(jnp.asarray(bits), dtype) if size > 1 else \
      jax.lax.bitcast_convert_type(jnp.asarray(bits[..., 0]), dtype)


@pytest.mark.parametrize("dtype,shape,as_words", [
    (jnp.float8_e4m3fn, (3, 8), True), (jnp.float8_e5m2, (2, 5, 4), True),
    (jnp.bfloat16, (4, 6), True), (jnp.float16, (2,), True), (jnp.uint8, (6, 12), True),
    (jnp.float8_e4m3fn, (3, 6), False),  # 6 bytes: not whole words
    (jnp.bfloat16, (5, 3), False), (jnp.float32, (2, 3), False), (jnp.float32, (), False),
])
def test_residuals_come_back_bit_for_bit(request, dtype, shape, as_words):
  a = random_bits(shape, dtype, request.node.nodeid)
  seen = {}

  def fwd(x, a):
    return x, (a, None, 7)

  def bwd(residuals, g):
    seen["residuals"] = residuals
    return g, jnp.zeros_like(residuals[0])

  packed_fwd, packed_bwd = packed(fwd, bwd)
  out, saved = packed_fwd(jnp.ones(()), a)
  (leaf,) = [v for v in jax.tree.leaves(saved) if hasattr(v, "dtype") and v.ndim == a.ndim]
  assert leaf.dtype == (jnp.uint32 if as_words else dtype)
  packed_bwd(saved, jnp.ones(()))
  back, none, seven = seen["residuals"]
  assert back.dtype == dtype and back.shape == a.shape and none is None and seven == 7
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(back, jnp.uint8)),
                                np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)))


def test_scanned_linear_stacks_fp8_residuals_as_words(request):
  """Under lax.scan the backward's stacked residuals of jax_fp8.linear are uint32 words, and
  the gradients equal those of the layers applied one by one."""
  key = jax.random.key(seed_for(request.node.nodeid))
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (32, 64), jnp.bfloat16)
  ws = jax.random.normal(kw, (3, 64, 64), jnp.float32) / 8
  states = jax.vmap(lambda _: jax_fp8.LinearState.create())(jnp.arange(3))

  def body(h, layer):
    w, s = layer
    return jax_fp8.linear(h, w, state=s), None

  def scanned(x, ws):
    return jnp.sum(jax.lax.scan(body, x, (ws, states))[0].astype(jnp.float32))

  def unrolled(x, ws):
    h = x
    for i in range(3):
      h = body(h, (ws[i], jax.tree.map(lambda v, i=i: v[i], states)))[0]
    return jnp.sum(h.astype(jnp.float32))

  _, vjp = jax.vjp(scanned, x, ws)
  stacked = [v for v in jax.tree.leaves(vjp) if getattr(v, "ndim", 0) == 3 and v.shape[0] == 3]
  assert stacked and not any(jnp.issubdtype(v.dtype, jnp.floating) and v.dtype.itemsize == 1
                             for v in stacked)
  assert any(v.dtype == jnp.uint32 for v in stacked)
  for a, b in zip(jax.grad(scanned, (0, 1))(x, ws), jax.grad(unrolled, (0, 1))(x, ws)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
