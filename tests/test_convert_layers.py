"""jax_fp8.convert beyond Dense / Linear: attention and einsum layers (nnx.LinearGeneral inside
nnx.MultiHeadAttention, nnx.Einsum, linen nn.Einsum) as one FP8 GEMM in every recipe, with
their gradients; contractions that are no GEMM left as they are; stacked layers (nnx.vmap built,
nnx.scan applied; linen nn.scan / nn.vmap) training with one ring and one stochastic rounding
stream a layer."""

import dataclasses

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
from jax_fp8.convert import convert, nnx_contraction_plan

D, HEADS, HEAD_DIM, LEN = 128, 4, 32, 8  # 128s: BlockScaling's K and N
DIFF = nnx.DiffState(0, (nnx.Param, jax_fp8.nnx.Fp8State))
RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.CurrentScaling(),
           "block": jax_fp8.BlockScaling(), "mxfp8": jax_fp8.MXFP8BlockScaling(),
           "nvfp4": jax_fp8.NVFP4BlockScaling()}
E4M3 = roundoff("e4m3")
E2M1 = 2.0**-2  # NVFP4's elements: half the spacing above 1 (1, 1.5, 2, ...)


def tol(layers: int, u: float = E4M3) -> float:
  """Normwise relative error of an output past ``layers`` converted layers on its deepest path
  (each quantizes its input and kernel to e4m3, or NVFP4's E2M1 for u=E2M1: two roundings a
  layer)."""
  return normwise(*[u] * (2 * layers))


def rel(a, b):
  a, b = np.asarray(a), np.asarray(b)
  return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def is_ring(v):
  return isinstance(v, jax_fp8.ScaleRing)


@nnx.jit
def nnx_apply(model, x):
  """An NNX model's output, jitted: one program, where eagerly each operation compiles."""
  return model(x)


@nnx.jit
def nnx_step(model, optimizer, x, target):
  """One training step of an NNX model (mean squared error): the loss and the gradients."""
  value, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - target) ** 2),
                                    argnums=DIFF)(model)
  optimizer.update(model, nnx.filter_state(grads, nnx.Param))
  jax_fp8.nnx.update_fp8_state(model, grads)
  return value, grads


class AttentionModel(nnx.Module):
  """A pre-norm transformer block: nnx.MultiHeadAttention (its query / key / value / out are
  nnx.LinearGeneral) and an nnx.Linear MLP, then a head."""

  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(HEADS, D, decode=False, rngs=rngs)
    self.up = nnx.Linear(D, 2 * D, rngs=rngs)
    self.down = nnx.Linear(2 * D, D, rngs=rngs)
    self.head = nnx.Linear(D, 16, rngs=rngs)

  def __call__(self, x):
    h = self.norm(x)
    x = x + self.attention(h, mask=nnx.make_causal_mask(x[..., 0]))
    x = x + self.down(nnx.gelu(self.up(x)))
    return self.head(x)


def test_nnx_attention(rng):
  x = jnp.asarray(rng.standard_normal((4, LEN, D)), jnp.float32)
  y_true = jnp.asarray(rng.standard_normal((4, LEN, 16)), jnp.float32)
  model = AttentionModel(nnx.Rngs(0))
  reference = nnx.clone(model)
  kernels = {n: getattr(model.attention, n).kernel for n in ("query", "key", "value", "out")}
  assert convert(model, jax_fp8.DelayedScaling()) is model
  for name, kernel in kernels.items():
    layer = getattr(model.attention, name)
    assert type(layer) is jax_fp8.nnx.LinearGeneral, name
    assert layer.kernel is kernel  # the same variable: checkpoints and partitioning fit
  assert model.attention.query.kernel.shape == (D, HEADS, HEAD_DIM)
  assert model.attention.out.kernel.shape == (HEADS, HEAD_DIM, D)
  assert type(model.head) is nnx.Linear
  # Deepest path: q / k / v, out, up, down.
  assert rel(nnx_apply(model, x), nnx_apply(reference, x)) < tol(4)

  # One step of SGD: the gradients (those of the loss before it) and the update.
  optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
  before = np.asarray(model.attention.query.kernel.get_value())
  _, grads = nnx_step(model, optimizer, x, y_true)
  _, grads_ref = nnx.jit(nnx.value_and_grad(lambda m: jnp.mean((m(x) - y_true) ** 2)))(reference)
  g = grads["attention"]["query"]["kernel"].get_value()
  g_ref = grads_ref["attention"]["query"]["kernel"].get_value()
  # The query kernel's gradient carries the forward's error (the loss gradient: eight e4m3
  # roundings on the deepest path) and the backward's: an e5m2 gradient and an e4m3 operand in
  # each of down's, up's and out's dgrads and in query's wgrad.
  assert rel(g, g_ref) < normwise(*[E4M3] * 12, *[roundoff("e5m2")] * 4)
  np.testing.assert_allclose(np.asarray(model.attention.query.kernel.get_value()),
                             before - 0.1 * np.asarray(g), rtol=1e-6, atol=1e-7)
  rings = jax.tree.leaves(nnx.state(model.attention, jax_fp8.nnx.Fp8State), is_leaf=is_ring)
  assert len(rings) == 4 * 3 and all(float(r.steps) == 1.0 for r in rings)


