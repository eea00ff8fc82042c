"""dequantize's values, and the 65535 x 128-row limit of the block kernels (CUDA's gridDim.y,
one grid row per 128 rows), checked at trace time with abstract inputs: nothing big is
allocated."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_fp8
from jax_fp8 import reference

LIMIT = 65535 * 128  # rows


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_dequantize_values(platform, rng, fmt, dtype):
  """Every FP8 byte (NaN aside) times a scale, against exact arithmetic: the product of an FP8
  value (at most 4 significant bits) and an f32 scale (24) is exact in f64, so dequantize in
  f32 must equal its f32 rounding, and in bf16 that value's rounding to bf16 (f32 -> bf16 is
  one correctly rounded step; the double rounding through f32 is what the op documents)."""
  dt = jax_fp8.fp8_dtype(fmt)
  q = np.arange(256, dtype=np.uint8).view(dt)
  q = q[np.isfinite(q.astype(np.float32))]
  scale = np.float32(rng.uniform(0.5, 2.0) * 2.0 ** rng.integers(-20, 20))
  got = np.asarray(jax.jit(lambda q: jax_fp8.dequantize(q, scale, dtype))(jnp.asarray(q)))
  exact = q.astype(np.float64) * np.float64(scale)
  want = exact.astype(np.float32).astype(jnp.dtype(dtype))
  assert got.dtype == jnp.dtype(dtype)
  np.testing.assert_array_equal(got.astype(np.float64), want.astype(np.float64))
  np.testing.assert_array_equal(
      got, np.asarray(reference.dequantize(jnp.asarray(q), scale, dtype)))


def rows(n, c=128):
  return jax.ShapeDtypeStruct((n, c), jnp.bfloat16)


@pytest.mark.parametrize("op", ["block_quantize", "group_cast_transpose"])
def test_row_limit_at_trace_time(op):
  fn = getattr(jax_fp8, op)
  jax.eval_shape(fn, rows(LIMIT))  # the limit itself traces
  with pytest.raises(ValueError, match=f"has {LIMIT + 1} rows; at most {LIMIT} "):
    jax.eval_shape(fn, rows(LIMIT + 1))


def test_block_linear_row_limit_under_grad():
  """BlockScaling's linear group-cast-transposes x [M, K] (M rows) and its gradient: one row
  over the limit raises when the gradient is traced, abstractly."""
  w = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  grad = jax.grad(lambda x, w: jnp.sum(jax_fp8.linear(x, w, recipe=jax_fp8.BlockScaling())
                                       .astype(jnp.float32)), argnums=(0, 1))
  jax.eval_shape(grad, rows(LIMIT), w)
  with pytest.raises(ValueError, match=f"has {LIMIT + 1} rows; at most {LIMIT} "):
    jax.eval_shape(grad, rows(LIMIT + 1), w)
