"""moe_mlp and the MoeMlp layers against an f32 mixture of experts (the same routing, experts
through f32 ragged_dot): values and gradients per recipe within the FP8 formats' bounds,
delayed-scaling state across steps, the sown load-balancing loss, the shared expert, expert
parallelism on CPU devices, and bad input."""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import LLVM_UNOPTIMIZED, filled, on_cpu, to_device
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P
from test_grouped_mlp import BWD_TOL, FWD_TOL  # the experts' grouped MLP's bounds

import jax_fp8
import jax_fp8.flax as jfl
import jax_fp8.nnx as jnx
from jax_fp8 import activations, moe_routing as mr
from jax_fp8.moe import MoeState, moe_mlp

T, D, H, E, K = 40, 32, 48, 4, 2
RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.CurrentScaling(),
           "block": jax_fp8.BlockScaling()}
# (D, H, backward tolerance) per recipe: BlockScaling's D and H multiples of 128, every operand
# (gradients too) in e4m3.
DIMS = {"delayed": (D, H, BWD_TOL), "current": (D, H, BWD_TOL), "block": (128, 128, FWD_TOL)}


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def problem(rng, tokens=T, experts=E, d=D, h=H):
  x = to_device(rng.standard_normal((tokens, d)), np.float32)
  router = to_device(rng.standard_normal((d, experts)), np.float32)
  w_in = to_device(rng.standard_normal((experts, d, 2 * h)) / np.sqrt(d), np.float32)
  w_out = to_device(rng.standard_normal((experts, h, d)) / np.sqrt(h), np.float32)
  return x, router, w_in, w_out


@functools.partial(jax.jit, static_argnames="top_k")
def moe_f32(x, router, w_in, w_out, top_k=K):
  """The same mixture in f32: moe_routing's routing and layout, ragged_dot experts (jitted:
  one program a shape, where eagerly each operation compiles)."""
  routing = mr.top_k_routing(jnp.dot(x, router, precision=jax.lax.Precision.HIGHEST), top_k)
  perm = mr.permute(x, routing.experts, w_in.shape[0])
  hi = jax.lax.Precision.HIGHEST
  h = jax.lax.ragged_dot(perm.rows, w_in, perm.group_sizes, precision=hi)
  out = jax.lax.ragged_dot(activations.apply(h, "swiglu"), w_out, perm.group_sizes, precision=hi)
  return mr.unpermute(out, perm, routing.weights), mr.load_balancing_loss(routing)


@pytest.mark.parametrize("recipe", RECIPES, ids=list(RECIPES))
def test_values_and_gradients_match_f32(rng, recipe):
  """Under BlockScaling each expert's rows are padded to 128 (its grouped_row_align), as its
  grouped wgrad needs."""
  d, h, bwd_tol = DIMS[recipe]
  recipe = RECIPES[recipe]
  x, router, w_in, w_out = problem(rng, d=d, h=h)
  ct = to_device(rng.standard_normal((T, d)), np.float32)
  state = MoeState.create(E, recipe) if recipe.stateful else None

  def loss(x, router, w_in, w_out):
    y, aux = moe_mlp(x, router, w_in, w_out, top_k=K, recipe=recipe, state=state)
    return jnp.sum(y * ct), (y, aux)

  def loss_f32(x, router, w_in, w_out):
    y, aux = moe_f32(x, router, w_in, w_out)
    return jnp.sum(y * ct), (y, aux)
  (_, (y, aux)), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3), has_aux=True))(
      x, router, w_in, w_out)
  (_, (y32, aux32)), grads32 = jax.jit(jax.value_and_grad(loss_f32, (0, 1, 2, 3), has_aux=True))(
      x, router, w_in, w_out)
  assert y.shape == (T, d) and y.dtype == jnp.float32
  assert rel(y, y32) <= FWD_TOL, rel(y, y32)
  np.testing.assert_allclose(aux, aux32, rtol=1e-6)  # the routing is f32 in both
  for name, g, g32 in zip(("x", "router", "w_in", "w_out"), grads, grads32):
    assert rel(g, g32) <= bwd_tol, (name, rel(g, g32))


