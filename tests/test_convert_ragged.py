"""jax_fp8.convert of a linen mixture of experts whose experts run through jax.lax.ragged_dot:
the calls run as jax_fp8.grouped_linear (bit for bit, values and gradients, rings included),
within the FP8 bound of the unconverted model, with the parameters unchanged and one ring set a
call site; a jitted train step threads the rings; the report lists the calls; the filter, the
forms and recipes convert leaves, nesting and other threads; NNX's calls are reported left."""

import functools
import threading

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import normwise, roundoff
from flax import nnx
from test_linear import rel

import jax_fp8
from jax_fp8.convert import HEAD_PATTERN, ConversionWarning, conversion_report, convert
from jax_fp8.moe_routing import permute, top_k_routing, unpermute
from jax_fp8.ops.grouped_gemm import XLA_RAGGED_DOT

bound_ragged_dot = jax.lax.ragged_dot  # bound at import, as `from jax.lax import ragged_dot`

E, D, H, TOKENS, TOP_K = 4, 32, 48, 24, 2  # experts; model and expert widths; tokens; top-k
RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.CurrentScaling(),
           "block": jax_fp8.BlockScaling()}
# (D, H) per recipe: BlockScaling's K and N multiples of 128 (its groups of x start at any row:
# grouped_linear lays them out at multiples of 128 for its wgrad itself).
DIMS = {"delayed": (D, H), "current": (D, H), "block": (128, 128)}
E4M3, E5M2 = roundoff("e4m3"), roundoff("e5m2")
# The unconverted model is f32; the converted one rounds, on the deepest path of its output,
# the permuted tokens and w_in, then the activation and w_out, to e4m3 (the router, N = E, and
# the head, excluded, stay f32). A gradient's deepest path (the loss is linear in the output,
# so its gradient carries no forward error) adds, in each expert GEMM's backward, the incoming
# gradient's e5m2 rounding and a kernel's e4m3 one, and the forward's roundings that reach it.
FWD_TOL = normwise(*[E4M3] * 4)
GRAD_TOL = normwise(*[E4M3] * 4, *[E5M2] * 2)
# The router's gradients are sums over the tokens of its logits' gradients g_t, which cancel
# (each token's sum to zero through the softmax): their error is within GRAD_TOL of the sums of
# the terms' magnitudes, sum_t |g_t| (the bias) and |x|^T |g| (the kernel), not of the sums.


class Experts(nn.Module):
  """A mixture-of-experts MLP as a user writes it in linen: an f32 router, top-k routing and
  token permutation (jax_fp8.moe_routing), expert weights [E, D, hidden] and [E, hidden, D]
  run by jax.lax.ragged_dot, looked up at the call as a model's code does (D: x's width).
  ``dots``: the two expert GEMMs' functions (lhs, rhs, group_sizes) of a twin instead."""

  hidden: int = H
  dots: tuple | None = None

  @nn.compact
  def __call__(self, x):
    # perturb: the per-token logit gradient, for the router's bound (a no-op without it)
    routing = top_k_routing(self.perturb("logits", nn.Dense(E, name="router")(x)), TOP_K)
    perm = permute(x, routing.experts, E)
    init = nn.initializers.lecun_normal(batch_axis=0)
    w_in = self.param("w_in", init, (E, x.shape[-1], self.hidden))
    w_out = self.param("w_out", init, (E, self.hidden, x.shape[-1]))
    first, second = self.dots or (None, None)
    h = jax.nn.gelu((first or jax.lax.ragged_dot)(perm.rows, w_in, perm.group_sizes))
    return unpermute((second or jax.lax.ragged_dot)(h, w_out, perm.group_sizes), perm,
                     routing.weights)


class Model(nn.Module):
  """The experts in a residual, then an output head."""

  hidden: int = H
  dots: tuple | None = None

  @nn.compact
  def __call__(self, x):
    return nn.Dense(16, name="head")(x + Experts(self.hidden, self.dots, name="moe")(x))


def data(rng, d=D):
  x = jnp.asarray(rng.standard_normal((TOKENS, d)), jnp.float32)
  return x, jnp.asarray(rng.standard_normal((TOKENS, 16)), jnp.float32)


