"""NVFP4BlockScaling: linear, multi_linear, mlp and the layers with the NVFP4 report's recipe
(x and the gradient in 1 x 16 blocks, the kernel in 16 x 16 blocks, the gradient stochastically
rounded, the wgrad operands through the random Hadamard transform) and the GEMMs emulated
(nvfp4_gemm): each GEMM against the jnp twins' composition, the whole against f32 within the
format's bounds, stochastic rounding unbiased through the backward, keys, the recipe's
checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TWIN_COMPILER_OPTIONS, jitted, roundoff, summation_error
from flax import nnx
from test_linear import problem

import jax_fp8
import jax_fp8.flax
import jax_fp8.nnx
from jax_fp8 import reference
from jax_fp8.convert import convert
from jax_fp8.hadamard import hadamard_transform

NV = jax_fp8.NVFP4BlockScaling()
KEY = jax.random.key(11)
E2M1_MAX, E4M3_MAX = 6.0, 448.0


def pad16(v):
  return np.pad(np.asarray(v), ((0, -v.shape[0] % 16), (0, 0)))


def deq(q, direction=""):
  """The f64 values of a twin's quantization (``direction`` "" rowwise, "_t" columnwise)."""
  gs = q.global_scale_t if direction and q.global_scale_t is not None else q.global_scale
  return np.asarray(jitted(reference.nvfp4_dequantize, getattr(q, "data" + direction),
                           getattr(q, "scale" + direction), gs), np.float64)


def grad_key(key, i):
  """The key kernel i's gradient draws from on one device: ``key`` folded with i (see
  ``linear``)."""
  return jax.random.key_data(jax.random.fold_in(key, i))


# The twin under jit (one compilation, where eager dispatch compiles each of its operations),
# on the default device; with TWIN_COMPILER_OPTIONS where that is the CPU.
nvfp4_twin = jax.jit(reference.nvfp4_quantize, static_argnames=(
    "rowwise", "columnwise", "block_2d", "stochastic_rounding", "rht", "rht_seed"),
    compiler_options=TWIN_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None)


def twins(x2, w, t2, recipe=NV, key=KEY, index=0):
  """The twins' quantizations of the three GEMMs' operands, as the recipe takes them (the
  gradient's as kernel ``index``'s)."""
  rht = {"rht": True, "rht_seed": recipe.rht_seed} if recipe.rht else {}
  sr = ({"stochastic_rounding": True, "key": grad_key(key, index)}
        if recipe.stochastic_rounding else {})
  qx = nvfp4_twin(x2)
  qxt = nvfp4_twin(pad16(x2), rowwise=False, columnwise=True, **rht)
  qw = nvfp4_twin(w, columnwise=True, block_2d=recipe.weight_block_2d)
  qg = nvfp4_twin(pad16(t2), columnwise=True, **sr, **rht)
  return qx, qxt, qw, qg


def within_order(got, a, b, extra=0.0):
  """got equals a @ b (f64 values of the twins' operands, global scales applied) up to the
  order of the f32 sums and the global scales' roundings (as nvfp4_gemm's test), plus ``extra``
  (a rounding of the result)."""
  want = a @ b
  bound = (2 * summation_error(a.shape[1]) + 6 * 2.0**-24) * (np.abs(a) @ np.abs(b)) + extra
  err = np.abs(np.asarray(got, np.float64) - want)
  assert np.all(err <= bound), np.max(err / np.maximum(bound, 1e-300))


@pytest.mark.parametrize("lead,recipe", [((4, 16), NV),
                                         ((4, 9), jax_fp8.NVFP4BlockScaling(rht_seed=12345))],
                         ids=["M=64", "M=36,rht_seed"])
