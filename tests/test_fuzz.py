"""Property tests (hypothesis): on arbitrary inputs, NaN, inf and subnormals included, the
quantize kernels (per-tensor and block-scaled) and the norm cast-transposes write the
reference's bytes and scales, and the rings advance as the reference's. Seeded from the tests' base seed (JAX_FP8_TEST_SEED, see
conftest) and the test's name, with no example database: the same examples every run, so CI is
repeatable; another base seed, or a larger max_examples, searches further."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (PLATFORMS, assert_same_quantized, jitted, reference_on_cpu, seed_for,
                      to_device)
from hypothesis import HealthCheck, given, seed, settings, strategies as st
from hypothesis.extra import numpy as hnp

import jax_fp8
from jax_fp8 import reference

FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
SCALES = st.floats(min_value=float(np.float32(1e-30)), max_value=float(np.float32(1e30)), width=32)


def arrays(shape):
  return hnp.arrays(np.float32, shape, elements=FLOATS)


def as_dtype(x, dtype):
  """NumPy ``x`` converted to ``dtype`` by XLA, as ``jnp.asarray(x).astype(dtype)`` converts it
  (NaN payloads included), returned as a NumPy array. The elements are padded to a power-of-two
  count (at least 256), so that one program per count and dtype (conftest.jitted) serves the
  examples' many shapes, where an eager conversion compiles at each new shape."""
  if np.dtype(dtype) == x.dtype:
    return x
  flat = np.ravel(x)
  n = max(256, 1 << max(flat.size - 1, 0).bit_length())
  out = np.asarray(jitted(jax.lax.convert_element_type, np.pad(flat, (0, n - flat.size)),
                          new_dtype=np.dtype(dtype)))
  return out[:flat.size].reshape(x.shape)


def fuzz(max_examples: int):
  """``max_examples`` examples drawn from ``seed_for`` the test's name; no database (nothing
  carried between runs), no deadline, and no too_slow health check, whose verdict depends on
  the machine's load."""
  def wrap(test):
    test = settings(max_examples=max_examples, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])(test)
    return seed(seed_for(f"{__name__}::{test.__name__}"))(test)
  return wrap


@pytest.mark.parametrize("platform_name", PLATFORMS)
@fuzz(max_examples=25)
@given(x=st.integers(1, 300).flatmap(lambda n: arrays((n,))), scale=SCALES,
       fmt=st.sampled_from(["e4m3", "e5m2"]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]))
def test_quantize_any_input(platform_name, x, scale, fmt, dtype):
  with jax.default_device(jax.devices(platform_name)[0]):
    xj = to_device(as_dtype(x, dtype))
    got = jax_fp8.quantize(xj, jnp.float32(scale), fmt)
  assert_same_quantized(got, reference_on_cpu(reference.quantize, xj, jnp.float32(scale),
                                              fmt=fmt))


@pytest.mark.parametrize("platform_name", PLATFORMS)
@fuzz(max_examples=25)
@given(data=st.data(), rows=st.integers(0, 80), cols16=st.integers(1, 5),
       margin=st.integers(-4, 4), algo=st.sampled_from(["max", "most_recent"]),
       steps=st.integers(1, 3))
def test_cast_transpose_ring_any_input(platform_name, data, rows, cols16, margin, algo, steps):
  ring = jax_fp8.ScaleRing.create(4, "e4m3", margin, algo)
  ref_ring = ring
  for _ in range(steps):
    x = to_device(data.draw(arrays((rows, 16 * cols16))))
    with jax.default_device(jax.devices(platform_name)[0]):
      got = jax_fp8.cast_transpose_delayed(x, ring)
    want = reference_on_cpu(reference.cast_transpose_delayed, x, ref_ring)
    assert_same_quantized(got.tensor, want.tensor)
    ring, ref_ring = got.ring, want.ring
    for got, want in zip(jax.tree.leaves(ring), jax.tree.leaves(ref_ring)):
      np.testing.assert_array_equal(np.asarray(got), want)


@pytest.mark.parametrize("platform_name", PLATFORMS)
@fuzz(max_examples=20)
@given(data=st.data(), rows=st.integers(0, 80),
       cols16=st.lists(st.integers(1, 5), min_size=1, max_size=4),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]), steps=st.integers(1, 2))
def test_cast_transpose_of_parts_any_input(platform_name, data, rows, cols16, dtype, steps):
  """x in 1 to 4 parts, drawn from every f32 (NaN, inf and subnormals included): the
  reference's bytes, amax, scale and ring, as its concatenation's."""
  ring = ref_ring = jax_fp8.ScaleRing.create(4, "e5m2")
  for _ in range(steps):
    xs = [to_device(as_dtype(data.draw(arrays((rows, 16 * c))), dtype)) for c in cols16]
    with jax.default_device(jax.devices(platform_name)[0]):
      got = jax_fp8.cast_transpose_delayed(xs, ring)
    want = reference_on_cpu(reference.cast_transpose_delayed, xs, ref_ring)
    assert_same_quantized(got.tensor, want.tensor)
    for g, w in zip(jax.tree.leaves(got.ring), jax.tree.leaves(want.ring)):
      np.testing.assert_array_equal(np.asarray(g), w)
    ring, ref_ring = got.ring, jax.tree.map(to_device, want.ring)


