"""``cast_kernel`` / ``jax_fp8.flax.cast_kernels``: kernels quantized once per step for the
microbatches of a ``lax.scan``. The cast layers must compute exactly what the uncast ones do
(the same bytes are quantized, only once), and the kernels' quantization must leave the
scan."""

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8
import jax_fp8.flax as jf
import jax_fp8.nnx as jn

MICROBATCHES = 3
RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.CurrentScaling(),
           "block": jax_fp8.BlockScaling()}
STATES = {"linear": jax_fp8.LinearState.create, "multi_linear":
          lambda recipe: jax_fp8.MultiLinearState.create(2, recipe), "mlp": jax_fp8.MlpState.create}
# The next state under jit: one program a state's structure, where eagerly each ring's
# operations compile.
update_state = jax.jit(jax_fp8.update_state)


def _problem(rng, op):
  """x [microbatches, 32, 128] and the op's kernels (f32, K, N, F, D = 128 or 256)."""
  x = jnp.asarray(rng.standard_normal((MICROBATCHES, 32, 128)), jnp.float32)
  x = x * jnp.asarray([1.0, 4.0, 0.5])[:, None, None]  # the microbatches' amaxes differ
  shapes = {"linear": [(128, 128)], "multi_linear": [(128, 128), (128, 256)],
            "mlp": [(128, 256), (128, 128)]}[op]
  return x, [jnp.asarray(rng.standard_normal(s) * 0.05, jnp.float32) for s in shapes]


def _call(op, x, kernels, state, recipe):
  if op == "linear":
    return jax_fp8.linear(x, kernels[0], state=state, recipe=recipe)
  if op == "multi_linear":
    return sum(jnp.sum(y) for y in jax_fp8.multi_linear(x, kernels, state=state, recipe=recipe))
  return jax_fp8.mlp(x, *kernels, state=state, recipe=recipe)


def _kernel_rings(op, state):
  if state is None:
    return (None, None)
  names = {"linear": ("kernel",), "multi_linear": ("kernels",), "mlp": ("kernel_in", "kernel_out")}
  rings = tuple(getattr(state, name) for name in names[op])
  return rings[0] if op == "multi_linear" else rings


def _scanned_loss(op, x, recipe, cast: bool):
  def loss(kernels, state):
    if cast:
      kernels = [jax_fp8.cast_kernel(k, r, recipe=recipe)
                 for k, r in zip(kernels, _kernel_rings(op, state))]

    def body(acc, mb):
      xm, sm = mb
      return acc + jnp.sum(_call(op, xm, kernels, sm, recipe) ** 2), None
    shared = None if state is None else jax_fp8.share(state, MICROBATCHES)
    return jax.lax.scan(body, 0.0, (x, shared))[0]
  return loss


