"""activation_cast_transpose and activation_grad_cast_transpose: an MLP's activation, and the
gradient through it, computed inside the cast-transpose. Against the jnp reference within the
bound docs/design.md states (the kernels' expf / tanhf are the platform's, so not byte for
byte): each dequantized element within one step of the format's grid, plus 2^-12 of the amax
where the two platforms' tanhf differ by an ulp near +-1 and gelu's derivative cancels; the
transposed copy is exactly the row-major one transposed; amax, scale and ring within 2^-16
(the activations' f32 values differ by a few ulps, more where 1 + tanh and 1 - tanh^2 cancel
in gelu's derivative)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (bits, covering_cases, on_cpu, poison_allocator, roundoff, summation_error,
                      to_device)

import jax_fp8
from jax_fp8 import activations, reference

ACTS = ["silu", "gelu", "swiglu", "geglu"]
# Output shapes [R, C]; 1040 columns make 17 column tiles, 1000 rows 16 row tiles.
SHAPES = [(1, 16), (17, 48), (100, 208), (1000, 1040)]
# Every activation at every shape, the input dtype varied so that every pair of the three occurs.
CASES = covering_cases({"activation": ACTS, "shape": SHAPES},
                       {"dtype": [jnp.float32, jnp.bfloat16, jnp.float16]})
SUBNORMAL_STEP = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}  # the smallest step, times the scale
F32_ULPS = 2.0**-12  # of the amax: where the platforms' f32 activations may differ (see above)
AMAX_RTOL = 2.0**-16  # amax, and the scale and ring taken from it


def close(got, want, fmt):
  """The bound of the module docstring on the data (of two ``Quantized``), and data.T == data_t
  exactly; amax and scale within AMAX_RTOL."""
  q, qt, a, s = got.data, got.data_t, got.amax, got.scale
  rq, ra, rs = want.data, want.amax, want.scale
  np.testing.assert_allclose(np.asarray(s), rs, rtol=AMAX_RTOL)
  np.testing.assert_allclose(np.asarray(a), ra, rtol=AMAX_RTOL)
  deq = np.asarray(q, np.float64) * float(s)
  ref = np.asarray(rq, np.float64) * float(rs)
  bound = (2 * roundoff(fmt) * np.maximum(np.abs(deq), np.abs(ref))
           + SUBNORMAL_STEP[fmt] * float(s) + F32_ULPS * float(ra))
  assert np.all(np.abs(deq - ref) <= bound), np.max(np.abs(deq - ref) / bound)
  rows = q.shape[0]
  np.testing.assert_array_equal(bits(qt)[:, :rows], bits(q).T)
  assert not bits(qt)[:, rows:].any()  # the padding columns are zero


def data(rng, shape, dtype, scale=3.0):
  return to_device(rng.standard_normal(shape) * scale, dtype)


@pytest.mark.parametrize("activation,shape,dtype", CASES)
def test_forward_matches_reference(platform, rng, activation, dtype, shape):
  gated = activations.ACTIVATIONS[activation][1]
  r, c = shape
  ring = jax_fp8.ScaleRing.create(8, "e4m3")
  step = jax.jit(jax_fp8.activation_cast_transpose, static_argnames="activation")
  for _ in range(2):  # the fresh step (scale from the activation's own amax), then a delayed one
    y = data(rng, (r, 2 * c if gated else c), dtype)
    poison_allocator(r * c)
    got = step(y, ring, activation=activation)
    want = on_cpu(lambda y, r: reference.activation_cast_transpose(y, r, activation=activation),
                  y, ring)
    assert got.tensor.data.shape == (r, c) and got.dbias is None
    close(got.tensor, want.tensor, "e4m3")
    for u, v in zip(jax.tree.leaves(got.ring), jax.tree.leaves(want.ring)):
      np.testing.assert_allclose(np.asarray(u), v, rtol=AMAX_RTOL)
    ring = want.ring


@pytest.mark.parametrize("activation,shape,dtype", CASES)
def test_grad_matches_reference(platform, rng, activation, dtype, shape):
  gated = activations.ACTIVATIONS[activation][1]
  r, c = shape
  ring = jax_fp8.ScaleRing.create(8, "e5m2")
  step = jax.jit(jax_fp8.activation_grad_cast_transpose,
                 static_argnames=("activation", "with_dbias"))
  for with_dbias in (True, False):  # the fresh step with dbias, then a delayed one without
    y = data(rng, (r, 2 * c if gated else c), dtype)
    dh = data(rng, (r, c), dtype, 1.0)
    poison_allocator(r * c)
    got = step(dh, y, ring, activation=activation, with_dbias=with_dbias)
    want = on_cpu(lambda dh, y, r: reference.activation_grad_cast_transpose(
        dh, y, r, activation=activation, with_dbias=with_dbias), dh, y, ring)
    assert got.tensor.data.shape == y.shape
    close(got.tensor, want.tensor, "e5m2")
    for u, v in zip(jax.tree.leaves(got.ring), jax.tree.leaves(want.ring)):
      np.testing.assert_allclose(np.asarray(u), v, rtol=AMAX_RTOL)
    ring = want.ring
    if not with_dbias:
      assert got.dbias is None
      continue
    # dbias: f32 column sums of the same values in another order, the values within the bound.
    v = np.asarray(on_cpu(lambda dh, y: activations.grad(dh, y, activation), dh, y), np.float64)
    bound = (summation_error(r) * np.abs(v).sum(axis=0)
             + r * F32_ULPS * float(want.tensor.amax))
    assert np.all(np.abs(np.asarray(got.dbias, np.float64) - v.sum(axis=0)) <= bound)


def test_grad_formulas_are_the_derivatives(rng):
  """jax_fp8.activations.grad (the kernels' formulas) against autodiff of apply."""
  for activation in ACTS:
    gated = activations.ACTIVATIONS[activation][1]
    y = jnp.asarray(rng.standard_normal((64, 64 if gated else 32)) * 4, jnp.float32)
    dh = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    _, vjp = jax.vjp(lambda y: activations.apply(y, activation), y)
    # Two f32 evaluations of the derivative, each within a few ulps of 1 (where gelu's
    # 1 + tanh and 1 - tanh^2 cancel) times the factor dh (* up) it is multiplied by.
    scale = np.abs(np.asarray(dh)) * (np.abs(np.asarray(jnp.split(y, 2, -1)[1])) if gated
                                      else 1.0)
    gated_scale = np.concatenate([scale, scale], -1) if gated else scale
    err = np.abs(np.asarray(activations.grad(dh, y, activation)) - np.asarray(vjp(dh)[0]))
    assert np.all(err <= 2.0**-16 * (np.abs(np.asarray(vjp(dh)[0])) + gated_scale))
  x = jnp.linspace(-6, 6, 97)
  np.testing.assert_allclose(activations.apply(x, "silu"), jax.nn.silu(x), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(activations.apply(x, "gelu"), jax.nn.gelu(x), rtol=1e-6, atol=1e-6)


def test_nan_stays_visible(platform):
  """A NaN in the pre-activation (gate or up) gives a NaN amax and the NaN byte, never a
  finite stand-in."""
  y = jnp.ones((16, 64), jnp.float32).at[3, 5].set(jnp.nan).at[7, 40].set(jnp.nan)
  ring = jax_fp8.ScaleRing.create(4)
  out = jax_fp8.activation_cast_transpose(y, ring, activation="swiglu")
  assert np.isnan(float(out.tensor.amax))
  b = bits(out.tensor.data)
  assert b[3, 5] == 0x7F and b[7, 8] == 0x7F
  dh = jnp.ones((16, 32), jnp.float32)
  g = jax_fp8.activation_grad_cast_transpose(dh, y, jax_fp8.ScaleRing.create(4, "e5m2"),
                                             activation="swiglu")
  assert np.isnan(float(g.tensor.amax))
  q = bits(g.tensor.data)
  assert q[3, 5] == 0x7F and q[3, 37] == 0x7F  # dgate and dup of gate's NaN


def test_bad_inputs():
  ring = jax_fp8.ScaleRing.create(4)
  y = jnp.ones((4, 64))
  with pytest.raises(ValueError, match="activation must be one of"):
    jax_fp8.activation_cast_transpose(y, ring, activation="relu")
  with pytest.raises(ValueError, match=r"\[R, 2C\] .* C a positive multiple of 16"):
    jax_fp8.activation_cast_transpose(jnp.ones((4, 48)), ring, activation="swiglu")
  with pytest.raises(ValueError, match="positive multiple of 16"):
    jax_fp8.activation_cast_transpose(jnp.ones((4, 24)), ring, activation="silu")
  with pytest.raises(TypeError, match="y must be float32"):
    jax_fp8.activation_cast_transpose(jnp.ones((4, 64), jnp.int32), ring, activation="silu")
  with pytest.raises(ValueError, match=r"y must be \[4, 64\]"):
    jax_fp8.activation_grad_cast_transpose(jnp.ones((4, 32)), jnp.ones((4, 32)), ring,
                                           activation="swiglu")
  with pytest.raises(TypeError, match="y must have dh's dtype bfloat16"):
    jax_fp8.activation_grad_cast_transpose(jnp.ones((4, 32), jnp.bfloat16), jnp.ones((4, 32)),
                                           ring, activation="silu")
  with pytest.raises(TypeError, match="with_dbias"):
    jax_fp8.activation_grad_cast_transpose(jnp.ones((4, 32)), jnp.ones((4, 32)), ring,
                                           activation="silu", with_dbias=1)
  with pytest.raises(TypeError, match="not differentiable"):
    jax.grad(lambda y: jnp.sum(jax_fp8.activation_cast_transpose(y, ring, activation="silu")
                               .tensor.amax))(y)
