"""jax_fp8.mlp and jax_fp8.flax.Mlp: the up projection, the activation fused into the
cast-transposes, the down projection. Against f32 (within the sum of the quantized operands'
roundoffs on each path) and against the unfused composition linear, jnp activation, linear
(the same quantizations except the activation's, computed by the other platform's expf /
tanhf: within one e4m3 roundoff); gradients against central differences; the rings move as
linear's do."""

import functools

import flax.serialization
import jax
import optax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import covering_cases, roundoff

import jax_fp8
import jax_fp8.nnx
from flax import nnx
from jax_fp8 import activations
from jax_fp8.flax import Mlp

ACTS = ["swiglu", "gelu"]
# Forward: x, kernel_in, the activation and kernel_out each rounded to e4m3. Backward (dx):
# also the two e5m2 gradients.
FWD_TOL = 4 * roundoff("e4m3")
BWD_TOL = FWD_TOL + 2 * roundoff("e5m2")


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def problem(rng, activation, k=64, f=48, d=32, dtype=jnp.float32):
  n = 2 * f if activations.ACTIVATIONS[activation][1] else f
  x = jnp.asarray(rng.standard_normal((3, 20, k)), dtype)
  k_in = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
  k_out = jnp.asarray(rng.standard_normal((f, d)) / np.sqrt(f), jnp.float32)
  b_in = jnp.asarray(rng.standard_normal(n) * 0.1, jnp.float32)
  b_out = jnp.asarray(rng.standard_normal(d) * 0.1, jnp.float32)
  t = jnp.asarray(rng.standard_normal((3, 20, d)), jnp.float32)
  return x, k_in, k_out, b_in, b_out, t


@functools.partial(jax.jit, static_argnums=5)
def mlp_f32(x, k_in, k_out, b_in, b_out, activation):
  """The MLP in f32 (full-precision matmuls on every platform: GPUs default to TF32); jitted,
  one program a shape, where eagerly each operation compiles."""
  dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)
  h = activations.apply(dot(x.astype(jnp.float32), k_in) + b_in, activation)
  return dot(h, k_out) + b_out


def warmed(rng, activation, recipe=jax_fp8.DelayedScaling(), shapes=(64, 48, 32), t=None):
  """A state whose rings have seen three steps of this problem's tensors (delayed scales),
  differentiated through ``sum(out * t)`` with a gradient of the test's magnitude (t: the
  test's, or a standard normal one of the problem's): the gradient rings see amaxes like the
  test's, not the 1 of ``sum(out)``, which would clip a third of the test's gradient."""
  state = jax_fp8.MlpState.create(recipe)
  grad = jax.jit(jax.grad(lambda s, t, *a: jnp.sum(
      jax_fp8.mlp(*a, activation=activation, state=s, recipe=recipe) * t), argnums=0))
  k, f, d = shapes
  x, k_in, k_out, b_in, b_out, t_prob = problem(rng, activation, k, f, d)
  if t is not None:
    x, t_prob = x[0, :t.shape[0]], t
  for _ in range(3):
    state = jax.jit(jax_fp8.update_state)(state, grad(state, t_prob, x, k_in, k_out, b_in, b_out))
  return state


