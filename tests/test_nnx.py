"""jax_fp8.nnx: Linear and MultiLinear as drop-ins for flax.nnx.Linear, the Fp8State variable,
and NNX train steps (nnx.jit, nnx.value_and_grad, optax through nnx.Optimizer, microbatches,
a tied layer, layers under nnx.scan)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import default_devices, roundoff, summation_error
from flax import nnx

import jax_fp8
from jax_fp8.nnx import Fp8State, Linear, MultiLinear, update_fp8_state

DIFF = nnx.DiffState(0, (nnx.Param, Fp8State))


def ring_leaves(model):
  return jax.tree.leaves(nnx.state(model, Fp8State))


def test_linear_is_a_drop_in(rng):
  x = jnp.asarray(rng.standard_normal((4, 8, 64)), jnp.float32)
  ours, theirs = Linear(64, 32, rngs=nnx.Rngs(3)), nnx.Linear(64, 32, rngs=nnx.Rngs(3))
  p_ours, p_theirs = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
  assert jax.tree.structure(p_ours) == jax.tree.structure(p_theirs)
  for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_theirs)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same initializers
  y, y_ref = ours(x), theirs(x)
  assert y.shape == (4, 8, 32) and y.dtype == jnp.float32
  # x and kernel in e4m3, each element within 2^-4 of itself: the product within the sum.
  assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) < 2 * roundoff("e4m3")
  state = ours.fp8_state.get_value()
  assert isinstance(state, jax_fp8.LinearState)
  np.testing.assert_array_equal(np.asarray(y), np.asarray(jax_fp8.linear(
      x, ours.kernel[...], ours.bias[...], state=state)))
  assert Linear(64, 32, recipe=jax_fp8.BlockScaling(), rngs=nnx.Rngs(0)).fp8_state is None
  y16 = Linear(64, 32, dtype=jnp.bfloat16, use_bias=False, rngs=nnx.Rngs(3))(x)
  assert y16.dtype == jnp.bfloat16


def test_multi_linear_matches_linear(rng):
  x = jnp.asarray(rng.standard_normal((2, 16, 128)), jnp.bfloat16)
  multi = MultiLinear(128, (128, 256), dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
  assert sorted(nnx.state(multi, nnx.Param)) == ["bias_0", "bias_1", "kernel_0", "kernel_1"]
  ys = multi(x)
  s = multi.fp8_state.get_value()
  for i, n in enumerate((128, 256)):
    single = Linear(128, n, dtype=jnp.bfloat16, rngs=nnx.Rngs(9))
    single.kernel[...] = getattr(multi, f"kernel_{i}")[...]
    single.bias[...] = getattr(multi, f"bias_{i}")[...]
    single.fp8_state.set_value(jax_fp8.LinearState(s.x, s.kernels[i], s.grads[i]))
    np.testing.assert_array_equal(np.asarray(ys[i]), np.asarray(single(x)))


class MLP(nnx.Module):
  def __init__(self, recipe, rngs):
    self.up = MultiLinear(128, (128, 128), recipe=recipe, rngs=rngs)  # BlockScaling's 128s
    self.down = Linear(128, 128, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    gate, up = self.up(x)
    return self.down(jax.nn.silu(gate) * up)


def problem(rng, n=256):
  x = jnp.asarray(rng.standard_normal((n, 128)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((128, 128)), jnp.float32) / 8
  return x, jnp.tanh(x @ w)


@nnx.jit
def train_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2), argnums=DIFF)(model)
  optimizer.update(model, nnx.filter_state(grads, nnx.Param))
  update_fp8_state(model, grads)
  return loss


@pytest.mark.parametrize("recipe", [jax_fp8.DelayedScaling(), jax_fp8.BlockScaling()],
                         ids=["delayed", "block"])
def test_train_step(rng, recipe):
  """nnx.jit + nnx.value_and_grad + nnx.Optimizer: the loss falls, the optimizer leaves the FP8
  state alone, and update_fp8_state advances every ring once a step, its newest amax that of
  the step's tensor (checked for the first layer's input)."""
  x, y = problem(rng)
  model = MLP(recipe, nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  losses = [float(train_step(model, optimizer, x[:32], y[:32]))]
  if isinstance(recipe, jax_fp8.DelayedScaling):
    state = model.up.fp8_state.get_value()
    assert float(state.x.amax_history[0]) == float(jnp.max(jnp.abs(x[:32])))
  for i in range(1, 40):
    sl = slice((i % 8) * 32, (i % 8) * 32 + 32)
    losses.append(float(train_step(model, optimizer, x[sl], y[sl])))
  # Task-level check of a short run, not a format bound: FP8 training learns this map.
  assert losses[-1] < 0.5 * losses[0]
  if isinstance(recipe, jax_fp8.DelayedScaling):
    steps = [float(r.steps) for r in jax.tree.leaves(
        nnx.state(model, Fp8State), is_leaf=lambda v: isinstance(v, jax_fp8.ScaleRing))]
    assert steps == [40.0] * 8  # up: x, 2 kernels, 2 gradients; down: x, kernel, gradient
  else:
    assert ring_leaves(model) == []


def test_microbatches_combine_by_max(rng):
  """Two microbatches of one step: parameter gradients add, state gradients combine by
  jax_fp8.combine_updates; the rings then record the max over the microbatches, as one
  differentiation over the whole batch does."""
  x, y = problem(rng, 64)
  x = x.at[32:].multiply(3.0)  # the second microbatch has the larger amax
  model = MLP(jax_fp8.DelayedScaling(), nnx.Rngs(0))
  loss = lambda m, xb, yb: jnp.mean((m(xb) - yb) ** 2)
  g1 = nnx.grad(loss, argnums=DIFF)(model, x[:32], y[:32])
  g2 = nnx.grad(loss, argnums=DIFF)(model, x[32:], y[32:])
  combined = jax_fp8.combine_updates(*(nnx.filter_state(g, Fp8State) for g in (g1, g2)))
  update_fp8_state(model, combined)
  assert float(model.up.fp8_state.get_value().x.amax_history[0]) == float(jnp.max(jnp.abs(x)))
  assert float(model.up.fp8_state.get_value().x.steps) == 1.0


def test_tied_layer(rng):
  """One Linear applied twice in a step: JAX sums its two observations (the gradient's step
  count says two uses), which update_state records as an upper bound of the max (see
  jax_fp8.update_state): the newest amax is at least each use's."""
  layer = Linear(32, 32, rngs=nnx.Rngs(0))
  x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
  grads = nnx.grad(lambda m: jnp.sum(m(m(x)) ** 2), argnums=DIFF)(layer)
  assert float(grads["fp8_state"].get_value().x.steps) == 2.0
  first_out = layer(x)
  update_fp8_state(layer, grads)
  ring = layer.fp8_state.get_value().x
  assert float(ring.amax_history[0]) >= max(float(jnp.max(jnp.abs(x))),
                                             float(jnp.max(jnp.abs(first_out))))
  assert float(ring.steps) == 1.0


