"""norm_cast_transpose and the layers' fused input norm (``norm=`` of linear, multi_linear,
mlp and their Flax layers): RMSNorm / LayerNorm computed inside x's cast-transpose.

The op is byte-identical to the jnp reference on every platform (csrc/norm.h rounds each
product and sum on its own, as the reference does). The layers are checked against the unfused
composition (``jax_fp8.norms.normalize`` by XLA, then the same layer without a norm: the same
quantizations, x's from f32 values instead of values rounded to x's dtype, so the same bits
on the CPU under f32 and otherwise an e4m3 step where that rounding crosses a midpoint) and
against f32 (within the operands' roundoffs, as test_linear bounds them); the norm's backward
is XLA's on both paths."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_same_quantized, bits, covering_cases, filled, jitted, normwise, on_cpu,
                      poison_allocator, reference_on_cpu, roundoff, to_device)
from flax import nnx

import jax_fp8
import jax_fp8.flax
import jax_fp8.nnx
from jax_fp8 import norms, reference

NORMS = ["rmsnorm", "layernorm"]
# Rows [R, C]; 1040 columns make 17 column tiles, 1000 rows 16 row tiles.
SHAPES = [(1, 16), (17, 48), (100, 208), (1000, 1040)]
E4M3, E5M2 = roundoff("e4m3"), roundoff("e5m2")
# Against f32, normwise (conftest.normwise): x (normed) and kernel each rounded to e4m3 once;
# a gradient GEMM's e5m2 (per-tensor) or e4m3 (block) gradient and its e4m3 operand.
FWD_TOL = normwise(E4M3, E4M3)  # 0.064
BWD_TOL = {"delayed": normwise(E5M2, E4M3), "block": normwise(E4M3, E4M3)}  # 0.101, 0.064


def unfused_tol(dtype, quantizations=1, roundings=1):
  """Fused and unfused differ only in quantizing x (normed) from f32 values or from values
  rounded to ``dtype`` (within u_d of themselves, or ``roundings`` u_d where they come from
  two computations of that many roundings): an e4m3 rounding then changes, by one step (at
  most 2 u4 of the element), only where that moves the value across a rounding midpoint
  (spaced 2 u4 of the binade), at most u_d / u4 of the time; RMS at most 2 sqrt(u4 u_d) per
  quantization, independent ones in quadrature."""
  u = roundings * roundoff(dtype)
  return float(np.sqrt(quantizations)) * 2 * float(np.sqrt(E4M3 * u))


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def params(rng, norm, k, dtype=jnp.float32):
  gamma = to_device(1 + 0.5 * rng.standard_normal(k), dtype)
  beta = to_device(0.5 * rng.standard_normal(k), dtype) if norm == "layernorm" else None
  return gamma, beta


def stats(x, norm, epsilon=1e-6):
  """norms.stats jitted (conftest.jitted): one program per shape, where eagerly each of its
  operations compiles."""
  return jitted(norms.stats, x, norm=norm, epsilon=epsilon)


# Every shape with every input dtype, the norm varied so that it meets every shape and dtype.
BYTES_CASES = covering_cases({"shape": SHAPES, "dtype": [jnp.float32, jnp.bfloat16, jnp.float16]},
                             {"norm": NORMS})


@pytest.mark.parametrize("shape,dtype,norm", BYTES_CASES)
def test_matches_reference_bytes(platform, rng, norm, dtype, shape):
  r, c = shape
  gamma, beta = params(rng, norm, c, dtype)
  ring = jax_fp8.ScaleRing.create(8, "e4m3")
  step = jax.jit(jax_fp8.norm_cast_transpose, static_argnames="norm")
  for _ in range(2):  # the fresh step (scale from the norm's own amax), then a delayed one
    x = to_device(rng.standard_normal((r, c)) * 3 + 1, dtype)
    row_stats = to_device(on_cpu(lambda x: jitted(norms.stats, x, norm=norm, epsilon=1e-6),
                                 x))  # one copy, for both
    poison_allocator(r * c)
    got = step(x, row_stats, gamma, beta, ring, norm=norm)
    want = reference_on_cpu(reference.norm_cast_transpose, x, row_stats, gamma, beta, ring,
                            norm=norm)
    assert_same_quantized(got.tensor, want.tensor)  # data, data_t, amax, scale
    assert got.dbias is None
    for u, v in zip(jax.tree.leaves(got.ring), jax.tree.leaves(want.ring)):
      np.testing.assert_array_equal(np.asarray(u), v)
    ring = want.ring


def test_apply_rounds_as_the_kernels(rng):
  """norms.apply (the reference's values) rounds LayerNorm's product before adding beta, also
  under jit, where XLA would otherwise fuse them into one multiply-add (the CPU has one)."""
  x = to_device(rng.standard_normal((64, 256)) * 3, np.float32)
  gamma, beta = params(rng, "layernorm", 256)
  st = stats(x, "layernorm")
  apart = np.float32(np.asarray(x) - np.asarray(st[:, :1])) * np.float32(
      np.asarray(st[:, 1:]) * np.asarray(gamma))
  want = np.float32(apart + np.asarray(beta))  # NumPy rounds each operation
  got = jax.jit(lambda *a: norms.apply(*a, "layernorm"))(x, st, gamma, beta)
  np.testing.assert_array_equal(np.asarray(got), want)


def test_normalize_matches_flax(rng):
  """jax_fp8.norms.normalize against flax.linen's RMSNorm and LayerNorm (f32 rounding apart:
  Flax multiplies rsigma into x before gamma)."""
  x = to_device(rng.standard_normal((8, 128)) * 2 + 0.5, np.float32)
  for norm, layer in (("rmsnorm", nn.RMSNorm(epsilon=1e-5)),
                      ("layernorm", nn.LayerNorm(epsilon=1e-5))):
    # each step jitted: one program each, where eagerly every operation compiles
    v = jax.jit(layer.init)(jax.random.key(0), x)
    p = jax.jit(lambda v: jax.tree.map(lambda a: a + jnp.linspace(0.5, 1.5, a.shape[0]), v))(
        v)["params"]
    want = jax.jit(layer.apply)({"params": p}, x)
    got = jitted(norms.normalize, x, p["scale"], p.get("bias"), norm=norm, epsilon=1e-5)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_nan_stays_visible(platform):
  x = np.ones((16, 64), np.float32)
  x[3, 5] = np.nan
  x = to_device(x)
  for norm in NORMS:
    gamma = filled(64, fill=1)
    beta = filled(64) if norm == "layernorm" else None
    out = jax_fp8.norm_cast_transpose(x, stats(x, norm), gamma, beta,
                                      jax_fp8.ScaleRing.create(4), norm=norm)
    assert np.isnan(float(out.tensor.amax))
    assert bits(out.tensor.data)[3, 5] == 0x7F and bits(out.tensor.data_t)[5, 3] == 0x7F


def test_bad_inputs():
  ring = jax_fp8.ScaleRing.create(4)
  x, g = filled(4, 32, fill=1), filled(32, fill=1)
  st = stats(x, "rmsnorm")
  with pytest.raises(ValueError, match="norm must be one of"):
    jax_fp8.norm_cast_transpose(x, st, g, None, ring, norm="batchnorm")
  with pytest.raises(TypeError, match="beta must be None under 'rmsnorm'"):
    jax_fp8.norm_cast_transpose(x, st, g, g, ring, norm="rmsnorm")
  with pytest.raises(TypeError, match=r"beta must be a \[K\] array under 'layernorm'"):
    jax_fp8.norm_cast_transpose(x, st, g, None, ring, norm="layernorm")
  with pytest.raises(ValueError, match=r"gamma must be \[32\]"):
    jax_fp8.norm_cast_transpose(x, st, filled(16, fill=1), None, ring, norm="rmsnorm")
  with pytest.raises(TypeError, match="gamma must be float32"):
    jax_fp8.norm_cast_transpose(x, st, filled(32, fill=1, dtype=np.int32), None, ring,
                                norm="rmsnorm")
  with pytest.raises(ValueError, match=r"row_stats must be \[4, 2\]"):
    jax_fp8.norm_cast_transpose(x, st, g, g, ring, norm="layernorm")
  with pytest.raises(ValueError, match="positive multiple of 16"):
    jax_fp8.norm_cast_transpose(filled(4, 24, fill=1), st, filled(24, fill=1), None, ring,
                                norm="rmsnorm")
  state = jax_fp8.LinearState.create()
  k = filled(32, 16, fill=1)
  with pytest.raises(ValueError, match="epsilon must be a finite float > 0"):
    jax_fp8.linear(x, k, state=state, norm="rmsnorm", gamma=g, epsilon=0.0)
  with pytest.raises(TypeError, match=r"norm='rmsnorm' needs gamma, its \[K\] scale, got None"):
    jax_fp8.linear(x, k, state=state, norm="rmsnorm")
  with pytest.raises(TypeError, match="gamma and beta are a norm's parameters"):
    jax_fp8.linear(x, k, state=state, gamma=g)
  with pytest.raises(ValueError, match=r"gamma must be \[32\]"):
    jax_fp8.mlp(x, filled(32, 32, fill=1), filled(16, 32, fill=1), state=jax_fp8.MlpState.create(),
                norm="rmsnorm", gamma=filled(16, fill=1))
  with pytest.raises(ValueError, match="Dense.norm must be one of"):
    jax_fp8.flax.Dense(16, norm="rms").init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="Mlp.norm_epsilon must be a finite float > 0"):
    jax_fp8.nnx.Mlp(32, 16, norm="layernorm", norm_epsilon=-1.0, rngs=nnx.Rngs(0))


def problem(rng, norm, k=64, n=48, dtype=jnp.float32):
  x = to_device(rng.standard_normal((3, 20, k)) * 2 + 0.3, dtype)
  kernel = to_device(rng.standard_normal((k, n)) / np.sqrt(k), np.float32)
  gamma, beta = params(rng, norm, k)
  t = to_device(rng.standard_normal((3, 20, n)), np.float32)
  return x, kernel, gamma, beta, t


def fused_and_unfused(layer, state, norm, epsilon=1e-6):
  """f(x, kernel, gamma, beta) of the layer with its norm fused, and the composition."""
  def fused(x, kernel, gamma, beta):
    return layer(x, kernel, state=state, norm=norm, gamma=gamma, beta=beta, epsilon=epsilon)

  def unfused(x, kernel, gamma, beta):
    h = norms.normalize(x, gamma, beta, norm=norm, epsilon=epsilon).astype(x.dtype)
    return layer(h, kernel, state=state)
  return fused, unfused


def output_and_grads(f, t, *args):
  """f's output and its gradients for the output gradient t, under one jit."""
  def run(*args):
    y, vjp = jax.vjp(f, *args)
    return y, vjp(t.astype(y.dtype))
  return jax.jit(run)(*args)