@pytest.mark.parametrize("activation", ACTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_against_f32_and_unfused(platform, rng, activation, dtype):
  x, k_in, k_out, b_in, b_out, t = problem(rng, activation, dtype=dtype)
  state = warmed(rng, activation)

  def fused(x, k_in, k_out, b_in, b_out, state):
    y = jax_fp8.mlp(x, k_in, k_out, b_in, b_out, activation=activation, state=state)
    return jnp.sum(y.astype(jnp.float32) * t), y

  def unfused(x, k_in, k_out, b_in, b_out, state):
    # linear's rings: x, kernel_in, grad_in; then hidden, kernel_out, grad_out.
    y = jax_fp8.linear(x, k_in, b_in, state=jax_fp8.LinearState(state.x, state.kernel_in,
                                                                state.grad_in))
    h = activations.apply(y, activation).astype(x.dtype)
    y = jax_fp8.linear(h, k_out, b_out, state=jax_fp8.LinearState(state.hidden,
                                                                  state.kernel_out,
                                                                  state.grad_out))
    return jnp.sum(y.astype(jnp.float32) * t), y

  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4, 5), has_aux=True))
  (_, y), g = grad(fused)(x, k_in, k_out, b_in, b_out, state)
  (_, y_u), g_u = grad(unfused)(x, k_in, k_out, b_in, b_out, state)
  assert y.shape == (3, 20, 32) and y.dtype == dtype
  out = roundoff(dtype)  # the activation's rounding to x's dtype in the unfused composition
  y32 = mlp_f32(x, k_in, k_out, b_in, b_out, activation)
  assert rel(y.astype(jnp.float32), y32) < FWD_TOL + out
  assert rel(y.astype(jnp.float32), y_u.astype(jnp.float32)) < roundoff("e4m3") + 2 * out
  want = jax.jit(jax.grad(lambda *a: jnp.sum(mlp_f32(*a, activation) * t),
                         argnums=(0, 1, 2, 3, 4)))(x, k_in, k_out, b_in, b_out)
  for name, got, unf, w in zip(("dx", "dkernel_in", "dkernel_out", "dbias_in", "dbias_out"),
                               g[:5], g_u[:5], want):
    assert got.dtype == (dtype if name == "dx" else jnp.float32), name
    assert rel(got.astype(jnp.float32), w) < BWD_TOL + out, name
    assert rel(got.astype(jnp.float32), unf.astype(jnp.float32)) < (
        roundoff("e4m3") + roundoff("e5m2") + 2 * out), name
  # The rings' observations: the same tensors' amaxes as the unfused composition's (the
  # hidden one from the activation in f32 here, in x's dtype there).
  for name in ("x", "kernel_in", "grad_in", "hidden", "kernel_out", "grad_out"):
    got, unf = getattr(g[5], name), getattr(g_u[5], name)
    np.testing.assert_allclose(np.asarray(got.amax_history), np.asarray(unf.amax_history),
                               rtol=2 * out + roundoff("e5m2"), err_msg=name)
    assert float(got.steps) == float(unf.steps) == float(getattr(state, name).steps) + 1


def swiglu64(y):
  """SwiGLU in f64 ([gate | up]) and its two partial derivatives."""
  g, u = np.split(y, 2, axis=-1)
  s = 1 / (1 + np.exp(-g))
  return g * s * u, s * (1 + g * (1 - s)) * u, g * s


def test_numerical_gradient(platform, rng):
  """Every element of dx, dkernel_in and dkernel_out against central differences of the f64
  MLP, each within its own bound: TOL times the magnitude A of that element (the gradient's
  chain with every factor replaced by its absolute value: the sum of the magnitudes of the
  products the FP8 GEMMs add up). TOL: the backward quantizes two gradients (e5m2) and two
  kernels and the activation (e4m3); each GEMM's error is at most the sum of its two operands'
  roundoffs of A, dx and dkernel_in see dh's error through the activation's derivative too,
  and the forward's e4m3 error in y moves act'(y) by a like fraction: 2 * (2^-3 + 2^-4) +
  2^-4; dkernel_out's A counts h's error from y's (|act'| times |x| @ |k_in|) (measured: max
  err / A 0.05-0.10 over seeds 0-2). Elements are mostly far below their
  A (random signs cancel), so the per-element bound alone would not see a sign flip: the
  gradient must also be within BWD_TOL of the numeric one normwise, which -g (2) and 2g (1)
  are not, and agree in sign wherever the bound fixes it."""
  tol = 2 * (roundoff("e5m2") + roundoff("e4m3")) + roundoff("e4m3")
  m, k, f, d = 16, 32, 32, 16
  x = rng.standard_normal((m, k))
  k_in, k_out = rng.standard_normal((k, 2 * f)) / np.sqrt(k), rng.standard_normal((f, d)) / 4
  t = rng.standard_normal((m, d))
  warm_state = warmed(rng, "swiglu", shapes=(k, f, d), t=jnp.asarray(t, jnp.float32))

  def loss64(x, k_in, k_out):
    return np.sum((swiglu64(x @ k_in)[0] @ k_out) * t)

  grads = jax.jit(jax.grad(lambda *a: jnp.sum(jax_fp8.mlp(*a, state=warm_state) * t),
                           argnums=(0, 1, 2)))(
      *(jnp.asarray(v, jnp.float32) for v in (x, k_in, k_out)))
  y = x @ k_in
  h, dgate, dup = swiglu64(y)
  a_dh = np.abs(t) @ np.abs(k_out).T  # [M, F]
  a_dy = np.concatenate([a_dh * np.abs(dgate), a_dh * np.abs(dup)], axis=1)  # [M, 2F]
  # h's forward error comes through y's, whose magnitude is |x| @ |k_in|, times act'.
  a_y = np.split(np.abs(x) @ np.abs(k_in), 2, axis=1)
  a_h = np.abs(h) + np.abs(dgate) * a_y[0] + np.abs(dup) * a_y[1]
  magnitudes = (a_dy @ np.abs(k_in).T, np.abs(x).T @ a_dy, a_h.T @ np.abs(t))
  args, eps = [x, k_in, k_out], 1e-5  # f64: truncation ~eps^2, rounding ~1e-16 / eps
  for i, (name, g, mag) in enumerate(zip(("dx", "dkernel_in", "dkernel_out"), grads,
                                         magnitudes)):
    numeric = np.empty(args[i].size)
    for j in range(args[i].size):
      up, dn = list(args), list(args)
      up[i], dn[i] = args[i].copy().ravel(), args[i].copy().ravel()
      up[i][j] += eps
      dn[i][j] -= eps
      up[i], dn[i] = up[i].reshape(args[i].shape), dn[i].reshape(args[i].shape)
      numeric[j] = (loss64(*up) - loss64(*dn)) / (2 * eps)
    numeric = numeric.reshape(args[i].shape)
    err = np.abs(np.asarray(g, np.float64) - numeric)
    assert np.all(err <= tol * mag), (name, np.max(err / mag))
    sure = np.abs(numeric) > tol * mag  # where the bound fixes the sign, it must agree
    assert np.all(np.sign(np.asarray(g)[sure]) == np.sign(numeric[sure])), name
    # And normwise (the scale): BWD_TOL (measured 0.12-0.21 for dx); -g or 2g are 2 and 1 off.
    assert rel(g, numeric) < BWD_TOL, name


