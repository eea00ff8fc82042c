"""jax_fp8.stochastic_rounding: the E2M1 rounding rule over every 16-bit draw. Its bits (the
documented Philox counters) and its use in NVFP4 quantization: test_nvfp4.py."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import E2M1

from jax_fp8.stochastic_rounding import e2m1_round_stochastic


@pytest.mark.parametrize("y", [0.3, 2.7, 5.123, 1.0000001, 0.5, 3.0, 6.0, -6.0, 0.0, -0.0, -0.3,
                               -4.75, 1e-45, -1e-40], ids=repr)
def test_stochastic_rounding_over_all_16_bit_draws(y):
  """All 65536 values of the bits: the magnitude rounds up for exactly ceil(2^16 t) of them
  (t its position in its gap, exact in f64), never for an E2M1 value or a subnormal (zero on
  every backend); the sign is kept."""
  y32 = np.float32(y)
  got = np.asarray(e2m1_round_stochastic(jnp.full(1 << 16, y32), jnp.arange(1 << 16,
                                                                             dtype=jnp.uint32)))
  a = 0.0 if abs(y32) < np.finfo(np.float32).tiny else abs(float(y32))
  gap = 0.5 if a < 2 else 1.0 if a < 4 else 2.0
  lo = max(c for c in E2M1 if c <= a)
  assert set(np.abs(got).tolist()) <= {lo, min(lo + gap, 6.0)}
  assert int(np.sum(np.abs(got) > lo)) == int(np.ceil((a - lo) / gap * 65536))
  assert np.all(np.signbit(got) == np.signbit(y32))