def test_gemms_equal_the_twins(platform, rng, lead, recipe):
  """fprop, dgrad and wgrad are the GEMMs of the twins' quantizations: x along K, the kernel
  in 16 x 16 blocks both ways, the gradient stochastically rounded along N (dgrad) and along M
  (wgrad), x and the gradient along M through the same Hadamard transform (the recipe's seed;
  M padded with zero rows to whole blocks), up to the order of the f32 sums."""
  x, w, b, t = problem(rng, lead=lead, k=64, n=96)
  f = lambda x, w, b: jax_fp8.linear(x, w, b, recipe=recipe, key=KEY)  # noqa: E731

  def fwd_bwd(x, w, b, t):  # one compilation, not the forward and the backward apart
    y, vjp = jax.vjp(f, x, w, b)
    return y, vjp(t)
  y, (dx, dw, db) = jax.jit(fwd_bwd)(x, w, b, t)
  x2, t2 = np.asarray(x).reshape(-1, 64), np.asarray(t).reshape(-1, 96)
  qx, qxt, qw, qg = twins(x2, w, t2, recipe)
  m = x2.shape[0]
  want_y = deq(qx) @ deq(qw, "_t").T
  within_order(np.asarray(y).reshape(-1, 96) - np.asarray(b), deq(qx), deq(qw, "_t").T,
               2 * roundoff(jnp.float32) * (np.abs(want_y) + np.abs(np.asarray(b))))
  within_order(np.asarray(dx).reshape(-1, 64), deq(qg)[:m], deq(qw).T)
  within_order(dw, deq(qxt, "_t"), deq(qg, "_t").T)
  bound = 2 * summation_error(m) * np.abs(t2).sum(0)  # one column sum, two orders
  assert np.all(np.abs(np.asarray(db, np.float64) - t2.sum(0, dtype=np.float64)) <= bound)