# recipe -> (linear under it, its state, K, N): BlockScaling's groups need multiples of 128.
LINEAR_RECIPES = {
    "delayed": (jax_fp8.linear, jax_fp8.LinearState.create(), 64, 48),
    "block": (functools.partial(jax_fp8.linear, recipe=jax_fp8.BlockScaling()), None, 256, 128),
}


@pytest.mark.parametrize("recipe,norm,dtype", covering_cases(
    {"recipe": list(LINEAR_RECIPES), "norm": NORMS}, {"dtype": [jnp.float32, jnp.bfloat16]}))
def test_linear_matches_unfused_and_f32(platform, rng, norm, dtype, recipe):
  """The norm fused into x's cast-transpose (per-tensor) or group cast-transpose (block)."""
  layer, state, k, n = LINEAR_RECIPES[recipe]
  x, kernel, gamma, beta, t = problem(rng, norm, k, n, dtype)
  fused, unfused = fused_and_unfused(layer, state, norm)
  got = output_and_grads(fused, t, x, kernel, gamma, beta)
  ref = output_and_grads(unfused, t, x, kernel, gamma, beta)

  def f32(x, kernel, gamma, beta):
    h = norms.normalize(x, gamma, beta, norm=norm, epsilon=1e-6)
    return jnp.matmul(h, kernel, precision=jax.lax.Precision.HIGHEST)
  exact = output_and_grads(f32, t, x.astype(jnp.float32), kernel, gamma, beta)
  # x's quantization from f32 values (fused) or from values rounded to x's dtype (unfused):
  # under f32 the same values, and on the CPU the same bits wherever the quantized x is all
  # that differs; the gradients of x and beta never see it (the same dgrad, then XLA's norm
  # backward); dgamma's XLA fusion differs under per-tensor scaling (f32 rounding apart).
  tol_unfused = unfused_tol(dtype)
  same_bits = platform == "cpu"
  # Where the quantized x is the same (f32 on the CPU), dgamma differs by f32 roundings of its
  # sum over the 60 rows alone: a random walk of about sqrt(60) roundoffs of f32.
  f32_order = np.sqrt(60) * roundoff(jnp.float32)
  assert rel(got[0], ref[0]) <= tol_unfused
  if same_bits and dtype == jnp.float32:
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
  assert rel(got[0], exact[0]) <= FWD_TOL + roundoff(dtype)
  identical = {"dx": True, "dkernel": dtype == jnp.float32, "dgamma": recipe == "block",
               "dbeta": True}
  for g, r, e, name in zip(got[1], ref[1], exact[1], identical):
    if e is None:  # RMSNorm's beta
      assert g is None and r is None
      continue
    assert g.dtype == r.dtype
    assert rel(g, r) <= tol_unfused, name  # the gradients' quantizations are the same
    if same_bits and identical[name]:
      np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
    elif same_bits and dtype == jnp.float32:
      assert rel(g, r) <= f32_order, name
    assert rel(g, e) <= BWD_TOL[recipe] + roundoff(dtype), name