def init_and_apply(model, plain, x):
  """Jitted: the converted ``model``'s variables, its output, and the unconverted ``plain``
  model's output on the same parameters."""
  def run(key, x):
    v = model.init(key, x)
    return v, model.apply(v, x), plain.apply({"params": v["params"]}, x)
  return jax.jit(run)(jax.random.key(0), x)


def rows():
  """M, the permuted rows each expert GEMM sees."""
  return jax.eval_shape(lambda x: permute(x, jnp.zeros((TOKENS, TOP_K), jnp.int32), E).rows,
                        jax.ShapeDtypeStruct((TOKENS, D), jnp.float32)).shape[0]


@pytest.mark.parametrize("name", RECIPES)
def test_moe_converts_in_one_line(rng, name):
  recipe, (d, h) = RECIPES[name], DIMS[name]
  x, t = data(rng, d)
  model = convert(Model(h), recipe)
  v, plain = jax.jit(lambda k, x: (model.init(k, x), Model(h).init(k, x)))(jax.random.key(0), x)
  assert jax.tree.structure(v["params"]) == jax.tree.structure(plain["params"])
  for a, b in zip(jax.tree.leaves(v["params"]), jax.tree.leaves(plain["params"])):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same names and values
  if recipe.stateful:
    sites = v["fp8_state"]["moe"]
    assert list(v["fp8_state"]) == ["moe"] and sorted(sites) == ["ragged_dot_0", "ragged_dot_1"]
    assert all(isinstance(s, jax_fp8.GroupedLinearState) and s.kernels.scale.shape == (E,)
               for s in sites.values())
  else:
    assert "fp8_state" not in v
  state = v.get("fp8_state", {})

  def converted(params, state, x):
    y = model.apply({"params": params, **({"fp8_state": state} if state else {})}, x)
    return jnp.sum(y * t), y

  def twin(params, state, x):  # the same model calling jax_fp8.grouped_linear itself
    dots = tuple(functools.partial(jax_fp8.grouped_linear, recipe=recipe,
                                   state=state["moe"][f"ragged_dot_{i}"] if state else None)
                 for i in range(2))
    y = Model(h, dots).apply({"params": params}, x)
    return jnp.sum(y * t), y

  def unconverted(params, state, x):
    y = Model(h).apply({"params": params}, x)
    return jnp.sum(y * t), y

  got, want, f32 = jax.jit(lambda *a: tuple(
      jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)(*a)
      for f in (converted, twin, unconverted)))(v["params"], state, x)
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  (_, y), (g_params, _, g_x) = got
  (_, y32), (g32_params, _, g32_x) = f32
  assert rel(y, y32) < FWD_TOL
  g_logits = jax.jit(jax.grad(lambda p: jnp.sum(Model(h).apply(
      {"params": v["params"], "perturbations": p}, x) * t)))(v["perturbations"])
  g_logits = np.abs(np.asarray(g_logits["moe"]["logits"], np.float64))  # f32 model's, [T, E]
  magnitudes = {"bias": g_logits.sum(0), "kernel": np.abs(np.asarray(x, np.float64)).T @ g_logits}
  for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_params),
                          jax.tree.leaves(g32_params)):
    where = jax.tree_util.keystr(path)
    if "router" in where:
      err = np.linalg.norm(np.asarray(a, np.float64) - np.asarray(b, np.float64))
      assert err < GRAD_TOL * np.linalg.norm(magnitudes[path[-1].key]), where
    else:
      assert rel(a, b) < GRAD_TOL, where
  assert rel(g_x, g32_x) < GRAD_TOL

  report = conversion_report(model, x)
  m = rows()
  for i, (k, n) in enumerate(((d, h), (h, d))):
    r = report[f"moe/ragged_dot_{i}"]
    assert (r.layer, r.k, r.n, r.m, r.groups, r.status) == ("lax.ragged_dot", k, n, m, E, "fp8")
  assert [r.path for r in report.left] == ["moe/router", "head"]
  assert str(report).splitlines()[1].split()[:6] == ["path", "layer", "K", "N", "M", "G"]
  assert "2 of 4 layers converted, 2 ran FP8" in str(report)
  assert jax.lax.ragged_dot is XLA_RAGGED_DOT  # restored


