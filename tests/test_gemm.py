"""gemm against an f32 reference: operands exactly FP8, tolerance from the output dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ACCUMULATION, on_cpu, poison_allocator, roundoff, to_device

import jax_fp8
from jax_fp8 import reference
from jax_fp8.ops import blockwise

PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")]
# Elementwise relative error allowed beside the accumulation's (below): one ulp of the output
# (2 x roundoff: its rounding, and the f32 scaling and bias add before it); an f32 output is
# only as good as the tensor cores' accumulation, ACCUMULATION (about 14 bits, so 2^-12, not
# f32's 2^-24).
RTOL = {jnp.bfloat16: 2 * roundoff(jnp.bfloat16), jnp.float16: 2 * roundoff(jnp.float16),
        jnp.float32: ACCUMULATION}


def accumulation_error(product, a, b, sa, sb, rel=ACCUMULATION):
  """Elementwise bound on the FP8 tensor cores' accumulation error: ``rel`` (ACCUMULATION,
  2^-12, unless told) of the scaled |a| @ |b| that ``product`` (reference.gemm or block_gemm)
  gives, plus 1e-6."""
  absdot = on_cpu(lambda *v: product(*v, out_dtype=jnp.float32), np.abs(np.asarray(a)),
                  np.abs(np.asarray(b)), sa, sb)  # |x| of an FP8 element is exact in NumPy
  return rel * absdot + 1e-6


def fp8_operand(rng, shape, fmt):
  x = rng.standard_normal(shape).astype(np.float32) * 4
  return to_device(x, jax_fp8.fp8_dtype(fmt))


@pytest.mark.parametrize("fa,fb", PAIRS)
# A fused bias needs a bf16 / f16 output (an f32 one is rejected: test_bad_inputs).
@pytest.mark.parametrize("out_dtype,with_bias", [
    (jnp.bfloat16, False), (jnp.bfloat16, True), (jnp.float16, False), (jnp.float16, True),
    (jnp.float32, False)], ids=["bfloat16", "bfloat16-bias", "float16", "float16-bias", "float32"])
@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (37, 48, 80), (256, 384, 512)])
def test_gemm_matches_f32(platform, rng, fa, fb, out_dtype, with_bias, m, n, k):
  a, b = fp8_operand(rng, (m, k), fa), fp8_operand(rng, (n, k), fb)
  sa, sb = jnp.float32(rng.uniform(0.01, 2)), jnp.float32(rng.uniform(0.01, 2))
  bias = to_device(rng.standard_normal(n) * 10, out_dtype) if with_bias else None
  got = jax.jit(jax_fp8.gemm, static_argnames="out_dtype")(a, b, sa, sb, bias=bias,
                                                           out_dtype=out_dtype)
  assert got.shape == (m, n) and got.dtype == out_dtype
  want = on_cpu(lambda *v: reference.gemm(*v[:4], bias=v[4] if with_bias else None,
                                          out_dtype=jnp.float32), a, b, sa, sb, bias)
  got = np.asarray(got).astype(np.float32)
  assert np.all(np.isfinite(got))
  # Elementwise: output rounding plus an accumulation error bounded by the sum of |products|;
  # normwise, the norm of that bound.
  bound = RTOL[out_dtype] * np.abs(want) + accumulation_error(reference.gemm, a, b, sa, sb)
  err = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err <= np.linalg.norm(bound) / np.linalg.norm(want), err
  assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


# Fast accumulation never promotes the tensor cores' partial sums to f32, so its error grows
# with K: bounded here by 2^-8 of |a| @ |b| (the benchmark's "gemm" rows give the measured
# error at the large shapes).
@pytest.mark.parametrize("k", [512, 4096])
def test_gemm_fast_accum(platform, rng, k):
  a, b = fp8_operand(rng, (64, k), "e4m3"), fp8_operand(rng, (128, k), "e5m2")
  sa, sb = jnp.float32(rng.uniform(0.01, 2)), jnp.float32(rng.uniform(0.01, 2))
  run = jax.jit(jax_fp8.gemm, static_argnames=("out_dtype", "fast_accum"))
  fast = np.asarray(run(a, b, sa, sb, out_dtype=jnp.float32, fast_accum=True))
  exact = np.asarray(run(a, b, sa, sb, out_dtype=jnp.float32))
  want = on_cpu(lambda *v: reference.gemm(*v, out_dtype=jnp.float32), a, b, sa, sb)
  bound = accumulation_error(reference.gemm, a, b, sa, sb, rel=2**-8)
  assert np.all(np.abs(fast - want) <= bound), np.max(np.abs(fast - want) / bound)
  # CPU ignores the flag; on CUDA it reaches cuBLASLt and changes the accumulation.
  assert np.array_equal(fast, exact) == (platform == "cpu")


def test_gemm_zero_rows(platform):
  a = jnp.zeros((0, 32), jnp.float8_e4m3fn)
  b = jnp.ones((16, 32), jnp.float8_e4m3fn)
  assert jax_fp8.gemm(a, b, jnp.float32(1), jnp.float32(1)).shape == (0, 16)


@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
def test_tiny_scales_do_not_underflow(platform, out_dtype):
  """Scales of tensors of magnitude 1e-20 and 1e-15 (about 2e-23 and 2e-18) multiply to an f32
  subnormal (4.9e-41), while the result (1.3e-33 at K = 128) is a normal f32: gemm, linear and
  the reference twin return it. Inputs quantize to 448 exactly, so the result is exact to the
  output's rounding (2^-8 for bf16); an underflowing scale product gives 0 on the CPU."""
  x = jnp.full((16, 128), 1e-20, jnp.float32)
  w = jnp.full((128, 32), 1e-15, jnp.float32)
  want = 128 * np.float64(1e-20) * np.float64(1e-15)  # every entry of x @ w
  qx = jax_fp8.quantize(x, jnp.float32(1e-20 / 448)).data
  qw = jax_fp8.quantize(w.T, jnp.float32(1e-15 / 448)).data
  sx, sw = jnp.float32(1e-20 / 448), jnp.float32(1e-15 / 448)
  assert float(sx) * float(sw) < np.finfo(np.float32).tiny  # the product alone underflows
  got = {"gemm": jax_fp8.gemm(qx, qw, sx, sw, out_dtype=out_dtype),
         "reference": on_cpu(lambda *a: reference.gemm(*a, out_dtype=out_dtype), qx, qw, sx, sw),
         "linear": jax_fp8.linear(x.astype(out_dtype), w.astype(out_dtype),
                                  state=jax_fp8.LinearState.create())}
  for name, y in got.items():
    np.testing.assert_allclose(np.asarray(y, np.float64), want, rtol=2**-7, err_msg=name)