# name -> (f(x, kernel [64, 48], **kw), its state, its output width, the e4m3 quantizations
# by which fused and unfused may differ: x's, and for mlp the activation's too).
LAYERS = {
    "multi_linear": (lambda x, kernel, **kw: jnp.concatenate(
        jax_fp8.multi_linear(x, (kernel, kernel[:, :32]), **kw), -1),
        jax_fp8.MultiLinearState.create(2), 80, 1),
    "mlp": (lambda x, kernel, **kw: jax_fp8.mlp(x, kernel, kernel.T, activation="gelu", **kw),
            jax_fp8.MlpState.create(), 64, 2),
}


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("layer", list(LAYERS))
def test_multi_linear_and_mlp_match_unfused(platform, rng, norm, layer):
  """multi_linear shares the one fused quantization among its kernels; mlp fuses the norm into
  x's cast-transpose as linear does."""
  f, state, width, quantizations = LAYERS[layer]
  x, kernel, gamma, beta, _ = problem(rng, norm)
  fused, unfused = fused_and_unfused(f, state, norm)
  t = to_device(rng.standard_normal((3, 20, width)), np.float32)
  got = output_and_grads(fused, t, x, kernel, gamma, beta)
  ref = output_and_grads(unfused, t, x, kernel, gamma, beta)
  # x is f32: the same values quantized, so on the CPU the same bits, except dgamma's XLA
  # fusion (f32 rounding apart), as in test_linear_matches_unfused_and_f32.
  tol = unfused_tol(x.dtype, quantizations)
  assert rel(got[0], ref[0]) <= tol
  if platform == "cpu":
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
  for g, r, name in zip(got[1], ref[1], ("dx", "dkernel", "dgamma", "dbeta")):
    if g is None:  # RMSNorm's beta
      continue
    assert rel(g, r) <= tol, name
    if platform == "cpu" and name != "dgamma":
      np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=name)
    elif platform == "cpu":  # f32 roundings of dgamma's sum over the 60 rows alone
      assert rel(g, r) <= np.sqrt(60) * roundoff(jnp.float32), name


