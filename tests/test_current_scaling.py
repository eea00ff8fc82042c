"""CurrentScaling: per-tensor scales from this step's amaxes, no state (linear, multi_linear,
mlp, the Flax layers, FP8 weights, checkpoints, recipe checks). The multi-device cases are in
test_multidevice.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from conftest import normwise
from test_linear import (BWD_TOL, E4M3, E5M2, FWD_TOL, bias_tol, check_numerical_gradient,
                         loss_f32, problem, rel)

import jax_fp8
import jax_fp8.flax
import jax_fp8.nnx
from jax_fp8 import checkpoint

CURRENT = jax_fp8.CurrentScaling()


def grads(recipe, state, x, w, b, t, **kw):
  """y and (dx, dkernel, dbias) of sum(linear(x) * t)."""
  f = lambda x, w, b: jax_fp8.linear(x, w, b, state=state, recipe=recipe, **kw)  # noqa: E731
  y, vjp = jax.vjp(f, x, w, b)
  return y, vjp(t.astype(y.dtype))


def assert_same_bits(a, b):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(u).view(np.uint8), np.asarray(v).view(np.uint8))


@pytest.mark.parametrize("fp8_format", ["hybrid", "e4m3"])
def test_equals_a_fresh_delayed_state(platform, rng, fp8_format):
  """A fresh delayed-scaling ring takes its first step's scale from the current amax with the
  same rule, so CurrentScaling gives that step's bits: forward and all three gradients."""
  x, w, b, t = problem(rng, dtype=jnp.bfloat16)
  delayed = jax_fp8.DelayedScaling(fp8_format=fp8_format)
  current = jax_fp8.CurrentScaling(fp8_format=fp8_format)
  want = jax.jit(lambda *a: grads(delayed, jax_fp8.LinearState.create(delayed), *a))(x, w, b, t)
  got = jax.jit(lambda *a: grads(current, None, *a))(x, w, b, t)
  assert_same_bits(got, want)


def test_scales_follow_the_tensors(platform, rng):
  """No state: a call sees only its own tensors. x and the gradient scaled by 2^10 (exact)
  give bit for bit 2^10 times the output and the gradients (2^20 the kernel's), where a
  delayed ring past its first step would saturate; and repeated calls give the same bits. (On
  one device a fresh delayed ring does the same: test_multidevice.py has the cases only
  current scaling passes.)"""
  x, w, b, t = problem(rng)
  run = jax.jit(lambda *a: grads(CURRENT, None, *a))
  y, (dx, dw, db) = run(x, w, jnp.zeros_like(b), t)
  y2, (dx2, dw2, db2) = run(1024 * x, w, jnp.zeros_like(b), 1024 * t)
  assert_same_bits((y2, dx2, dw2, db2), (1024 * y, 1024 * dx, 1024 * 1024 * dw, 1024 * db))
  assert_same_bits(run(x, w, jnp.zeros_like(b), t), (y, (dx, dw, db)))


def test_forward_and_grads_against_f32(platform, rng):
  x, w, b, t = problem(rng)
  y, got = jax.jit(lambda *a: grads(CURRENT, None, *a))(x, w, b, t)
  want_y = x @ w + b
  assert rel(y, want_y) < FWD_TOL
  want = jax.grad(loss_f32, argnums=(0, 1, 2))(x, w, b, t)
  tols = (BWD_TOL, BWD_TOL, bias_tol(jnp.float32, 36))  # dbias: 4 * 9 rows of t in f32
  for g, r, name, tol in zip(got, want, ("dx", "dkernel", "dbias"), tols):
    assert rel(g, r) < tol, name


def test_numerical_gradient(rng):
  x, w, b, t = problem(rng, lead=(8,), k=16, n=32)
  # The backward's e5m2 gradient and e4m3 operand, the forward's x and kernel (test_linear).
  check_numerical_gradient(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=CURRENT),
                           x, w, b, t, normwise(E5M2, E4M3, E4M3, E4M3))


def test_multi_linear_is_linear_per_kernel(platform, rng):
  x, w, b, t = problem(rng, n=32)
  w2 = jnp.asarray(rng.standard_normal(w.shape) * 3, jnp.float32)
  ys = jax.jit(lambda x: jax_fp8.multi_linear(x, (w, w2), (b, None), recipe=CURRENT))(x)
  assert_same_bits(ys, (jax_fp8.linear(x, w, b, recipe=CURRENT),
                        jax_fp8.linear(x, w2, recipe=CURRENT)))