def _gemm_twin(x, kernel, bias, perm, n_contract, features, recipe, state, key, out_perm=None):
  """The layer's output computed by jax_fp8.linear on the reshaped operands: the oracle."""
  lead = x.shape[:x.ndim - n_contract]
  k2 = (kernel if perm is None else jnp.transpose(kernel, perm)).reshape(-1, int(np.prod(features)))
  y = jax_fp8.linear(x.reshape(*lead, -1), k2, None if bias is None else bias.reshape(-1),
                     state=state, recipe=recipe, key=key).reshape(*lead, *features)
  return y if out_perm is None else jnp.transpose(y, out_perm)


# (layer, input shape, kernel perm or None, contracted axes, output features, output perm)
NNX_LAYERS = {
    "linear_general_in": (lambda r: jax_fp8.nnx.LinearGeneral(D, (HEADS, HEAD_DIM), recipe=r,
                                                               rngs=nnx.Rngs(1)),
                          (2, LEN, D), None, 1, (HEADS, HEAD_DIM), None),
    "linear_general_out": (lambda r: jax_fp8.nnx.LinearGeneral(
        (HEADS, HEAD_DIM), D, axis=(-2, -1), recipe=r, rngs=nnx.Rngs(1)),
        (2, LEN, HEADS, HEAD_DIM), None, 2, (D,), None),
    # Gemma's key-value projection: the kernel's contracted axis in the middle, its leading
    # axis (key or value) leading the output.
    "einsum_permuted": (lambda r: jax_fp8.nnx.Einsum(
        "BSD,CKDH->CBSKH", (2, HEADS, D, HEAD_DIM), (2, HEADS, HEAD_DIM), recipe=r,
        bias_init=nnx.initializers.normal(), rngs=nnx.Rngs(1)),
        (2, LEN, D), (2, 0, 1, 3), 1, (2, HEADS, HEAD_DIM), (2, 0, 1, 3, 4)),
}