def test_delayed_state_moves_over_steps(rng):
  recipe = jax_fp8.DelayedScaling()
  x, router, w_in, w_out = problem(rng)
  state = MoeState.create(E, recipe)

  @jax.jit
  def step(state):
    f = lambda s: jnp.sum(moe_mlp(x, router, w_in, w_out, top_k=K, recipe=recipe,
                                  state=s)[0])  # noqa: E731
    return jax_fp8.update_state(state, jax.grad(f)(state))
  s1 = step(state)
  s2 = step(s1)
  assert np.all(np.asarray(s2.experts.kernel_in.steps) == 2)
  assert np.all(np.asarray(s2.experts.hidden.steps) == 2)
  # each expert kernel's ring observed its own kernel's amax
  np.testing.assert_allclose(np.asarray(s2.experts.kernel_in.amax_history)[:, 0],
                             np.abs(np.asarray(w_in)).max(axis=(1, 2)), rtol=1e-6)


def test_linen_layer(rng):
  x = to_device(rng.standard_normal((2, 20, D)), np.float32)
  layer = jfl.MoeMlp(num_experts=E, top_k=K, hidden_features=H)
  variables = jax.jit(layer.init)(jax.random.key(0), x)
  assert variables["params"]["w_in"].shape == (E, D, 2 * H)
  assert isinstance(variables["fp8_state"]["moe"], MoeState)
  y, updated = jax.jit(functools.partial(layer.apply, mutable=["intermediates"]))(variables, x)
  assert y.shape == x.shape
  (aux,) = updated["intermediates"]["load_balancing_loss"]
  params = variables["params"]
  y32, aux32 = moe_f32(x.reshape(-1, D), params["router"], params["w_in"], params["w_out"])
  np.testing.assert_allclose(aux, aux32, rtol=1e-6)
  assert rel(y.reshape(-1, D), y32) <= FWD_TOL

  def loss(params, state):
    return jnp.sum(layer.apply({"params": params, "fp8_state": state}, x) ** 2)
  grads, state_grads = jax.jit(jax.grad(loss, (0, 1)))(params, variables["fp8_state"])
  assert set(grads) >= {"router", "w_in", "w_out"}
  new_state = jax.jit(jax_fp8.update_state)(variables["fp8_state"], state_grads)
  assert int(new_state["moe"].experts.grad_out.steps) == 1


def test_nnx_layer_train_step(rng):
  model = jnx.MoeMlp(D, E, K, H, recipe=jax_fp8.DelayedScaling(), rngs=nnx.Rngs(0))
  x = to_device(rng.standard_normal((T, D)), np.float32)
  diff = nnx.DiffState(0, (nnx.Param, jnx.Fp8State))

  @nnx.jit
  def step(model, x):
    def loss_fn(model):
      y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
      aux = intermediates["load_balancing_loss"].get_value()
      return jnp.mean(y ** 2) + 0.01 * aux
    loss, grads = nnx.value_and_grad(loss_fn, argnums=diff)(model)
    jnx.update_fp8_state(model, grads)
    return loss
  step(model, x)
  step(model, x)
  assert np.all(np.asarray(model.fp8_state.get_value().experts.kernel_in.steps) == 2)
  with warnings.catch_warnings(record=True) as caught:  # outside nnx.capture: nothing sown
    warnings.simplefilter("always")
    model(x)
  assert not [w for w in caught if "sow" in str(w.message)]
  assert not nnx.state(model, nnx.Intermediate)


def test_expert_parallel_layer_equals_one_device(rng):
  """Experts over 4 CPU devices (CurrentScaling: each device scales its own pieces): values
  within the FP8 bound of the f32 mixture of the gathered parameters."""
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("e",))
  recipe = jax_fp8.CurrentScaling()
  layer = jfl.MoeMlp(num_experts=8, top_k=K, hidden_features=H, recipe=recipe,
                     expert_axis="e")
  x = to_device(rng.standard_normal((4 * T, D)), np.float32)
  specs = {"router": P(), "w_in": P("e"), "w_out": P("e")}
  init = jax.jit(jax.shard_map(lambda x: layer.init(jax.random.key(0), x)["params"], mesh=mesh,
                               in_specs=P("e"), out_specs=specs, check_vma=False))
  params = init(x)
  assert params["w_in"].shape == (8, D, 2 * H)
  # each device made its own slice of the stack one (CPU) device makes from the same key: the
  # same bits, or with LLVM's optimizations off (conftest.LLVM_UNOPTIMIZED) the same values up
  # to the last bits of the normal sampler's polynomial, which XLA:CPU then rounds differently
  # in the two programs; another key or slice would differ everywhere
  whole = on_cpu(jax.jit(lambda x: jfl.MoeMlp(num_experts=8, top_k=K, hidden_features=H,
                                              recipe=recipe).init(jax.random.key(0), x)["params"]),
                 x)
  for name in ("router", "w_in", "w_out"):
    want = np.asarray(whole[name])
    np.testing.assert_allclose(np.asarray(params[name]), want, rtol=0,
                               atol=2.0**-20 * np.abs(want).max() if LLVM_UNOPTIMIZED else 0)
  run = jax.jit(jax.shard_map(lambda p, x: layer.apply({"params": p}, x), mesh=mesh,
                              in_specs=(specs, P("e")), out_specs=P("e")))
  y = run(params, x)
  y32, _ = moe_f32(x, params["router"], params["w_in"], params["w_out"])
  assert rel(y, y32) <= FWD_TOL, rel(y, y32)


