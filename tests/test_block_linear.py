"""jax_fp8.linear and jax_fp8.flax.Dense under BlockScaling: forward against the unfused
reference, gradients against f32, the accuracy gain on outlier channels, data parallelism."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import normwise, on_cpu, roundoff, summation_error
from jax.sharding import Mesh, PartitionSpec as P

import jax_fp8
import jax_fp8.flax
from jax_fp8 import reference

# Normwise relative error against f32 math: every operand, gradients too, in e4m3, each
# element within 2^-4 of itself, so every product within two such roundings in quadrature
# (conftest.normwise; measured on the problems here, 40 seeds: forward 2.5-2.8%, gradients
# 3.6-3.8%).
FWD_TOL = BWD_TOL = normwise(roundoff("e4m3"), roundoff("e4m3"))  # 0.064


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def problem(rng, lead=(3, 70), k=256, n=384, dtype=jnp.bfloat16):
  x = jnp.asarray(rng.standard_normal((*lead, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
  b = jnp.asarray(rng.standard_normal(n), jnp.float32)
  t = jnp.asarray(rng.standard_normal((*lead, n)), jnp.float32)
  return x, w, b, t


def loss(x, w, b, t, recipe):
  y = jax_fp8.linear(x, w.astype(x.dtype), b.astype(x.dtype), recipe=recipe)
  return jnp.sum(y.astype(jnp.float32) * t)


def loss_f32(x, w, b, t):
  return jnp.sum((x.astype(jnp.float32) @ w + b) * t)


def order_bounds(x, w, t):
  """Elementwise bounds on |sharded - one device| for dx, dkernel and dbias: the same e4m3
  products (magnitudes within (1 + 2^-4)^2 of the unquantized ones) summed in two f32 orders,
  2 * summation_error(n) of their magnitudes for sums of n terms."""
  x, w, t = (np.abs(np.asarray(v, np.float64)) for v in (x, w, t))
  q = (1 + roundoff("e4m3"))**2
  return (2 * summation_error(w.shape[1]) * q * t @ w.T,
          2 * summation_error(x.shape[0]) * q * x.T @ t,
          2 * summation_error(t.shape[0]) * t.sum(0))


@pytest.mark.parametrize("ue8m0", [False, True], ids=["f32scale", "ue8m0"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_forward_and_grads(platform, rng, ue8m0, dtype):
  recipe = jax_fp8.BlockScaling(ue8m0=ue8m0)
  x, w, b, t = problem(rng, dtype=dtype)  # 210 tokens: a ragged last group along M
  w, b = w.astype(dtype), b.astype(dtype)
  y = jax.jit(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=recipe))(x, w, b)
  assert y.shape == (3, 70, 384) and y.dtype == dtype
  y_ref = on_cpu(lambda x, w, b: reference.block_linear(x, w, b, recipe=recipe), x, w, b)
  # Same quantized operands; only the GEMM's summation order (the reference's f32 sum and this
  # platform's, summation_error each, of the products' magnitudes, grown by at most
  # (1 + 2^-4)^2 by quantization) and the two roundings to dtype differ; normwise, the norm of
  # that elementwise bound. On the CPU both sum in the same order: the same bits.
  out = roundoff(dtype)
  y_ref = y_ref.astype(np.float32)
  absdot = on_cpu(lambda x, w: jnp.abs(x.astype(jnp.float32)) @ jnp.abs(w.astype(jnp.float32)),
                  x, w)
  orders = summation_error(x.shape[-1]) + summation_error(x.shape[-1], platform)
  bound = 2 * out * np.abs(y_ref) + orders * (1 + roundoff("e4m3"))**2 * absdot
  assert rel(y.astype(jnp.float32), y_ref) <= np.linalg.norm(bound) / np.linalg.norm(y_ref)
  if platform == "cpu":
    np.testing.assert_array_equal(np.asarray(y.astype(jnp.float32)), y_ref)
  y_f32 = on_cpu(lambda x, w, b: x.astype(jnp.float32) @ w.astype(jnp.float32) + b, x, w, b)
  assert rel(y.astype(jnp.float32), y_f32) < FWD_TOL + out

  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=4)(x, w, b, t, recipe)
  want = on_cpu(jax.grad(loss_f32, argnums=(0, 1, 2)), x.astype(jnp.float32),
                w.astype(jnp.float32), b.astype(jnp.float32), t)
  # dbias sums t's 210 rows in f32 (no FP8): t and the sum rounded to dtype, and the f32
  # sum's roundings, a random walk of about sqrt(210) roundoffs of f32.
  bias_tol = 2 * out + np.sqrt(210) * roundoff(jnp.float32)
  for got, ref, name, tol in zip(grads, want, ("dx", "dkernel", "dbias"),
                                 (BWD_TOL + out, BWD_TOL + out, bias_tol)):
    assert got.dtype == dtype and got.shape == ref.shape, name
    assert rel(got.astype(jnp.float32), ref) < tol, name


def test_gradient_matches_central_difference(rng):
  """The custom_vjp's directional derivative along its own gradient agrees with a central
  difference of the f32 linear, which the block-scaled one approximates. (Along the gradient
  the derivative is large; along a random direction it is a sum that cancels.) The f32 loss is
  bilinear, so the central difference is its exact derivative up to f32 noise; the two differ
  by the gradients' errors e projected on the unit directions v = g / |g|, g = g32 + e: the
  error's own part |e|^2 / |g| (e within BWD_TOL of |g|: BWD_TOL^2 of the derivative) and
  e's projection on g32's direction, a random direction's in d = 2 * 128 * 128 dimensions:
  |e| / sqrt(d), three of its standard deviations allowed."""
  x, w, b, t = problem(rng, lead=(128,), k=128, n=128, dtype=jnp.float32)
  recipe = jax_fp8.BlockScaling()
  dx, dw, db = jax.grad(loss, argnums=(0, 1, 2))(x, w, b, t, recipe)
  vx, vw = dx / jnp.linalg.norm(dx), dw / jnp.linalg.norm(dw)
  h = 1e-2
  fd = (loss_f32(x + h * vx, w + h * vw, b, t) - loss_f32(x - h * vx, w - h * vw, b, t)) / (2 * h)
  ad = jnp.vdot(dx, vx) + jnp.vdot(dw, vw)
  d = x.size + w.size
  assert abs(float(ad - fd)) < (BWD_TOL**2 + 3 * BWD_TOL / np.sqrt(d)) * float(ad), (
      float(ad), float(fd))
  # dbias is the f32 column sum of t: two summation orders of 128 terms.
  bound = 2 * summation_error(t.shape[0]) * np.abs(np.asarray(t)).sum(0)
  assert np.all(np.abs(np.asarray(db) - np.asarray(t.sum(0))) <= bound)


def test_outlier_channels_accuracy(platform, rng):
  """Activations with a few channels 100x larger (the outliers of LLM activations), each in
  its own 128-channel group: the output's relative error under block scaling against
  per-tensor scaling. The kernel is exact in e4m3 under both (its values e4m3 numbers, 448 in
  every 128 x 128 block), so the error is the activations' alone."""
  m, k, n, outliers = 512, 1024, 256, 4
  x = rng.standard_normal((m, k)).astype(np.float32)
  groups = rng.choice(k // 128, outliers, replace=False)
  x[:, 128 * groups + rng.integers(128, size=outliers)] *= 100.0
  x = jnp.asarray(x, jnp.bfloat16)
  w = np.clip(rng.standard_normal((k, n)) * 100, -448, 448).astype(jnp.float8_e4m3fn)
  w = w.astype(np.float32)
  w[::128, ::128] = 448.0  # every block's amax, and the tensor's: every scale 2^-12
  w = jnp.asarray(w * 2.0**-12, jnp.bfloat16)  # e4m3 numbers times 2^-12, ~N(0, 1/k)
  exact = on_cpu(lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32), x, w)
  y_block = jax_fp8.linear(x, w, recipe=jax_fp8.BlockScaling())
  y_tensor = jax_fp8.linear(x, w, state=jax_fp8.LinearState.create())  # current scaling, step 0
  e_block, e_tensor = rel(y_block.astype(jnp.float32), exact), rel(y_tensor.astype(jnp.float32),
                                                                     exact)
  print(f"relative error with outlier channels: block {e_block:.4f}, per-tensor {e_tensor:.4f}")
  # Each group's largest element maps exactly onto 448, so the outlier channels are exact under
  # block scaling; e4m3's relative step is the same for the ordinary channels under both (100x
  # stays inside its normal range). The ordinary channels carry a share f of |y|^2, so the
  # block error is about sqrt(f) of per-tensor's, and at most 2^-4 sqrt(f) plus bf16's 2^-8.
  f = (k - outliers) / (k - outliers + outliers * 100.0**2)
  assert e_block < roundoff("e4m3") * np.sqrt(f) + roundoff(jnp.bfloat16)
  assert e_block < (1 + np.sqrt(f)) / 2 * e_tensor  # halfway between sqrt(f) and no gain