@pytest.mark.parametrize("recipe", RECIPES.values(), ids=RECIPES.keys())
def test_contraction_layers_are_linear(rng, recipe):
  """Each contraction layer (NNX LinearGeneral / Einsum; linen nn.Einsum converted) is
  jax_fp8.linear on the reshaped (and, for a permuted kernel, transposed) operands, bit for
  bit, in its output and in the gradients of its input, kernel and bias (and rings)."""
  key = jax.random.key(7)  # the stream's first draw is fold_in(key, 0)
  for name, (make, shape, perm, n_contract, features, out_perm) in NNX_LAYERS.items():
    layer = make(recipe)
    if recipe.draws_key:
      layer.rngs = nnx.RngStream(key, tag="stochastic_rounding")
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    out_shape = (*shape[:len(shape) - n_contract], *features)
    g = jnp.asarray(rng.standard_normal(
        out_shape if out_perm is None else [out_shape[a] for a in out_perm]), jnp.float32)
    bias = None if layer.bias is None else layer.bias.get_value()
    state = None if layer.fp8_state is None else layer.fp8_state.get_value()

    def twin(x, kernel, bias, state):
      return jnp.sum(g * _gemm_twin(x, kernel, bias, perm, n_contract, features, recipe, state,
                                    jax.random.fold_in(key, 0) if recipe.draws_key else None,
                                    out_perm))

    want = jax.value_and_grad(twin, argnums=(0, 1, 2, 3))(x, layer.kernel.get_value(), bias,
                                                          state)
    value, (g_layer, g_x) = nnx.value_and_grad(lambda m, x: jnp.sum(g * m(x)),
                                               argnums=(DIFF, 1))(layer, x)
    assert float(value) == float(want[0]), name
    np.testing.assert_array_equal(np.asarray(g_x), np.asarray(want[1][0]), err_msg=name)
    np.testing.assert_array_equal(np.asarray(g_layer["kernel"].get_value()),
                                  np.asarray(want[1][1]), err_msg=name)
    if bias is not None:
      np.testing.assert_array_equal(np.asarray(g_layer["bias"].get_value()),
                                    np.asarray(want[1][2]), err_msg=name)
    if state is not None:
      for a, b in zip(jax.tree.leaves(g_layer["fp8_state"].get_value()),
                      jax.tree.leaves(want[1][3])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)

  # linen nn.Einsum, converted, with its einsum given at the call. (Its stochastic rounding key
  # comes from linen's rng folding, which the twin cannot name: rounding to nearest here; the
  # NNX layers above check the key's path.)
  if recipe.draws_key:
    recipe = dataclasses.replace(recipe, stochastic_rounding=False)
  x = jnp.asarray(rng.standard_normal((2, LEN, D)), jnp.float32)
  fp8 = convert(nn.Einsum((HEADS, D, HEAD_DIM), bias_init=nn.initializers.normal()), recipe)
  v = fp8.init(jax.random.key(0), x, "BTD,NDH->BTNH")
  assert jax.tree.map(jnp.shape, v["params"]) == {"kernel": (HEADS, D, HEAD_DIM),
                                                  "bias": (HEADS, HEAD_DIM)}
  assert ("fp8_state" in v) == recipe.stateful
  g = jnp.asarray(rng.standard_normal((2, LEN, HEADS, HEAD_DIM)), jnp.float32)

  def linen_loss(params, x):
    return jnp.sum(g * fp8.apply({**v, "params": params}, x, einsum_str="BTD,NDH->BTNH"))

  def linen_twin(params, x):
    state = v["fp8_state"]["linear"] if recipe.stateful else None
    return jnp.sum(g * _gemm_twin(x, params["kernel"], params["bias"], (1, 0, 2), 1,
                                  (HEADS, HEAD_DIM), recipe, state, None))

  got = jax.value_and_grad(linen_loss, argnums=(0, 1))(v["params"], x)
  want = jax.value_and_grad(linen_twin, argnums=(0, 1))(v["params"], x)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# (einsum, kernel shape, input shape): einsums whose outputs put the axes in other orders.
OUTPUT_ORDERS = [("BSD,CKDH->CBSKH", (2, HEADS, D, HEAD_DIM), (2, LEN, D)),
                 ("btd,dk->tbk", (D, 16), (2, LEN, D)),
                 ("...d,cdf->c...f", (2, D, 16), (2, 3, LEN, D)),
                 ("bi,ij->jb", (D, 32), (LEN, D))]


def test_einsum_output_orders(rng):
  """An einsum whose output is not the input's other axes then the kernel's (a kernel axis
  leading, batch axes swapped, "..." inside) computes the einsum: held to jnp.einsum below
  fp8_min_intensity (the GEMM's operands unquantized, at XLA's default precision, as the
  layer's: TF32 on a GPU), so only the axes' order is tested."""
  recipe = jax_fp8.DelayedScaling(fp8_min_intensity=1e9)
  for spec, kernel_shape, shape in OUTPUT_ORDERS:
    layer = jax_fp8.nnx.Einsum(spec, kernel_shape, recipe=recipe, rngs=nnx.Rngs(0))
    x = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    want = jnp.einsum(spec, x, layer.kernel.get_value())
    np.testing.assert_allclose(nnx_apply(layer, x), want, rtol=1e-5, atol=1e-5, err_msg=spec)
  with pytest.raises(ValueError, match="inputs must have 3 axes.*BS and the contracted"):
    jax_fp8.nnx.Einsum(*OUTPUT_ORDERS[0][:2], rngs=nnx.Rngs(0))(jnp.ones((2, 2, LEN, D)))


