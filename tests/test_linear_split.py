"""jax_fp8.linear's ``split``: the output cut into parts along N, with the values and gradients
of the output cut after the layer, on every path (each recipe, the norm fused, the plain path
below fp8_min_intensity, FP8 inference weights); under the per-tensor recipes the parts'
gradients reach the backward separately (no concatenation in the program); the layers' split."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.core import FrozenDict

import jax_fp8
import jax_fp8.flax
import jax_fp8.nnx

K, SPLIT = 128, (128, 256, 128)  # multiples of 128, as block scaling needs
RECIPES = {
    "delayed": jax_fp8.DelayedScaling(),
    "current": jax_fp8.CurrentScaling(),
    "block": jax_fp8.BlockScaling(),
    "mxfp8": jax_fp8.MXFP8BlockScaling(),
    "nvfp4": jax_fp8.NVFP4BlockScaling(stochastic_rounding=False),
    "plain": jax_fp8.DelayedScaling(fp8_min_intensity=1e9),  # below it: BF16 through XLA
}


def problem(rng, n=sum(SPLIT)):
  x = jnp.asarray(rng.standard_normal((2, 48, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((K, n)) / np.sqrt(K), jnp.float32)
  b = jnp.asarray(rng.standard_normal(n), jnp.float32)
  gamma = jnp.asarray(1 + 0.1 * rng.standard_normal(K), jnp.float32)
  beta = jnp.asarray(0.1 * rng.standard_normal(K), jnp.float32)
  ts = [jnp.asarray(rng.standard_normal((2, 48, c)), jnp.float32) for c in SPLIT]
  return x, w, b, gamma, beta, ts


def outputs(x, w, b, gamma, beta, state, recipe, norm, split):
  """The parts: the layer's with ``split``, else its whole output cut by jnp.split."""
  kw = dict(state=state, recipe=recipe, norm=norm, gamma=gamma if norm else None,
            beta=beta if norm else None)
  if split:
    return jax_fp8.linear(x, w, b, split=SPLIT, **kw)
  return tuple(jnp.split(jax_fp8.linear(x, w, b, **kw), np.cumsum(SPLIT)[:-1], axis=-1))


def loss(x, w, b, gamma, beta, state, ts, recipe, norm, split):
  ys = outputs(x, w, b, gamma, beta, state, recipe, norm, split)
  return sum(jnp.sum(y.astype(jnp.float32) * t) for y, t in zip(ys, ts))


@pytest.mark.parametrize("norm", [None, "layernorm"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_split_equals_the_output_cut(platform, rng, name, norm):
  """The parts and every gradient (x, kernel, bias, the norm's, the state's observations) are
  bit for bit those of the whole output cut after the layer."""
  recipe = RECIPES[name]
  x, w, b, gamma, beta, ts = problem(rng)
  state = jax_fp8.LinearState.create(recipe) if isinstance(recipe, jax_fp8.DelayedScaling) else None
  fwd = jax.jit(outputs, static_argnums=(6, 7, 8))
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)), static_argnums=(7, 8, 9))
  got, want = (fwd(x, w, b, gamma, beta, state, recipe, norm, s) for s in (True, False))
  assert [y.shape for y in got] == [(2, 48, c) for c in SPLIT]
  for g, v in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))
  got, want = (grad(x, w, b, gamma, beta, state, ts, recipe, norm, s) for s in (True, False))
  for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))


@pytest.mark.parametrize("name", ["delayed", "current"])
def test_parts_reach_the_backward_separately(rng, name):
  """Under the per-tensor recipes the backward quantizes the parts' gradients where they lie:
  the program never concatenates them, as it does when the output is cut after the layer."""
  x, w, b, gamma, beta, ts = problem(rng)
  recipe = RECIPES[name]
  state = jax_fp8.LinearState.create(recipe) if name == "delayed" else None
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=(7, 8, 9))
  hlo = {s: grad.lower(x, w, b, gamma, beta, state, ts, recipe, None, s).compile().as_text()
         for s in (True, False)}
  whole = re.compile(rf",{sum(SPLIT)}\]\{{[\d,]+\}} concatenate\(")  # [..., N]: the parts' gradients
  assert not whole.search(hlo[True]) and whole.search(hlo[False])


def test_fp8_weight_split(rng):
  """Inference on FP8 weights cuts the output as the training path does."""
  x, w, b, *_ = problem(rng)
  weight = jax_fp8.quantize_weight(w, jax_fp8.CurrentScaling())
  kw = dict(recipe=jax_fp8.CurrentScaling())
  got = jax_fp8.linear(x, weight, b, split=SPLIT, **kw)
  want = jnp.split(jax_fp8.linear(x, weight, b, **kw), np.cumsum(SPLIT)[:-1], axis=-1)
  for g, v in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))