def test_fused_path_runs_one_cast_transpose_for_x(rng):
  """Fused: x's norm is quantized by the kernel (no normalized copy of x goes in), under
  BlockScaling in its group cast-transpose when differentiated (its forward alone quantizes
  the norm by XLA: on the CPU the same bytes); the below-intensity path is the composition
  itself."""
  x, kernel, gamma, beta, _ = problem(rng, "layernorm")
  f = lambda x: jax_fp8.linear(x, kernel, state=jax_fp8.LinearState.create(),  # noqa: E731
                               norm="layernorm", gamma=gamma, beta=beta)
  hlo = jax.jit(f).lower(x).as_text()
  assert hlo.count("jax_fp8_cast_transpose_ring") == 2  # x (normed) and the kernel
  assert "norm = 2" in hlo
  block = jax_fp8.BlockScaling()
  xb = to_device(rng.standard_normal((2, 128, 128)), np.float32)
  kb, gb = kernel.repeat(2, 0).repeat(8, 1)[:128, :128], jnp.linspace(0.5, 1.5, 128)
  fb = lambda x: jax_fp8.linear(x, kb, recipe=block, norm="rmsnorm", gamma=gb)  # noqa: E731
  hlo = jax.jit(lambda x: jax.vjp(fb, x)[0]).lower(xb).as_text()
  assert hlo.count("jax_fp8_group_cast_transpose") == 1 and "norm = 1" in hlo
  want = jax_fp8.linear(norms.normalize(xb, gb, None, norm="rmsnorm", epsilon=1e-6), kb,
                        recipe=block)
  if jax.default_backend() == "cpu":
    np.testing.assert_array_equal(fb(xb), want)
    np.testing.assert_array_equal(jax.vjp(fb, xb)[0], want)
  else:  # XLA:GPU's fusions may sum a row's 128 squares in another order: its norm differs
    tol = unfused_tol(jnp.float32, roundings=128)  # by up to 128 f32 roundings
    assert rel(fb(xb), want) <= tol and rel(jax.vjp(fb, xb)[0], want) <= tol
  slow = jax_fp8.DelayedScaling(fp8_min_intensity=1e6)
  got = jax_fp8.linear(x, kernel, state=jax_fp8.LinearState.create(slow), recipe=slow,
                       norm="layernorm", gamma=gamma, beta=beta)
  want = norms.normalize(x, gamma, beta, norm="layernorm", epsilon=1e-6) @ kernel
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-5)