class EinsumMlp(nnx.Module):
  """An MLP of nnx.Einsum layers (a Gemma-style gated one), and a batched einsum that is no
  GEMM."""

  def __init__(self, rngs):
    self.gating = nnx.Einsum("...d,cdf->...cf", (2, D, 2 * D), rngs=rngs)
    self.linear = nnx.Einsum("...f,fd->...d", (2 * D, D), (D,), rngs=rngs)
    self.mix = nnx.Einsum("btd,tdk->btk", (LEN, D, D), rngs=rngs)  # t batched: left

  def __call__(self, x):
    h = self.gating(x)
    return self.mix(self.linear(nnx.gelu(h[..., 0, :]) * h[..., 1, :]))


def test_nnx_einsum_mlp(rng):
  x = jnp.asarray(rng.standard_normal((4, LEN, D)), jnp.float32)
  target = jnp.asarray(rng.standard_normal((4, LEN, D)), jnp.float32)
  model = EinsumMlp(nnx.Rngs(0))
  reference = nnx.clone(model)
  assert "batched" in nnx_contraction_plan(model.mix)
  convert(model, jax_fp8.DelayedScaling())
  assert type(model.gating) is jax_fp8.nnx.Einsum and type(model.linear) is jax_fp8.nnx.Einsum
  assert type(model.mix) is nnx.Einsum
  assert rel(nnx_apply(model, x), nnx_apply(reference, x)) < tol(2)

  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  _, grads = nnx_step(model, optimizer, x, target)
  assert all(np.linalg.norm(np.asarray(grads[n]["kernel"].get_value())) > 0
             for n in ("gating", "linear", "mix"))
  rings = jax.tree.leaves(nnx.state(model, jax_fp8.nnx.Fp8State), is_leaf=is_ring)
  assert len(rings) == 2 * 3 and all(float(r.steps) == 1.0 for r in rings)
  # The gating ring saw x: its newest amax is x's.
  assert float(model.gating.fp8_state.get_value().x.amax_history[0]) == np.max(np.abs(
      np.asarray(x)))


class LinenEinsumModel(nn.Module):
  @nn.compact
  def __call__(self, x):
    q = nn.Einsum((HEADS, D, HEAD_DIM), "BTD,NDH->BTNH", name="query")(x)
    y = nn.Einsum((HEADS, HEAD_DIM, D), "BTNH,NHD->BTD", name="out")(jnp.tanh(q))
    return nn.Einsum((LEN, D, D), "btd,tdk->btk", name="batched")(y)  # no GEMM: left


