"""Residuals saved as 32-bit words: the same bytes come back, and a scanned layer stacks words;
under scan each kernel compiles once."""

import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import HAS_CUDA, seed_for

import jax_fp8
from jax_fp8 import _residuals
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

  def fwd(x):  # a is a value the rule computed, not one of its inputs
    return x, (a, None, 7)

  def bwd(residuals, g):
    seen["residuals"] = residuals
    return (g,)

  packed_fwd, packed_bwd = packed(fwd, bwd)
  out, saved = packed_fwd(jnp.ones(()))
  (leaf,) = [v for v in jax.tree.leaves(saved) if hasattr(v, "dtype") and v.ndim == a.ndim]
  assert leaf.dtype == (jnp.uint32 if as_words else dtype)
  packed_bwd(saved, jnp.ones(()))
  back, none, seven = seen["residuals"]
  assert back.dtype == dtype and back.shape == a.shape and none is None and seven == 7
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(back, jnp.uint8)),
                                np.asarray(jax.lax.bitcast_convert_type(a, jnp.uint8)))


@pytest.fixture
def fresh_traces(request):
  """No traces cached from before, none left for after: these tests switch packing off."""
  jax.clear_caches()
  request.addfinalizer(jax.clear_caches)


def _scan_outputs(fn, *args):
  """The avals of the outputs of the first scan in fn's jaxpr."""
  jaxpr = jax.make_jaxpr(fn)(*args)
  return next([v.aval for v in e.outvars] for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan")


def test_scanned_linear_stacks_fp8_residuals_as_words(request, monkeypatch, fresh_traces):
  """Under lax.scan the stacked residuals of jax_fp8.linear are uint32 words, not FP8, and the
  gradients equal those computed with the residuals saved as they are."""
  key = jax.random.key(seed_for(request.node.nodeid))
  kx, kw = jax.random.split(key)
  x = jax.random.normal(kx, (32, 64), jnp.bfloat16)
  ws = jax.random.normal(kw, (3, 64, 64), jnp.float32) / 8
  states = jax.vmap(lambda _: jax_fp8.LinearState.create())(jnp.arange(3))

  def loss(x, ws):
    body = lambda h, layer: (jax_fp8.linear(h, layer[0], state=layer[1]), None)  # noqa: E731
    return jnp.sum(jax.lax.scan(body, x, (ws, states))[0].astype(jnp.float32))

  stacked = [a for a in _scan_outputs(lambda x, ws: jax.vjp(loss, x, ws)[1](1.0), x, ws)
             if a.ndim == 3 and a.shape[0] == 3]
  assert any(a.dtype == jnp.uint32 for a in stacked)
  assert not any(a.dtype.itemsize == 1 for a in stacked)
  packed_grads = jax.grad(loss, (0, 1))(x, ws)
  monkeypatch.setattr(_residuals, "_pack", lambda a: a)
  jax.clear_caches()  # traced with packing above
  for a, b in zip(packed_grads, jax.grad(loss, (0, 1))(x, ws)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_input_residual_is_not_copied(monkeypatch, fresh_traces):
  """A residual that is the rule's own input (x, read by the fused norm's backward) stays as
  it is: scanned over xs, JAX reuses xs instead of stacking a copy."""
  xs = jnp.ones((4, 32, 64), jnp.bfloat16)
  w, gamma = jnp.ones((64, 64)) / 8, jnp.ones((64,), jnp.bfloat16)

  def grads(xs, w):
    def loss(xs, w):
      step = lambda c, x: (c + jnp.sum(jax_fp8.linear(  # noqa: E731
          x, w, recipe=jax_fp8.CurrentScaling(), norm="rmsnorm", gamma=gamma)), None)
      return jax.lax.scan(step, jnp.zeros((), jnp.bfloat16), xs)[0]
    return jax.vjp(loss, xs, w)[1](jnp.ones((), jnp.bfloat16))

  packed = _scan_outputs(grads, xs, w)
  monkeypatch.setattr(_residuals, "_pack", lambda a: a)
  jax.clear_caches()  # traced with packing above
  plain = _scan_outputs(grads, xs, w)
  nbytes = lambda avals: sorted(a.size * a.dtype.itemsize for a in avals)  # noqa: E731
  assert nbytes(packed) == nbytes(plain)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU with the jax_fp8 CUDA targets")
@pytest.mark.parametrize("recipe", [jax_fp8.CurrentScaling(), jax_fp8.BlockScaling()],
                         ids=["current", "block"])
@pytest.mark.parametrize("program", ["linear_squared", "mlp", "ys"])
def test_scanned_kernels_compile_once(recipe, program):
  """Under scan each jax_fp8 kernel of the program compiles once: XLA's dynamic-slice fusion,
  which writes a custom call's output straight into its stack, ran a call whose output was
  also read a second time for the stack. The programs: a linear whose output the model's own
  rule saves (a square's), an mlp (its y and, under BlockScaling, its kernel blocks are
  residuals the forward reads), and a scan without gradients whose ys is a linear's output."""
  layers, d = 3, 256
  x = jax.ShapeDtypeStruct((256, d), jnp.bfloat16)
  ws = tuple(jax.ShapeDtypeStruct((layers, *shape), jnp.float32)
             for shape in ((d, d), (d, 2 * d), (d, d)))

  def body(h, w):
    if program == "mlp":
      return h + jax_fp8.mlp(h, w[1], w[2], recipe=recipe), None
    v = jax_fp8.linear(h, w[0], recipe=recipe)
    return (h + v * v, None) if program == "linear_squared" else (h + v, v)

  def loss(x, ws):
    h, ys = jax.lax.scan(body, x, ws)
    return jnp.sum(h.astype(jnp.float32)) + (0.0 if ys is None else
                                             jnp.sum(ys.astype(jnp.float32)))

  lowered = jax.jit(loss if program == "ys" else jax.grad(loss, (0, 1))).lower(x, ws)
  planned = collections.Counter(re.findall(r"custom_call @(jax_fp8_\w+)", lowered.as_text()))
  compiled = collections.Counter(re.findall(r'custom_call_target="(jax_fp8_\w+)"',
                                            lowered.compile().as_text()))
  assert planned and compiled == planned
