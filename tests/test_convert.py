"""jax_fp8.convert: transformers written without jax_fp8 in mind (linen with Flax's own
attention, NNX), converted in one line: same parameters, outputs within FP8 error of the
original, training with the FP8 state moving; the filter's rules."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import normwise, roundoff
from flax import nnx

import jax_fp8
import jax_fp8.nnx
from jax_fp8.convert import convert, default_recipe

VOCAB, D, HEADS, LEN = 64, 64, 4, 16
RECIPE = jax_fp8.DelayedScaling()  # always FP8: the test shapes are far below the crossover
# Each converted layer on the path quantizes its input and kernel (each element within
# roundoff(e4m3) of itself): two e4m3 roundings, independent of the other layers', so to first
# order the errors of the layers on a path add in quadrature (conftest.normwise). One block's
# deepest path runs through four converted layers: q / k / v, the output projection, up, down.
E4M3 = roundoff("e4m3")


def tol(layers: int) -> float:
  """The normwise relative error of an output past ``layers`` converted layers."""
  return normwise(*[E4M3] * (2 * layers))


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(HEADS)(h, mask=nn.make_causal_mask(x[..., 0]))
    h = nn.LayerNorm()(x)
    return x + nn.Dense(D)(nn.gelu(nn.Dense(4 * D)(h)))


class LinenLM(nn.Module):
  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(VOCAB, D)(tokens)
    for i in range(2):
      x = LinenBlock(name=f"block_{i}")(x)
    return nn.Dense(VOCAB, name="lm_head")(nn.LayerNorm()(x))


def data(rng):
  tokens = jnp.asarray(rng.integers(0, VOCAB, (8, LEN + 1)), jnp.int32)
  return tokens[:, :-1], tokens[:, 1:]


def rel(a, b):
  return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def test_linen_transformer(rng):
  inputs, targets = data(rng)
  model, fp8 = LinenLM(), convert(LinenLM(), RECIPE)
  v0 = jax.jit(model.init)(jax.random.key(0), inputs)  # jitted: eagerly each operation compiles
  v = jax.jit(fp8.init)(jax.random.key(0), inputs)
  assert jax.tree.structure(v["params"]) == jax.tree.structure(v0["params"])
  for a, b in zip(jax.tree.leaves(v["params"]), jax.tree.leaves(v0["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same initializers
  # Flax's attention projections are DenseGeneral; the MLP Dense; the head stays.
  state = v["fp8_state"]
  assert sorted(state) == ["block_0", "block_1"]
  assert sorted(state["block_0"]) == ["Dense_0", "Dense_1", "MultiHeadDotProductAttention_0"]
  assert sorted(state["block_0"]["MultiHeadDotProductAttention_0"]) == ["key", "out", "query",
                                                                        "value"]
  # Two blocks in sequence: twice the one block's path.
  assert rel(jax.jit(fp8.apply)(v, inputs), jax.jit(model.apply)(v0, inputs)) < tol(2 * 4)

  tx = optax.adam(3e-3)

  @jax.jit
  def step(params, opt, state):
    def loss(params, state):
      logits = fp8.apply({"params": params, "fp8_state": state}, inputs)
      return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    value, (g, sg) = jax.value_and_grad(loss, argnums=(0, 1))(params, state)
    updates, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, updates), opt, jax_fp8.update_state(state, sg), value

  params, opt = v["params"], tx.init(v["params"])
  losses = []
  for _ in range(30):
    params, opt, state, value = step(params, opt, state)
    losses.append(float(value))
  # Task-level check, not a format bound: 30 steps on one batch memorize much of it.
  assert losses[-1] < 0.5 * losses[0]
  rings = jax.tree.leaves(state, is_leaf=lambda r: isinstance(r, jax_fp8.ScaleRing))
  assert [float(r.steps) for r in rings] == [30.0] * len(rings)


class NNXLM(nnx.Module):
  def __init__(self, rngs):
    self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
    self.blocks = nnx.List([nnx.Dict(up=nnx.Linear(D, 4 * D, rngs=rngs),
                                      down=nnx.Linear(4 * D, D, rngs=rngs)) for _ in range(2)])
    self.lm_head = nnx.Linear(D, VOCAB, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for b in self.blocks:
      x = x + b["down"](nnx.gelu(b["up"](x)))
    return self.lm_head(x)


def test_nnx_transformer(rng):
  inputs, targets = data(rng)
  model = NNXLM(nnx.Rngs(0))
  before = nnx.state(model, nnx.Param)
  y0 = model(inputs)
  assert convert(model, RECIPE) is model
  assert all(isinstance(b[k], jax_fp8.nnx.Linear) for b in model.blocks for k in ("up", "down"))
  assert type(model.lm_head) is nnx.Linear  # the head stays
  after = nnx.state(model, nnx.Param)
  assert jax.tree.structure(after) == jax.tree.structure(before)
  for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert rel(model(inputs), y0) < tol(2 * 2)  # 2 blocks, 2 layers each

  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  diff = nnx.DiffState(0, (nnx.Param, jax_fp8.nnx.Fp8State))

  @nnx.jit
  def step(model, optimizer):
    loss = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(inputs), targets).mean()
    value, grads = nnx.value_and_grad(loss, argnums=diff)(model)
    optimizer.update(model, nnx.filter_state(grads, nnx.Param))
    jax_fp8.nnx.update_fp8_state(model, grads)
    return value

  losses = [float(step(model, optimizer)) for _ in range(30)]
  assert losses[-1] < 0.5 * losses[0]  # task-level, as above
  assert float(model.blocks[0]["up"].fp8_state.get_value().x.steps) == 30.0


def test_filter():
  x = jnp.ones((2, 256))
  paths = lambda variables: sorted(variables.get("fp8_state", {}))

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      x = nn.Dense(256, name="a")(inputs=x)  # the input by name is converted too
      x = nn.Dense(24, name="odd")(x)  # N not a multiple of 16: stays
      return nn.Dense(256, name="head")(nn.Dense(128, name="b")(x[..., :16]))

  assert paths(convert(Net(), RECIPE).init(jax.random.key(0), x)) == ["a", "b"]
  assert paths(convert(Net(), RECIPE, include="^a$").init(jax.random.key(0), x)) == ["a"]
  assert paths(convert(Net(), RECIPE, exclude=None).init(jax.random.key(0), x)) == ["a", "b",
                                                                                  "head"]
  # BlockScaling needs 128s: b's K is 16; stateless, so the selection shows in the outputs.
  block = convert(Net(), jax_fp8.BlockScaling(), include="^b$")
  v = block.init(jax.random.key(0), x)
  assert "fp8_state" not in v
  assert np.array_equal(block.apply(v, x), Net().apply(v, x))
  assert convert(Net()).recipe == default_recipe()  # test_convert_report: its value
  # Applied with the params alone, a converted layer says where its rings live.
  v = convert(Net(), RECIPE).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match='keeps its scale rings in the "fp8_state" collection.*'
                                       'the layer at /a: apply with the variables init'):
    convert(Net(), RECIPE).apply({"params": v["params"]}, x)


def test_linen_methods_by_name():
  """A converted linen model's other methods run converted by name: ``method="encode"`` then
  ``"decode"`` give ``__call__``'s output bit for bit, init by a method creates that method's
  layers' FP8 state alone; a name the model has no method of, or a method passed as a function,
  is an AttributeError that says to pass methods by name."""

  class Net(nn.Module):
    def setup(self):
      self.enc, self.dec = nn.Dense(128), nn.Dense(128)

    def __call__(self, x):
      return self.decode(self.encode(x))

    def encode(self, x):
      return self.enc(x)

    def decode(self, h):
      return self.dec(h)

  model = convert(Net(), RECIPE)
  x = jax.random.normal(jax.random.key(1), (64, 128))
  v = model.init(jax.random.key(0), x)
  h = model.apply(v, x, method="encode")
  np.testing.assert_array_equal(model.apply(v, h, method="decode"), model.apply(v, x))
  assert not np.array_equal(h, Net().apply({"params": v["params"]}, x, method="encode"))
  assert sorted(model.init(jax.random.key(0), x, method="encode")["fp8_state"]) == ["enc"]
  with pytest.raises(AttributeError, match='"Converted" object has no attribute "nope".*Net '
                                           "has no method 'nope'; pass the model's methods by"):
    model.apply(v, x, method="nope")
  with pytest.raises(AttributeError, match="no method 'dec'; pass the model's methods by name"):
    model.apply(v, h, method=Net.decode)  # a function: runs on the wrapper, which has no dec


def test_bad_arguments():
  cases = [
      (lambda: convert(lambda x: x), TypeError, "model must be a flax.linen.Module or a flax.nnx"),
      (lambda: convert(nn.Dense(16), "hybrid"), TypeError, "recipe must be None"),
      (lambda: convert(nn.Dense(16), include=3), TypeError, "include must be a regular"),
      (lambda: convert(nn.Dense(16), exclude="("), ValueError, "exclude is not a valid"),
  ]
  for fn, exc, match in cases:
    with pytest.raises(exc, match=match):
      fn()


def test_fp8_weights_on_a_converted_model(rng):
  """quantize_weights on a converted model's parameters (the layers it converted): on a fresh
  state the forward is the same bits as with the float kernels (both quantize the kernel
  with its current amax)."""
  inputs, _ = data(rng)
  fp8 = convert(LinenLM(), RECIPE)
  v = fp8.init(jax.random.key(0), inputs)
  select = lambda path, kernel: "lm_head" not in path and "MultiHead" not in path
  q = jax_fp8.quantize_weights(v["params"], RECIPE, select=select)
  assert isinstance(q["block_0"]["Dense_0"]["kernel"], jax_fp8.Fp8Weight)
  np.testing.assert_array_equal(np.asarray(fp8.apply({**v, "params": q}, inputs)),
                                np.asarray(fp8.apply(v, inputs)))


def test_nnx_shared_top_level_and_custom_layers():
  class Shared(nnx.Module):
    def __init__(self, rngs):
      self.a = nnx.Linear(D, D, rngs=rngs)
      self.b = self.a
      self.custom = nnx.Linear(D, D, dot_general=lambda *a, **k: jax.lax.dot_general(*a, **k),
                               rngs=rngs)

  m = convert(Shared(nnx.Rngs(0)), RECIPE)
  assert isinstance(m.a, jax_fp8.nnx.Linear) and m.a is m.b  # shared stays shared
  assert type(m.custom) is nnx.Linear  # its own dot_general: left as it is
  top = nnx.Linear(D, D, rngs=nnx.Rngs(0))
  converted = convert(top, RECIPE)
  assert isinstance(converted, jax_fp8.nnx.Linear) and converted.kernel is top.kernel