class Stack(nnx.Module):
  """Layers made by nnx.vmap and applied by nnx.scan, each with its own FP8 state."""

  def __init__(self, layers, rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(rngs):
      return Linear(32, 32, rngs=rngs)
    self.layers = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(layer, h):
      return jnp.tanh(layer(h))
    return body(self.layers, x)


def test_scan_over_layers(rng):
  x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32) * 5
  model = Stack(3, nnx.Rngs(0))
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2), argnums=DIFF))(model)
  update_fp8_state(model, grads)
  state = model.layers.fp8_state.get_value()
  assert state.x.amax_history.shape == (3, 16)
  np.testing.assert_array_equal(np.asarray(state.x.steps), [1.0, 1.0, 1.0])
  # Layer 0 sees x; the later ones see tanh outputs (amax < 1): each ring its own amax.
  assert float(state.x.amax_history[0, 0]) == float(jnp.max(jnp.abs(x)))
  assert all(float(a) <= 1.0 for a in state.x.amax_history[1:, 0])


def test_bad_arguments(rng):
  x = jnp.ones((4, 64), jnp.float32)
  cases = [
      (lambda: Linear(64, 0, rngs=nnx.Rngs(0)), ValueError, "Linear.out_features must be an int"),
      (lambda: update_fp8_state(Linear(64, 32, rngs=nnx.Rngs(0)), nnx.grad(
          lambda m: jnp.sum(m(x)))(Linear(64, 32, rngs=nnx.Rngs(0)))), ValueError,
       r"no gradient for the model's Fp8State .*nnx.DiffState"),
      (lambda: Linear(64.0, 32, rngs=nnx.Rngs(0)), TypeError, "Linear.in_features"),
      (lambda: Linear(64, 32, use_bias=1, rngs=nnx.Rngs(0)), TypeError, "Linear.use_bias"),
      (lambda: Linear(64, 32, recipe="hybrid", rngs=nnx.Rngs(0)), TypeError, "Linear.recipe"),
      (lambda: Linear(64, 32, rngs=0), TypeError, "Linear.rngs must be a flax.nnx.Rngs"),
      (lambda: Linear(32, 32, rngs=nnx.Rngs(0))(x), ValueError,
       r"Linear inputs must be \[..., 32\] \(in_features\), got shape \(4, 64\)"),
      (lambda: Linear(64, 24, rngs=nnx.Rngs(0))(x), ValueError, "multiples of 16"),
      (lambda: MultiLinear(64, 32, rngs=nnx.Rngs(0)), TypeError,
       "MultiLinear.out_features must be a non-empty tuple of ints, got 32"),
      (lambda: MultiLinear(64, (32, -1), rngs=nnx.Rngs(0)), ValueError,
       r"MultiLinear.out_features\[1\]"),
      (lambda: Linear(64, 32, dtype="bf16", rngs=nnx.Rngs(0)), TypeError,
       "Linear.dtype must be None, float32, bfloat16 or float16, got 'bf16'"),
      (lambda: Linear(64, 32, param_dtype=jnp.int32, rngs=nnx.Rngs(0)), TypeError,
       r"Linear.param_dtype must be float32, bfloat16 or float16 \(or float64 under x64\), "
       "got int32"),
      (lambda: Linear(64, 32, param_dtype="fp32", rngs=nnx.Rngs(0)), TypeError,
       "Linear.param_dtype must be .* got 'fp32'"),
      (lambda: Linear(64, 32, rngs=nnx.Rngs(0))(x.astype(bool)), TypeError,
       "the layer's inputs must be floats"),
      (lambda: update_fp8_state(Linear(64, 32, rngs=nnx.Rngs(0)), None), TypeError,
       "grads must be the nnx.State that nnx.grad returns, got NoneType"),
  ]
  for fn, exc, match in cases:
    with pytest.raises(exc, match=match):
      fn()