@pytest.mark.parametrize("norm", [None, "layernorm"])
def test_mlp_against_f32(platform, rng, norm):
  """The fused MLP (activation inside the cast-transposes, its amax from XLA's activation)
  against the f32 MLP: each of its two linears within the linear's bounds."""
  k, f, d = 64, 32, 48
  x = jnp.asarray(rng.standard_normal((4, 9, k)), jnp.float32)
  w_in = jnp.asarray(rng.standard_normal((k, 2 * f)) / np.sqrt(k), jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((f, d)) / np.sqrt(f), jnp.float32)
  t = jnp.asarray(rng.standard_normal((4, 9, d)), jnp.float32)
  params = dict(gamma=jnp.ones(k), beta=jnp.zeros(k)) if norm else {}

  def loss(fp8, x, w_in, w_out):
    if fp8:
      y = jax_fp8.mlp(x, w_in, w_out, recipe=CURRENT, norm=norm, **params)
    else:
      v = jax_fp8.norms.normalize(x, norm=norm, epsilon=1e-6, **params) if norm else x
      y = jax_fp8.activations.apply(v @ w_in, "swiglu") @ w_out
    return jnp.sum(y * t), y

  (_, y), g = jax.jit(jax.value_and_grad(lambda *a: loss(True, *a), argnums=(0, 1, 2),
                                         has_aux=True))(x, w_in, w_out)
  (_, y32), g32 = jax.value_and_grad(lambda *a: loss(False, *a), argnums=(0, 1, 2),
                                     has_aux=True)(x, w_in, w_out)
  # Forward: x and kernel_in reach both halves of the SwiGLU product (twice each), then its
  # output and kernel_out: six e4m3 roundings. Backward: those of the forward's gate and up
  # halves (four), the two e5m2 gradients (dy, and dz after SwiGLU's derivative) and the two
  # kernels.
  assert rel(y, y32) < normwise(*[E4M3] * 6)
  for a, r, name in zip(g, g32, ("dx", "dkernel_in", "dkernel_out")):
    assert rel(a, r) < normwise(E5M2, E5M2, *[E4M3] * 6), name


def test_flax_dense_has_no_state(rng):
  x, w, b, _ = problem(rng)
  layer = jax_fp8.flax.Dense(w.shape[1], recipe=CURRENT)
  variables = layer.init(jax.random.key(0), x)
  assert set(variables) == {"params"}
  params = {"params": {"kernel": w, "bias": b}}
  assert_same_bits(layer.apply(params, x), jax_fp8.linear(x, w, b, recipe=CURRENT))


def test_nnx_linear_has_no_state(rng):
  x, w, b, _ = problem(rng)
  layer = jax_fp8.nnx.Linear(w.shape[0], w.shape[1], recipe=CURRENT, rngs=nnx.Rngs(0))
  assert layer.fp8_state is None
  layer.kernel.set_value(w)
  layer.bias.set_value(b)
  assert_same_bits(layer(x), jax_fp8.linear(x, w, b, recipe=CURRENT))


def test_fp8_weights(rng):
  """quantize_weight takes the recipe (one E4M3 scale, as under DelayedScaling); the linear
  then quantizes x with the scale of its own amax."""
  x, w, b, _ = problem(rng)
  fw = jax_fp8.quantize_weight(w, CURRENT)
  assert fw.scale.shape == ()
  y = jax_fp8.linear(x, fw, b, recipe=CURRENT)
  assert rel(y, x @ w + b) < FWD_TOL


def test_checkpoint_round_trip(tmp_path, rng):
  x, w, b, _ = problem(rng)
  params = {"kernel": w, "bias": b}
  checkpoint.save(tmp_path / "ckpt", params, CURRENT)
  back = checkpoint.restore(tmp_path / "ckpt", jax.tree.map(jnp.zeros_like, params), CURRENT)
  assert_same_bits(back, params)
  other = jax_fp8.CurrentScaling(fp8_format="e4m3", margin=1)  # no state: may change
  assert_same_bits(checkpoint.restore(tmp_path / "ckpt", params, other), params)
  with pytest.raises(ValueError, match="saved under another recipe"):
    checkpoint.restore(tmp_path / "ckpt", params, jax_fp8.BlockScaling())
  with pytest.raises(ValueError, match="CurrentScaling is stateless"):
    checkpoint.save(tmp_path / "rings", jax_fp8.LinearState.create(), CURRENT)


def test_errors(rng):
  x, w, b, _ = problem(rng)
  with pytest.raises(ValueError, match="CurrentScaling is stateless"):
    jax_fp8.linear(x, w, b, recipe=CURRENT, state=jax_fp8.LinearState.create())
  with pytest.raises(ValueError, match="CurrentScaling is stateless"):
    jax_fp8.mlp(x, jnp.zeros((64, 64)), jnp.zeros((32, 64)), recipe=CURRENT,
                state=jax_fp8.MlpState.create())
  with pytest.raises(ValueError, match="fp8_format"):
    jax_fp8.CurrentScaling(fp8_format="e5m2")
  with pytest.raises((TypeError, ValueError), match="margin"):
    jax_fp8.CurrentScaling(margin=0.5)
  with pytest.raises(ValueError, match="CurrentScaling.fast_accum_gemms"):
    jax_fp8.CurrentScaling(fast_accum_gemms=("fprop", "fprop"))
  assert jax_fp8.CurrentScaling(fast_accum_gemms=["wgrad", "fprop"]).fast_accum_gemms == (
      "fprop", "wgrad")
  with pytest.raises(TypeError, match="a CurrentScaling"):
    jax_fp8.linear(x, w, b, recipe="current")
  with pytest.raises(ValueError, match="amax_axis_name names the axis"):
    jax_fp8.linear(x, w, b, recipe=CURRENT, amax_axis_name="batch")
