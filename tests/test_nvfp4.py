"""NVFP4's numerics with round-to-nearest (NVIDIA's NVFP4 report, arXiv 2509.25149): the global
scale in jax_fp8.formats and the reference twin of NVFP4 quantization (jax_fp8.reference), the
specification the kernels of the NVFP4 / MXFP8 issue are to match byte for byte."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import block_scaled_data

from jax_fp8 import reference
from jax_fp8.formats import NVFP4_BLOCK, nvfp4_global_scale

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]  # the codes 0..7; code | 8 is the negative


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
def test_round_trip_within_the_format_bound(rng, dtype, block_2d):
  # Blocks of magnitudes within 10^+-1 of each other: their E4M3 scales are normal numbers.
  x = block_scaled_data(rng, (64, 128), NVFP4_BLOCK, 1, dtype)
  t = reference.nvfp4_quantize(x, rowwise=True, columnwise=True, block_2d=block_2d)
  assert t["data"].shape == (64, 64) and t["data"].dtype == jnp.uint8
  assert t["scales"].shape == (64, 8) and t["scales"].dtype == jnp.float8_e4m3fn
  assert t["data_t"].shape == (128, 32) and t["scales_t"].shape == (128, 4)
  amax = np.float32(np.max(np.abs(np.asarray(x, np.float32))))
  assert float(t["global_scale"]) == amax / np.float32(448 * 6)  # one f32 division
  ref = np.asarray(x, np.float64)
  rows = reference.nvfp4_dequantize(t["data"], t["scales"], t["global_scale"])
  cols = reference.nvfp4_dequantize(t["data_t"], t["scales_t"], t["global_scale"])
  for back, want, scales in ((rows, ref, t["scales"]), (cols, ref.T, t["scales_t"])):
    step = np.repeat(np.asarray(scales, np.float64), NVFP4_BLOCK, 1) * float(t["global_scale"])
    # E2M1's gap is 0.5 below 2, 1 up to 4 and 2 up to 6, so rounding moves x by at most
    # max(step / 4, |x| / 4); the E4M3 rounding of the scale can push |x| / step past 6 by at
    # most 6 * 2^-4 / (1 - 2^-4) = 0.4, within the same bound; plus f32 rounding of x / step.
    bound = np.maximum(step / 4, np.abs(want) / 4) * (1 + 2.0**-20)
    assert np.all(np.abs(np.asarray(back, np.float64) - want) <= bound)
  if block_2d:  # 16 x 16 tiles: both directions hold the same numbers
    np.testing.assert_array_equal(np.asarray(cols).T, np.asarray(rows))


def test_packing_and_rounding():
  """Element 2i in the low nibble; exact E2M1 values keep their codes, ties go to the even
  code."""
  row = np.zeros(16, np.float32)
  row[:8] = [6.0, 0.5, -1.5, 3.0, 0.25, 0.75, 5.0, -2.5]
  t = reference.nvfp4_quantize(jnp.asarray(row[None]))
  # amax 6: global scale 6 / 2688 = 1/448, block scale e4m3(6 / 6 * 448) = 448: step 1.
  assert float(t["scales"][0, 0].astype(jnp.float32)) == 448.0
  codes = [E2M1.index(6.0), E2M1.index(0.5), 8 | E2M1.index(1.5), E2M1.index(3.0),
           0, E2M1.index(1.0), E2M1.index(4.0), 8 | E2M1.index(2.0)]  # 0.25->0, 0.75->1, 5->4
  packed = np.asarray(t["data"])[0, :4]
  assert [int(b) & 0xF for b in packed] == codes[0::2]
  assert [int(b) >> 4 for b in packed] == codes[1::2]


def test_special_tensors():
  zeros = reference.nvfp4_quantize(jnp.zeros((1, 32)))
  assert float(zeros["global_scale"]) == 1.0
  assert np.all(np.asarray(zeros["scales"], np.float32) == 0) and not np.any(zeros["data"])
  x = np.ones((2, 32), np.float32)
  x[1, 20] = np.nan
  t = reference.nvfp4_quantize(jnp.asarray(x))
  assert np.isnan(float(t["global_scale"]))  # a NaN anywhere stays visible
  assert np.all(np.isnan(np.asarray(reference.nvfp4_dequantize(t["data"], t["scales"],
                                                               t["global_scale"]))))
  assert np.isnan(float(nvfp4_global_scale(jnp.float32(jnp.inf))))