def test_expert_parallel_keeps_each_experts_scale(rng):
  """Experts 1e5 apart in magnitude on different devices: each expert's kernel is scaled by
  its own amax (not the max over the devices holding other experts), so the tokens of the
  small experts keep E4M3's precision."""
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("e",))
  recipe = jax_fp8.CurrentScaling()
  x, router, w_in, w_out = problem(rng, tokens=4 * T, experts=8)
  small = np.repeat([1e-5, 1.0, 1.0, 1.0], 2)[:, None, None]  # device 0's experts 0 and 1
  w_in = to_device(np.asarray(w_in) * small.astype(np.float32))  # f32 products, as XLA's

  def local(x, router, w_in, w_out):
    return moe_mlp(x, router, w_in, w_out, top_k=1, recipe=recipe, expert_axis="e")[0]
  run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("e"), P(), P("e"), P("e")),
                              out_specs=P("e")))
  y = np.asarray(run(x, router, w_in, w_out))
  y32 = np.asarray(moe_f32(x, router, w_in, w_out, top_k=1)[0])
  routing = jax.jit(lambda x, router: mr.top_k_routing(  # as moe_f32 routes, jitted
      jnp.dot(x, router, precision=jax.lax.Precision.HIGHEST), 1))(x, router)
  rows = np.isin(np.asarray(routing.experts[:, 0]), [0, 1])
  assert rows.sum() > 0
  assert rel(y[rows], y32[rows]) <= FWD_TOL, rel(y[rows], y32[rows])


def test_data_parallel_delayed_scaling(rng):
  """Every device holds every expert, tokens split over "data": with amax_axis_name the
  replicated rings move identically on every device, and the values are the f32 mixture's."""
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("data",))
  recipe = jax_fp8.DelayedScaling()
  x, router, w_in, w_out = problem(rng, tokens=4 * T)
  state = MoeState.create(E, recipe)

  def local(x, state):
    f = lambda s: jnp.sum(moe_mlp(x, router, w_in, w_out, top_k=K, recipe=recipe, state=s,
                                  amax_axis_name="data")[0] ** 2)  # noqa: E731
    y = moe_mlp(x, router, w_in, w_out, top_k=K, recipe=recipe, state=state,
                amax_axis_name="data")[0]
    return y, jax.grad(f)(state)
  run = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("data"), P()),
                              out_specs=(P("data"), P())))
  y, grads = run(x, state)
  new = jax.jit(jax_fp8.update_state)(state, grads)
  assert int(new.experts.x.steps) == 1
  np.testing.assert_allclose(np.asarray(new.experts.x.amax_history)[0],
                             np.abs(np.asarray(x)).max(), rtol=1e-6)  # the max over devices
  assert rel(y, moe_f32(x, router, w_in, w_out)[0]) <= FWD_TOL


@pytest.mark.parametrize("layer", ["linen", "nnx"])
def test_shared_expert_keeps_the_compute_dtype(rng, layer):
  x = to_device(rng.standard_normal((T, D)), jnp.bfloat16)
  if layer == "linen":
    m = jfl.MoeMlp(num_experts=E, top_k=K, hidden_features=H, shared_hidden_features=32)
    variables = jax.jit(m.init)(jax.random.key(0), x)
    assert variables["params"]["shared"]["kernel_in"].shape == (D, 64)  # a gated Mlp
    y = jax.jit(m.apply)(variables, x)
  else:
    model = jnx.MoeMlp(D, E, K, H, shared_hidden_features=32, rngs=nnx.Rngs(0))
    assert isinstance(model.shared, jnx.Mlp)
    y = nnx.jit(lambda model, x: model(x))(model, x)
  assert y.dtype == jnp.bfloat16 and y.shape == x.shape