def test_linen_einsum(rng):
  x = jnp.asarray(rng.standard_normal((2, LEN, D)), jnp.float32)
  model, fp8 = LinenEinsumModel(), convert(LinenEinsumModel(), jax_fp8.DelayedScaling())
  y0, v0 = jax.jit(model.init_with_output)(jax.random.key(0), x)
  y, v = jax.jit(fp8.init_with_output)(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, v["params"]) == jax.tree.map(jnp.shape, v0["params"])
  for a, b in zip(jax.tree.leaves(v["params"]), jax.tree.leaves(v0["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # same initializers
  assert sorted(v["fp8_state"]) == ["out", "query"]
  assert rel(y, y0) < tol(2)  # the outputs of init, as apply gives them
  grads, state_grads = jax.jit(jax.grad(lambda p, s: jnp.sum(
      fp8.apply({"params": p, "fp8_state": s}, x) ** 2), argnums=(0, 1)))(v["params"],
                                                                          v["fp8_state"])
  assert np.linalg.norm(np.asarray(grads["query"]["kernel"])) > 0
  state = jax.jit(jax_fp8.update_state)(v["fp8_state"], state_grads)
  assert float(state["query"]["linear"].x.amax_history[0]) == np.max(np.abs(np.asarray(x)))


def test_nnx_unmapped_layers_are_left():
  rngs = nnx.Rngs(0)
  cases = {
      "batch_axis": nnx.LinearGeneral(D, D, batch_axis={0: 2}, rngs=rngs),
      "positive_axis": nnx.LinearGeneral(D, D, axis=1, rngs=rngs),
      "sum": nnx.Einsum("btd,dk->bk", (D, D), rngs=rngs),
      "leading": nnx.Einsum("dbt,dk->btk", (D, D), rngs=rngs),
  }
  reasons = {"batch_axis": "batch dims", "positive_axis": "not negative",
             "sum": "sums an axis", "leading": "trailing axes"}
  for name, layer in cases.items():
    assert reasons[name] in nnx_contraction_plan(layer), name
    assert convert(layer, jax_fp8.DelayedScaling()) is layer, name
  with pytest.raises(ValueError, match="batched contraction.*contractions of the input's trailing axes"):
    jax_fp8.nnx.Einsum("btd,tdk->btk", (LEN, D, D), rngs=rngs)
  with pytest.raises(ValueError, match="not the input's trailing axes"):
    jax_fp8.nnx.LinearGeneral(D, D, axis=0, rngs=rngs)(jnp.ones((D, 4)))
  # cast_kernels casts [K, N] kernels; a multi-axis one cast as a stack would be wrong.
  layer = jax_fp8.nnx.LinearGeneral(D, (32, 32), recipe=RECIPES["current"], rngs=rngs)
  nnx.update(layer, jax_fp8.nnx.cast_kernels(nnx.state(layer, nnx.Param), None,
                                             RECIPES["current"]))
  with pytest.raises(TypeError, match="kernel is a CastKernel.*leave LinearGeneral / Einsum"):
    layer(jnp.ones((4, D)))


LAYERS = 3


class NnxStack(nnx.Module):
  """Blocks made by nnx.vmap (stacked kernels [L, ...]) and applied by nnx.scan, as Flax's
  scan-over-layers example: an nnx.Linear and an attention-style nnx.LinearGeneral pair."""

  def __init__(self, rngs):
    @nnx.split_rngs(splits=LAYERS)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(rngs):
      return nnx.Dict(up=nnx.Linear(D, D, rngs=rngs),
                      heads=nnx.LinearGeneral(D, (HEADS, HEAD_DIM), rngs=rngs),
                      merge=nnx.LinearGeneral((HEADS, HEAD_DIM), D, axis=(-2, -1), rngs=rngs))
    self.blocks = make(rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
    def body(block, h):
      return jnp.tanh(block["merge"](block["heads"](block["up"](h))))
    return body(self.blocks, x)


@pytest.mark.parametrize("recipe", [RECIPES["delayed"], RECIPES["nvfp4"]],
                         ids=["delayed", "nvfp4"])
def test_nnx_vmap_scan_stack(rng, recipe):
  """convert of nnx.vmap-built layers: stacked rings (one a layer, leading axis L) and
  stochastic rounding streams (one a layer, as nnx.Dropout forks its own); nnx.scan over them
  trains two steps, every layer's ring advancing with its own amaxes."""
  x = jnp.asarray(rng.standard_normal((16, D)), jnp.float32) * 4
  target = jnp.asarray(rng.standard_normal((16, D)), jnp.float32) * 0.5
  model = NnxStack(nnx.Rngs(0))
  reference = nnx.clone(model)
  convert(model, recipe, rngs=nnx.Rngs(stochastic_rounding=5) if recipe.draws_key else None)
  blocks = model.blocks
  assert [type(blocks[n]).__name__ for n in ("up", "heads", "merge")] == [
      "Linear", "LinearGeneral", "LinearGeneral"]
  assert isinstance(blocks["up"], jax_fp8.nnx.Linear)
  assert blocks["heads"].kernel.shape == (LAYERS, D, HEADS, HEAD_DIM)
  u = E2M1 if isinstance(recipe, jax_fp8.NVFP4BlockScaling) else E4M3
  assert rel(nnx_apply(model, x), nnx_apply(reference, x)) < tol(3 * LAYERS, u)
  optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
  losses = [float(nnx_step(model, optimizer, x, target)[0]) for _ in range(2)]
  assert np.all(np.isfinite(losses)) and losses[1] < losses[0]
  if recipe.stateful:
    rings = jax.tree.leaves(nnx.state(model, jax_fp8.nnx.Fp8State), is_leaf=is_ring)
    assert len(rings) == 3 * 3
    for r in rings:
      assert r.amax_history.shape == (LAYERS, 16)
      np.testing.assert_array_equal(np.asarray(r.steps), [2.0] * LAYERS)
    # Layer 0's up sees x; the later ones tanh outputs (amax <= 1): each ring its own.
    amax = np.asarray(blocks["up"].fp8_state.get_value().x.amax_history[:, 0])
    assert amax[0] == np.max(np.abs(np.asarray(x))) and np.all(amax[1:] <= 1.0)
  else:
    for name in ("up", "heads", "merge"):
      stream = blocks[name].rngs
      keys = np.asarray(jax.random.key_data(stream.key.get_value()))
      assert keys.shape[0] == LAYERS and len({k.tobytes() for k in keys}) == LAYERS, name
      # One draw a call: the comparison above and two steps.
      np.testing.assert_array_equal(np.asarray(stream.count.get_value()), [3] * LAYERS)
    streams = {np.asarray(jax.random.key_data(blocks[n].rngs.key.get_value())).tobytes()
               for n in ("up", "heads", "merge")}
    assert len(streams) == 3  # each layer its own stream


class LinenBlock(nn.Module):
  @nn.compact
  def __call__(self, h, _):
    q = nn.Einsum((D, HEADS, HEAD_DIM), "bd,dnh->bnh", name="heads")(h)
    return jnp.tanh(nn.DenseGeneral(D, axis=(-2, -1), name="merge")(q)), None


class LinenStack(nn.Module):
  vmap: bool = False

  @nn.compact
  def __call__(self, x):
    kw = dict(variable_axes={"params": 0, "fp8_state": 0},
              split_rngs={"params": True, "stochastic_rounding": True})
    if self.vmap:  # each layer on its own slice of the input
      return nn.vmap(LinenBlock, in_axes=(0, None), axis_size=LAYERS, **kw)()(x, None)[0]
    return nn.scan(LinenBlock, length=LAYERS, **kw)()(x, None)[0]


@pytest.mark.parametrize("recipe", [RECIPES["delayed"], RECIPES["nvfp4"]],
                         ids=["delayed", "nvfp4"])
@pytest.mark.parametrize("vmap", [False, True], ids=["scan", "vmap"])
def test_linen_stack(rng, recipe, vmap):
  """A converted linen nn.scan / nn.vmap stack ("fp8_state" in variable_axes, the
  "stochastic_rounding" stream split): stacked rings that train two steps, one a layer."""
  x = jnp.asarray(rng.standard_normal((LAYERS, 16, D) if vmap else (16, D)), jnp.float32) * 4
  model, fp8 = LinenStack(vmap), convert(LinenStack(vmap), recipe)
  y0, v0 = jax.jit(model.init_with_output)(jax.random.key(0), x)
  y, v = jax.jit(fp8.init_with_output)(jax.random.key(0), x)
  assert jax.tree.map(jnp.shape, v["params"]) == jax.tree.map(jnp.shape, v0["params"])
  u = E2M1 if isinstance(recipe, jax_fp8.NVFP4BlockScaling) else E4M3
  assert rel(y, y0) < tol(2 * LAYERS, u)  # the outputs of init, as apply gives them
  tx = optax.adam(1e-3)

  @jax.jit
  def step(params, opt, state, key):
    def loss(params, state):
      variables = {"params": params, **({"fp8_state": state} if state else {})}
      y = fp8.apply(variables, x, rngs={"stochastic_rounding": key})
      return jnp.mean((y - 0.5) ** 2)
    value, (g, sg) = jax.value_and_grad(loss, argnums=(0, 1))(params, state)
    updates, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, updates), opt, jax_fp8.update_state(state, sg), value

  params, opt, state = v["params"], tx.init(v["params"]), v.get("fp8_state", {})
  losses = []
  for i in range(2):
    params, opt, state, value = step(params, opt, state, jax.random.key(i))
    losses.append(float(value))
  assert np.all(np.isfinite(losses)) and losses[1] < losses[0]
  if recipe.stateful:
    rings = jax.tree.leaves(state, is_leaf=is_ring)
    assert len(rings) == 2 * 3
    for r in rings:
      np.testing.assert_array_equal(np.asarray(r.steps), [2.0] * LAYERS)
    (block,) = state.values()
    amax = np.asarray(block["heads"]["linear"].x.amax_history[:, 0])
    if vmap:  # each layer its slice of x
      np.testing.assert_array_equal(amax, np.max(np.abs(np.asarray(x)), axis=(1, 2)))
    else:  # layer 0 sees x, the later ones tanh outputs
      assert amax[0] == np.max(np.abs(np.asarray(x))) and np.all(amax[1:] <= 1.0)
