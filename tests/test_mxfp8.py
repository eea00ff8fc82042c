"""MXFP8's numerics (OCP MX v1.0 with RCEIL scales): the E8M0 scale rule in jax_fp8.formats and
the reference twin of MXFP8 quantization (jax_fp8.reference), the specification the kernels of
the NVFP4 / MXFP8 issue are to match byte for byte."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import block_scaled_data

from jax_fp8 import reference
from jax_fp8.formats import MX_BLOCK, e8m0_apply, e8m0_rceil, fp8_max

FMTS = ["e4m3", "e5m2"]
# Half the smallest subnormal of each format: the absolute rounding error near zero, in units of
# the block scale; and the relative one (half an ulp) of its normals.
HALF_SUBNORMAL = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}
HALF_ULP = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}


@pytest.mark.parametrize("fmt", FMTS)
def test_rceil_is_tight_and_never_overflows(rng, fmt):
  a = np.float32(10.0) ** rng.uniform(-30, 30, 4096).astype(np.float32)
  a = np.concatenate([a, np.float32(fp8_max(fmt)) * np.float32(2.0) ** np.arange(-20, 20)])
  k = np.asarray(e8m0_rceil(jnp.asarray(a), fmt)).astype(np.int64) - 127
  fmax = fp8_max(fmt)
  assert np.all(a / np.exp2(k) <= fmax)  # never saturates
  assert np.all(a / np.exp2(k - 1) > fmax)  # the smallest such power of two


@pytest.mark.parametrize("fmt", FMTS)
def test_special_blocks(fmt):
  a = jnp.asarray([0.0, 1e-45, 3.4e38, jnp.inf, -jnp.inf, jnp.nan], jnp.float32)
  got = np.asarray(e8m0_rceil(jnp.abs(a), fmt))
  # zero and tiny: the smallest scale (finite); huge: finite; inf and NaN: the NaN byte.
  assert list(got[:2]) == [0, 0] and got[2] < 255 and list(got[3:]) == [255, 255, 255]
  applied = np.asarray(e8m0_apply(jnp.float32(448), jnp.asarray([255, 0, 127], jnp.uint8)))
  assert np.isnan(applied[0]) and applied[1] == np.float32(448 * 2.0**-127) and applied[2] == 448


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
def test_round_trip_within_the_format_bound(rng, fmt, dtype):
  x = block_scaled_data(rng, (64, 128), MX_BLOCK, 3, dtype)
  t = reference.mxfp8_quantize(x, rowwise=True, columnwise=True, fmt=fmt)
  assert t["data"].dtype == jnp.dtype({"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[fmt])
  assert t["scales"].shape == (64, 4) and t["scales"].dtype == jnp.uint8
  assert t["data_t"].shape == (128, 64) and t["scales_t"].shape == (128, 2)
  for data, scales, ref in ((t["data"], t["scales"], x), (t["data_t"], t["scales_t"], x.T)):
    back = np.asarray(reference.mxfp8_dequantize(data, scales), np.float64)
    ref = np.asarray(ref, np.float64)
    scale = np.repeat(np.exp2(np.asarray(scales, np.float64) - 127), MX_BLOCK, axis=1)
    bound = np.maximum(HALF_ULP[fmt] * np.abs(ref), HALF_SUBNORMAL[fmt] * scale)
    assert np.all(np.abs(back - ref) <= bound)
  # Each direction from x itself: the columnwise copy is x.T's rowwise quantization.
  t2 = reference.mxfp8_quantize(x.T, fmt=fmt)
  assert np.array_equal(np.asarray(t["data_t"]).view(np.uint8), np.asarray(t2["data"]).view(
      np.uint8))


def test_nan_and_inf_blocks_stay_visible(rng):
  x = np.asarray(rng.standard_normal((2, 64)), np.float32)
  x[0, 3], x[1, 40] = np.nan, np.inf
  t = reference.mxfp8_quantize(jnp.asarray(x))
  assert np.asarray(t["scales"]).tolist()[0][0] == 255 and np.asarray(t["scales"])[1, 1] == 255
  back = np.asarray(reference.mxfp8_dequantize(t["data"], t["scales"]))
  assert np.all(np.isnan(back[0, :32])) and np.all(np.isnan(back[1, 32:]))
  assert np.all(np.isfinite(back[0, 32:])) and np.all(np.isfinite(back[1, :32]))


def test_zero_block():
  t = reference.mxfp8_quantize(jnp.zeros((1, 32)))
  assert int(t["scales"][0, 0]) == 0
  assert np.all(np.asarray(t["data"], np.float32) == 0)