@pytest.mark.parametrize("activation,norm,dtype", covering_cases(
    {"activation": ACTS, "norm": [None, "layernorm"]}, {"dtype": [jnp.float32, jnp.bfloat16]}))
def test_block_scaling_against_f32_and_unfused(platform, rng, activation, dtype, norm):
  """BlockScaling: the activation, its gradient (and the norm, here LayerNorm with gamma and
  beta) fused into the group cast-transposes, with biases. Against the composition norm,
  linear, activation, linear under the same recipe (the activation by the other platform's
  exp / tanh: within one e4m3 roundoff) and against f32, with the bounds of the per-tensor test
  (every operand is E4M3 here, each within its group's roundoff)."""
  x, k_in, k_out, b_in, b_out, t = problem(rng, activation, k=256, f=128, d=128, dtype=dtype)
  gamma = jnp.asarray(1 + 0.5 * rng.standard_normal(256), jnp.float32)
  beta = jnp.asarray(0.5 * rng.standard_normal(256), jnp.float32)
  block = jax_fp8.BlockScaling()
  norm_kw = {} if norm is None else {"norm": norm, "epsilon": 1e-6}

  @jax.jit
  def normed(x, gamma, beta):
    return x if norm is None else jax_fp8.norms.normalize(x, gamma, beta, **norm_kw)

  def fused(x, k_in, k_out, b_in, b_out, gamma, beta):
    y = jax_fp8.mlp(x, k_in, k_out, b_in, b_out, activation=activation, recipe=block,
                    **({} if norm is None else {"gamma": gamma, "beta": beta, **norm_kw}))
    return jnp.sum(y.astype(jnp.float32) * t), y

  def unfused(x, k_in, k_out, b_in, b_out, gamma, beta):
    h = normed(x, gamma, beta).astype(x.dtype)
    h = activations.apply(jax_fp8.linear(h, k_in, b_in, recipe=block), activation)
    y = jax_fp8.linear(h.astype(x.dtype), k_out, b_out, recipe=block)
    return jnp.sum(y.astype(jnp.float32) * t), y

  def exact(x, k_in, k_out, b_in, b_out, gamma, beta):
    return jnp.sum(mlp_f32(normed(x.astype(jnp.float32), gamma, beta), k_in, k_out, b_in, b_out,
                           activation) * t)

  args = (x, k_in, k_out, b_in, b_out, gamma, beta)
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=range(7), has_aux=True))  # noqa: E731
  (_, y), g = grad(fused)(*args)
  (_, y_u), g_u = grad(unfused)(*args)
  want = jax.jit(jax.grad(exact, argnums=range(7)))(*args)
  hlo = jax.jit(jax.grad(lambda *a: fused(*a)[0], argnums=range(7))).lower(*args).as_text()
  assert hlo.count("jax_fp8_group_cast_transpose") == 4  # x, act(y); g, dy: one each
  assert hlo.count("norm = 2") == (norm is not None)  # x's, with the norm fused
  assert y.shape == (3, 20, 128) and y.dtype == dtype
  out = roundoff(dtype)  # the norm's and the activation's rounding to x's dtype when unfused
  y32 = mlp_f32(normed(x.astype(jnp.float32), gamma, beta), k_in, k_out, b_in, b_out, activation)
  assert rel(y.astype(jnp.float32), y32) < FWD_TOL + out
  assert rel(y.astype(jnp.float32), y_u.astype(jnp.float32)) < roundoff("e4m3") + 2 * out
  names = ("dx", "dkernel_in", "dkernel_out", "dbias_in", "dbias_out", "dgamma", "dbeta")
  for name, got, unf, w in zip(names, g, g_u, want):
    if norm is None and name in ("dgamma", "dbeta"):
      continue
    assert got.dtype == (dtype if name == "dx" else jnp.float32), name
    assert rel(got.astype(jnp.float32), w) < BWD_TOL + out, name
    assert rel(got.astype(jnp.float32), unf.astype(jnp.float32)) < (
        roundoff("e4m3") + roundoff("e5m2") + 2 * out), name