@pytest.mark.parametrize("op", ["linear", "multi_linear", "mlp"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_cast_matches_the_uncast_layer(platform, rng, op, name):
  """The loss, the kernels' gradients and the next state are bit for bit those of the layer
  quantizing its kernel in every microbatch."""
  recipe = RECIPES[name]
  x, kernels = _problem(rng, op)
  state = STATES[op](recipe) if name == "delayed" else None
  results = []
  for cast in (False, True):
    loss = jax.jit(jax.value_and_grad(_scanned_loss(op, x, recipe, cast), argnums=(0, 1)))
    value, (grads, state_grads) = loss(kernels, state)
    nxt = None if state is None else update_state(state, state_grads)
    results.append((value, grads, nxt))
  assert np.isfinite(float(results[0][0]))
  for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  if state is not None:  # each kernel ring advanced once, by the kernel's amax
    for ring, kernel in zip(_kernel_rings(op, results[1][2]), kernels):
      assert float(ring.steps) == 1
      assert float(ring.amax_history[0]) == np.max(np.abs(np.asarray(kernel)))


def _ffi_calls(jaxpr, in_scan=False, found=None):
  """{in a scan's body (bool): [FFI target names]} over a jaxpr and its sub-jaxprs."""
  found = {False: [], True: []} if found is None else found
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "ffi_call":
      found[in_scan].append(eqn.params["target_name"])
    for param in eqn.params.values():
      sub = getattr(param, "jaxpr", param)
      if hasattr(sub, "eqns"):
        _ffi_calls(sub, in_scan or eqn.primitive.name == "scan", found)
  return found


@pytest.mark.parametrize("name", list(RECIPES))
def test_kernels_leave_the_scan(rng, name):
  """Differentiated under DelayedScaling, the scans over the microbatches hold one
  quantization fewer per kernel, and outside them each kernel is quantized once. Under the
  stateless recipes JAX's partial evaluation of the scan already hoists the kernels'
  quantizations (they depend on the kernel alone), and the cast leaves the count as it was."""
  recipe = RECIPES[name]
  x, kernels = _problem(rng, "mlp")
  state = STATES["mlp"](recipe) if name == "delayed" else None
  calls = [_ffi_calls(jax.make_jaxpr(jax.grad(_scanned_loss("mlp", x, recipe, cast),
                                              argnums=(0, 1)))(kernels, state).jaxpr)
           for cast in (False, True)]
  assert len(calls[1][False]) == len(kernels)  # outside the scans: each kernel's, once
  moved = len(kernels) if name == "delayed" else 0
  assert len(calls[1][True]) == len(calls[0][True]) - moved
  assert len(calls[0][False]) == len(kernels) - moved


def test_forward_only_and_below_min_intensity(rng):
  """Without a gradient the cast layer gives the uncast one's output. Below
  ``fp8_min_intensity`` the layer runs XLA's GEMM on the cast's float kernel, and the kernel's
  ring is left as it is, as the uncast layer leaves it: no FP8 GEMM used the cast."""
  x, (kernel,) = _problem(rng, "linear")
  state = jax_fp8.LinearState.create()
  cast = jax_fp8.cast_kernel(kernel, state.kernel)
  np.testing.assert_array_equal(jax_fp8.linear(x, cast, state=state),
                                jax_fp8.linear(x, kernel, state=state))
  high = jax_fp8.DelayedScaling(fp8_min_intensity=1e9)
  np.testing.assert_array_equal(
      jax_fp8.linear(x, jax_fp8.cast_kernel(kernel, state.kernel, recipe=high), state=state,
                     recipe=high), x @ kernel)
  nxt = [update_state(state, jax.jit(jax.grad(_scanned_loss("linear", x, high, cast),
                                              argnums=1))([kernel], state))
         for cast in (False, True)]
  for got, want, kept in zip(jax.tree.leaves(nxt[1]), jax.tree.leaves(nxt[0]),
                             jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, kept)


class _Block(nn.Module):
  recipe: jax_fp8.DelayedScaling

  @nn.compact
  def __call__(self, x, _):
    q, k = jf.MultiDense((128, 128), recipe=self.recipe, norm="rmsnorm")(x)
    h = jf.Mlp(128, recipe=self.recipe)(q * k)
    return x + jf.Dense(128, recipe=self.recipe)(h), None


class _Model(nn.Module):
  recipe: jax_fp8.DelayedScaling

  @nn.compact
  def __call__(self, x):
    x, _ = nn.scan(_Block, variable_axes={"params": 0, "fp8_state": 0},
                   split_rngs={"params": True}, length=2)(self.recipe, name="layers")(x, None)
    return nn.Dense(8, name="head")(x)  # a Flax layer: its kernel stays float


@pytest.mark.parametrize("name", list(RECIPES))
def test_flax_cast_kernels(platform, rng, name):
  """``cast_kernels`` over a linen model (Dense, MultiDense and Mlp stacked by nn.scan, a Flax
  nn.Dense head): the cast model's loss and gradients are the uncast model's, bit for bit."""
  recipe = RECIPES[name]
  model = _Model(recipe)
  x = jnp.asarray(rng.standard_normal((MICROBATCHES, 16, 128)), jnp.float32)
  variables = jax.jit(model.init)(jax.random.key(0), x[0])
  params, state = variables["params"], variables.get("fp8_state")
  keep_head = {} if state is not None else {"select": lambda path, kernel: "head" not in path}

  def cast_of(params, state):  # traced (jax.eval_shape): the casts' structure, none compiled
    cast = jf.cast_kernels(params, state, recipe, **keep_head)
    assert cast["head"]["kernel"] is params["head"]["kernel"]
    return cast
  cast = jax.eval_shape(cast_of, params, state)
  assert isinstance(cast["layers"]["Mlp_0"]["kernel_in"], jax_fp8.CastKernel)
  assert cast["layers"]["Mlp_0"]["kernel_in"].q.shape == (2, 128, 256)

  def loss(params, state, cast):
    used = jf.cast_kernels(params, state, recipe, **keep_head) if cast else params

    def body(acc, mb):
      xm, sm = mb
      variables = {"params": used} if sm is None else {"params": used, "fp8_state": sm}
      return acc + jnp.mean(model.apply(variables, xm) ** 2), None
    shared = None if state is None else jax_fp8.share(state, MICROBATCHES)
    return jax.lax.scan(body, 0.0, (x, shared))[0]
  results = [jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(params, state,
                                                                                 cast)
             for cast in (False, True)]
  for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_flax_cast_kernels_errors(rng):
  """Collections passed at the wrong level, a CastKernel of another shape in a layer, and a
  kernel the recipe cannot cast (its path named) raise; an Fp8Weight leaf stays as it is."""
  recipe = RECIPES["delayed"]
  model = _Model(recipe)
  x = jnp.asarray(rng.standard_normal((16, 128)), jnp.float32)
  variables = jax.jit(model.init)(jax.random.key(0), x)  # one program, not one per op
  params, state = variables["params"], variables["fp8_state"]
  with pytest.raises(ValueError, match="no kernel of params found its ring in fp8_state"):
    jf.cast_kernels(params, {"fp8_state": state}, recipe)
  with pytest.raises(ValueError, match="no kernel of params found its ring in fp8_state"):
    jf.cast_kernels(variables, state, recipe)
  with pytest.raises(ValueError, match=r"head/kernel: [A-Za-z]*Scaling needs K and N multiples of 16"):
    jf.cast_kernels(params, None, RECIPES["current"])
  layer = jf.Dense(128, use_bias=False, recipe=recipe)
  small = jax.jit(layer.init)(jax.random.key(0), x[:, :64])
  ck = jax_fp8.cast_kernel(jnp.ones((128, 128)), small["fp8_state"]["linear"].kernel)
  with pytest.raises(ValueError, match=r"Dense's kernel is a CastKernel of a \[128, 128\] "
                                       r"kernel; the layer's is \[64, 128\]"):
    layer.apply({"params": {"kernel": ck}, "fp8_state": small["fp8_state"]}, x[:, :64])
  weights = {"dense": {"kernel": jax_fp8.quantize_weight(jnp.ones((128, 128)), recipe)}}
  cast = jf.cast_kernels({**params, **weights}, state, recipe)
  assert cast["dense"]["kernel"] is weights["dense"]["kernel"]


class _NnxBlock(nnx.Module):
  def __init__(self, recipe, rngs):
    self.qk = jn.MultiLinear(128, (128, 128), recipe=recipe, norm="rmsnorm", rngs=rngs)
    self.mlp = jn.Mlp(128, 128, recipe=recipe, rngs=rngs)
    self.out = jn.Linear(128, 128, recipe=recipe, rngs=rngs)

  def __call__(self, x):
    q, k = self.qk(x)
    return x + self.out(self.mlp(q * k))


class _NnxModel(nnx.Module):
  """Two _NnxBlocks made by nnx.vmap and applied by a lax.scan over their split state (NNX's
  own transforms refuse variables that an outer jax.grad traces), then a Flax nnx.Linear
  head."""

  def __init__(self, recipe, rngs):
    @nnx.split_rngs(splits=2)
    @nnx.vmap(in_axes=0, out_axes=0)
    def make(rngs):
      return _NnxBlock(recipe, rngs)
    self.layers = make(rngs)
    self.head = nnx.Linear(128, 8, rngs=rngs)

  def __call__(self, x):
    graphdef, layers = nnx.split(self.layers)
    x = jax.lax.scan(lambda h, layer: (nnx.merge(graphdef, layer)(h), None), x, layers)[0]
    return self.head(x)


@pytest.mark.parametrize("name", list(RECIPES))
def test_nnx_cast_kernels(platform, rng, name):
  """``jax_fp8.nnx.cast_kernels`` over an NNX model (Linear, MultiLinear and Mlp made by
  nnx.vmap, a Flax nnx.Linear head) split into params and FP8 state and merged in the
  microbatch scan: the cast model's loss and gradients are the uncast model's, bit for bit."""
  recipe = RECIPES[name]
  delayed = isinstance(recipe, jax_fp8.DelayedScaling)
  graphdef, params, fp8, rest = nnx.split(_NnxModel(recipe, nnx.Rngs(0)), nnx.Param,
                                          jn.Fp8State, ...)
  x = jnp.asarray(rng.standard_normal((MICROBATCHES, 16, 128)), jnp.float32)
  keep_head = {} if delayed else {"select": lambda path, kernel: "head" not in path}
  state = fp8 if delayed else None
  cast = jn.cast_kernels(params, state, recipe, **keep_head)
  assert isinstance(cast["layers"]["mlp"]["kernel_in"].get_value(), jax_fp8.CastKernel)
  assert cast["layers"]["mlp"]["kernel_in"].get_value().q.shape == (2, 128, 256)
  assert cast["head"]["kernel"] is params["head"]["kernel"]

  def loss(params, fp8, cast):
    used = (jn.cast_kernels(params, fp8 if delayed else None, recipe, **keep_head) if cast
            else params)

    def body(acc, mb):
      xm, st = mb
      return acc + jnp.mean(nnx.merge(graphdef, used, st, rest)(xm) ** 2), None
    return jax.lax.scan(body, 0.0, (x, jax_fp8.share(fp8, MICROBATCHES)))[0]
  results = [jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)(params, fp8, cast)
             for cast in (False, True)]
  for got, want in zip(jax.tree.leaves(results[1]), jax.tree.leaves(results[0])):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_nnx_cast_kernels_errors():
  """States of the wrong kind or level, and a kernel the recipe cannot cast (its path named)."""
  recipe = RECIPES["delayed"]
  params, fp8 = nnx.state(_NnxModel(recipe, nnx.Rngs(0)), nnx.Param, jn.Fp8State)
  with pytest.raises(TypeError, match="params must be an nnx.State"):
    jn.cast_kernels([params], fp8, recipe)
  with pytest.raises(TypeError, match=r"params holds a bare float32\[128, 128\] at kernel"):
    jn.cast_kernels({"kernel": jnp.ones((128, 128))}, fp8, recipe)
  with pytest.raises(TypeError, match="fp8_state must be an nnx.State"):
    jn.cast_kernels(params, 3, recipe)
  with pytest.raises(TypeError, match=r"takes the model's Fp8State \(nnx.state\(model, Fp8State"):
    jn.cast_kernels(params, None, recipe)
  with pytest.raises(ValueError, match="no kernel of params found its ring in fp8_state"):
    jn.cast_kernels(params, nnx.state(nnx.Linear(16, 16, rngs=nnx.Rngs(0)), jn.Fp8State), recipe)
  with pytest.raises(ValueError, match="CurrentScaling is stateless: pass fp8_state=None"):
    jn.cast_kernels(params, fp8, RECIPES["current"])
  with pytest.raises(ValueError, match=r"head/kernel: [A-Za-z]*Scaling needs K and N multiples of 16"):
    jn.cast_kernels(params, None, RECIPES["current"])
  with pytest.raises(TypeError, match=r"params holds a Fp8State at layers/mlp/fp8_state: pass "
                                      r"nnx.state\(model, nnx.Param\)"):
    jn.cast_kernels(nnx.merge_state(params, fp8), fp8, recipe)
  with pytest.raises(TypeError, match=r"fp8_state holds a Param at head/bias"):
    jn.cast_kernels(params, nnx.merge_state(params, fp8), recipe)
  cast = jn.cast_kernels(params, fp8, recipe)
  with pytest.raises(TypeError, match="is a CastKernel already"):
    jn.cast_kernels(cast, fp8, recipe)
  kept = jn.cast_kernels(params, fp8, recipe, select=lambda path, kernel: False)
  assert all(a is b for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(params)))