def test_flax_dense_block_scaling(rng):
  x = jnp.asarray(rng.standard_normal((2, 8, 128)), jnp.float32)
  layer = jax_fp8.flax.Dense(256, recipe=jax_fp8.BlockScaling())
  variables = layer.init(jax.random.key(0), x)
  assert set(variables) == {"params"}  # stateless: no "fp8_state" collection
  y = layer.apply(variables, x)
  p = variables["params"]
  want = jax_fp8.linear(x, p["kernel"], p["bias"], recipe=jax_fp8.BlockScaling())
  np.testing.assert_array_equal(y, want)
  plain = nn.Dense(256).init(jax.random.key(0), x)  # same parameters and initializers
  np.testing.assert_array_equal(plain["params"]["kernel"], p["kernel"])


def test_data_parallel_matches_one_device(rng):
  """Under shard_map data parallelism each device quantizes its own tokens: 1 x 128 groups
  along K are per token, and the wgrad's 128-token groups match one device's when each device
  holds a multiple of 128 tokens (here 128), so the weight gradient is the same sum."""
  x, w, b, t = problem(rng, lead=(8 * 128,), k=128, n=256, dtype=jnp.float32)
  recipe = jax_fp8.BlockScaling()
  grad = jax.grad(loss, argnums=(0, 1, 2))
  mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
  run = jax.jit(jax.shard_map(lambda x, w, b, t: grad(x, w, b, t, recipe), mesh=mesh,
                              in_specs=(P("data"), P(), P(), P("data")),
                              out_specs=(P("data"), P(), P())))
  got = run(x, w, b, t)
  want = on_cpu(lambda *a: grad(*a, recipe), x, w, b, t)  # one device of the same platform
  np.testing.assert_array_equal(got[0], want[0])  # dx: per-token, bit-identical
  for g, w_, bound in zip(got[1:], want[1:], order_bounds(x, w, t)[1:]):  # dW, db: summed over
    assert np.all(np.abs(np.asarray(g, np.float64) - w_) <= bound)  # devices, another order