def test_below_min_intensity(rng):
  """Below fp8_min_intensity: XLA in x's dtype, the rings untouched."""
  x, k_in, k_out, _, _, _ = problem(rng, "swiglu", k=128, f=128, d=128)
  high = jax_fp8.DelayedScaling(fp8_min_intensity=1e9)
  state = jax_fp8.MlpState.create(high)
  y, ds = jax.jit(jax.value_and_grad(lambda s: jnp.sum(jax_fp8.mlp(x, k_in, k_out, state=s,
                                                                   recipe=high))))(state)
  # XLA's f32 matmuls at their default precision: TF32 on GPUs (2^-11 a product).
  np.testing.assert_allclose(float(y), float(jnp.sum(mlp_f32(x, k_in, k_out, 0, 0, "swiglu"))),
                             rtol=2.0**-9)
  assert all(not np.asarray(v).any() for v in jax.tree.leaves(ds))  # no observation


def test_flax_layer(rng):
  """Mlp's parameters, state and output are mlp's; the state round-trips through Flax
  serialization; a train step moves it."""
  x = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.bfloat16)
  layer = Mlp(48, activation="geglu", out_features=32, dtype=jnp.bfloat16)
  v = jax.jit(layer.init)(jax.random.PRNGKey(0), x)
  p = v["params"]
  assert {k: p[k].shape for k in p} == {"kernel_in": (64, 96), "kernel_out": (48, 32),
                                        "bias_in": (96,), "bias_out": (32,)}
  state = v["fp8_state"]["mlp"]
  assert isinstance(state, jax_fp8.MlpState)
  y = layer.apply(v, x)
  want = jax_fp8.mlp(x, p["kernel_in"], p["kernel_out"], p["bias_in"].astype(jnp.bfloat16),
                     p["bias_out"].astype(jnp.bfloat16), activation="geglu", state=state)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(want, np.float32))
  grads = jax.jit(jax.grad(lambda v: jnp.sum(layer.apply(v, x).astype(jnp.float32))))(v)
  moved = jax.jit(jax_fp8.update_state)(v["fp8_state"], grads["fp8_state"])
  assert float(moved["mlp"].hidden.steps) == 1.0
  restored = flax.serialization.from_bytes(v["fp8_state"], flax.serialization.to_bytes(moved))
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(moved)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_nnx_layer(rng):
  """jax_fp8.nnx.Mlp: its output is mlp's on its parameters and state; a train step with
  nnx.value_and_grad and update_fp8_state moves the rings and the parameters."""
  x = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.bfloat16)
  layer = jax_fp8.nnx.Mlp(64, 48, 32, activation="swiglu", dtype=jnp.bfloat16,
                          rngs=nnx.Rngs(0))
  assert layer.kernel_in.get_value().shape == (64, 96)
  assert layer.kernel_out.get_value().shape == (48, 32) and layer.bias_out.get_value().shape == (32,)
  state = layer.fp8_state.get_value()
  assert isinstance(state, jax_fp8.MlpState)
  want = jax_fp8.mlp(x, layer.kernel_in.get_value(), layer.kernel_out.get_value(),
                     layer.bias_in.get_value().astype(jnp.bfloat16),
                     layer.bias_out.get_value().astype(jnp.bfloat16), state=state)
  np.testing.assert_array_equal(np.asarray(layer(x), np.float32), np.asarray(want, np.float32))
  optimizer = nnx.Optimizer(layer, optax.sgd(1e-2), wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, x):
    diff = nnx.DiffState(0, (nnx.Param, jax_fp8.nnx.Fp8State))
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean(m(x).astype(jnp.float32) ** 2),
                                     argnums=diff)(model)
    optimizer.update(model, nnx.filter_state(grads, nnx.Param))
    jax_fp8.nnx.update_fp8_state(model, grads)
    return loss

  before = np.asarray(layer.kernel_in.get_value())
  step(layer, optimizer, x)
  assert float(layer.fp8_state.get_value().hidden.steps) == 1.0
  assert not np.array_equal(before, np.asarray(layer.kernel_in.get_value()))
  with pytest.raises(ValueError, match=r"Mlp inputs must be \[..., 64\]"):
    layer(x[..., :32])
  with pytest.raises(TypeError, match="Mlp.rngs"):
    jax_fp8.nnx.Mlp(64, 48, rngs=0)
  assert jax_fp8.nnx.Mlp(64, 128, recipe=jax_fp8.BlockScaling(), use_bias=False,
                         rngs=nnx.Rngs(0)).fp8_state is None


