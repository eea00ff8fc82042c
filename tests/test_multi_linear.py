"""jax_fp8.multi_linear and jax_fp8.flax.MultiDense: several kernels on one input, quantized
once. Each output, kernel gradient, bias gradient and ring is the one linear computes for that
kernel alone (bit for bit: the same quantization of x, the same GEMMs); dx is the sum of the
linears' dgrads."""

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import roundoff

import jax_fp8
from jax_fp8.flax import Dense, MultiDense

RECIPES = [pytest.param(jax_fp8.DelayedScaling(), id="delayed"),
           pytest.param(jax_fp8.BlockScaling(), id="block")]


def problem(rng, ns, k=128, dtype=jnp.float32):
  x = jnp.asarray(rng.standard_normal((2, 64, k)), dtype)
  ws = tuple(jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32) for n in ns)
  bs = (jnp.asarray(rng.standard_normal(ns[0]), jnp.float32),) + (None,) * (len(ns) - 1)
  ts = tuple(jnp.asarray(rng.standard_normal((2, 64, n)), jnp.float32) for n in ns)
  return x, ws, bs, ts


def warm(state, rng):
  """A state past its first steps, each ring with its own history and scale (about amax / 448
  for these tensors: x's amax is about 4)."""
  def ring(r):
    return jax_fp8.ScaleRing(jnp.asarray(rng.uniform(1, 4, r.amax_history.shape), jnp.float32),
                             jnp.float32(rng.uniform(0.005, 0.02)), jnp.float32(3), r.fmt,
                             r.margin, r.algo)
  return jax.tree.map(ring, state, is_leaf=lambda v: isinstance(v, jax_fp8.ScaleRing))


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_matches_separate_linears(platform, rng, recipe, dtype):
  ns = (128, 256, 128)
  x, ws, bs, ts = problem(rng, ns, dtype=dtype)
  delayed = isinstance(recipe, jax_fp8.DelayedScaling)
  state = warm(jax_fp8.MultiLinearState.create(3, recipe), rng) if delayed else None

  def loss_multi(x, ws, bs, state):
    ys = jax_fp8.multi_linear(x, ws, bs, state=state, recipe=recipe)
    return sum(jnp.sum(y.astype(jnp.float32) * t) for y, t in zip(ys, ts)), ys

  def loss_separate(x, ws, bs, states):
    ys = tuple(jax_fp8.linear(x, w, b, state=s, recipe=recipe)
               for w, b, s in zip(ws, bs, states))
    return sum(jnp.sum(y.astype(jnp.float32) * t) for y, t in zip(ys, ts)), ys

  # linear i sees the rings multi_linear uses for kernel i (its x ring being the shared one).
  states = ((jax_fp8.LinearState(state.x, k, g) for k, g in zip(state.kernels, state.grads))
            if delayed else (None,) * 3)
  states = tuple(states)
  grad = lambda f: jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3), has_aux=True))
  (_, ys), (dx, dws, dbs, dstate) = grad(loss_multi)(x, ws, bs, state)
  (_, ys_ref), (dx_ref, dws_ref, dbs_ref, dstates) = grad(loss_separate)(x, ws, bs, states)
  for got, want in zip(ys + dws, ys_ref + dws_ref):
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(dbs[0]), np.asarray(dbs_ref[0]))
  assert dbs[1:] == (None, None) and dbs_ref[1:] == (None, None)
  # dx: the same three dgrads, summed in x's dtype in another order; each sum rounds to x's
  # dtype once, so the two differ by at most two roundings of the largest partial sum.
  bound = 2 * roundoff(dtype) * float(sum(jnp.max(jnp.abs(d.astype(jnp.float32)))
                                          for d in (dx, dx_ref)))
  assert float(jnp.max(jnp.abs(dx.astype(jnp.float32) - dx_ref.astype(jnp.float32)))) <= bound
  if delayed:  # the observations: x's from any linear (all saw the same x), the others each
    for i, s in enumerate(dstates):
      for got, want in ((dstate.x, s.x), (dstate.kernels[i], s.kernel),
                        (dstate.grads[i], s.grad)):
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
          np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_quantizes_x_once(rng):
  """One cast-transpose of x for three kernels in the forward, where three linears take
  three."""
  x, ws, bs, ts = problem(rng, (128, 128, 128), dtype=jnp.bfloat16)
  state = jax_fp8.MultiLinearState.create(3)
  fwd = jax.jit(lambda x, ws, s: jax_fp8.multi_linear(x, ws, state=s))
  hlo = fwd.lower(x, ws, state).compile().as_text()
  assert hlo.count('custom_call_target="jax_fp8_cast_transpose_ring"') == 1 + 3  # x, kernels


def test_below_min_intensity_runs_in_x_dtype(rng):
  x, ws, bs, ts = problem(rng, (128, 128))
  recipe = jax_fp8.DelayedScaling(fp8_min_intensity=1e9)
  state = jax_fp8.MultiLinearState.create(2, recipe)
  ys = jax_fp8.multi_linear(x, ws, bs, state=state, recipe=recipe)
  for y, w, b in zip(ys, ws, bs):
    want = x @ w if b is None else x @ w + b
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))