def quantization_bound(v, blocks):
  """Elementwise bound on |v - NVFP4(v)| under round to nearest, from the format: a block of
  ``blocks`` (rows, columns) elements with amax A has the step s = scale * global_scale <= A / 6
  * (1 + 2^-4) (its E4M3 scale rounded, a normal here), so an element q = v / s rounds by at
  most half its E2M1 spacing, max(1/4, |q| / 4) steps, or saturates at 6 from at most
  6 (1 + 2^-4): 3/8 of a step more."""
  r, c = blocks
  a = np.abs(np.asarray(v, np.float64))
  amax = a.reshape(a.shape[0] // r, r, a.shape[1] // c, c).max(axis=(1, 3))
  step = np.repeat(np.repeat(amax, r, 0), c, 1) / E2M1_MAX * (1 + roundoff("e4m3"))
  return np.maximum(step / 4, a / 4) + 3 / 8 * step


def test_gemms_against_f32_within_the_format(platform, rng):
  """y, dx and dkernel (stochastic rounding off) against f32: each operand's elements move by
  at most ``quantization_bound`` (x and the gradient in 1 x 16 blocks along the contraction,
  the kernel in 16 x 16 blocks; for wgrad x and the gradient after the Hadamard transform,
  16 x 1 blocks of their transformed columns), so a product's error is at most
  |da| |b| + |a| |db| + |da| |db| plus the sums' order; the transform, orthogonal, cancels in
  wgrad's product, so dkernel is compared with f32's x.T @ g itself. The blocks' scales are E4M3
  normals here (every block's amax above 2^-6 / 448 of the tensor's), as the bound assumes."""
  recipe = jax_fp8.NVFP4BlockScaling(stochastic_rounding=False, rht_seed=12345)
  x = np.asarray(rng.standard_normal((64, 64)), np.float32)
  w = np.asarray(rng.standard_normal((64, 96)) / 8, np.float32)
  t = np.asarray(rng.standard_normal((64, 96)), np.float32)

  def fwd_bwd(x, w, t):  # one compilation, not the forward and the backward apart
    y, vjp = jax.vjp(lambda x, w: jax_fp8.linear(x, w, recipe=recipe), x, w)
    return y, vjp(t)
  y, (dx, dw) = jax.jit(fwd_bwd)(x, w, t)
  hx, ht = (np.asarray(jitted(hadamard_transform, v, seed=recipe.rht_seed, axis=0)).T
            for v in (x, t))  # [K, M], [N, M]
  cases = ((x, (1, 16), w, (16, 16), y, x.astype(np.float64) @ w),
           (t, (1, 16), w.T, (16, 16), dx, t.astype(np.float64) @ w.T),
           (hx, (1, 16), ht.T, (16, 1), dw, x.T.astype(np.float64) @ t))
  for a, a_blocks, b, b_blocks, got, want in cases:
    for v, blocks in ((a, a_blocks), (b, b_blocks)):
      v = np.abs(v)
      assert v.reshape(v.shape[0] // blocks[0], blocks[0], -1, blocks[1]).max(
          axis=(1, 3)).min() > 2.0**-6 / E4M3_MAX * v.max()
    ea, eb = quantization_bound(a, a_blocks), quantization_bound(b, b_blocks)
    aa, ab = np.abs(a.astype(np.float64)), np.abs(b.astype(np.float64))
    bound = ea @ ab + aa @ eb + ea @ eb + 2 * summation_error(a.shape[1]) * ((aa + ea) @ (ab + eb))
    err = np.abs(np.asarray(got, np.float64) - want)
    assert np.all(err <= bound), np.max(err / bound)
    assert np.max(err / bound) > 0.05  # the bound is not so loose that it checks nothing


def sr_moments(v, scales, global_scale):
  """The mean and variance of stochastic rounding of v [R, C] with these block scales
  [R, C/16]: each element's q = v / step lies between two neighbours of the E2M1 grid, d apart
  (d = 1/2, 1 or 2 steps below 2, 4 and 6), and rounds up with probability p (its distance
  from the lower one over d): mean q, variance p (1 - p) d^2; beyond 6 it saturates (mean 6,
  no variance)."""
  step = np.repeat(np.asarray(scales, np.float64), 16, 1) * float(global_scale)
  q = np.abs(np.asarray(v, np.float64) / np.where(step == 0, 1, step))
  d = np.where(q < 2, 0.5, np.where(q < 4, 1.0, 2.0))
  p = np.where(q >= E2M1_MAX, 0.0, q / d - np.floor(q / d))
  mean = np.sign(v) * np.minimum(q, E2M1_MAX) * step
  return mean, p * (1 - p) * (d * step)**2


def test_stochastic_rounding_is_unbiased_through_the_backward(rng):
  """The mean of dgrad and wgrad over 256 keys approaches the GEMMs with the gradient's copies
  unrounded (each element's expectation under stochastic rounding: the element itself, clipped
  at the block's 6 steps): within 6 standard deviations of that mean, each draw's variance the
  sum of the products' (``sr_moments``; the draws of different elements are independent).
  Round to nearest differs from the same expectation by far more."""
  m, k, n, draws = 32, 64, 48, 256
  x = np.asarray(rng.standard_normal((m, k)), np.float32)
  w = np.asarray(rng.standard_normal((k, n)) / 8, np.float32)
  t = np.asarray(rng.standard_normal((m, n)), np.float32)

  def grads(key):
    _, vjp = jax.vjp(lambda x, w: jax_fp8.linear(x, w, recipe=NV, key=key), x, w)
    return vjp(t)

  keys = jax.random.split(jax.random.key(5), draws)
  dx, dw = jax.jit(jax.vmap(grads))(keys)
  rn = jax.jit(lambda x, w: jax.vjp(lambda x, w: jax_fp8.linear(
      x, w, recipe=jax_fp8.NVFP4BlockScaling(stochastic_rounding=False)), x, w)[1](t))(x, w)
  qx, qxt, qw, qg = twins(x, w, t, jax_fp8.NVFP4BlockScaling(stochastic_rounding=False))
  # dgrad: g along N (its scales as round to nearest sets them: they come from the amaxes)
  g_mean, g_var = sr_moments(t, qg.scale, qg.global_scale)
  wq = deq(qw)  # [K, N], the kernel as dgrad reads it
  want_dx, var_dx = g_mean @ wq.T, g_var @ (wq**2).T
  # wgrad: the gradient's transformed copy along M, against x's (both through the transform)
  gt = np.asarray(jitted(hadamard_transform, t, seed=NV.rht_seed, axis=0), np.float64).T
  gt_mean, gt_var = sr_moments(gt, qg.scale_t, qg.global_scale_t)
  xq = deq(qxt, "_t")  # [K, M]
  want_dw, var_dw = xq @ gt_mean.T, (xq**2) @ gt_var.T
  for got, want, var, nearest in ((dx, want_dx, var_dx, rn[0]), (dw, want_dw, var_dw, rn[1])):
    mean = np.asarray(got, np.float64).mean(0)
    sigma = np.sqrt(var / draws) + 1e-6 * np.abs(want)
    assert np.all(np.abs(mean - want) <= 6 * sigma), np.max(np.abs(mean - want) / sigma)
    assert np.max(np.abs(np.asarray(nearest) - want) / sigma) > 6  # the test can tell


def test_keys_draw_the_rounding(rng):
  """One key gives the same gradients twice; another key other gradients; the forward takes
  no key and needs none."""
  x = rng.standard_normal((32, 64)).astype(np.float32)
  w = (rng.standard_normal((64, 48)) / 8).astype(np.float32)
  grad = jax.jit(jax.grad(lambda w, key: jnp.sum(jax_fp8.linear(x, w, recipe=NV, key=key)**2)))
  a, b, c = grad(w, KEY), grad(w, KEY), grad(w, jax.random.key(12))
  np.testing.assert_array_equal(a, b)
  assert not np.array_equal(a, c)
  np.testing.assert_array_equal(jitted(jax_fp8.linear, x, w, recipe=NV),
                                jitted(jax_fp8.linear, x, w, recipe=NV, key=KEY))


def test_each_option_is_taken(rng):
  """Each of the recipe's options (2D weight blocks, stochastic rounding, the transform) turned
  on alone changes the gradients; with all off, wgrad is the GEMM of x's and the gradient's
  plain 1 x 16 quantizations along M."""
  x, w, b, t = problem(rng, lead=(32,), k=64, n=48)

  @functools.partial(jax.jit, static_argnums=0)
  def grads(recipe, key=None):
    return jax.grad(lambda x, w: jnp.sum(jax_fp8.linear(x, w, recipe=recipe, key=key) * t),
                    argnums=(0, 1))(x, w)
  plain = jax_fp8.NVFP4BlockScaling(weight_block_2d=False, stochastic_rounding=False, rht=False)
  base = grads(plain)
  for recipe, key in ((jax_fp8.NVFP4BlockScaling(stochastic_rounding=False, rht=False), None),
                      (jax_fp8.NVFP4BlockScaling(weight_block_2d=False, rht=False), KEY),
                      (jax_fp8.NVFP4BlockScaling(weight_block_2d=False,
                                                 stochastic_rounding=False), None)):
    assert any(not np.array_equal(a, c) for a, c in zip(grads(recipe, key), base)), recipe
  # Without the transform, stochastic rounding or 2D blocks, wgrad is x's and t's 1 x 16
  # quantizations along M: the twins' exactly, up to the order of the sums.
  qxt = nvfp4_twin(np.asarray(x), rowwise=False, columnwise=True)
  qgt = nvfp4_twin(np.asarray(t), rowwise=False, columnwise=True)
  within_order(base[1], deq(qxt, "_t"), deq(qgt, "_t").T)


def test_multi_linear_mlp_and_layers(rng):
  """multi_linear is linear per kernel (x quantized once; kernel i's gradient draws from the
  key folded with i); mlp is linear, the activation by XLA, linear (keys folded with 0 and 1);
  flax.Dense, nnx.Linear and a converted model draw their keys from the "stochastic_rounding"
  rng stream, and a forward needs none."""
  x, w, b, t = problem(rng, lead=(32,), k=64, n=96)
  w2 = jnp.asarray(rng.standard_normal((64, 32)) / 8, jnp.float32)
  t2 = np.asarray(rng.standard_normal((32, 32)), np.float32)

  # Each forward with its backward (two cotangents for multi_linear's, given as arguments) in
  # one compilation, not apart.
  def multi(w, w2, cotangents):
    ys, vjp = jax.vjp(lambda w, w2: jax_fp8.multi_linear(x, (w, w2), (b, None), recipe=NV,
                                                         key=KEY), w, w2)
    return ys, [vjp(c) for c in cotangents]

  def single(w, t):
    y, vjp = jax.vjp(lambda w: jax_fp8.linear(x, w, b, recipe=NV, key=KEY), w)
    return y, vjp(t)
  zeros = lambda n: np.zeros((32, n), np.float32)  # noqa: E731
  ys, (d_first, d_second) = jax.jit(multi)(w, w2, [(t, zeros(32)), (zeros(96), t2)])
  y, d_single = jax.jit(single)(w, t)
  np.testing.assert_array_equal(ys[0], y)
  np.testing.assert_array_equal(ys[1], jitted(jax_fp8.linear, x, w2, recipe=NV))
  np.testing.assert_array_equal(d_first[0], d_single[0])
  # kernel 1's gradient: the key folded with 1
  dw2 = d_second[1]
  _, qxt, _, qg = twins(np.asarray(x), w2, t2, index=1)
  within_order(dw2, deq(qxt, "_t"), deq(qg, "_t").T)

  w_in = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((32, 64)) / 8, jnp.float32)

  def composed(x, w_in, w_out):
    h = jax_fp8.linear(x, w_in, recipe=NV, key=jax.random.fold_in(KEY, 0))
    h = jax_fp8.activations.apply(h, "swiglu").astype(x.dtype)
    return jax_fp8.linear(h, w_out, recipe=NV, key=jax.random.fold_in(KEY, 1))

  loss = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a)**2), argnums=(0, 1, 2)))(  # noqa: E731
      x, w_in, w_out)
  for a, c in zip(loss(lambda x, w_in, w_out: jax_fp8.mlp(x, w_in, w_out, recipe=NV, key=KEY)),
                  loss(composed)):
    np.testing.assert_array_equal(a, c)

  layer = jax_fp8.flax.Dense(96, recipe=NV)
  params = jax.jit(layer.init)(jax.random.key(0), x)
  assert set(params) == {"params"}
  apply = jax.jit(layer.apply)
  np.testing.assert_array_equal(apply(params, x), apply(params, x, rngs={
      "stochastic_rounding": KEY}))
  grad_of = jax.jit(jax.grad(lambda p, key: jnp.sum(layer.apply(p, x, rngs={
      "stochastic_rounding": key})**2)))
  grad = lambda key: grad_of(params, key)["params"]["kernel"]  # noqa: E731
  np.testing.assert_array_equal(grad(KEY), grad(KEY))
  assert not np.array_equal(grad(KEY), grad(jax.random.key(12)))
  with pytest.raises(ValueError, match=r"rngs=\{'stochastic_rounding': key\}"):
    jax.jit(jax.grad(lambda p: jnp.sum(layer.apply(p, x))))(params)

  lin = jax_fp8.nnx.Linear(64, 96, recipe=NV, rngs=nnx.Rngs(0, stochastic_rounding=3))
  step = nnx.jit(lambda m: nnx.grad(lambda m: jnp.sum(m(x)**2))(m)["kernel"].get_value())
  assert not np.array_equal(step(lin), step(lin))  # the stream advances each call
  model = convert(nnx.Sequential(nnx.Linear(64, 96, rngs=nnx.Rngs(0))), NV,
                  rngs=nnx.Rngs(stochastic_rounding=4))
  assert isinstance(model.layers[0], jax_fp8.nnx.Linear) and model.layers[0].rngs is not None
  assert not np.array_equal(step(model.layers[0]), step(model.layers[0]))