def test_gemm_nan_propagates(platform, rng):
  a = fp8_operand(rng, (16, 32), "e4m3").at[3, 5].set(jnp.nan)
  b = fp8_operand(rng, (16, 32), "e4m3")
  d = np.asarray(jax_fp8.gemm(a, b, jnp.float32(1), jnp.float32(1))).astype(np.float32)
  assert np.all(np.isnan(d[3])) and np.all(np.isfinite(np.delete(d, 3, axis=0)))



# An e4m3 output: q = saturate(rne(d / out_scale)) and amax = max |d| (cuBLASLt's amax-D).
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("headroom", [1.0, 0.25], ids=["fits", "saturates"])
@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (37, 48, 80), (256, 384, 512)])
def test_gemm_e4m3_out(platform, rng, with_bias, headroom, m, n, k):
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (n, k), "e4m3")
  sa, sb = jnp.float32(rng.uniform(0.01, 2)), jnp.float32(rng.uniform(0.01, 2))
  bias = to_device(rng.standard_normal(n) * 10, jnp.bfloat16) if with_bias else None
  want = on_cpu(lambda *v: reference.gemm(*v[:4], bias=v[4], out_dtype=jnp.float32),
                a, b, sa, sb, bias)
  amax_want = np.max(np.abs(want))
  # headroom 1: the largest |d| lands near 448; 0.25: a quarter of the range, so the largest
  # values saturate to +-448.
  out_scale = jnp.float32(amax_want / 448 * headroom)
  poison_allocator(m * n)
  q, amax = jax.jit(jax_fp8.gemm, static_argnames="out_dtype")(
      a, b, sa, sb, bias=bias, out_dtype=jnp.float8_e4m3fn, out_scale=out_scale)
  assert q.shape == (m, n) and q.dtype == jnp.float8_e4m3fn and amax.shape == ()
  got = np.asarray(q).astype(np.float32)
  assert np.all(np.isfinite(got))  # saturation, never NaN, and every element written
  acc_err = accumulation_error(reference.gemm, a, b, sa, sb)
  # With a bias, cuBLASLt 13.1's epilogue beside an e4m3 D adds it in bf16 (C's type): its amax
  # was 0.74% (2^-7.1) off the f32 result on the H200, so allow 2^-6 relative there.
  epi = 2**-6 if with_bias else 0.0
  assert abs(float(amax) - amax_want) <= epi * amax_want + acc_err.max(), (float(amax),
                                                                           amax_want)
  y = want / float(out_scale)  # the exact result in units of the output's step
  # e4m3 rounding: half a step of 2^-3 relative (of 2^-9 absolute among subnormals).
  half_step = float(jnp.finfo(jnp.float8_e4m3fn).smallest_subnormal) / 2
  bound = (roundoff("e4m3") + epi) * np.abs(y) + half_step + acc_err / float(out_scale)
  fits = np.abs(y) < 448 - bound
  assert np.all(np.abs(got - y)[fits] <= bound[fits]), np.max((np.abs(got - y) / bound)[fits])
  over = np.abs(y) > 464 + bound  # beyond 448's rounding interval: saturated
  assert np.array_equal(got[over], 448 * np.sign(y[over]))
  assert over.any() == (headroom < 1)


