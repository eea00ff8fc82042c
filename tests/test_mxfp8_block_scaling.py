"""MXFP8BlockScaling: linear, multi_linear and mlp with every GEMM operand in MXFP8 (1 x 32 E8M0
blocks along its contraction dimension, each direction quantized from the tensor itself) and
the GEMMs emulated (mxfp8_gemm), against the jnp twins and f32; the layers; recipe checks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import roundoff, summation_error
from test_linear import check_numerical_gradient, loss_f32, problem, rel

import jax_fp8
import jax_fp8.flax
from jax_fp8 import reference

MX = jax_fp8.MXFP8BlockScaling()
# Normwise error against f32, as test_linear's FWD_TOL: both operands in e4m3 blocks whose scale
# never saturates, each element moved by at most a unit roundoff of itself (2^-4; less than that
# plus its block's subnormal step for elements 2^15 below the block's largest), a product by
# about the sum of two. Measured on the problems here: 2.6% (y), 3.8-3.9% (dx, dkernel).
TOL = 2 * roundoff("e4m3")


@functools.partial(jax.jit, static_argnums=(2, 3))  # one compilation, not op by op
def ref_gemm(a, b, contract_a, contract_b):
  """a contracted with b over the given axes, each quantized along them by the jnp twin."""
  qa = reference.mxfp8_quantize(jnp.moveaxis(a, contract_a, -1))
  qb = reference.mxfp8_quantize(jnp.moveaxis(b, contract_b, -1))
  return reference.mxfp8_gemm(qa.data, qb.data, qa.scale, qb.scale,
                              out_dtype=jnp.float32)


def pad32(v):
  return jnp.pad(v, ((0, -v.shape[0] % 32), (0, 0)))


def within_order(got, want, a, b):
  """got equals want up to the order of an f32 sum of |a| @ |b| products (quantized: at most
  (1 + 2^-4)^2 larger), and a rounding of each result (the bias added after the sum)."""
  want = np.asarray(want, np.float64)
  bound = (2 * summation_error(a.shape[1]) * (1 + roundoff("e4m3"))**2 * (np.abs(a) @ np.abs(b))
           + 2 * roundoff(jnp.float32) * np.abs(want))
  err = np.abs(np.asarray(got, np.float64) - want)
  assert np.all(err <= bound), np.max(err / bound)


@pytest.mark.parametrize("lead", [(4, 16), (4, 9)], ids=["M=64", "M=36"])
def test_gemms_equal_the_twins(platform, rng, lead):
  """fprop, dgrad and wgrad are the jnp twins' MXFP8 GEMMs of the right operands (M padded
  with zero rows to whole blocks for wgrad), up to the order of the f32 sums."""
  x, w, b, t = problem(rng, lead=lead, k=64, n=96)
  f = lambda x, w, b: jax_fp8.linear(x, w, b, recipe=MX)  # noqa: E731

  def fwd_bwd(x, w, b, t):  # one compilation, not the backward op by op
    y, vjp = jax.vjp(f, x, w, b)
    return y, vjp(t)
  y, (dx, dw, db) = jax.jit(fwd_bwd)(x, w, b, t)
  x2, t2 = np.asarray(x).reshape(-1, 64), np.asarray(t).reshape(-1, 96)
  within_order(np.asarray(y).reshape(-1, 96), ref_gemm(x2, w, 1, 0) + b, x2, np.asarray(w))
  within_order(np.asarray(dx).reshape(-1, 64), ref_gemm(t2, w, 1, 1), t2, np.asarray(w).T)
  within_order(dw, ref_gemm(pad32(x2), pad32(t2), 0, 0), x2.T, t2)
  bound = 2 * summation_error(t2.shape[0]) * np.abs(t2).sum(0)  # one column sum, two orders
  assert np.all(np.abs(np.asarray(db, np.float64) - t2.sum(0, dtype=np.float64)) <= bound)


def test_each_gemm_blocks_its_contraction_axis(platform, rng):
  """Each GEMM's operands blocked along the axis it contracts, and only that: every operand's
  magnitude spans 2^-20 .. 2^20 along the other axis, so a block along the wrong one would mix
  magnitudes and flush its small elements to zero (far outside the twins' agreement)."""
  m, k, n = 36, 64, 96
  spread = lambda size: 2.0 ** np.linspace(-20, 20, size)  # noqa: E731
  normal = lambda shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
  x_m, g_m = normal((m, k)) * spread(m)[:, None], normal((m, n)) * spread(m)[:, None]
  w_n, w_k = normal((k, n)) * spread(n)[None, :], normal((k, n)) * spread(k)[:, None]
  x_k, g_n = normal((m, k)) * spread(k)[None, :], normal((m, n)) * spread(n)[None, :]

  def vjp(x, w, g):
    y, f = jax.vjp(lambda x, w: jax_fp8.linear(x, w, recipe=MX), x, w)
    return (y, *f(g))

  run = jax.jit(vjp)
  within_order(run(x_m, w_n, g_m)[0], ref_gemm(x_m, w_n, 1, 0), x_m, w_n)  # fprop: along K
  within_order(run(x_m, w_k, g_m)[1], ref_gemm(g_m, w_k, 1, 1), g_m, w_k.T)  # dgrad: along N
  within_order(run(x_k, w_n, g_n)[2], ref_gemm(pad32(x_k), pad32(g_n), 0, 0), x_k.T,
               g_n)  # wgrad: along M


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_forward_and_grads_against_f32(platform, rng, dtype):
  x, w, b, t = problem(rng, dtype=dtype, k=64, n=96)

  def loss(x, w, b):
    return jnp.sum(jax_fp8.linear(x, w, b, recipe=MX).astype(jnp.float32) * t)

  y = jax.jit(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=MX))(x, w, b)
  assert y.dtype == dtype
  f32 = [v.astype(jnp.float32) for v in (x, w, b)]
  out = roundoff(dtype)
  assert rel(y.astype(jnp.float32), f32[0] @ f32[1] + f32[2]) < TOL + out
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, w, b)
  want = jax.grad(loss_f32, argnums=(0, 1, 2))(*f32, t)
  for g, r, name in zip(grads, want, ("dx", "dkernel", "dbias")):
    assert g.dtype == dtype, name
    assert rel(g.astype(jnp.float32), r) < TOL + out, name


