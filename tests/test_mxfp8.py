"""MXFP8 (OCP MX v1.0 with RCEIL scales): the E8M0 scale rule in jax_fp8.formats, the reference
twin (jax_fp8.reference.mxfp8_quantize), and jax_fp8.mxfp8_quantize's CUDA kernel and CPU
handler, byte for byte against it."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (HAS_CUDA, assert_same_quantized, block_scaled_data, jitted, on_cpu,
                      poison_allocator, reference_on_cpu)

import jax_fp8
from jax_fp8 import _ffi, reference
from jax_fp8.formats import MX_BLOCK, e8m0_apply, e8m0_rceil, fp8_max

FMTS = ["e4m3", "e5m2"]
# Half the smallest subnormal of each format: the absolute rounding error near zero, in units of
# the block scale; and the relative one (half an ulp) of its normals.
HALF_SUBNORMAL = {"e4m3": 2.0**-10, "e5m2": 2.0**-17}
HALF_ULP = {"e4m3": 2.0**-4, "e5m2": 2.0**-3}


@pytest.mark.parametrize("fmt", FMTS)
def test_rceil_is_tight_and_never_overflows(rng, fmt):
  # Every binade of normal f32s (the lowest ones clamp to k = -127, where the block cannot
  # saturate either), the format's maximum times powers of two (the tight edge) and its
  # neighbours.
  a = np.ldexp(rng.uniform(1, 1.99, 4096), rng.integers(-126, 128, 4096)).astype(np.float32)
  edges = np.float32(fp8_max(fmt)) * np.exp2(np.arange(-140, 113, dtype=np.float32))
  edges = edges[(edges >= np.finfo(np.float32).tiny) & np.isfinite(edges)]
  a = np.concatenate([a, edges, np.nextafter(edges, np.float32(np.inf)),
                      np.nextafter(edges, np.float32(0)), [np.finfo(np.float32).max]])
  k = np.asarray(e8m0_rceil(jnp.asarray(a), fmt)).astype(np.int64) - 127
  fmax, a = fp8_max(fmt), a.astype(np.float64)
  assert np.all(a / np.exp2(k) <= fmax)  # never saturates
  assert np.all((a / np.exp2(k - 1) > fmax) | (k == -127))  # the smallest such power of two


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
  assert t.data.dtype == jnp.dtype({"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}[fmt])
  assert t.scale.shape == (64, 4) and t.scale.dtype == jnp.uint8
  assert t.data_t.shape == (128, 64) and t.scale_t.shape == (128, 2)
  for data, scales, ref in ((t.data, t.scale, x), (t.data_t, t.scale_t, x.T)):
    back = np.asarray(reference.mxfp8_dequantize(data, scales), np.float64)
    ref = np.asarray(ref, np.float64)
    scale = np.repeat(np.exp2(np.asarray(scales, np.float64) - 127), MX_BLOCK, axis=1)
    bound = np.maximum(HALF_ULP[fmt] * np.abs(ref), HALF_SUBNORMAL[fmt] * scale)
    assert np.all(np.abs(back - ref) <= bound)


def test_nan_and_inf_blocks_stay_visible(rng):
  x = np.asarray(rng.standard_normal((2, 64)), np.float32)
  x[0, 3], x[1, 40] = np.nan, np.inf
  t = reference.mxfp8_quantize(jnp.asarray(x))
  assert np.asarray(t.scale).tolist()[0][0] == 255 and np.asarray(t.scale)[1, 1] == 255
  back = np.asarray(reference.mxfp8_dequantize(t.data, t.scale))
  assert np.all(np.isnan(back[0, :32])) and np.all(np.isnan(back[1, 32:]))
  assert np.all(np.isfinite(back[0, 32:])) and np.all(np.isfinite(back[1, :32]))


def test_zero_block():
  t = reference.mxfp8_quantize(jnp.zeros((1, 32)))
  assert int(t.scale[0, 0]) == 0
  assert np.all(np.asarray(t.data, np.float32) == 0)


DIRECTIONS = {"rowwise": (True, False), "columnwise": (False, True), "both": (True, True)}
# (shape, whether R is a multiple of 32, so every direction applies): whole and partial
# 64 x 64 tiles of the kernel, and rows that only the rowwise direction takes.
SHAPES = [((32, 32), True), ((64, 96), True), ((96, 416), True), ((5, 64), False),
          ((33, 160), False)]


def _check_against_reference(x, directions, fmt):
  rowwise, columnwise = DIRECTIONS[directions]
  poison_allocator(x.size * 2)
  kw = dict(rowwise=rowwise, columnwise=columnwise, fmt=fmt)
  got = jitted(jax_fp8.mxfp8_quantize, x, **kw)
  want = reference_on_cpu(reference.mxfp8_quantize, x, **kw)
  assert_same_quantized(got, want)


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("directions", DIRECTIONS)
@pytest.mark.parametrize("shape,whole_rows", SHAPES, ids=lambda v: str(v))
def test_kernel_bytes_equal_reference(platform, rng, shape, whole_rows, directions, fmt):
  if not whole_rows and directions != "rowwise":
    pytest.skip("columnwise blocks need R a multiple of 32")
  _check_against_reference(block_scaled_data(rng, shape, MX_BLOCK, 6, jnp.float32), directions,
                           fmt)


# Rowwise alone runs the group quantize kernel on CUDA; with a columnwise copy, the tile kernel.
@pytest.mark.parametrize("directions", ["rowwise", "both"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
def test_kernel_input_dtypes(platform, rng, dtype, directions):
  decades = 3 if dtype == jnp.float16 else 12
  _check_against_reference(block_scaled_data(rng, (64, 256), MX_BLOCK, decades, dtype),
                           directions, "e4m3")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU with the jax_fp8 CUDA targets")
def test_columnwise_takes_any_number_of_rows(rng):
  """More rows than a CUDA grid's y dimension holds blocks of 32 (65535 of them), both
  directions, against the CPU handler."""
  x = np.asarray(rng.standard_normal((_ffi.CONSTANTS["max_tile_rows"] * MX_BLOCK + MX_BLOCK, 32)),
                 np.float32)
  got = jax_fp8.mxfp8_quantize(jax.device_put(x, jax.devices("cuda")[0]), columnwise=True)
  want = on_cpu(lambda v: jax_fp8.mxfp8_quantize(v, columnwise=True), x)
  assert_same_quantized(got, want)


@pytest.mark.parametrize("directions", ["rowwise", "both"])
@pytest.mark.parametrize("fmt", FMTS)
def test_kernel_special_values(platform, rng, fmt, directions):
  """NaN and infinity (their blocks NaN in both directions), all-zero blocks, f32 subnormals
  (zero), the largest f32 values, blocks of 1e-30 and of 3e-36 (where k clamps to -127 or
  lies just above), and values exactly at the format's maximum times a power of two (the tight
  RCEIL edge)."""
  x = np.asarray(rng.standard_normal((64, 128)), np.float32)
  x[0, 5], x[40, 70], x[9, 100] = np.nan, np.inf, -np.inf
  x[32:64, 0:32] = 0.0
  x[1, 32:64] = 1e-40
  x[2, 64:96] = rng.uniform(-3.4e38, 3.4e38, 32)
  x[3, 96:128] = 1e-30 * rng.standard_normal(32)
  x[4, 32:64] = fp8_max(fmt) * 2.0 ** rng.integers(-20, 20, 32)
  x[5, 0:32] = 3e-36 * rng.standard_normal(32)
  x[6, 0:32] = fp8_max(fmt) * 2.0 ** rng.integers(-140, -100, 32)
  _check_against_reference(jnp.asarray(x), directions, fmt)
  t = jax_fp8.mxfp8_quantize(jnp.asarray(x), columnwise=directions == "both", fmt=fmt)
  scales = np.asarray(t.scale)
  assert scales[0, 0] == scales[40, 2] == scales[9, 3] == 255
  assert scales[40, 0] == 0 and np.all(scales[2, 2] < 255)
  if directions == "both":
    scales_t = np.asarray(t.scale_t)
    assert scales_t[5, 0] == scales_t[70, 1] == scales_t[100, 0] == 255


@pytest.mark.parametrize("directions", ["rowwise", "both"])
@pytest.mark.parametrize("fmt", FMTS)
def test_finite_inputs_stay_finite(platform, rng, fmt, directions):
  """Blocks whose amax lies above 1.75 * 2^127 get the top scale 2^(128 - emax), where an
  element rounding to 2^emax would dequantize to inf: they saturate at the largest FP8 value
  below 2^emax (e4m3 240, e5m2 28672). Elements up to the largest f32, either sign; the
  other blocks as before."""
  big = np.finfo(np.float32).max
  x = np.asarray(rng.standard_normal((64, 64)), np.float32)
  x[0:32, 0:32] = rng.uniform(0.9 * big, big, (32, 32)) * rng.choice([-1, 1], (32, 32))
  x[0, 0:4], x[1, 0:4] = [big, -big, 3.3e38, -3.3e38], 1.76 * 2.0**127
  _check_against_reference(jnp.asarray(x), directions, fmt)
  t = jax_fp8.mxfp8_quantize(jnp.asarray(x), columnwise=directions == "both", fmt=fmt)
  top = {"e4m3": (247, 240.0), "e5m2": (240, 28672.0)}[fmt]
  pairs = [(t.data, t.scale, "data")] + [(t.data_t, t.scale_t, "data_t")] * (directions == "both")
  for data, scale, name in pairs:
    d = np.asarray(jax_fp8.mxfp8_dequantize(data, scale))
    assert np.all(np.isfinite(d)), name
    s = np.asarray(scale)
    assert np.all(s[:32, 0] == top[0]) and np.all(s[32:, :] < top[0]), name
    d = d if name == "data" else d.T  # x's layout
    assert d[0, 0] == top[1] * 2.0 ** (top[0] - 127) and d[0, 1] == -d[0, 0], name


def test_jit_and_vmap(rng):
  x = jnp.asarray(rng.standard_normal((3, 64, 64)), jnp.bfloat16)
  f = lambda v: jax_fp8.mxfp8_quantize(v, columnwise=True)  # noqa: E731
  got = jax.jit(jax.vmap(f))(x)
  for i in range(3):
    assert_same_quantized(jax.tree.map(lambda v: v[i], got),
                          reference.mxfp8_quantize(x[i], columnwise=True))


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_round_trip(rng, fmt):
  x = block_scaled_data(rng, (64, 128), MX_BLOCK, 3, jnp.float32)
  t = jax_fp8.mxfp8_quantize(x, columnwise=True, fmt=fmt)
  for data, scales, ref in ((t.data, t.scale, x), (t.data_t, t.scale_t, x.T)):
    back = np.asarray(jax_fp8.mxfp8_dequantize(data, scales), np.float64)
    ref = np.asarray(ref, np.float64)
    scale = np.repeat(np.exp2(np.asarray(scales, np.float64) - 127), MX_BLOCK, axis=1)
    assert np.all(np.abs(back - ref) <= np.maximum(HALF_ULP[fmt] * np.abs(ref),
                                                   HALF_SUBNORMAL[fmt] * scale))
  # bfloat16 holds every E4M3 / E5M2 value times a power of two in its normal range
  np.testing.assert_array_equal(
      np.asarray(jax_fp8.mxfp8_dequantize(t.data, t.scale, jnp.bfloat16), np.float32),
      np.asarray(jax_fp8.mxfp8_dequantize(t.data, t.scale), np.float32))


X = jnp.ones((64, 64), jnp.float32)


@pytest.mark.parametrize("call,error,message", [
    (lambda: jax_fp8.mxfp8_quantize(jnp.ones((4, 48))), ValueError,
     r"C a positive multiple of 32.*\(4, 48\)"),
    (lambda: jax_fp8.mxfp8_quantize(jnp.ones(64)), ValueError, r"x must be \[R, C\]"),
    (lambda: jax_fp8.mxfp8_quantize(jnp.ones((40, 64)), columnwise=True), ValueError,
     "columnwise=True needs x's rows R a multiple of 32"),
    (lambda: jax_fp8.mxfp8_quantize(X, rowwise=False), ValueError,
     "needs rowwise=True or columnwise=True"),
    (lambda: jax_fp8.mxfp8_quantize(X, columnwise=1), TypeError,
     "columnwise must be a bool, got int 1"),
    (lambda: jax_fp8.mxfp8_quantize(X, fmt="e2m1"), ValueError, "e2m1"),
    (lambda: jax_fp8.mxfp8_quantize(X.astype(jnp.int32)), TypeError,
     "x must be float32, bfloat16 or float16, got int32"),
    (lambda: jax_fp8.mxfp8_dequantize(X, jnp.zeros((64, 2), jnp.uint8)), TypeError,
     "data must be float8_e4m3fn or float8_e5m2"),
    (lambda: jax_fp8.mxfp8_dequantize(X.astype(jnp.float8_e4m3fn), jnp.zeros((64, 2))),
     TypeError, "scales must be uint8"),
    (lambda: jax_fp8.mxfp8_dequantize(X.astype(jnp.float8_e4m3fn),
                                      jnp.zeros((64, 4), jnp.uint8)), ValueError,
     r"scales must be data's shape with the last axis divided by 32.*\(64, 4\)"),
])
def test_bad_input(call, error, message):
  with pytest.raises(error, match=message):
    call()


def test_not_differentiable():
  with pytest.raises(TypeError, match="jax_fp8.mxfp8_quantize is not differentiable"):
    jax.grad(lambda x: jax_fp8.mxfp8_quantize(x).data.astype(jnp.float32).sum())(X)