def test_no_tokens():
  x, router, w_in, w_out = problem(np.random.default_rng(0))
  y, aux = jax.jit(lambda x: moe_mlp(x, router, w_in, w_out, top_k=K,
                                     recipe=jax_fp8.CurrentScaling()))(x[:0])
  assert y.shape == (0, D) and float(aux) == 0.0


@pytest.mark.parametrize("change,error,match", [
    (dict(router=filled(D + 1, E)), ValueError, "router_kernel must be \\[D, E\\]"),
    (dict(w_in=filled(E, D, 2 * H + 1)), ValueError, "F must be 2 H"),
    (dict(w_out=filled(E, H, D + 16)), ValueError, "w_out must be \\[E, H, D\\]"),
    (dict(w_in=filled(E + 1, D, 2 * H), w_out=filled(E + 1, H, D)), ValueError,
     "must hold the router's 4 experts"),
    (dict(activation="relu"), ValueError, "activation"),
    (dict(state=None), TypeError, "state must be a jax_fp8.moe.MoeState"),
    (dict(recipe=jax_fp8.MXFP8BlockScaling(), state=None), TypeError, "moe_mlp takes"),
    (dict(recipe=jax_fp8.BlockScaling(), state=None, align=16), ValueError,
     "align must be a multiple of BlockScaling's grouped row alignment 128"),
    (dict(recipe=jax_fp8.BlockScaling(), state=None), ValueError,
     "multiples of 128, got D=32, H=48"),
    (dict(top_k=E + 1), ValueError, "top_k"),
    (dict(w_in=filled(E, D, 2 * 24), w_out=filled(E, 24, D)), ValueError,
     "multiples of 16, got D=32, H=24"),
    (dict(capacity=8), ValueError, "capacity applies with expert_axis"),
    (dict(expert_axis=3, recipe=jax_fp8.CurrentScaling(), state=None), TypeError,
     "moe_mlp's expert_axis must be None or a mesh axis name \\(str\\), got int 3"),
    (dict(expert_axis="e"), TypeError, "moe_mlp with expert_axis takes a stateless recipe"),
    (dict(expert_axis="e", recipe=jax_fp8.CurrentScaling(), state=None), ValueError,
     "moe_mlp's expert_axis names the axis 'e', which is not bound here"),
    # a state's repr would spell out its arrays: the message cuts it
    (dict(state=jax_fp8.GroupedMlpState.create(E, jax_fp8.DelayedScaling())), TypeError,
     "state must be a jax_fp8.moe.MoeState .* got GroupedMlpState .{,90}$"),
    (dict(state=MoeState.create(2 * E, jax_fp8.DelayedScaling())), ValueError,
     r"state must be the MoeState of w_in's 4 experts \(MoeState.create\(4, recipe\)\): "
     r"state.experts.kernel_in.scale \[4\], got \[8\]"),
    (dict(recipe=jax_fp8.CurrentScaling(),
          state=jax_fp8.GroupedMlpState.create(E, jax_fp8.DelayedScaling())), ValueError,
     "CurrentScaling is stateless: pass no state"),
    (dict(recipe=jax_fp8.CurrentScaling(), state={}), ValueError,
     "CurrentScaling is stateless: pass no state"),
    (dict(x=jnp.float32(1.0), recipe=jax_fp8.CurrentScaling(), state=None), ValueError,
     r"x must be \[..., D\] tokens, got a scalar"),
])
def test_bad_input(rng, change, error, match):
  x, router, w_in, w_out = problem(rng)
  args = dict(x=x, router=router, w_in=w_in, w_out=w_out, top_k=K,
              recipe=jax_fp8.DelayedScaling(), state=MoeState.create(E, jax_fp8.DelayedScaling()),
              activation="swiglu")
  args.update(change)
  with pytest.raises(error, match=match):
    moe_mlp(args.pop("x"), args.pop("router"), args.pop("w_in"), args.pop("w_out"), **args)


