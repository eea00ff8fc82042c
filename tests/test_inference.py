"""FP8 weights for inference: quantize_weight / quantize_weights, linear and multi_linear on
Fp8Weight kernels (both recipes, CPU and CUDA), the fallback below fp8_min_intensity, the
Flax layers on a quantized parameter tree, memory, and the errors."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import roundoff
from flax import linen as nn, nnx

import jax_fp8
import jax_fp8.flax
import jax_fp8.nnx
from jax_fp8.inference import dequantized

RECIPES = [pytest.param(jax_fp8.DelayedScaling(), id="delayed"),
           pytest.param(jax_fp8.BlockScaling(), id="block")]


def state_for(recipe, n=1):
  if isinstance(recipe, jax_fp8.BlockScaling):
    return None
  return jax_fp8.LinearState.create(recipe) if n == 1 else jax_fp8.MultiLinearState.create(
      n, recipe)


def problem(rng, m=64, k=256, n=128):
  x = jnp.asarray(rng.standard_normal((2, m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), jnp.float32)
  b = jnp.asarray(rng.standard_normal(n), jnp.float32)
  return x, w, b


@pytest.mark.parametrize("recipe", RECIPES)
def test_same_forward_as_training(platform, rng, recipe):
  """On a fresh state the training forward quantizes the kernel with its current amax, as
  quantize_weight does: the outputs are the same bits, for linear and multi_linear."""
  x, w, b = problem(rng)
  w8 = jax_fp8.quantize_weight(w, recipe)
  assert w8.q.shape == (128, 256) and w8.q.dtype == jnp.float8_e4m3fn
  fwd = jax.jit(lambda x, w, b: jax_fp8.linear(x, w, b, state=state_for(recipe), recipe=recipe))
  np.testing.assert_array_equal(np.asarray(fwd(x, w8, b)), np.asarray(fwd(x, w, b)))
  multi = jax.jit(lambda x, ws: jax_fp8.multi_linear(x, ws, state=state_for(recipe, 2),
                                                     recipe=recipe))
  for got, want in zip(multi(x, (w8, w8)), multi(x, (w, w))):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("recipe", RECIPES)
def test_below_min_intensity_dequantizes(rng, recipe):
  """Below fp8_min_intensity the dequantized weight goes to XLA's GEMM in x's dtype: within
  the weight's e4m3 rounding and the output's bf16 rounding of the float result."""
  x, w, b = problem(rng, m=1)
  w8 = jax_fp8.quantize_weight(w, recipe)
  slow = dataclasses.replace(recipe, fp8_min_intensity=1e9)
  y = jax_fp8.linear(x, w8, b, state=state_for(slow), recipe=slow)
  assert y.dtype == jnp.bfloat16
  y_f32 = x.astype(jnp.float32) @ w + b
  err = jnp.linalg.norm(y.astype(jnp.float32) - y_f32) / jnp.linalg.norm(y_f32)
  # x and the bias enter in bf16 (a bf16 roundoff each), the kernel in e4m3, the sum in bf16.
  assert float(err) < roundoff("e4m3") + 3 * roundoff(jnp.bfloat16)
  np.testing.assert_array_equal(
      np.asarray(y), np.asarray(x @ dequantized(w8, jnp.bfloat16) + b.astype(jnp.bfloat16)))


@pytest.mark.parametrize("recipe", RECIPES)
def test_flax_layers_on_quantized_params(rng, recipe):
  x, w, b = problem(rng)
  dense = jax_fp8.flax.Dense(128, dtype=jnp.bfloat16, recipe=recipe)
  v = dense.init(jax.random.key(0), x)
  q = jax_fp8.quantize_weights(v["params"], recipe)
  assert isinstance(q["kernel"], jax_fp8.Fp8Weight) and q["bias"] is v["params"]["bias"]
  np.testing.assert_array_equal(
      np.asarray(dense.apply({**v, "params": q}, x)),
      np.asarray(jax_fp8.linear(x, q["kernel"], v["params"]["bias"].astype(jnp.bfloat16),
                                state=v.get("fp8_state", {}).get("linear"), recipe=recipe)))
  multi = jax_fp8.flax.MultiDense((128, 256), dtype=jnp.bfloat16, recipe=recipe)
  v = multi.init(jax.random.key(0), x)
  # a NumPy bool is a bool (a select of np.prod(k.shape) > n gives one)
  q = jax_fp8.quantize_weights(v["params"], recipe,
                               select=lambda path, k: np.bool_(path != "kernel_1"))
  assert isinstance(q["kernel_0"], jax_fp8.Fp8Weight) and not isinstance(q["kernel_1"],
                                                                         jax_fp8.Fp8Weight)
  with pytest.raises(TypeError, match="all arrays or all Fp8Weight"):
    multi.apply({**v, "params": q}, x)
  swapped = jax_fp8.quantize_weights(v["params"], recipe)  # each kernel's N checked
  swapped = {**swapped, "kernel_0": swapped["kernel_1"], "kernel_1": swapped["kernel_0"]}
  with pytest.raises(ValueError, match=r"MultiDense's kernel_0 is an Fp8Weight of a \[256, 256\] "
                                       r"kernel; the layer's is \[256, 128\]"):
    multi.apply({**v, "params": swapped}, x)
  layer = jax_fp8.nnx.Linear(256, 128, dtype=jnp.bfloat16, recipe=recipe, rngs=nnx.Rngs(0))
  y = layer(x)
  nnx.update(layer, jax_fp8.quantize_weights(nnx.state(layer, nnx.Param), recipe))
  assert isinstance(layer.kernel.get_value(), jax_fp8.Fp8Weight)
  np.testing.assert_array_equal(np.asarray(layer(x)), np.asarray(y))  # fresh state: same bits


@pytest.mark.parametrize("recipe", RECIPES)
def test_scanned_layers_on_quantized_params(rng, recipe):
  """With stacked_axes=1, kernels stacked by nn.scan ([L, K, N]) become stacked Fp8Weights,
  which the scan slices into one a layer: on a fresh state the same bits as the float params'
  forward. Without it they stay float (a kernel of another rank may be no stack: DenseGeneral's,
  a convolution's)."""
  class Layer(nn.Module):
    @nn.compact
    def __call__(self, h, _):
      return h + jax_fp8.flax.Dense(256, dtype=jnp.bfloat16, recipe=recipe)(h), None

  model = nn.scan(Layer, variable_axes={"params": 0, "fp8_state": 0},
                  split_rngs={"params": True}, length=3)()
  x = problem(rng)[0]
  v = model.init(jax.random.key(0), x, None)
  plain = jax_fp8.quantize_weights(v["params"], recipe)["Dense_0"]["kernel"]
  assert plain is v["params"]["Dense_0"]["kernel"]
  q = jax_fp8.quantize_weights(v["params"], recipe, stacked_axes=1)
  kernel = q["Dense_0"]["kernel"]
  assert isinstance(kernel, jax_fp8.Fp8Weight) and kernel.q.shape == (3, 256, 256)
  for i in range(3):  # each layer's slice is that layer's kernel quantized alone
    one = jax_fp8.quantize_weight(v["params"]["Dense_0"]["kernel"][i], recipe)
    for got, want in zip(jax.tree.map(lambda a: a[i], kernel), one, strict=True):
      np.testing.assert_array_equal(np.asarray(got).reshape(-1).view(np.uint8),
                                    np.asarray(want).reshape(-1).view(np.uint8))
  np.testing.assert_array_equal(np.asarray(model.apply({**v, "params": q}, x, None)[0]),
                                np.asarray(model.apply(v, x, None)[0]))


def test_memory_is_about_half_of_bf16(rng):
  params = {"a": {"kernel": jnp.zeros((1024, 4096))}, "b": {"kernel": jnp.zeros((4096, 1024))}}
  nbytes = lambda tree, cast=None: sum((cast or v.dtype).itemsize * v.size
                                       for v in jax.tree.leaves(tree))
  bf16 = nbytes(params, jnp.dtype(jnp.bfloat16))
  for recipe in (jax_fp8.DelayedScaling(), jax_fp8.BlockScaling()):
    fp8 = nbytes(jax_fp8.quantize_weights(params, recipe))
    assert 0.5 < fp8 / bf16 < 0.5 + 1e-3  # one byte an element, plus the scales


def test_errors(rng):
  x, w, b = problem(rng)
  delayed, block = jax_fp8.DelayedScaling(), jax_fp8.BlockScaling()
  w8 = jax_fp8.quantize_weight(w, block)
  cases = [
      (lambda: jax_fp8.linear(x, w8, state=state_for(delayed), recipe=delayed), ValueError,
       r"kernel.scale must be \[\] for a DelayedScaling recipe"),
      (lambda: jax.grad(lambda x: jnp.sum(jax_fp8.linear(x, w8, recipe=block)))(x), TypeError,
       "inference-only"),
      # with respect to the state too (its x ring was a tracer the op's rule never saw)
      (lambda: jax.grad(lambda s: jnp.sum(jax_fp8.linear(
          x, jax_fp8.quantize_weight(w, delayed), state=s, recipe=delayed)))(state_for(delayed)),
       TypeError, "inference-only"),
      (lambda: jax_fp8.linear(x[..., :128], w8, recipe=block), ValueError, "must share K"),
      (lambda: jax_fp8.quantize_weight(w.astype(jnp.int32), delayed), TypeError,
       "kernel must be a float32"),
      (lambda: jax_fp8.quantize_weight(w[:, :24], delayed), ValueError, "multiples of 16"),
      (lambda: jax_fp8.quantize_weight(w[:64, :64], block), ValueError, "multiples of 128"),
      (lambda: jax_fp8.quantize_weights({"kernel": w}, block, select=3), TypeError,
       "select must be a callable"),
      (lambda: jax_fp8.quantize_weights({"kernel": w}, block, stacked_axes=-1), ValueError,
       "stacked_axes must be an int >= 0, got -1"),
      (lambda: jax_fp8.quantize_weights({"kernel": w}, block, stacked_axes=True), TypeError,
       "stacked_axes must be a Python int"),
      (lambda: jax_fp8.quantize_weights({"ok": {"kernel": w}, "odd": {"kernel": w[:, :24]}},
                                        block), ValueError,
       "params' kernel at odd/kernel: BlockScaling needs K and N multiples of 128"),
      (lambda: jax_fp8.quantize_weight(w, "e4m3"), TypeError, "recipe must be"),
      (lambda: jax_fp8.linear(x, jax_fp8.Fp8Weight(w8.q.astype(jnp.float8_e5m2), w8.scale),
                              recipe=block), TypeError, "kernel must hold float8_e4m3fn"),
      (lambda: jax_fp8.mlp(x, w8, w.T[:, :128], activation="gelu", recipe=block), TypeError,
       "kernel_in is an Fp8Weight; mlp takes float kernels"),
  ]
  for fn, exc, match in cases:
    with pytest.raises(exc, match=match):
      fn()


def test_mlp_kernels_stay_float(rng):
  """quantize_weights replaces Dense's kernel and leaves Mlp's kernel_in / kernel_out float
  (mlp takes float kernels)."""
  params = {"dense": {"kernel": jnp.ones((128, 128))},
            "mlp": {"kernel_in": jnp.ones((128, 256)), "kernel_out": jnp.ones((128, 128))}}
  out = jax_fp8.quantize_weights(params, jax_fp8.BlockScaling())
  assert isinstance(out["dense"]["kernel"], jax_fp8.Fp8Weight)
  assert out["mlp"]["kernel_in"] is params["mlp"]["kernel_in"]
  assert out["mlp"]["kernel_out"] is params["mlp"]["kernel_out"]
  layer = jax_fp8.flax.Mlp(128, activation="gelu", recipe=jax_fp8.BlockScaling())
  x = jnp.ones((4, 128))
  p = layer.init(jax.random.key(0), x)["params"]
  p = {**p, "kernel_in": jax_fp8.quantize_weight(p["kernel_in"], jax_fp8.BlockScaling())}
  with pytest.raises(TypeError, match="kernel_in is an Fp8Weight; mlp takes float kernels"):
    layer.apply({"params": p}, x)
