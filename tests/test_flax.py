"""jax_fp8.flax.Dense: a drop-in for flax.linen.Dense."""

import re

import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as orbax
import pytest
from conftest import roundoff

import jax_fp8
from jax_fp8.flax import Dense


def test_init_matches_nn_dense(rng):
  x = jnp.asarray(rng.standard_normal((2, 7, 32)), jnp.float32)
  key = jax.random.PRNGKey(int(rng.integers(1 << 30)))
  ours = Dense(48).init(key, x)
  theirs = nn.Dense(48).init(key, x)
  assert jax.tree.structure(ours["params"]) == jax.tree.structure(theirs["params"])
  for a, b in zip(jax.tree.leaves(ours["params"]), jax.tree.leaves(theirs["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same initializers
  assert isinstance(ours["fp8_state"]["linear"], jax_fp8.LinearState)
  y = Dense(48).apply(ours, x)
  y_ref = nn.Dense(48).apply(theirs, x)
  assert y.shape == (2, 7, 48)
  # x and kernel e4m3 (each element within 2^-4 of itself): the product within about the sum.
  assert np.linalg.norm(y - y_ref) / np.linalg.norm(y_ref) < 2 * roundoff("e4m3")
  y16 = Dense(48, dtype=jnp.bfloat16, use_bias=False).apply(
      {"params": {"kernel": ours["params"]["kernel"]}, "fp8_state": ours["fp8_state"]}, x)
  assert y16.dtype == jnp.bfloat16


@pytest.mark.parametrize("recipe", [jax_fp8.DelayedScaling(), jax_fp8.BlockScaling()],
                         ids=["delayed", "block"])
def test_kernel_quantized_from_its_param_dtype(rng, recipe):
  """bf16 compute with f32 master weights: the kernel goes to the FP8 quantization as f32 (no
  bf16 copy of it in the step) and its gradient leaves the wgrad GEMM as f32; the output is
  the same as jax_fp8.linear's on the f32 kernel."""
  x = jnp.asarray(rng.standard_normal((256, 128)), jnp.bfloat16)
  layer = Dense(128, dtype=jnp.bfloat16, use_bias=False, recipe=recipe)
  variables = layer.init(jax.random.PRNGKey(0), x)
  kernel = variables["params"]["kernel"]
  assert kernel.dtype == jnp.float32
  loss = lambda p: jnp.sum(layer.apply({**variables, "params": p}, x).astype(jnp.float32))
  step = jax.jit(jax.grad(loss))
  assert not re.search(r"bf16\[128,128\]\{[0-9,]*\} convert\(", step.lower(
      variables["params"]).compile().as_text())
  assert step(variables["params"])["kernel"].dtype == jnp.float32
  state = variables.get("fp8_state", {}).get("linear")
  y = layer.apply(variables, x)
  assert y.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(y), np.asarray(
      jax_fp8.linear(x, kernel, state=state, recipe=recipe)))


def test_float64_params_compute_in_dtype():
  """float64 master weights (under x64), which the FP8 kernels do not read, go through the
  compute dtype; their gradient is float64 again."""
  with jax.enable_x64(True):
    layer = Dense(128, dtype=jnp.float32, param_dtype=jnp.float64)
    x = jnp.ones((4, 128), jnp.float32)
    y, variables = layer.init_with_output(jax.random.PRNGKey(0), x)
    assert y.dtype == jnp.float32 and variables["params"]["kernel"].dtype == jnp.float64
    grads = jax.grad(lambda p: jnp.sum(layer.apply({**variables, "params": p}, x)))(
        variables["params"])
    assert grads["kernel"].dtype == jnp.float64


@pytest.mark.parametrize("layer,message", [
    (Dense(16, param_dtype=jnp.float64), r"dtype is None, so it would compute in float64"),
    (Dense(16, dtype=jnp.float64), r"dtype must be None, float32, bfloat16 or float16, got "
                                   r"float64"),
    (jax_fp8.flax.Mlp(32, param_dtype=jnp.float64), r"dtype is None, so it would compute in "
                                                    r"float64"),
    (Dense(16, dtype=jnp.int8), r"dtype must be None, float32, bfloat16 or float16, got int8"),
    (jax_fp8.flax.Mlp(32, dtype=jnp.int8), r"dtype must be None, float32, bfloat16 or float16, "
                                           r"got int8"),
], ids=["dense params", "dense dtype", "mlp params", "dense int8", "mlp int8"])
def test_wrong_compute_dtype_is_refused(layer, message):
  """Under x64 a float64 compute dtype (set, or promoted from float64 parameters) is named as
  the layer's dtype, not as a wrong x or kernel; so is an integer dtype (not Flax's own
  message)."""
  with jax.enable_x64(True), pytest.raises(TypeError, match=message):
    layer.init(jax.random.PRNGKey(0), jnp.ones((4, 32), jnp.float32))


@pytest.mark.parametrize("layer,x_dtype,message", [
    (Dense(16, dtype="bf16"), jnp.float32,
     "Dense.dtype must be None, float32, bfloat16 or float16, got 'bf16'"),
    (Dense(16, param_dtype=jnp.int32), jnp.float32,
     r"Dense.param_dtype must be float32, bfloat16 or float16 \(or float64 under x64\), got "
     "int32"),
    (jax_fp8.flax.Mlp(32, param_dtype=jnp.float8_e4m3fn), jnp.float32,
     "Mlp.param_dtype must be .* got float8_e4m3fn"),
    (Dense(16, param_dtype="fp32"), jnp.float32, "Dense.param_dtype must be .* got 'fp32'"),
    (Dense(16), jnp.int32, r"the layer's inputs must be floats \(float32, bfloat16 or float16\), "
                           "got int32"),
], ids=["dtype string", "int params", "fp8 params", "param_dtype string", "int inputs"])
def test_layer_dtypes_are_checked(layer, x_dtype, message):
  """A dtype, param_dtype or input dtype the layers cannot compute in is refused naming the
  attribute (not JAX's or Flax's message, nor a silent promotion of integer inputs)."""
  with pytest.raises(TypeError, match=message):
    layer.init(jax.random.PRNGKey(0), jnp.ones((4, 32), x_dtype))


def test_float64_dtype_without_x64_computes_in_float32():
  """dtype=float64 without x64 is float32, as JAX canonicalizes it (and nn.Dense computes)."""
  y, _ = Dense(16, dtype=jnp.float64).init_with_output(jax.random.PRNGKey(0),
                                                      jnp.ones((4, 32), jnp.float32))
  assert y.dtype == jnp.float32


class MLP(nn.Module):
  dense: type

  @nn.compact
  def __call__(self, x):
    x = jax.nn.gelu(self.dense(64)(x))
    return self.dense(16)(x)


def train(dense, data, steps=50):
  x, y = data
  model = MLP(dense)
  variables = model.init(jax.random.PRNGKey(0), x[:8])
  params, state = variables["params"], variables.get("fp8_state", {})
  tx = optax.adam(3e-3)
  opt = tx.init(params)

  def loss_fn(params, state, xb, yb):
    pred = model.apply({"params": params, "fp8_state": state}, xb)
    return jnp.mean((pred - yb) ** 2)

  @jax.jit
  def step(params, opt, state, xb, yb):
    loss, (g, sg) = jax.value_and_grad(loss_fn, argnums=(0, 1))(params, state, xb, yb)
    upd, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, upd), opt, jax_fp8.update_state(state, sg), loss

  losses = []
  for i in range(steps):
    sl = slice((i % 8) * 32, (i % 8) * 32 + 32)
    params, opt, state, loss = step(params, opt, state, x[sl], y[sl])
    losses.append(float(loss))
  return losses, state


def test_fp8_training_tracks_bf16(rng):
  x = jnp.asarray(rng.standard_normal((256, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32) / 4
  y = jnp.tanh(x @ w)
  fp8, state = train(Dense, (x, y))
  ref, _ = train(nn.Dense, (x, y))
  # Task-level checks of a training run, not format bounds: over 40 seeds (CPU) the final loss
  # fell to at most 0.225 of the first (f32 at most 0.226), and the FP8 and f32 runs' final
  # losses differed by at most 1.1%.
  assert fp8[-1] < 0.3 * fp8[0]  # it learns
  assert abs(np.mean(fp8[-5:]) - np.mean(ref[-5:])) < 0.15 * np.mean(ref[-5:]) + 1e-3
  rings = jax.tree.leaves(state, is_leaf=lambda v: isinstance(v, jax_fp8.ScaleRing))
  assert len(rings) == 6 and all(float(r.steps) == 50 for r in rings)


class Block(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + jax.nn.gelu(Dense(32)(x)), None


def test_scan_over_layers_and_checkpoint(rng, tmp_path):
  """Rings stacked by nn.scan advance one by one; the state round-trips through
  flax.serialization and orbax (restored against a target, which carries the static fields)."""
  model = nn.scan(Block, variable_axes={"params": 0, "fp8_state": 0},
                  split_rngs={"params": True}, length=3)()
  x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
  v = model.init(jax.random.PRNGKey(0), x, None)
  f = lambda p, s: jnp.sum(model.apply({"params": p, "fp8_state": s}, x, None)[0] ** 2)
  _, state_grads = jax.grad(f, argnums=(0, 1))(v["params"], v["fp8_state"])
  new = jax_fp8.update_state(v["fp8_state"], state_grads)
  ring = jax.tree.leaves(new, is_leaf=lambda r: isinstance(r, jax_fp8.ScaleRing))[0]  # x ring
  assert ring.amax_history.shape == (3, 16)
  np.testing.assert_array_equal(np.asarray(ring.steps), [1, 1, 1])
  assert float(ring.amax_history[0, 0]) == float(jnp.max(jnp.abs(x)))

  restored = flax.serialization.from_bytes(v["fp8_state"], flax.serialization.to_bytes(new))
  for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(new)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  ckpt = orbax.StandardCheckpointer()
  ckpt.save(tmp_path / "state", new)
  ckpt.wait_until_finished()
  back = ckpt.restore(tmp_path / "state", target=v["fp8_state"])
  assert jax.tree.structure(back) == jax.tree.structure(new)
  for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(new)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