def test_general_layers_are_drop_ins(rng):
  """LinearGeneral and Einsum: the parameters (names, shapes, values) of nnx.LinearGeneral /
  nnx.Einsum built from the same rngs, outputs within two e4m3 roundings of theirs."""
  x = jnp.asarray(rng.standard_normal((2, 8, 64)), jnp.float32)
  pairs = [(lambda mod: mod.LinearGeneral(64, (2, 32), rngs=nnx.Rngs(3)), x),
           (lambda mod: mod.LinearGeneral((8, 64), 32, axis=(-2, -1), rngs=nnx.Rngs(3)), x),
           (lambda mod: mod.Einsum("btd,ndh->btnh", (2, 64, 16), (2, 16), rngs=nnx.Rngs(3),
                                   bias_init=nnx.initializers.normal()), x)]
  for make, inputs in pairs:
    ours, theirs = make(jax_fp8.nnx), make(nnx)
    p_ours, p_theirs = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
    assert jax.tree.structure(p_ours) == jax.tree.structure(p_theirs)
    for a, b in zip(jax.tree.leaves(p_ours), jax.tree.leaves(p_theirs)):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    y, y_ref = ours(inputs), theirs(inputs)
    assert y.shape == y_ref.shape
    assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) < 2 * roundoff("e4m3")