def test_numerical_gradient(rng):
  # The forward's quantization and the backward's, each TOL (as test_linear's check).
  x, w, b, t = problem(rng, lead=(8,), k=32, n=64)
  check_numerical_gradient(lambda x, w, b: jax_fp8.linear(x, w, b, recipe=MX), x, w, b, t,
                           2 * TOL)


def test_multi_linear_mlp_and_flax(rng):
  """multi_linear is linear per kernel (x quantized once); mlp is linear, the activation by
  XLA, linear; flax.Dense has no state and is linear."""
  x, w, b, _ = problem(rng, k=64, n=96)
  w2 = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
  ys = jax_fp8.multi_linear(x, (w, w2), (b, None), recipe=MX)
  for y, want in zip(ys, (jax_fp8.linear(x, w, b, recipe=MX), jax_fp8.linear(x, w2, recipe=MX))):
    np.testing.assert_array_equal(y, want)
  w_in = jnp.asarray(rng.standard_normal((64, 64)) / 8, jnp.float32)
  w_out = jnp.asarray(rng.standard_normal((32, 64)) / 8, jnp.float32)
  h = jax_fp8.activations.apply(jax_fp8.linear(x, w_in, recipe=MX), "swiglu").astype(x.dtype)
  np.testing.assert_array_equal(jax_fp8.mlp(x, w_in, w_out, recipe=MX),
                                jax_fp8.linear(h, w_out, recipe=MX))
  layer = jax_fp8.flax.Dense(96, recipe=MX)
  assert set(layer.init(jax.random.key(0), x)) == {"params"}
  np.testing.assert_array_equal(layer.apply({"params": {"kernel": w, "bias": b}}, x),
                                jax_fp8.linear(x, w, b, recipe=MX))


def test_mxfp8_gemm_is_exact_to_the_f32_sums(platform, rng):
  """The emulation's BF16 operands are the MXFP8 values exactly: the GEMM equals the f32 one
  of the dequantized operands up to the order of the f32 sums, for E4M3 and E5M2 data."""
  a = np.asarray(rng.standard_normal((48, 96)) * np.exp(rng.uniform(-8, 8, (48, 1))), np.float32)
  b = np.asarray(rng.standard_normal((40, 96)), np.float32)
  for fmt in ("e4m3", "e5m2"):
    qa, qb = (jax_fp8.mxfp8_quantize(v, fmt=fmt) for v in (a, b))
    got = jax_fp8.mxfp8_gemm(qa.data, qb.data, qa.scale, qb.scale,
                             out_dtype=jnp.float32)
    fa, fb = (np.asarray(jax_fp8.mxfp8_dequantize(q.data, q.scale), np.float64)
              for q in (qa, qb))
    bound = 2 * summation_error(96) * (np.abs(fa) @ np.abs(fb).T)
    assert np.all(np.abs(np.asarray(got, np.float64) - fa @ fb.T) <= bound)


def test_errors(rng):
  x, w, b, _ = problem(rng, k=64, n=96)
  with pytest.raises(ValueError, match="HYBRID is not offered"):
    jax_fp8.MXFP8BlockScaling(fp8_format="hybrid")
  with pytest.raises(ValueError, match="MXFP8BlockScaling needs K and N multiples of 32"):
    jax_fp8.linear(x[..., :48], w[:48], recipe=MX)
  with pytest.raises(ValueError, match="MXFP8BlockScaling is stateless"):
    jax_fp8.linear(x, w, recipe=MX, state=jax_fp8.LinearState.create())
  with pytest.raises(ValueError, match="MXFP8BlockScaling reduces no amax.*got 'data'"):
    jax_fp8.linear(x, w, recipe=MX, amax_axis_name="data")
  with pytest.raises(ValueError, match="MXFP8BlockScaling needs K and N multiples of 32.*got K=64, F=48, D=64"):
    jax_fp8.mlp(x, jnp.zeros((64, 96)), jnp.zeros((48, 64)), recipe=MX)
  with pytest.raises(TypeError, match="recipe must be"):
    jax_fp8.quantize_weight(w, MX)
  fw = jax_fp8.quantize_weight(w, jax_fp8.DelayedScaling())
  with pytest.raises(TypeError, match="under MXFP8BlockScaling pass the float kernel"):
    jax_fp8.linear(x, fw, recipe=MX)
  q = jax_fp8.mxfp8_quantize(w)
  with pytest.raises(ValueError, match="must share K"):
    jax_fp8.mxfp8_gemm(q.data, q.data[:, :64], q.scale, q.scale[:, :2])
  with pytest.raises(ValueError, match=r"b_scales uint8.*got b float8_e4m3fn\[64, 96\] and "
                                       r"b_scales float8_e4m3fn"):
    jax_fp8.mxfp8_gemm(q.data, q.data, q.scale, q.data)  # data as b_scales
  with pytest.raises(TypeError, match="b must be float8_e4m3fn or float8_e5m2, got float32"):
    jax_fp8.mxfp8_gemm(q.data, w, q.scale, q.scale)
  with pytest.raises(TypeError, match=r"got the class CurrentScaling: pass an instance"):
    jax_fp8.linear(x, w, recipe=jax_fp8.CurrentScaling)