def test_flax_and_nnx_layers(rng):
  """The linen and NNX layers with a norm: "gamma" (and LayerNorm's "beta") parameters, the
  output of the function they wrap, gradients for the norm's parameters."""
  x = to_device(rng.standard_normal((2, 16, 64)), np.float32)
  for norm in NORMS:
    layer = jax_fp8.flax.Mlp(32, activation="swiglu", norm=norm, norm_epsilon=1e-5)
    v = layer.init(jax.random.key(0), x)
    p = v["params"]
    assert p["gamma"].shape == (64,) and ("beta" in p) == (norm == "layernorm")
    want = jax_fp8.mlp(x, p["kernel_in"], p["kernel_out"], p["bias_in"], p["bias_out"],
                       activation="swiglu", state=v["fp8_state"]["mlp"], norm=norm,
                       gamma=p["gamma"], beta=p.get("beta"), epsilon=1e-5)
    np.testing.assert_array_equal(layer.apply(v, x), want)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply({**v, "params": p}, x) ** 2)))(p)
    assert np.abs(np.asarray(grads["gamma"])).sum() > 0
    dense = jax_fp8.flax.MultiDense((32, 16), norm=norm)
    dv = dense.init(jax.random.key(1), x)
    outs = dense.apply(dv, x)
    want = jax_fp8.multi_linear(x, (dv["params"]["kernel_0"], dv["params"]["kernel_1"]),
                                (dv["params"]["bias_0"], dv["params"]["bias_1"]),
                                state=dv["fp8_state"]["linear"], norm=norm,
                                gamma=dv["params"]["gamma"], beta=dv["params"].get("beta"))
    for o, w in zip(outs, want):
      np.testing.assert_array_equal(o, w)
    m = jax_fp8.nnx.Linear(64, 32, norm=norm, rngs=nnx.Rngs(0))
    assert (m.beta is None) == (norm == "rmsnorm")
    want = jax_fp8.linear(x, m.kernel[...], m.bias[...], state=m.fp8_state.get_value(),
                          norm=norm, gamma=m.gamma[...],
                          beta=None if m.beta is None else m.beta[...])
    np.testing.assert_array_equal(m(x), want)
    mlp = jax_fp8.nnx.Mlp(64, 32, norm=norm, rngs=nnx.Rngs(0))
    grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(mlp)
    assert np.abs(np.asarray(grads["gamma"][...])).sum() > 0