def test_converted_linen_model_draws_from_the_stream(rng):
  """A linen model converted under NVFP4BlockScaling takes its keys from the
  "stochastic_rounding" stream given to apply: one key, the same gradients; another, others;
  none, the error that names the stream."""
  import flax.linen as nn

  class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(32, name="out")(nn.relu(nn.Dense(64, name="hidden")(x)))

  model = convert(Model(), NV)
  x = rng.standard_normal((16, 32)).astype(np.float32)
  params = jax.jit(model.init)(jax.random.key(1), x)["params"]
  grad_of = jax.jit(lambda p, rngs: jax.grad(lambda p: jnp.sum(
      model.apply({"params": p}, x, rngs=rngs)**2))(p)["hidden"]["kernel"])
  grad = lambda rngs: grad_of(params, rngs)  # noqa: E731
  np.testing.assert_array_equal(grad({"stochastic_rounding": KEY}),
                                grad({"stochastic_rounding": KEY}))
  assert not np.array_equal(grad({"stochastic_rounding": KEY}),
                            grad({"stochastic_rounding": jax.random.key(12)}))
  with pytest.raises(ValueError, match="stochastic_rounding"):
    grad({})


@pytest.mark.parametrize("call,error,message", [
    (lambda: jax_fp8.NVFP4BlockScaling(rht=1), TypeError, r"NVFP4BlockScaling.rht must be a bool"),
    (lambda: jax_fp8.NVFP4BlockScaling(rht_seed=-1), ValueError,
     r"NVFP4BlockScaling.rht_seed must be an int in \[0, 2\^64\), got -1"),
    (lambda: jax_fp8.NVFP4BlockScaling(rht=False, rht_seed=3), ValueError,
     "rht_seed=3 with rht=False"),
    (lambda: jax_fp8.nnx.Linear(32, 16, recipe=NV, rngs=nnx.Rngs(params=0)), ValueError,
     "rngs has neither a 'stochastic_rounding' nor a 'default' stream"),
    (lambda: jax_fp8.linear(jnp.ones((4, 40)), jnp.ones((40, 16)), recipe=NV), ValueError,
     "NVFP4BlockScaling needs K and N multiples of 16"),
    (lambda: jax_fp8.linear(jnp.ones((4, 32)), jnp.ones((32, 16)), recipe=NV,
                            state=jax_fp8.LinearState.create()), ValueError,
     "NVFP4BlockScaling is stateless"),
    (lambda: jax_fp8.linear(jnp.ones((4, 32)), jnp.ones((32, 16)), key=KEY), ValueError,
     "key serves NVFP4BlockScaling's stochastic rounding.*DelayedScaling draws no random bits"),
    (lambda: jax_fp8.linear(jnp.ones((4, 32)), jnp.ones((32, 16)), key=KEY,
                            recipe=jax_fp8.NVFP4BlockScaling(stochastic_rounding=False)),
     ValueError, r"NVFP4BlockScaling\(stochastic_rounding=False\) draws no random bits"),
    (lambda: jax_fp8.linear(jnp.ones((4, 32)), jnp.ones((32, 16)), recipe=NV,
                            key=jnp.zeros(3, jnp.uint32)), ValueError,
     "key must be a JAX PRNG key of two uint32 words"),
    (lambda: jax_fp8.mlp(jnp.ones((4, 32)), jnp.ones((32, 32)), jnp.ones((16, 32)), recipe=NV,
                         key=jnp.float32(1)), ValueError, "key must be a JAX PRNG key"),
    (lambda: jax_fp8.linear(jnp.ones((4, 32)), jax_fp8.quantize_weight(
        jnp.ones((32, 16)), jax_fp8.DelayedScaling()), recipe=NV), TypeError,
     "under NVFP4BlockScaling pass the float kernel"),
    (lambda: convert(nnx.Linear(32, 16, rngs=nnx.Rngs(0)), NV), ValueError,
     "needs an nnx.Rngs for its keys"),
    (lambda: convert(nnx.Linear(32, 16, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0)), ValueError,
     "draws no keys: pass rngs=None"),
])
def test_errors(call, error, message):
  with pytest.raises(error, match=message):
    call()