def test_call_takes_nnx_keywords():
  """Every keyword of flax's own __call__ (out_sharding, einsum_str, ...) is accepted."""
  import inspect
  for ours, theirs in ((Linear, nnx.Linear), (MultiLinear, nnx.Linear),
                       (jax_fp8.nnx.Mlp, nnx.Linear),
                       (jax_fp8.nnx.LinearGeneral, nnx.LinearGeneral),
                       (jax_fp8.nnx.Einsum, nnx.Einsum)):
    have = inspect.signature(ours.__call__).parameters
    for name, p in inspect.signature(theirs.__call__).parameters.items():
      assert name in have and have[name].default == p.default, (ours.__name__, name)


def test_out_sharding(rng):
  """out_sharding (a NamedSharding, or a PartitionSpec under jax.set_mesh) shards each layer's
  output as asked, the values as without it."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(default_devices(2)), ("model",))
  x = jnp.asarray(rng.standard_normal((8, 64)), jnp.float32)
  rngs = nnx.Rngs(0)
  last = P(None, "model")
  layers = [(Linear(64, 64, rngs=rngs), last), (MultiLinear(64, (32, 64), rngs=rngs), last),
            (jax_fp8.nnx.Mlp(64, 32, rngs=rngs), last),
            (jax_fp8.nnx.LinearGeneral(64, (2, 32), rngs=rngs), P(None, None, "model")),
            (jax_fp8.nnx.Einsum("bd,dnh->bnh", (64, 2, 32), rngs=rngs), P(None, "model"))]
  for layer, spec in layers:
    name = type(layer).__name__
    plain = layer(x)
    for sharding, context in ((NamedSharding(mesh, spec), None), (spec, mesh)):
      call = nnx.jit(lambda m, x, s=sharding: m(x, out_sharding=s))
      if context is None:
        got = call(layer, x)
      else:
        with jax.set_mesh(context):
          got = call(layer, x)
      for y, y0 in zip(jax.tree.leaves(got), jax.tree.leaves(plain)):
        assert y.sharding.spec == spec, (name, y.sharding)
        assert y.sharding.shard_shape(y.shape) != y.shape  # split across the two devices
        # The same FP8 operands; the f32 sums' order may differ (two orders: twice gamma_K).
        assert np.linalg.norm(y - y0) <= 2 * summation_error(64) * np.linalg.norm(y0), name


def test_stacked_layers_fork_their_streams(rng):
  """NVFP4 layers made under nnx.vmap fork their stochastic rounding streams per layer, as
  nnx.Dropout does (one key a layer), and train under nnx.scan."""
  x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
  recipe = jax_fp8.NVFP4BlockScaling()

  @nnx.split_rngs(splits=3)
  @nnx.vmap(in_axes=0, out_axes=0)
  def make(rngs):
    return Linear(32, 32, recipe=recipe, rngs=rngs)
  layers = make(nnx.Rngs(0))
  keys = np.asarray(jax.random.key_data(layers.rngs.key.get_value()))
  assert keys.shape[0] == 3 and len({k.tobytes() for k in keys}) == 3

  @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
  def body(layer, h):
    return jnp.tanh(layer(h))
  grads = nnx.jit(nnx.grad(lambda m: jnp.sum(body(m, x) ** 2)))(layers)
  assert grads["kernel"].get_value().shape == (3, 32, 32)
  assert np.all(np.isfinite(np.asarray(grads["kernel"].get_value())))
  np.testing.assert_array_equal(np.asarray(layers.rngs.count.get_value()), [1, 1, 1])
  # Two plain layers from one Rngs: two streams, not one shared.
  a, b = (Linear(32, 32, recipe=recipe, rngs=r) for r in [nnx.Rngs(0)] * 2)
  assert not np.array_equal(jax.random.key_data(a.rngs()), jax.random.key_data(b.rngs()))