def test_state_create_names_its_arguments():
  with pytest.raises(ValueError, match="num_experts must be an int >= 1, got 0"):
    MoeState.create(0, jax_fp8.DelayedScaling())
  with pytest.raises(TypeError, match="MoeState.create takes a DelayedScaling recipe, got str "
                                      "'delayed'$"):
    MoeState.create(E, "delayed")


def test_layers_check_the_recipe_first():
  with pytest.raises(TypeError, match="recipe"):
    jfl.MoeMlp(num_experts=E, top_k=K, hidden_features=H, recipe="delayed").init(
        jax.random.key(0), jnp.zeros((4, D)))
  with pytest.raises(TypeError, match="recipe"):
    jnx.MoeMlp(D, E, K, H, recipe="delayed", rngs=nnx.Rngs(0))


def test_layers_check_their_attributes():
  """Outside the shard_map over expert_axis, under any recipe, init names the unbound axis (and
  under DelayedScaling the recipe first); more experts than the grouped GEMM takes, a dtype
  that is no float, top_k out of [1, E], a recipe of no grouped GEMM, sizes the FP8 GEMMs
  cannot take, a non-bool normalize_weights: each names the attribute, before the first call
  (NNX: at construction)."""
  x = jnp.zeros((4, D))
  for recipe, error, match in ((jax_fp8.CurrentScaling(), ValueError,
                                "MoeMlp's expert_axis names the axis 'e', which is not bound"),
                               (jax_fp8.DelayedScaling(), TypeError,
                                "MoeMlp with expert_axis takes a stateless recipe")):
    with pytest.raises(error, match=match):
      jfl.MoeMlp(num_experts=E, top_k=K, hidden_features=H, recipe=recipe,
                 expert_axis="e").init(jax.random.key(0), x)
    with pytest.raises(error, match=match):
      jnx.MoeMlp(D, E, K, H, recipe=recipe, expert_axis="e", rngs=nnx.Rngs(0))
  match = r"MoeMlp.num_experts must be an int in \[1, 1024\], got 2000"
  with pytest.raises(ValueError, match=match):
    jfl.MoeMlp(num_experts=2000, top_k=K, hidden_features=H).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match=match):
    jnx.MoeMlp(D, 2000, K, H, rngs=nnx.Rngs(0))
  base = dict(num_experts=E, top_k=K, hidden_features=H)
  for kw, error, match in (
      (dict(dtype=jnp.int8), TypeError, "MoeMlp.dtype must be None, float32, bfloat16 or "
                                        "float16, got int8"),
      (dict(param_dtype=jnp.int8), TypeError, "MoeMlp.param_dtype must be float32, "),
      (dict(param_dtype="fp32"), TypeError, "MoeMlp.param_dtype must be .* got 'fp32'"),
      (dict(top_k=E + 1), ValueError, rf"MoeMlp.top_k must be an int in \[1, {E}\], got {E + 1}"),
      (dict(top_k=0), ValueError, rf"MoeMlp.top_k must be an int in \[1, {E}\], got 0"),
      (dict(recipe=jax_fp8.MXFP8BlockScaling()), TypeError,
       "MoeMlp takes a DelayedScaling, a CurrentScaling or a BlockScaling .* got "
       "MXFP8BlockScaling"),
      (dict(hidden_features=24), ValueError,
       r"MoeMlp.hidden_features must be a multiple of 16 \(DelayedScaling's FP8 GEMMs\), got 24"),
      (dict(normalize_weights=1), TypeError, "MoeMlp.normalize_weights must be a bool, got int 1"),
      (dict(shared_hidden_features=24), ValueError,
       r"MoeMlp.shared_hidden_features must be a multiple of 16 \(DelayedScaling's FP8 GEMMs\), "
       "got 24"),
      (dict(shared_hidden_features=0), ValueError,
       r"MoeMlp.shared_hidden_features must be an int >= 1, got 0")):
    with pytest.raises(error, match=match):
      jfl.MoeMlp(**{**base, **kw}).init(jax.random.key(0), x)
    with pytest.raises(error, match=match):
      jnx.MoeMlp(in_features=D, **{**base, **kw}, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match=r"MoeMlp.in_features must be a multiple of 16 "):
    jnx.MoeMlp(40, E, K, H, rngs=nnx.Rngs(0))