def test_gradients_at_zero(rng):
  """Exact zeros in x, gamma and beta get their gradients (the layers initialize beta to
  zeros): against the norm written in plain jnp, with no subnormal flush."""
  x, kernel, _, _, t = problem(rng, "layernorm")
  x, gamma, beta = np.array(x), np.ones(64, np.float32), np.zeros(64, np.float32)
  x[..., 0], gamma[1], beta[2] = 0.0, 0.0, 0.5  # in NumPy: no eager scatter to compile
  x, gamma, beta = to_device(x), to_device(gamma), to_device(beta)

  def plain(x, kernel, gamma, beta):
    mu = jnp.mean(x, -1, keepdims=True)
    var = jnp.mean(x * x, -1, keepdims=True) - mu * mu
    h = (x - mu) * jax.lax.rsqrt(var + 1e-6) * gamma + beta
    return jnp.matmul(h, kernel, precision=jax.lax.Precision.HIGHEST)
  fused, _ = fused_and_unfused(jax_fp8.linear, jax_fp8.LinearState.create(), "layernorm")
  got = output_and_grads(fused, t, x, kernel, gamma, beta)[1]
  want = output_and_grads(plain, t, x, kernel, gamma, beta)[1]
  # dgamma and dbeta sum dh over the 60 rows, every row's error from the same rounded kernel:
  # the two roundings' errors may add rather than add in quadrature.
  tols = (BWD_TOL["delayed"],) * 2 + (normwise(E5M2 + E4M3),) * 2
  for g, w, tol, name in zip(got, want, tols, ("dx", "dkernel", "dgamma", "dbeta")):
    assert rel(g, w) <= tol, name
  assert np.all(np.asarray(got[3]) != 0) and np.asarray(got[2])[1] != 0  # beta 0, gamma[1] 0
  assert np.all(np.asarray(got[0])[..., 0] != 0)  # x's zero column


def test_norm_reads_x_in_its_own_dtype(rng):
  """With dtype=bfloat16 the GEMMs compute in bf16, and the norm reads an f32 x before any
  rounding: where a row's mean dwarfs its spread, rounding x to bf16 first (spacing 0.5 at
  100) would lose the spread."""
  x = to_device(rng.standard_normal((64, 64)) + 100.0, np.float32)
  kernel = to_device(rng.standard_normal((64, 32)) / 8, np.float32)
  gamma, beta = filled(64, fill=1), filled(64)
  exact = norms.normalize(x, gamma, beta, norm="layernorm", epsilon=1e-6) @ kernel
  # FP8: x and kernel in e4m3, the output in bf16; below the intensity XLA's bf16 GEMM: x,
  # kernel and output each rounded to bf16.
  bf16 = roundoff(jnp.bfloat16)
  for recipe, state, tol in ((jax_fp8.DelayedScaling(), jax_fp8.LinearState.create(),
                              FWD_TOL + bf16),
                             (jax_fp8.DelayedScaling(fp8_min_intensity=1e9),
                              jax_fp8.LinearState.create(), normwise(bf16, bf16, bf16))):
    y, vjp = jax.vjp(lambda x: jax_fp8.linear(x, kernel, state=state, recipe=recipe,
                                              norm="layernorm", gamma=gamma, beta=beta,
                                              dtype=jnp.bfloat16), x)
    assert y.dtype == jnp.bfloat16 and jax.eval_shape(vjp, y)[0].dtype == jnp.float32
    assert rel(y, exact) <= tol
  h = norms.normalize(x, gamma, beta, norm="layernorm", epsilon=1e-6)
  kw = dict(norm="layernorm", gamma=gamma, beta=beta, dtype=jnp.bfloat16)
  y, vjp = jax.vjp(lambda x: jax_fp8.mlp(x, kernel, kernel.T, activation="gelu",
                                         state=jax_fp8.MlpState.create(), **kw), x)
  assert y.dtype == jnp.bfloat16 and jax.eval_shape(vjp, y)[0].dtype == jnp.float32
  exact = jax.nn.gelu(h @ kernel, approximate=True) @ kernel.T
  # x, kernel, the activation and kernel.T each rounded to e4m3 (GELU's slope under 1.2).
  assert rel(y, exact) <= normwise(E4M3, E4M3, E4M3, E4M3) + roundoff(jnp.bfloat16)
  ys = jax_fp8.multi_linear(x, (kernel, kernel[:, :16]), state=jax_fp8.MultiLinearState.create(2),
                            **kw)
  assert ys[1].dtype == jnp.bfloat16 and rel(ys[0], h @ kernel) <= FWD_TOL + roundoff(jnp.bfloat16)
  layer = jax_fp8.flax.Dense(32, norm="layernorm", dtype=jnp.bfloat16)
  v = layer.init(jax.random.key(0), x)
  p = v["params"]
  y = layer.apply(v, x)
  exact = norms.normalize(x, p["gamma"], p["beta"], norm="layernorm", epsilon=1e-6) @ p["kernel"]
  assert y.dtype == jnp.bfloat16 and rel(y, exact + p["bias"]) <= FWD_TOL + roundoff(jnp.bfloat16)
  with pytest.raises(TypeError, match="dtype must be None, float32"):
    jax_fp8.linear(x, kernel, state=jax_fp8.LinearState.create(), dtype=jnp.int8)


