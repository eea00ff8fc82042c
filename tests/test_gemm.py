"""gemm against an f32 reference: operands exactly FP8, tolerance from the output dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import on_cpu

import jax_fp8
from jax_fp8 import reference

PAIRS = [("e4m3", "e4m3"), ("e4m3", "e5m2"), ("e5m2", "e4m3")]
# Normwise relative error allowed: the output's rounding (bf16 2^-8, f16 2^-11) plus the
# accumulation. Hopper's FP8 tensor cores accumulate with fewer than f32's bits (about 14,
# DeepSeek-V3 technical report, section 3.3.2), so an f32 output is good to ~2^-13, not 2^-24.
TOL = {jnp.bfloat16: 8e-3, jnp.float16: 1e-3, jnp.float32: 2e-4}
RTOL = {jnp.bfloat16: 2**-7, jnp.float16: 2**-10, jnp.float32: 2**-12}


def fp8_operand(rng, shape, fmt):
  x = rng.standard_normal(shape).astype(np.float32) * 4
  return jnp.asarray(x).astype(jax_fp8.fp8_dtype(fmt))


@pytest.mark.parametrize("fa,fb", PAIRS)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float16, jnp.float32],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("m,n,k", [(1, 16, 16), (37, 48, 80), (256, 384, 512)])
def test_gemm_matches_f32(platform, rng, fa, fb, out_dtype, with_bias, m, n, k):
  if with_bias and out_dtype == jnp.float32:
    pytest.skip("a fused bias needs a bf16 / f16 output (tested in test_bad_inputs)")
  a, b = fp8_operand(rng, (m, k), fa), fp8_operand(rng, (n, k), fb)
  sa, sb = jnp.float32(rng.uniform(0.01, 2)), jnp.float32(rng.uniform(0.01, 2))
  bias = jnp.asarray(rng.standard_normal(n) * 10, out_dtype) if with_bias else None
  got = jax.jit(jax_fp8.gemm, static_argnames="out_dtype")(a, b, sa, sb, bias=bias,
                                                           out_dtype=out_dtype)
  assert got.shape == (m, n) and got.dtype == out_dtype
  want = on_cpu(lambda *v: reference.gemm(*v[:4], bias=v[4] if with_bias else None,
                                          out_dtype=jnp.float32), a, b, sa, sb, bias)
  got = np.asarray(got.astype(jnp.float32))
  assert np.all(np.isfinite(got))
  err = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err < TOL[out_dtype], err
  # Elementwise: output rounding plus an accumulation error bounded by the sum of |products|.
  absdot = on_cpu(lambda a, b, sa, sb: reference.gemm(
      jnp.abs(a.astype(jnp.float32)).astype(a.dtype), jnp.abs(b.astype(jnp.float32)).astype(
          b.dtype), sa, sb, out_dtype=jnp.float32), a, b, sa, sb)
  bound = RTOL[out_dtype] * np.abs(want) + 2**-12 * absdot + 1e-6
  assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


def test_gemm_zero_rows(platform):
  a = jnp.zeros((0, 32), jnp.float8_e4m3fn)
  b = jnp.ones((16, 32), jnp.float8_e4m3fn)
  assert jax_fp8.gemm(a, b, jnp.float32(1), jnp.float32(1)).shape == (0, 16)


def test_gemm_nan_propagates(platform, rng):
  a = fp8_operand(rng, (16, 32), "e4m3").at[3, 5].set(jnp.nan)
  b = fp8_operand(rng, (16, 32), "e4m3")
  d = np.asarray(jax_fp8.gemm(a, b, jnp.float32(1), jnp.float32(1)).astype(jnp.float32))
  assert np.all(np.isnan(d[3])) and np.all(np.isfinite(np.delete(d, 3, axis=0)))


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
  with pytest.raises(TypeError, match="a_scale must be a float32 scalar"):
    jax_fp8.gemm(e4, e4, jnp.ones(2), one)
  with pytest.raises(TypeError, match="fused bias needs"):
    jax_fp8.gemm(e4, e4, one, one, bias=jnp.ones(32), out_dtype=jnp.float32)
  with pytest.raises(ValueError, match="bias must be"):
    jax_fp8.gemm(e4, e4, one, one, bias=jnp.ones(16, jnp.bfloat16))