def test_expert_axis_refuses_delayed_scaling():
  mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("e",))
  layer = jfl.MoeMlp(num_experts=4, top_k=1, hidden_features=H, expert_axis="e")
  with pytest.raises(TypeError, match="expert_axis takes a stateless recipe"):
    jax.jit(jax.shard_map(lambda x: layer.init(jax.random.key(0), x), mesh=mesh,
                          in_specs=P("e"), out_specs=P(), check_vma=False))(jnp.zeros((8, D)))


def test_expert_axis_names_a_whole_stack_passed_as_local(rng):
  """Under expert_axis, w_in holding all E experts (not this device's E / n) is named as such,
  not as the grouped MLP's kernel_in."""
  mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("e",))
  x, router, w_in, w_out = problem(rng)

  def local(x):
    return moe_mlp(x, router, w_in, w_out, top_k=K, recipe=jax_fp8.CurrentScaling(),
                   expert_axis="e")[0]
  match = (r"with expert_axis 'e' of 2 devices, w_in and w_out must hold this device's E / n of "
           r"the router's 4 experts, got w_in \[4, 32, 96\]")
  with pytest.raises(ValueError, match=match):
    jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("e"), out_specs=P("e")))(x)


@pytest.mark.parametrize("layer", ["linen", "nnx"])
def test_float64_parameters_and_array_likes(rng, layer):
  """float64 parameters (param_dtype under x64), which the FP8 kernels do not read, are read in
  the compute dtype as Dense reads them, their gradients float64; a nested list of inputs is
  taken as an array (with dtype set too)."""
  with jax.enable_x64(True):
    x = np.asarray(rng.standard_normal((T, D)), np.float32)
    kw = dict(param_dtype=jnp.float64, dtype=jnp.float32, recipe=jax_fp8.CurrentScaling())
    if layer == "linen":
      m = jfl.MoeMlp(num_experts=E, top_k=K, hidden_features=H, **kw)
      params = jax.jit(lambda key: m.init(key, x.tolist()))(jax.random.key(0))["params"]
      apply = lambda p, x: m.apply({"params": p}, x)  # noqa: E731
    else:
      model = jnx.MoeMlp(D, E, K, H, **kw, rngs=nnx.Rngs(0))
      graph, params = nnx.split(model, nnx.Param)
      apply = lambda p, x: nnx.merge(graph, p)(x)  # noqa: E731
    # jitted (eagerly, each of the layer's ops compiles on its own); the list is a constant
    y = jax.jit(lambda p: apply(p, x.tolist()))(params)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(jax.jit(apply)(params, x)))
    grads = jax.jit(jax.grad(lambda p: jnp.sum(apply(p, x) ** 2)))(params)
    pure = params if layer == "linen" else nnx.to_pure_dict(params)
    assert sorted(pure) == ["router", "w_in", "w_out"]
    assert all(v.dtype == jnp.float64 for v in pure.values())
    f32 = {k: jnp.asarray(v, jnp.float32) for k, v in pure.items()}
    kw["dtype"] = None  # float64 parameters, no compute dtype: refused as Dense refuses them
    match = "the layer's dtype is None, so it would compute in float64"
    with pytest.raises(TypeError, match=match):
      if layer == "linen":
        jfl.MoeMlp(num_experts=E, top_k=K, hidden_features=H, **kw).apply({"params": pure}, x)
      else:
        jnx.MoeMlp(D, E, K, H, **kw, rngs=nnx.Rngs(0))(x)
  assert y.dtype == jnp.float32
  assert all(g.dtype == jnp.float64 and np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
  want = moe_f32(jnp.asarray(x), f32["router"], f32["w_in"], f32["w_out"])[0]
  assert rel(y, want) <= FWD_TOL, rel(y, want)
  if layer == "linen":  # without x64, NumPy float64 parameters are float32 ones, as JAX takes them
    m = jfl.MoeMlp(num_experts=E, top_k=K, hidden_features=H, recipe=jax_fp8.CurrentScaling())
    wide = {k: np.asarray(v, np.float64) for k, v in f32.items()}
    x16 = jnp.asarray(x, jnp.bfloat16)
    wide_y, f32_y = (jax.jit(lambda: m.apply({"params": p}, x16))() for p in (wide, f32))
    np.testing.assert_array_equal(np.asarray(wide_y, np.float32), np.asarray(f32_y, np.float32))