def test_gemm_e4m3_out_nan(platform, rng):
  """A NaN operand stays visible: NaN in its output row and a NaN amax (so a scale ring that
  takes it keeps its last finite scale)."""
  a = fp8_operand(rng, (16, 32), "e4m3").at[3, 5].set(jnp.nan)
  b = fp8_operand(rng, (16, 32), "e4m3")
  q, amax = jax_fp8.gemm(a, b, jnp.float32(1), jnp.float32(1), out_dtype=jnp.float8_e4m3fn,
                         out_scale=jnp.float32(0.5))
  d = np.asarray(q).astype(np.float32)
  assert np.all(np.isnan(d[3])) and np.all(np.isfinite(np.delete(d, 3, axis=0)))
  assert np.isnan(float(amax))

def test_bad_inputs():
  e4 = jnp.ones((32, 32), jnp.float8_e4m3fn)
  e5 = jnp.ones((32, 32), jnp.float8_e5m2)
  one = jnp.float32(1)
  with pytest.raises(TypeError, match="a must be float8"):
    jax_fp8.gemm(jnp.ones((32, 32)), e4, one, one)
  with pytest.raises(TypeError, match="e5m2 x e5m2"):
    jax_fp8.gemm(e5, e5, one, one)
  with pytest.raises(ValueError, match="share K"):
    jax_fp8.gemm(e4, jnp.ones((32, 48), jnp.float8_e4m3fn), one, one)
  with pytest.raises(ValueError, match="multiples of 16"):
    jax_fp8.gemm(jnp.ones((8, 24), jnp.float8_e4m3fn), jnp.ones((32, 24), jnp.float8_e4m3fn),
                 one, one)
  with pytest.raises(ValueError, match="scales must be float32 scalars"):
    jax_fp8.gemm(e4, e4, jnp.ones(2), one)
  # Block scales need K a multiple of 128 and the shapes of one scale mode.
  with pytest.raises(ValueError, match=r"K a multiple of 128: K=32 is not"):
    jax_fp8.gemm(e4, e4, jnp.ones((32, 1)), jnp.ones((1, 1)))
  a128, b128 = jnp.ones((32, 256), jnp.float8_e4m3fn), jnp.ones((48, 256), jnp.float8_e4m3fn)
  with pytest.raises(ValueError, match=r"got a_scale \[32, 1\] and b_scale \[1, 2\]"):
    jax_fp8.gemm(a128, b128, jnp.ones((32, 1)), jnp.ones((1, 2)))
  with pytest.raises(ValueError, match=r"a_scale \[M, K/128\] = \[32, 2\]"):
    jax_fp8.gemm(a128, b128, jnp.ones((2, 32)), jnp.ones((48, 2)))
  with pytest.raises(ValueError, match="scales must be float32 scalars"):
    jax_fp8.gemm(a128, b128, jnp.ones((32, 2)), jnp.ones((47, 2)))
  with pytest.raises(ValueError, match="scales must be float32 scalars"):  # block with scalar
    jax_fp8.gemm(a128, b128, jnp.ones((32, 2)), one)
  with pytest.raises(TypeError, match="block-scaled GEMMs take e4m3 operands"):
    jax_fp8.gemm(a128, b128.astype(jnp.float8_e5m2), jnp.ones((32, 2)), jnp.ones((1, 2)))
  with pytest.raises(TypeError, match="fast_accum must be a bool"):
    jax_fp8.gemm(e4, e4, one, one, fast_accum=("fprop",))
  with pytest.raises(ValueError, match="fast_accum applies to per-tensor scales only"):
    jax_fp8.gemm(a128, b128, jnp.ones((32, 2)), jnp.ones((1, 2)), fast_accum=True)
  with pytest.raises(TypeError, match="a_scale must be float32, got int32"):
    jax_fp8.gemm(a128, b128, jnp.ones((32, 2), jnp.int32), jnp.ones((1, 2)))
  with pytest.raises(TypeError, match="b_scale must be float32, got int32"):
    jax_fp8.gemm(e4, e4, one, jnp.int32(1))
  with pytest.raises(TypeError, match="fused bias needs"):
    jax_fp8.gemm(e4, e4, one, one, bias=jnp.ones(32), out_dtype=jnp.float32)
  with pytest.raises(ValueError, match="bias must be"):
    jax_fp8.gemm(e4, e4, one, one, bias=jnp.ones(16, jnp.bfloat16))
  # An e4m3 output needs its scale, per-tensor operand scales and a bf16 bias.
  with pytest.raises(TypeError, match="needs out_scale"):
    jax_fp8.gemm(e4, e4, one, one, out_dtype=jnp.float8_e4m3fn)
  with pytest.raises(TypeError, match="out_scale applies to out_dtype float8_e4m3fn only"):
    jax_fp8.gemm(e4, e4, one, one, out_scale=one)
  with pytest.raises(TypeError, match="out_scale must be a float32 scalar"):
    jax_fp8.gemm(e4, e4, one, one, out_dtype=jnp.float8_e4m3fn, out_scale=jnp.ones(2))
  with pytest.raises(ValueError, match="per-tensor scales only, got block scales"):
    jax_fp8.gemm(a128, b128, jnp.ones((32, 2)), jnp.ones((1, 2)), out_dtype=jnp.float8_e4m3fn,
                 out_scale=one)
  with pytest.raises(TypeError, match=r"bias must be \[32\] bfloat16"):
    jax_fp8.gemm(e4, e4, one, one, bias=jnp.ones(32, jnp.float16), out_dtype=jnp.float8_e4m3fn,
                 out_scale=one)
  with pytest.raises(TypeError, match="out_dtype must be one of float32, bfloat16, float16, "
                                      "float8_e4m3fn, got float8_e5m2"):
    jax_fp8.gemm(e4, e4, one, one, out_dtype=jnp.float8_e5m2)