@pytest.mark.parametrize("specs", [(P("data"), P()), (P(), P(None, "data")),
                                   (P(None, "data"), P("data"))],
                         ids=["data_parallel", "tensor_column", "tensor_row"])
def test_sharded_jit_matches_one_device(rng, specs):
  """A plain jit over 8 devices (no shard_map): the block ops' and gemm's sharding rules keep
  x and the kernel split, each device holding whole groups and blocks, and the results are
  one device's within f32 summation order (XLA:CPU may block a shard's dot differently)."""
  x, w, b, t = problem(rng, lead=(8 * 128,), k=1024, n=1024, dtype=jnp.float32)
  recipe = jax_fp8.BlockScaling()
  grad = jax.grad(loss, argnums=(0, 1, 2))
  mesh = Mesh(np.array(jax.devices("cpu")[:8]), ("data",))
  put = lambda v, s: jax.device_put(v, jax.sharding.NamedSharding(mesh, s))
  x_spec, w_spec = specs
  t_spec = P(x_spec[0] if len(x_spec) else None, w_spec[1] if len(w_spec) > 1 else None)
  b_spec = P(w_spec[1] if len(w_spec) > 1 else None)
  run = jax.jit(lambda x, w, b, t: grad(x, w, b, t, recipe))
  args = (put(x, x_spec), put(w, w_spec), put(b, b_spec), put(t, t_spec))
  got = run(*args)
  want = on_cpu(lambda *a: grad(*a, recipe), x, w, b, t)
  if x_spec == P("data"):
    assert "all-gather" not in run.lower(*args).compile().as_text()
  for g, w_, bound in zip(got, want, order_bounds(x, w, t)):  # f32 summation order
    assert np.all(np.abs(np.asarray(g, np.float64) - w_) <= bound)

def test_bad_inputs():
  x = jnp.ones((4, 128))
  with pytest.raises(ValueError, match="multiples of 128"):
    jax_fp8.linear(jnp.ones((4, 64)), jnp.ones((64, 128)), recipe=jax_fp8.BlockScaling())
  with pytest.raises(ValueError, match="multiples of 128"):
    jax_fp8.linear(x, jnp.ones((128, 48)), recipe=jax_fp8.BlockScaling())
  with pytest.raises(ValueError, match="stateless"):
    jax_fp8.linear(x, jnp.ones((128, 128)), state=jax_fp8.LinearState.create(),
                   recipe=jax_fp8.BlockScaling())
  with pytest.raises(TypeError, match="BlockScaling.ue8m0 must be a bool, got int 900"):
    jax_fp8.BlockScaling(900)  # meant as fp8_min_intensity, which is a keyword
  with pytest.raises(TypeError, match="recipe must be"):
    jax_fp8.linear(x, jnp.ones((128, 128)), recipe="block")
  with pytest.raises(TypeError, match="recipe must be"):
    jax_fp8.flax.Dense(128, recipe=None).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match="kernel must be float32"):
    jax_fp8.linear(x, jnp.ones((128, 128), jnp.int32), recipe=jax_fp8.BlockScaling())
  y = jax_fp8.linear(x, jnp.ones((128, 128)), recipe=jax_fp8.BlockScaling(), amax_axis_name=())
  assert y.shape == (4, 128)