def test_layers_split(rng):
  """flax Dense and nnx Linear with ``split`` return the parts of the unsplit layer's output."""
  x = jnp.asarray(rng.standard_normal((2, 48, K)), jnp.float32)
  dense = jax_fp8.flax.Dense(sum(SPLIT), split=SPLIT, norm="rmsnorm", dtype=jnp.bfloat16)
  variables = dense.init(jax.random.key(0), x)
  got = dense.apply(variables, x)
  want = jax_fp8.flax.Dense(sum(SPLIT), norm="rmsnorm", dtype=jnp.bfloat16).apply(variables, x)
  assert isinstance(got, tuple) and len(got) == len(SPLIT)
  np.testing.assert_array_equal(np.asarray(jnp.concatenate(got, -1), np.float32),
                                np.asarray(want, np.float32))
  layer = jax_fp8.nnx.Linear(K, sum(SPLIT), split=list(SPLIT), rngs=nnx.Rngs(0),
                             dtype=jnp.bfloat16)
  got = layer(x)
  assert [y.shape for y in got] == [(2, 48, c) for c in SPLIT]
  layer.split = None
  np.testing.assert_array_equal(np.asarray(jnp.concatenate(got, -1), np.float32),
                                np.asarray(layer(x), np.float32))


@pytest.mark.parametrize("split, error, match", [
    ((128, 128), ValueError, r"sum to the output's N=512 .*, got \(128, 128\), which sum to 256"),
    ((128, 120, 264), ValueError, "positive multiples of 16"),
    ((0, 512), ValueError, "positive multiples of 16"),
    ((64,) * 8, ValueError, "1 to 4 sizes, got 8"),
    ((), ValueError, "1 to 4 sizes, got 0"),
    ("abc", TypeError, "tuple / list of ints, got str"),
    (512, TypeError, "tuple / list of ints, got int"),
    (FrozenDict(q=128, kv=384), TypeError,  # its repr on one line
     r"got FrozenDict FrozenDict\(\{ q: 128, kv: 384, \}\)$"),
    ((128.0, 384), TypeError, r"split\[0\] must be a Python int"),
])
def test_bad_split(rng, split, error, match):
  x, w, b, *_ = problem(rng)
  with pytest.raises(error, match=match):
    jax_fp8.linear(x, w, b, state=jax_fp8.LinearState.create(), split=split)
  with pytest.raises(error, match=match):
    jax_fp8.nnx.Linear(K, sum(SPLIT), split=split, rngs=nnx.Rngs(0))


def test_an_unused_part(rng):
  """A part the loss does not read gets a zero gradient: the gradients are the unsplit layer's
  with zeros in that part's columns of the output gradient."""
  x, w, b, gamma, beta, ts = problem(rng)
  state = jax_fp8.LinearState.create()
  ts[1] = jnp.zeros_like(ts[1])

  def only_ends(x, w, b, state, split):
    ys = outputs(x, w, b, gamma, beta, state, RECIPES["delayed"], None, split)
    return jnp.sum(ys[0].astype(jnp.float32) * ts[0]) + jnp.sum(ys[2].astype(jnp.float32) * ts[2])
  got = jax.jit(jax.grad(only_ends, argnums=(0, 1, 2, 3)), static_argnums=4)(x, w, b, state, True)
  want = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 5)), static_argnums=(7, 8, 9))(
      x, w, b, gamma, beta, state, ts, RECIPES["delayed"], None, False)
  for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))


def test_sharded_jit(rng):
  """Under a sharded jit (x's tokens over the devices) the split layer's gradients are the
  unsplit one's, bit for bit."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  x, w, b, gamma, beta, ts = problem(rng)
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("data",))
  rows = lambda v: jax.device_put(v, NamedSharding(mesh, P(None, "data")))  # noqa: E731
  state = jax_fp8.LinearState.create()
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 5)), static_argnums=(7, 8, 9))
  args = (rows(x), w, b, gamma, beta, state, [rows(t) for t in ts], RECIPES["delayed"], None)
  got, want = grad(*args, True), grad(*args, False)
  for g, v in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(v, np.float32))


def test_flax_dense_bad_split(rng):
  x = jnp.ones((2, K), jnp.float32)
  with pytest.raises(ValueError, match=r"sum to the output's N=48"):
    jax_fp8.flax.Dense(48, split=(16, 16)).init(jax.random.key(0), x)
  with pytest.raises(TypeError, match=r"split\[0\] must be a Python int"):
    jax_fp8.flax.Dense(48, split=(16.0, 32)).init(jax.random.key(0), x)