def test_train_step_threads_the_rings(rng):
  recipe = RECIPES["delayed"]
  x, t = data(rng)
  model = convert(Model(), recipe)
  v = jax.jit(model.init)(jax.random.key(0), x)

  @jax.jit
  def step(params, state, x):
    def loss(params, state):
      return jnp.sum(model.apply({"params": params, "fp8_state": state}, x) * t)
    value, (g, g_state) = jax.value_and_grad(loss, argnums=(0, 1))(params, state)
    return (jax.tree.map(lambda p, d: p - 1e-2 * d, params, g),
            jax_fp8.update_state(state, g_state), value)

  params, state = v["params"], v["fp8_state"]
  for _ in range(3):
    used = params
    params, state, value = step(params, state, x)
    assert np.isfinite(float(value))
  for i, w in enumerate(("w_in", "w_out")):
    ring = state["moe"][f"ragged_dot_{i}"]
    assert float(ring.x.steps) == 3 and float(ring.grad.steps) == 3
    np.testing.assert_array_equal(np.asarray(ring.kernels.steps), np.full((E,), 3.0))
    # Each expert's ring observed its own kernel's amax at the last step.
    np.testing.assert_array_equal(np.asarray(ring.kernels.amax_history[:, 0]),
                                  np.max(np.abs(np.asarray(used["moe"][w])), axis=(1, 2)))


def test_filter_and_sizes(rng):
  x, _ = data(rng)
  recipe = RECIPES["delayed"]
  for include, exclude, kept in ((None, HEAD_PATTERN + r"|ragged_dot_1$", "ragged_dot_0"),
                                 (r"^moe/ragged_dot_1", None, "ragged_dot_1")):
    model = convert(Model(), recipe, include=include, exclude=exclude)
    assert sorted(jax.eval_shape(model.init, jax.random.key(0), x)["fp8_state"]["moe"]) == [kept]
    left = "ragged_dot_1" if kept == "ragged_dot_0" else "ragged_dot_0"
    assert conversion_report(model, x)[f"moe/{left}"].status == (
        "excluded" if exclude else "not_included")
  unaligned = convert(Model(hidden=40), recipe)  # H = 40: K, N not multiples of 16
  with pytest.warns(ConversionWarning, match="none of the 4 layers was converted"):
    assert "fp8_state" not in jax.eval_shape(unaligned.init, jax.random.key(0), x)
  report = conversion_report(unaligned, x)
  assert {report[f"moe/ragged_dot_{i}"].status for i in range(2)} == {"unaligned"}
  # Intensity: never at any M (K = 32 and N = 48 bound it by 19.2), or below it at this M.
  never = conversion_report(convert(Model(), jax_fp8.DelayedScaling(fp8_min_intensity=20)), x)
  assert never["moe/ragged_dot_0"].status == "never_pays"
  below = convert(Model(), jax_fp8.DelayedScaling(fp8_min_intensity=12))
  with pytest.warns(ConversionWarning, match="fall below it"):
    v, y, want = init_and_apply(below, Model(), x)
  assert sorted(v["fp8_state"]["moe"]) == ["ragged_dot_0", "ragged_dot_1"]
  np.testing.assert_array_equal(np.asarray(y), np.asarray(want))  # XLA's f32 ragged_dot
  r = conversion_report(below, x)["moe/ragged_dot_0"]
  assert r.status == "below_intensity" and r.intensity < 12


class Forms(nn.Module):
  """Ragged dots convert leaves, one it converts (ragged_dot_general in ragged_dot's own
  form) and one it cannot see (bound before the call), each on the same tokens."""

  @nn.compact
  def __call__(self, x):
    sizes = jnp.asarray([8, 0, 12, 4], jnp.int32)
    w = self.param("w", nn.initializers.lecun_normal(batch_axis=0), (E, D, H))
    dims = jax.lax.RaggedDotDimensionNumbers((([1], [2]), ([], [])), [0], [0])  # rhs [G, N, K]
    plain = jax.lax.RaggedDotDimensionNumbers((([1], [1]), ([], [])), [0], [0])
    return (jax.lax.ragged_dot(x, w, sizes, precision=jax.lax.Precision.HIGHEST),
            jax.lax.ragged_dot_general(x, jnp.swapaxes(w, 1, 2), sizes, dims),
            jax.lax.ragged_dot(x[:, :4].astype(jnp.int8), w[:, :4].astype(jnp.int8), sizes,
                               preferred_element_type=jnp.int32),
            jax.checkpoint(lambda x: jax.lax.ragged_dot(x, w, sizes))(x),
            jax.lax.ragged_dot_general(x, w, sizes, plain),
            bound_ragged_dot(x, w, sizes))  # not seen