def test_bad_arguments(rng):
  x, k_in, k_out, b_in, b_out, _ = problem(rng, "swiglu")
  state = jax_fp8.MlpState.create()
  with pytest.raises(ValueError, match="activation must be one of"):
    jax_fp8.mlp(x, k_in, k_out, state=state, activation="relu")
  with pytest.raises(ValueError, match=r"N = 2F"):
    jax_fp8.mlp(x, k_in[:, :48], k_out, state=state)
  with pytest.raises(ValueError, match=r"bias_in must be \[96\]"):
    jax_fp8.mlp(x, k_in, k_out, b_out, state=state)
  with pytest.raises(TypeError, match="state must be a jax_fp8.MlpState"):
    jax_fp8.mlp(x, k_in, k_out, state=jax_fp8.LinearState.create())
  with pytest.raises(TypeError, match="kernel_out must be float32"):
    jax_fp8.mlp(x, k_in, k_out.astype(jnp.int32), state=state)
  with pytest.raises(ValueError, match="do not match the recipe"):
    jax_fp8.mlp(x, k_in, k_out, state=jax_fp8.MlpState.create(jax_fp8.DelayedScaling(
        history_len=4)))
  with pytest.raises(ValueError, match="BlockScaling is stateless"):
    jax_fp8.mlp(x, k_in, k_out, state=state, recipe=jax_fp8.BlockScaling())
  with pytest.raises(ValueError, match="multiples of 16"):
    jax_fp8.mlp(x[..., :40], k_in[:40], k_out, state=state,
                recipe=jax_fp8.DelayedScaling(fp8_min_intensity=0))
  with pytest.raises(TypeError, match="amax_axis_name must be None"):  # also below the crossover
    jax_fp8.mlp(x, k_in, k_out, state=jax_fp8.MlpState.create(jax_fp8.DelayedScaling(
        fp8_min_intensity=1e9)), recipe=jax_fp8.DelayedScaling(fp8_min_intensity=1e9),
        amax_axis_name=5)
  with pytest.raises(ValueError, match="Mlp.activation must be one of"):
    Mlp(48, activation="tanh").init(jax.random.PRNGKey(0), x)
  with pytest.raises(TypeError, match="MlpState.create takes a DelayedScaling"):
    jax_fp8.MlpState.create(jax_fp8.BlockScaling())