# Block scaling (DeepSeek-V3 recipe): a with 1 x 128 scales [M, K/128]; b with 128 x 128 block
# scales [ceil(N/128), K/128] (mode 1) or 1 x 128 scales [N, K/128] (mode 2).
BLOCK_SHAPES = [(1, 16, 128), (40, 48, 256), (256, 384, 512), (300, 272, 384)]


def block_scales(rng, shape):
  """Positive f32 scales, half of them powers of two (2^-6..2^2), half not (0.01..2)."""
  pow2 = 2.0 ** rng.integers(-6, 3, size=shape)
  other = rng.uniform(0.01, 2, size=shape)
  return to_device(np.where(rng.random(shape) < 0.5, pow2, other), np.float32)


def b_scale_shape(mode, n, k):
  return (-(-n // 128) if mode == 1 else n, k // 128)


def check_block_gemm(got, a, b, sa, sb, bias, out_dtype):
  """Normwise and elementwise against reference.block_gemm in f32, the bounds as in
  test_gemm_matches_f32: output rounding plus ACCUMULATION (2^-12) of the scaled |a| @ |b|."""
  want = on_cpu(lambda *v: reference.block_gemm(*v[:4], bias=v[4], out_dtype=jnp.float32),
                a, b, sa, sb, bias)
  got = np.asarray(got).astype(np.float32)
  assert np.all(np.isfinite(got))
  bound = RTOL[out_dtype] * np.abs(want) + accumulation_error(reference.block_gemm, a, b, sa, sb)
  err = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err <= np.linalg.norm(bound) / np.linalg.norm(want), err
  assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


@pytest.mark.parametrize("mode", [1, 2], ids=["b128x128", "b1x128"])
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("m,n,k", BLOCK_SHAPES)
def test_block_gemm_matches_f32(platform, rng, mode, out_dtype, m, n, k):
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (n, k), "e4m3")
  sa, sb = block_scales(rng, (m, k // 128)), block_scales(rng, b_scale_shape(mode, n, k))
  got = jax.jit(jax_fp8.gemm, static_argnames="out_dtype")(a, b, sa, sb, out_dtype=out_dtype)
  assert got.shape == (m, n) and got.dtype == out_dtype
  check_block_gemm(got, a, b, sa, sb, None, out_dtype)


@pytest.mark.parametrize("m,n,k", [(40, 48, 256), (300, 272, 384)])
def test_block_gemm_bias(platform, rng, m, n, k):
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (n, k), "e4m3")
  sa, sb = block_scales(rng, (m, k // 128)), block_scales(rng, b_scale_shape(1, n, k))
  bias = to_device(rng.standard_normal(n) * 10, jnp.bfloat16)
  got = jax.jit(jax_fp8.gemm)(a, b, sa, sb, bias=bias)
  assert got.shape == (m, n) and got.dtype == jnp.bfloat16
  check_block_gemm(got, a, b, sa, sb, bias, jnp.bfloat16)


def test_block_quantized_product(platform, rng):
  """group_quantize(x) (1 x 128) times block_quantize(w) (128 x 128), or w in 1 x 128 groups,
  close to the f32 product x @ w.T: each operand element within 2^-4 of itself (e4m3), so the
  product, as a whole and row by row, within about the sum of the two, plus the output's
  rounding (measured: at most 3.9% as a whole, 4.6% per row, over 40 seeds)."""
  m, n, k = 192, 272, 512
  x = rng.standard_normal((m, k)).astype(np.float32)
  x *= 2.0 ** rng.uniform(-8, 8, size=(m, 1))  # tokens of very different magnitudes
  x = to_device(x, jnp.bfloat16)
  w = to_device(rng.standard_normal((n, k)) * 0.02, jnp.bfloat16)
  want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
  qx = blockwise.group_quantize(x)
  for qw in (blockwise.block_quantize(w), blockwise.group_quantize(w)):
    for out_dtype in (jnp.float32, jnp.bfloat16):
      y = np.asarray(jax_fp8.gemm(qx.data, qw.data, qx.scale, qw.scale,
                                  out_dtype=out_dtype)).astype(np.float32)
      tol = 2 * roundoff("e4m3") + roundoff(out_dtype)
      rel = np.linalg.norm(y - want) / np.linalg.norm(want)
      assert rel < tol, rel
      rows = np.linalg.norm(y - want, axis=1) / np.linalg.norm(want, axis=1)
      assert np.all(rows < tol), rows.max()  # per token too: the small rows are not swamped