def test_epsilon_and_statistics_types():
  x, g = filled(4, 32, fill=1), filled(32, fill=1)
  k, state = filled(32, 16, fill=1), jax_fp8.LinearState.create()
  y = jax_fp8.linear(x, k, state=state, norm="rmsnorm", gamma=g, epsilon=np.float32(1e-5))
  assert y.shape == (4, 16)
  with pytest.raises(TypeError, match="epsilon must be a float > 0, got str"):
    jax_fp8.linear(x, k, state=state, norm="rmsnorm", gamma=g, epsilon="1e-6")
  with pytest.raises(ValueError, match="epsilon must be a finite float > 0 .*, got inf"):
    jax_fp8.linear(x, k, state=state, norm="rmsnorm", gamma=g, epsilon=float("inf"))
  for eps in (1e-39, 1e39):  # 0 (a subnormal, flushed) and inf in f32
    with pytest.raises(ValueError, match="epsilon must be a finite float > 0 that is a normal f32"):
      jax_fp8.linear(x, k, state=state, norm="rmsnorm", gamma=g, epsilon=eps)
  with pytest.raises(ValueError, match="normal f32 .*, got 1e-39"):
    jax_fp8.norms.stats(x, "rmsnorm", 1e-39)
  with pytest.raises(ValueError, match="norm must be one of"):
    jax_fp8.norms.stats(x, "rms", 1e-6)
  with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16, got int32"):
    jax_fp8.norms.stats(x.astype(jnp.int32), "rmsnorm", 1e-6)
  with pytest.raises(TypeError, match="row_stats must be float32"):
    jax_fp8.norm_cast_transpose(x, filled(4, 1, fill=1, dtype=jnp.bfloat16), g, None,
                                jax_fp8.ScaleRing.create(4), norm="rmsnorm")


def test_float64_norm_parameters_compute_in_dtype():
  """float64 gamma and beta (under x64) go through the compute dtype, as the kernels do; their
  gradients are float64 again."""
  with jax.enable_x64(True):
    layer = jax_fp8.flax.Dense(32, norm="layernorm", dtype=jnp.float32,
                               param_dtype=jnp.float64)
    x = jnp.ones((4, 64), jnp.float32) * jnp.arange(64)
    v = jax.jit(layer.init)(jax.random.PRNGKey(0), x)
    grads = jax.jit(jax.grad(lambda p: jnp.sum(layer.apply({**v, "params": p}, x))))(v["params"])
    assert grads["gamma"].dtype == jnp.float64 and grads["beta"].dtype == jnp.float64