@pytest.mark.parametrize("platform_name", PLATFORMS)
@fuzz(max_examples=20)
@given(data=st.data(), rows=st.integers(1, 80), cols16=st.integers(1, 4),
       norm=st.sampled_from(["rmsnorm", "layernorm"]), steps=st.integers(1, 2))
def test_norm_cast_transpose_any_input(platform_name, data, rows, cols16, norm, steps):
  """x, the row statistics, gamma and beta drawn from every f32 (NaN, inf and subnormals
  included): the norm's products and sums rounded and flushed as the reference's."""
  cols, per_row = 16 * cols16, 2 if norm == "layernorm" else 1
  ring = ref_ring = jax_fp8.ScaleRing.create(4, "e4m3")
  for _ in range(steps):
    args = tuple(to_device(data.draw(arrays(shape))) for shape in
                 ((rows, cols), (rows, per_row), (cols,)))
    beta = to_device(data.draw(arrays((cols,)))) if norm == "layernorm" else None
    with jax.default_device(jax.devices(platform_name)[0]):
      got = jax_fp8.norm_cast_transpose(*args, beta, ring, norm=norm)
    want = reference_on_cpu(reference.norm_cast_transpose, *args, beta, ref_ring, norm=norm)
    assert_same_quantized(got.tensor, want.tensor)
    for g, w in zip(jax.tree.leaves(got.ring), jax.tree.leaves(want.ring)):
      np.testing.assert_array_equal(np.asarray(g), w)
    ring, ref_ring = got.ring, want.ring


@pytest.mark.parametrize("platform_name", PLATFORMS)
@fuzz(max_examples=20)
@given(data=st.data(), rows=st.integers(1, 140), groups=st.integers(1, 3),
       group_size=st.sampled_from([16, 32, 64, 128]), fmt=st.sampled_from(["e4m3", "e5m2"]),
       ue8m0=st.booleans(), layout=st.sampled_from(["row", "col", "col_tma"]),
       eps=st.sampled_from([1e-10, 1e-3, 1.0]))
def test_group_quantize_any_input(platform_name, data, rows, groups, group_size, fmt, ue8m0,
                                  layout, eps):
  x = to_device(data.draw(arrays((rows, groups * group_size))))
  kw = dict(group_size=group_size, fmt=fmt, eps=eps, ue8m0=ue8m0, scale_layout=layout)
  with jax.default_device(jax.devices(platform_name)[0]):
    got = jax_fp8.group_quantize(x, **kw)
  assert_same_quantized(got, reference_on_cpu(reference.group_quantize, x, **kw))


@pytest.mark.parametrize("platform_name", PLATFORMS)
@fuzz(max_examples=15)
@given(data=st.data(), rows=st.integers(1, 300), cols=st.integers(1, 2),
       ue8m0=st.booleans(), transpose=st.booleans())
def test_block_ops_any_input(platform_name, data, rows, cols, ue8m0, transpose):
  """block_quantize (C a multiple of 16) or group_cast_transpose (C a multiple of 128)."""
  if transpose:
    x = to_device(data.draw(arrays((rows, 128 * cols))))
    op, ref = jax_fp8.group_cast_transpose, reference.group_cast_transpose
  else:
    x = to_device(data.draw(arrays((rows, 16 * data.draw(st.integers(1, 20))))))
    op, ref = jax_fp8.block_quantize, reference.block_quantize
  with jax.default_device(jax.devices(platform_name)[0]):
    got = op(x, ue8m0=ue8m0)
  assert_same_quantized(got, reference_on_cpu(ref, x, ue8m0=ue8m0))


@pytest.mark.parametrize("platform_name", PLATFORMS)
@fuzz(max_examples=12)
@given(data=st.data(), rows=st.integers(1, 140), cols=st.integers(1, 2),
       norm=st.sampled_from(["rmsnorm", "layernorm"]), ue8m0=st.booleans())
def test_norm_group_cast_transpose_any_input(platform_name, data, rows, cols, norm, ue8m0):
  """The norm in 1 x 128 / 128 x 1 groups, from every f32 as test_norm_cast_transpose_any_input
  draws them: the group scales and bytes the reference's."""
  cols, per_row = 128 * cols, 2 if norm == "layernorm" else 1
  args = tuple(to_device(data.draw(arrays(shape))) for shape in
               ((rows, cols), (rows, per_row), (cols,)))
  beta = to_device(data.draw(arrays((cols,)))) if norm == "layernorm" else None
  with jax.default_device(jax.devices(platform_name)[0]):
    got = jax_fp8.norm_group_cast_transpose(*args, beta, norm=norm, ue8m0=ue8m0)
  assert_same_quantized(got, reference_on_cpu(reference.norm_group_cast_transpose, *args, beta,
                                              norm=norm, ue8m0=ue8m0))