class SetupStyle(nn.Module):
  """Expert weights made in setup, the ragged dot in a method that is not @nn.compact."""

  def setup(self):
    self.w = self.param("w", nn.initializers.lecun_normal(batch_axis=0), (E, D, H))

  def __call__(self, x):
    return jax.lax.ragged_dot(x, self.w, jnp.asarray([8, 0, 12, 4], jnp.int32))


def test_forms_left_as_they_were(rng):
  x = jnp.asarray(rng.standard_normal((TOKENS, D)), jnp.float32)
  model = convert(Forms(), RECIPES["delayed"])
  # the calls left are named, not only listed in the report
  with pytest.warns(ConversionWarning, match=r"4 of 5 layers stay in higher precision, left "
                    r"unsupported: 'ragged_dot_0' \(lax.ragged_dot\): precision=HIGHEST: .*; "
                    r"'ragged_dot_3' \(lax.ragged_dot\): .*inside a JAX transform"):
    v, got, want = init_and_apply(model, Forms(), x)
  assert sorted(v["fp8_state"]) == ["ragged_dot_4"]
  for a, b in zip(got[:4] + got[5:], want[:4] + want[5:]):  # left: as it was, bit for bit
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert rel(got[4], want[4]) < normwise(E4M3, E4M3)
  report = conversion_report(model, x)
  assert [r.path for r in report.layers] == [f"ragged_dot_{i}" for i in range(5)]
  why = {r.path: (r.layer, r.status, r.detail) for r in report.layers}
  assert why["ragged_dot_0"][1:] == ("unsupported", "precision=HIGHEST: the call asks for a "
                                     "precision of its own, which FP8 would lower")
  assert why["ragged_dot_1"][0] == "lax.ragged_dot_general"
  assert "dimension numbers" in why["ragged_dot_1"][2] and report["ragged_dot_1"].k is None
  assert why["ragged_dot_2"][2] == ("lhs int8, rhs int8 into int32: grouped_linear takes "
                                    "float32, bfloat16 or float16")
  assert "inside a JAX transform" in why["ragged_dot_3"][2]
  assert why["ragged_dot_4"] == ("lax.ragged_dot_general", "fp8", "")
  # A setup-style module: no ring can be made there under DelayedScaling; CurrentScaling
  # needs none.
  delayed = conversion_report(convert(SetupStyle(), RECIPES["delayed"]), x)["ragged_dot_0"]
  assert delayed.status == "unsupported" and "@nn.compact" in delayed.detail
  current = conversion_report(convert(SetupStyle(), RECIPES["current"]), x)["ragged_dot_0"]
  assert current.status == "fp8"


class Layer(nn.Module):
  @nn.compact
  def __call__(self, x, _):
    return x + Experts(name="moe")(x), None


class Stack(nn.Module):
  """Three expert layers under nn.scan, rematerialized (nn.remat)."""

  @nn.compact
  def __call__(self, x):
    return nn.scan(nn.remat(Layer), variable_axes={"params": 0, "fp8_state": 0},
                   split_rngs={"params": True}, length=3)(name="layers")(x, None)[0]


def test_scan_stacks_the_rings():
  x = jax.ShapeDtypeStruct((TOKENS, D), jnp.float32)
  model = convert(Stack(), RECIPES["delayed"])
  v = jax.eval_shape(model.init, jax.random.key(0), x)
  ring = v["fp8_state"]["layers"]["moe"]["ragged_dot_1"]
  assert ring.kernels.amax_history.shape == (3, E, 16) and ring.x.scale.shape == (3,)
  report = conversion_report(model, x)
  assert [r.status for r in report.converted] == ["fp8", "fp8"]
  assert report["layers/moe/ragged_dot_0"].m == rows()