@pytest.mark.parametrize("recipe", RECIPES)
def test_multi_dense_matches_dense(rng, recipe):
  """MultiDense's outputs are those of Dense layers holding its kernels and biases (and, under
  delayed scaling, rings made alike); its state updates through update_state."""
  x = jnp.asarray(rng.standard_normal((4, 32, 128)), jnp.bfloat16)
  layer = MultiDense((128, 256), dtype=jnp.bfloat16, recipe=recipe)
  variables = layer.init(jax.random.PRNGKey(0), x)
  p = variables["params"]
  assert sorted(p) == ["bias_0", "bias_1", "kernel_0", "kernel_1"]
  assert p["kernel_1"].shape == (128, 256) and p["kernel_1"].dtype == jnp.float32
  ys = layer.apply(variables, x)
  for i, n in enumerate((128, 256)):
    single = {"params": {"kernel": p[f"kernel_{i}"], "bias": p[f"bias_{i}"]}}
    if "fp8_state" in variables:
      s = variables["fp8_state"]["linear"]
      single["fp8_state"] = {"linear": jax_fp8.LinearState(s.x, s.kernels[i], s.grads[i])}
    y = Dense(n, dtype=jnp.bfloat16, recipe=recipe).apply(single, x)
    np.testing.assert_array_equal(np.asarray(ys[i]), np.asarray(y))
  if "fp8_state" in variables:
    grads = jax.grad(lambda s: sum(jnp.sum(y.astype(jnp.float32)) for y in layer.apply(
        {"params": p, "fp8_state": s}, x)))(variables["fp8_state"])
    new = jax_fp8.update_state(variables["fp8_state"], grads)["linear"]
    assert float(new.x.amax_history[0]) == float(jnp.max(jnp.abs(x.astype(jnp.float32))))
    assert [float(r.steps) for r in (new.x, *new.kernels, *new.grads)] == [1.0] * 5


def test_bad_arguments(rng):
  x, ws, bs, ts = problem(rng, (128, 128))
  state = jax_fp8.MultiLinearState.create(2)
  cases = [
      (lambda: jax_fp8.multi_linear(x, ws[0], state=state), TypeError,
       "kernels must be a non-empty tuple"),
      (lambda: jax_fp8.multi_linear(x, (), state=state), TypeError,
       "kernels must be a non-empty tuple .*, got an empty tuple"),
      (lambda: jax_fp8.multi_linear(x, ws, (bs[0],), state=state), TypeError,
       "biases must be None or a tuple / list of 2 .*, got 1 of them"),
      (lambda: jax_fp8.multi_linear(x, (ws[0], ws[1][:, :0]), state=state), ValueError,
       r"kernels\[1\] has N = 0 beside other kernels"),
      (lambda: jax_fp8.multi_linear(x, (ws[0], ws[1][:, :120]), state=state), ValueError,
       "got K=128, N=128, 120"),
      (lambda: jax_fp8.multi_linear(x, (ws[0], ws[1][:64]), state=state), ValueError,
       r"kernels\[1\] \[K, N\] must share K"),
      (lambda: jax_fp8.multi_linear(x, ws, (None, bs[0][:64]), state=state), ValueError,
       r"biases\[1\] must be \[128\]"),
      (lambda: jax_fp8.multi_linear(x, ws + ws[:1], state=state), ValueError,
       "state holds 2 kernel and 2 gradient rings for 3 kernels"),
      (lambda: jax_fp8.multi_linear(x, ws, state=jax_fp8.LinearState.create()), TypeError,
       "state must be a jax_fp8.MultiLinearState, got LinearState"),
      (lambda: jax_fp8.multi_linear(x, ws, state=jax_fp8.MultiLinearState(
          state.x, list(state.kernels), state.grads)), TypeError,
       r"state.kernels must be a tuple of jax_fp8.ScaleRing, got list"),
      (lambda: jax_fp8.multi_linear(x, ws, state=jax_fp8.MultiLinearState(
          state.x, state.grads, state.kernels)), ValueError,
       r"for \(state.x, state.kernels\[0\], state.kernels\[1\], state.grads\[0\]"),
      (lambda: jax_fp8.multi_linear(x, ws, state=state, recipe=jax_fp8.BlockScaling()),
       ValueError, "BlockScaling is stateless"),
      (lambda: jax_fp8.MultiLinearState.create(0), ValueError, "outputs"),
      (lambda: jax_fp8.MultiLinearState.create(True), TypeError, "outputs"),
      (lambda: jax_fp8.MultiLinearState.create(2, jax_fp8.BlockScaling()), TypeError,
       "MultiLinearState.create takes a DelayedScaling recipe"),
      (lambda: MultiDense(128).init(jax.random.PRNGKey(0), x), TypeError,
       "MultiDense.features must be a non-empty tuple of ints, got 128"),
      (lambda: MultiDense((128, 2.0)).init(jax.random.PRNGKey(0), x), TypeError,
       r"MultiDense.features\[1\]"),
      (lambda: MultiDense((128,), use_bias="no").init(jax.random.PRNGKey(0), x), TypeError,
       "MultiDense.use_bias"),
  ]
  for fn, exc, match in cases:
    with pytest.raises(exc, match=match):
      fn()


def test_flax_serialization_round_trip():
  state = jax_fp8.MultiLinearState.create(3)
  state = jax.tree.map(lambda v: v + 1, state)
  target = jax_fp8.MultiLinearState.create(3)
  back = flax.serialization.from_bytes(target, flax.serialization.to_bytes(state))
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