def test_recipes_that_leave_them(rng):
  """BlockScaling converts ragged dots whose K and N are multiples of 128
  (test_moe_converts_in_one_line) and leaves others as unaligned; a recipe without grouped
  GEMMs (MXFP8BlockScaling) leaves every one, saying which recipes convert them."""
  x, _ = data(rng)
  for recipe, status, detail in (
      (jax_fp8.BlockScaling(), "unaligned", "BlockScaling needs K and N multiples of 128"),
      (jax_fp8.MXFP8BlockScaling(), "unsupported",
       "grouped_linear takes a DelayedScaling, a CurrentScaling or a BlockScaling")):
    model = convert(Model(), recipe)
    with pytest.warns(ConversionWarning, match="none of the 4 layers"):
      v, y, want = init_and_apply(model, Model(), x)
    assert "fp8_state" not in v
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    report = conversion_report(model, x)
    for i in range(2):
      r = report[f"moe/ragged_dot_{i}"]
      assert (r.status, r.groups) == (status, E)
      assert r.detail.startswith(detail), r.detail


def test_nested_refused_and_other_threads(rng):
  x, _ = data(rng)
  recipe = RECIPES["current"]

  class Outer(nn.Module):  # a converted model inside a converted model
    inner: nn.Module

    @nn.compact
    def __call__(self, x):
      return self.inner(x)
  with pytest.raises(ValueError, match="runs inside another converted model"):
    convert(Outer(convert(Model(), recipe)), recipe).init(jax.random.key(0), x)
  assert jax.lax.ragged_dot is XLA_RAGGED_DOT

  # While one thread runs a converted model, another's plain ragged_dot runs as before, and a
  # third's converted model converts its own calls.
  inside, release = threading.Event(), threading.Event()

  class Waiting(nn.Module):
    @nn.compact
    def __call__(self, x):
      inside.set()
      release.wait(60)
      return Experts(name="moe")(x)
  held = threading.Thread(target=jax.eval_shape, args=(convert(Waiting(), recipe).init,
                                                       jax.random.key(0), x))
  held.start()
  try:
    assert inside.wait(60) and jax.lax.ragged_dot is not XLA_RAGGED_DOT
    w = jnp.asarray(rng.standard_normal((E, D, H)), jnp.float32)
    sizes = jnp.asarray([8, 0, 12, 4], jnp.int32)
    np.testing.assert_array_equal(np.asarray(jax.lax.ragged_dot(x, w, sizes)),
                                  np.asarray(XLA_RAGGED_DOT(x, w, sizes)))
    other = []
    third = threading.Thread(target=lambda: other.append(
        conversion_report(convert(Model(), recipe), x)))
    third.start()
    third.join(60)
    assert other[0]["moe/ragged_dot_1"].status == "fp8"
  finally:
    release.set()
    held.join(60)
  assert jax.lax.ragged_dot is XLA_RAGGED_DOT


class NnxExperts(nnx.Module):
  def __init__(self, rngs):
    self.up = nnx.Linear(D, D, rngs=rngs)
    self.w = nnx.Param(jax.random.normal(rngs.params(), (E, D, H)) / np.sqrt(D))

  def __call__(self, x):
    return jax.lax.ragged_dot(self.up(x), self.w[...], jnp.asarray([8, 0, 12, 4], jnp.int32))


def test_nnx_ragged_dots_are_reported_left(rng):
  x = jnp.asarray(rng.standard_normal((TOKENS, D)), jnp.float32)
  model = convert(NnxExperts(nnx.Rngs(0)), RECIPES["delayed"])
  report = conversion_report(model, x)
  assert [r.path for r in report.layers] == ["up", "ragged_dot_0"]
  r = report["ragged_dot_0"]
  assert (r.layer, r.k, r.n, r.m, r.groups, r.status) == ("lax.ragged_dot", D, H, TOKENS, E,
                                                          "unsupported")
  assert r.detail.startswith("NNX: convert swaps layers in place")
  assert jax.lax.ragged_dot is XLA_RAGGED_DOT
