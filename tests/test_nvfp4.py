"""NVFP4 (NVIDIA's NVFP4 report, arXiv 2509.25149): the global scale (jax_fp8.formats), the
reference twin (jax_fp8.reference.nvfp4_quantize) with stochastic rounding and the random
Hadamard transform, and jax_fp8.nvfp4_quantize's CUDA kernel and CPU handler, byte for byte
against it. The rounding rule and the transform alone: test_stochastic_rounding.py,
test_hadamard.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (E2M1, HAS_CUDA, assert_same_quantized, bits, block_scaled_data, jitted,
                      on_cpu, poison_allocator, reference_on_cpu, summation_error)

import jax_fp8
from jax_fp8 import _ffi, reference
from jax_fp8.formats import NVFP4_BLOCK, nvfp4_global_scale
from jax_fp8.hadamard import hadamard_transform, rht_signs
from jax_fp8.ops import nvfp4 as nvfp4_ops
from jax_fp8.philox import philox4x32


def twin_on_cpu(x, options):
  """``reference_on_cpu(reference.nvfp4_quantize, x, **options)`` given x in f32: the twin's
  first step (as_f32) converts x to f32, exactly, so one program serves every input dtype."""
  return reference_on_cpu(reference.nvfp4_quantize, np.asarray(x, np.float32), **options)


@pytest.mark.parametrize("block_2d", [False, True], ids=["1d", "2d"])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
def test_round_trip_within_the_format_bound(rng, dtype, block_2d):
  # Blocks of magnitudes within 10^+-1 of each other: their E4M3 scales are normal numbers.
  x = block_scaled_data(rng, (64, 128), NVFP4_BLOCK, 1, dtype)
  t = reference_on_cpu(reference.nvfp4_quantize, x, rowwise=True, columnwise=True,
                       block_2d=block_2d)
  assert t.data.shape == (64, 64) and t.data.dtype == np.uint8
  assert t.scale.shape == (64, 8) and t.scale.dtype == jnp.float8_e4m3fn
  assert t.data_t.shape == (128, 32) and t.scale_t.shape == (128, 4)
  amax = np.float32(np.max(np.abs(np.asarray(x, np.float32))))
  assert float(t.global_scale) == amax * np.float32(1 / 2688)  # one f32 rounding
  ref = np.asarray(x, np.float64)
  rows = e2m1_values(t)
  cols = e2m1_values(t, "data_t", "scale_t")
  for back, want, scales in ((rows, ref, t.scale), (cols, ref.T, t.scale_t)):
    step = np.repeat(np.asarray(scales, np.float64), NVFP4_BLOCK, 1) * float(t.global_scale)
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
  t = reference_on_cpu(reference.nvfp4_quantize, row[None])
  # amax 6: global scale 6 / 2688 = 1/448, block scale e4m3(6 / 6 * 448) = 448: step 1.
  assert float(t.scale[0, 0].astype(jnp.float32)) == 448.0
  codes = [E2M1.index(6.0), E2M1.index(0.5), 8 | E2M1.index(1.5), E2M1.index(3.0),
           0, E2M1.index(1.0), E2M1.index(4.0), 8 | E2M1.index(2.0)]  # 0.25->0, 0.75->1, 5->4
  packed = np.asarray(t.data)[0, :4]
  assert [int(b) & 0xF for b in packed] == codes[0::2]
  assert [int(b) >> 4 for b in packed] == codes[1::2]


def test_special_tensors():
  zeros = reference_on_cpu(reference.nvfp4_quantize, np.zeros((1, 32), np.float32))
  assert float(zeros.global_scale) == 1.0
  assert np.all(np.asarray(zeros.scale, np.float32) == 0) and not np.any(zeros.data)
  x = np.ones((2, 32), np.float32)
  x[1, 20] = np.nan
  t = reference_on_cpu(reference.nvfp4_quantize, x)
  assert np.isnan(float(t.global_scale))  # a NaN anywhere stays visible
  assert np.all(np.isnan(e2m1_values(t)))
  assert np.isnan(float(jitted(nvfp4_global_scale, np.float32(np.inf))))
  # A tensor whose amax / 2688 is below FLT_MIN: the global scale clamps there, so the block
  # scales' encoding factor stays finite and zero blocks keep scale 0.
  tiny = np.zeros((1, 32), np.float32)
  tiny[0, :16] = 1e-37
  t = reference_on_cpu(reference.nvfp4_quantize, tiny)
  assert float(t.global_scale) == np.finfo(np.float32).tiny
  scales = np.asarray(t.scale, np.float32)
  assert scales[0, 0] > 0 and scales[0, 1] == 0 and np.all(np.isfinite(scales))


# Stochastic rounding, the random Hadamard transform and the global amax (the NVFP4 report's
# training recipe).

def unit_step_blocks(values, rows):
  """f32 [rows, 16 * len(values)]: every 16-element block starts with 6 (so the global amax is
  6 and each block's step is 448 * fl(6 * fl(1 / 2688)), exactly 1 in f32) followed by 15 of
  ``values``, cycled."""
  v = np.resize(np.asarray(values, np.float32), (rows, 15 * len(values)))
  blocks = v.reshape(rows, len(values), 15)
  return np.concatenate([np.full((rows, len(values), 1), 6.0, np.float32), blocks],
                        axis=2).reshape(rows, 16 * len(values))


def e2m1_values(t, data="data", scale="scale"):
  return np.asarray(jitted(reference.nvfp4_dequantize, getattr(t, data), getattr(t, scale),
                           t.global_scale))


# (value, probability of rounding its magnitude up): halfway points of each gap, and quarters.
SR_TARGETS = [(0.25, 0.5), (0.75, 0.5), (1.25, 0.5), (1.75, 0.5), (2.5, 0.5), (3.5, 0.5),
              (5.0, 0.5), (4.5, 0.25), (0.375, 0.75), (-2.5, 0.5), (-5.5, 0.75), (-0.125, 0.25)]


def test_stochastic_rounding_is_unbiased():
  """1.1 million draws: each value rounds up as often as its position in its gap says (to 6
  standard deviations of a binomial; halfway values half the time), and the mean error over
  all of them is 0 to 6 standard deviations."""
  values = [v for v, _ in SR_TARGETS]
  x = unit_step_blocks(values, rows=6144)
  t = reference_on_cpu(reference.nvfp4_quantize, x, stochastic_rounding=True,
                       key=jax.random.key(3))
  back = e2m1_values(t)
  body = np.arange(x.shape[1]) % 16 != 0
  got, want = back[:, body], x[:, body]
  assert got.size >= 10**6
  for value, p_up in SR_TARGETS:
    sel = want == np.float32(value)
    lo = np.max([c for c in E2M1 if c <= abs(value)])
    up = np.abs(got[sel]) > lo
    assert abs(up.mean() - p_up) <= 6 * np.sqrt(p_up * (1 - p_up) / sel.sum()), value
  err = (got - want).astype(np.float64)  # each |error| < its gap <= 2, variance <= 1
  assert abs(err.mean()) <= 6 / np.sqrt(err.size)
  assert np.any(got != 0)


def test_stochastic_rounding_bits_follow_the_documented_counter():
  """An element's rounding decided by its 16 bits of Philox4x32-10(counter (block, row,
  direction, j)): recomputed here by hand for one element in each direction."""
  x = unit_step_blocks([0.25, -2.5, 5.0, -1.75], rows=32)  # [32, 64]
  key = jax.random.key(11)
  t = reference_on_cpu(reference.nvfp4_quantize, x, columnwise=True, stochastic_rounding=True,
                       key=key)
  words = np.asarray(jax.random.key_data(key))
  for name, xs, scales, direction in (("data", x, "scale", 0), ("data_t", x.T, "scale_t", 1)):
    back = e2m1_values(t, name, scales)
    for row, col in ((5, 16 + 7), (17, 12), (0, 3), (30, 31)):
      block, i = divmod(col, 16)
      w = np.concatenate([jitted(philox4x32, np.uint32([block, row, direction, j]), words)
                          for j in (0, 1)])
      bits = (int(w[i // 2]) >> (16 * (i % 2))) & 0xFFFF
      step = np.float32(getattr(t, scales)[row, block].astype(np.float32)) * np.float32(
          t.global_scale)  # f32, as the quantizer and nvfp4_dequantize compute it
      y = np.float32(xs[row, col]) / step
      lo = max(c for c in E2M1 if c <= abs(y))
      gap = 0.5 if abs(y) < 2 else 1.0 if abs(y) < 4 else 2.0
      up = bits < (abs(y) - lo) / gap * 65536
      want = np.copysign(np.float32(lo + gap if up else lo) * step, y)
      assert back[row, col] == want and np.signbit(back[row, col]) == np.signbit(want), (
          name, row, col)


def test_stochastic_rounding_keys():
  x = unit_step_blocks([0.25, 2.5, 5.0], rows=16)
  q = lambda k: reference_on_cpu(reference.nvfp4_quantize, x,  # noqa: E731
                                 stochastic_rounding=True, key=jax.random.key(k)).data
  np.testing.assert_array_equal(q(1), q(1))
  assert np.any(q(1) != q(2))
  nearest = reference_on_cpu(reference.nvfp4_quantize, x).data
  assert np.any(q(1) != nearest)


def test_stochastic_rounding_keeps_nan_visible():
  x = np.ones((1, 32), np.float32)
  x[0, 3] = np.nan
  t = reference_on_cpu(reference.nvfp4_quantize, x, stochastic_rounding=True,
                       key=jax.random.key(0))
  assert np.isnan(float(t.global_scale)) and np.all(np.isnan(e2m1_values(t)))


def test_hadamard_transform_of_the_columnwise_copy(rng):
  """rht: the rowwise copy is untouched; the columnwise copy, dequantized and transformed back
  by the matrix's transpose, is x.T within the format's bound carried through the orthogonal
  matrix (each 16-element group's error norm is kept)."""
  x = block_scaled_data(rng, (64, 128), NVFP4_BLOCK, 1, jnp.float32)
  plain = twin_on_cpu(x, dict(columnwise=True))
  t = twin_on_cpu(x, dict(columnwise=True, rht=True, rht_seed=5))
  np.testing.assert_array_equal(t.data, plain.data)
  m = np.asarray(hadamard_transform(jnp.eye(16), 5), np.float64)  # its matrix
  xt = np.asarray(x, np.float64).T
  transformed = np.asarray(hadamard_transform(jnp.asarray(x).T, 5), np.float64)
  want_gs = np.float32(np.max(np.abs(transformed))) * np.float32(1 / 2688)
  assert float(t.global_scale_t) == float(want_gs)
  back = np.asarray(jitted(reference.nvfp4_dequantize, t.data_t, t.scale_t, t.global_scale_t),
                    np.float64)
  step = np.repeat(np.asarray(t.scale_t, np.float64), 16, 1) * float(t.global_scale_t)
  bound = np.maximum(step / 4, np.abs(transformed) / 4) * (1 + 2.0**-20)
  assert np.all(np.abs(back - transformed) <= bound)
  group_err = np.linalg.norm((back.reshape(128, 4, 16) @ m.T) - xt.reshape(128, 4, 16), axis=-1)
  # the transform's own f32 rounding (at most 4 additions, 2^-24 each) beside the format's bound
  slack = 2.0**-20 * np.linalg.norm(xt.reshape(128, 4, 16), axis=-1)
  assert np.all(group_err <= np.linalg.norm(bound.reshape(128, 4, 16), axis=-1) + slack)


def test_global_amax_sets_the_global_scales(rng):
  x = block_scaled_data(rng, (32, 64), NVFP4_BLOCK, 1, jnp.float32)
  own = float(np.max(np.abs(np.asarray(x))))
  same = twin_on_cpu(x, dict(global_amax=jnp.float32(own)))
  assert_same_quantized(same, twin_on_cpu(x, {}))
  # the op takes a Python number as an f32 amax
  assert float(jax_fp8.nvfp4_quantize(x, global_amax=own).global_scale) == float(
      same.global_scale)
  t = twin_on_cpu(x, dict(columnwise=True, rht=True, global_amax=jnp.float32(2 * own),
                         global_amax_t=jnp.float32(3 * own)))
  assert float(t.global_scale) == np.float32(2 * own) * np.float32(1 / 2688)
  assert float(t.global_scale_t) == np.float32(3 * own) * np.float32(1 / 2688)


@pytest.mark.parametrize("kwargs,match", [
    (dict(stochastic_rounding=True), r"stochastic_rounding=True needs a key .* got key=None"),
    (dict(key=jax.random.key(0)), "key is stochastic rounding's: it needs "
                                  "stochastic_rounding=True"),
    (dict(rht=True), "needs columnwise=True"),
    (dict(rht=True, columnwise=True, block_2d=True), "block_2d=False"),
    (dict(stochastic_rounding=True, key=jax.random.key(0), block_2d=True), "1 x 16 blocks"),
    (dict(global_amax=jnp.ones(2)), "global_amax must be a float scalar"),
    (dict(global_amax_t=jnp.float32(1)), "needs rht=True"),
    (dict(stochastic_rounding=True, key=jnp.zeros(3, jnp.uint32)), "two uint32 words"),
])
def test_unsupported_combinations_raise(kwargs, match):
  with pytest.raises(ValueError, match=match):
    jax_fp8.nvfp4_quantize(jnp.ones((16, 32)), **kwargs)


@pytest.mark.parametrize("kwargs,match", [
    (dict(stochastic_rounding=True), "draws its bits under a key: got key=None"),
    (dict(stochastic_rounding=True, key=jnp.zeros(3, jnp.uint32)), "two uint32 words"),
    (dict(global_amax=jnp.ones(2)), "global_amax must be a scalar"),
    (dict(columnwise=True, rht=True, global_amax_t=jnp.ones(2)), "global_amax_t must be a scalar"),
])
def test_reference_raises_where_it_cannot_compute(kwargs, match):
  """The twin has its own checks, of what it needs to compute (none of the op's)."""
  with pytest.raises(ValueError, match=match):
    reference.nvfp4_quantize(jnp.ones((16, 32)), **kwargs)


KEY = jax.random.key(7)
# The options as the NVFP4 recipe combines them: activations and weights round to nearest
# (weights in 16 x 16 tiles), gradients round stochastically, the wgrad operands' columnwise
# copies go through the Hadamard transform.
OPTIONS = {
    "rowwise": dict(),
    "columnwise": dict(rowwise=False, columnwise=True),
    "both": dict(columnwise=True),
    "both_2d": dict(columnwise=True, block_2d=True),
    "rowwise_2d": dict(block_2d=True),
    "rowwise_sr": dict(stochastic_rounding=True, key=KEY),
    "both_sr": dict(columnwise=True, stochastic_rounding=True, key=KEY),
    "columnwise_rht": dict(rowwise=False, columnwise=True, rht=True, rht_seed=3),
    "both_rht_sr": dict(columnwise=True, rht=True, rht_seed=2**40 + 5,
                        stochastic_rounding=True, key=KEY),
}
# Whole and partial 64 x 64 tiles, several of them: 16 rows; partial in both dimensions, the
# last column tile holding 1, 2 or 3 of its four 16-column blocks; 2 x 2 whole tiles; rows that
# only 1D rowwise blocks take.
SHAPES = [(16, 80), (80, 160), (48, 240), (128, 128), (5, 64)]


def _check_against_reference(x, options):
  poison_allocator(x.size // 2)  # the packed data's bytes
  got = jax_fp8.nvfp4_quantize(x, **options)
  assert_same_quantized(got, twin_on_cpu(x, options))


@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_bytes_equal_reference(platform, rng, shape, option):
  options = OPTIONS[option]
  if shape[0] % NVFP4_BLOCK and (options.get("columnwise") or options.get("block_2d")):
    pytest.skip("columnwise and 2D blocks need R a multiple of 16")
  _check_against_reference(block_scaled_data(rng, shape, NVFP4_BLOCK, 4, jnp.float32), options)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("option", ["rowwise_sr", "both", "both_2d", "both_rht_sr"])
def test_kernel_input_dtypes(platform, rng, dtype, option):
  decades = 2 if dtype == jnp.float16 else 8
  _check_against_reference(block_scaled_data(rng, (64, 256), NVFP4_BLOCK, decades, dtype),
                           OPTIONS[option])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("option", ["rowwise_sr", "both", "both_2d", "both_sr", "both_rht_sr"])
def test_kernel_special_values(platform, rng, option, dtype):
  """With a given global amax (so a NaN does not make every scale NaN): NaN and infinity (their
  blocks' scales NaN / 448), all-zero blocks, subnormals (zero; the kernels read them unflushed
  and flush them in use), blocks of 1e-30 and of the largest f32 values, values at the E2M1
  rounding ties; and without one, the NaN global scale."""
  x = np.asarray(rng.standard_normal((64, 128)), np.float32)
  x[0, 5], x[40, 70], x[9, 100] = np.nan, np.inf, -np.inf
  x[32:48, 0:16] = 0.0
  x[1, 16:32] = 1e-40
  x[2, 64:80] = rng.uniform(-3e38, 3e38, 16)
  x[3, 96:112] = 1e-30 * rng.standard_normal(16)
  x[4, 32:48] = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * 2) * (2 / 6 * 448)
  extra = dict(global_amax=jnp.float32(100.0))
  if OPTIONS[option].get("rht"):
    extra["global_amax_t"] = jnp.float32(100.0)
  x[5, 48:64] = -1e-39 * rng.uniform(0.5, 1.0, 16)  # a block of negative subnormals only
  _check_against_reference(jnp.asarray(x, dtype), {**OPTIONS[option], **extra})
  _check_against_reference(jnp.asarray(x, dtype), OPTIONS[option])
  finite = np.where(np.isfinite(x), x, 1.0)  # a tensor of tiny values: the clamped global scale
  _check_against_reference(jnp.asarray(finite * np.float32(1e-37), dtype), OPTIONS[option])


@pytest.mark.parametrize("option", ["rowwise", "both", "both_sr"])
def test_kernel_rounding_ties(platform, option):
  """Every E2M1 rounding tie (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5), its neighbours one f32 ulp
  away and both signs, in blocks whose step is 1 (unit_step_blocks): to the even code at a
  tie, to the nearer value beside it; stochastically rounded, the reference's draws."""
  ties = np.float32([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
  values = np.concatenate([ties, np.nextafter(ties, np.float32(0)),
                           np.nextafter(ties, np.float32(7))])
  x = unit_step_blocks(np.concatenate([values, -values]), 16)
  _check_against_reference(jnp.asarray(x), OPTIONS[option])


@pytest.mark.parametrize("options,cuda_kernel,reason", [
    (dict(), "nvfp4_rowwise_kernel", ""),
    (dict(columnwise=True), "nvfp4_quantize_kernel", "columnwise=True"),
    (dict(rowwise=False, columnwise=True), "nvfp4_quantize_kernel", "columnwise=True"),
    (dict(block_2d=True), "nvfp4_quantize_kernel", "block_2d=True"),
])
def test_cuda_kernel_choice(options, cuda_kernel, reason):
  got, got_reason = jax_fp8.nvfp4_quantize_cuda_kernel(**options)
  assert got == cuda_kernel and got_reason.startswith(reason) and bool(got_reason) == bool(reason)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU with the jax_fp8 CUDA targets")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("stochastic_rounding", [False, True], ids=["rn", "sr"])
def test_specialised_and_general_kernels_agree(rng, dtype, stochastic_rounding):
  """The rowwise 1D case, which the specialised kernel takes, also run by the general one: the
  same bytes, over whole and partial tiles and ragged rows."""
  gpu = jax.devices("cuda")[0]
  options = dict(rowwise=True, columnwise=False, block_2d=False,
                 stochastic_rounding=stochastic_rounding, rht=False)
  args = [jax.device_put(a, gpu) for a in (np.float32([0.5, 0.5]), np.uint32([3, 9]),
                                           rht_signs(0))]
  for shape in ((16, 32), (37, 416), (4099, 4096)):  # the last: several grid-stride rounds
    x = jax.device_put(block_scaled_data(rng, shape, NVFP4_BLOCK, 4, dtype), gpu)
    outs = [nvfp4_ops.quantize_call(x, *args, specialised=s, **options) for s in (True, False)]
    for name, a, b in zip(("data", "scale"), outs[0], outs[1]):
      np.testing.assert_array_equal(bits(a), bits(b), err_msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="no CUDA GPU with the jax_fp8 CUDA targets")
def test_kernels_take_any_number_of_rows(rng):
  """More rows than a CUDA grid's y dimension holds tiles of 16 (65535 of them): the
  specialised kernel (rowwise, stochastic rounding) and the general one (2D blocks, both
  directions) against the CPU handler."""
  x = np.asarray(rng.standard_normal((_ffi.CONSTANTS["max_tile_rows"] * NVFP4_BLOCK + 16, 32)),
                 np.float32)
  for options in (dict(stochastic_rounding=True, key=np.uint32([5, 6])),
                  dict(columnwise=True, block_2d=True)):
    got = jax_fp8.nvfp4_quantize(jax.device_put(x, jax.devices("cuda")[0]), **options)
    want = on_cpu(lambda v: jax_fp8.nvfp4_quantize(v, **options), x)  # noqa: B023
    assert_same_quantized(got, want)


def test_jit_and_vmap(rng):
  """Each slice of the jitted vmap is the twin's quantization of that slice. The slices are
  test_kernel_input_dtypes' [64, 256] bfloat16 under both_rht_sr (twin_on_cpu): the twin
  compiled there runs here again."""
  x = np.asarray(rng.standard_normal((3, 64, 256)), jnp.bfloat16)
  f = lambda v: jax_fp8.nvfp4_quantize(v, **OPTIONS["both_rht_sr"])  # noqa: E731
  got = jax.tree.map(np.asarray, jax.jit(jax.vmap(f))(x))
  for i in range(3):
    want = twin_on_cpu(x[i], OPTIONS["both_rht_sr"])
    assert_same_quantized(jax.tree.map(lambda v: v[i], got), want)  # noqa: B023


@pytest.mark.parametrize("shape", [(0, 32), (3, 0, 64)], ids=str)
def test_empty_tensors(platform, shape):
  """No rows (or an empty batch dimension): quantize and dequantize give empty arrays."""
  x = np.zeros(shape, np.float32)  # each op jitted: one program, not one an operation
  t = jitted(jax_fp8.nvfp4_quantize, x[0] if len(shape) == 3 else x)
  back = jitted(jax_fp8.nvfp4_dequantize, t.data, t.scale, t.global_scale)
  assert back.shape == (0, shape[-1])
  data = np.zeros((*shape[:-1], shape[-1] // 2), np.uint8)
  scales = np.zeros((*shape[:-1], shape[-1] // NVFP4_BLOCK), jnp.float8_e4m3fn)
  assert jitted(jax_fp8.nvfp4_dequantize, data, scales, np.float32(1)).shape == shape


def test_dequantize_round_trip(rng):
  x = np.asarray(block_scaled_data(rng, (32, 64), NVFP4_BLOCK, 1, jnp.float32))
  t = jitted(jax_fp8.nvfp4_quantize, x, columnwise=True)  # jitted: one program each
  for data, scales, ref in ((t.data, t.scale, x), (t.data_t, t.scale_t, x.T)):
    back = np.asarray(jitted(jax_fp8.nvfp4_dequantize, data, scales, t.global_scale),
                      np.float64)
    step = np.repeat(np.asarray(scales, np.float64), NVFP4_BLOCK, 1) * float(t.global_scale)
    ref = np.asarray(ref, np.float64)  # the bound of test_round_trip_within_the_format_bound
    assert np.all(np.abs(back - ref) <= np.maximum(step / 4, np.abs(ref) / 4) * (1 + 2.0**-20))
  # A power-of-two global scale: every value is an E2M1 value (2 significant bits) times an
  # E4M3 scale (4) times 2^k, which bfloat16 (8) holds exactly.
  t = jitted(jax_fp8.nvfp4_quantize, x, global_amax=np.asarray(2688 * 2.0**-3, np.float32))
  assert float(t.global_scale) == 2.0**-3
  np.testing.assert_array_equal(
      np.asarray(jitted(jax_fp8.nvfp4_dequantize, t.data, t.scale, t.global_scale,
                        dtype=jnp.bfloat16), np.float32),
      np.asarray(jitted(jax_fp8.nvfp4_dequantize, t.data, t.scale, t.global_scale)))


X = jnp.ones((32, 64), jnp.float32)


def test_gemm_is_exact_to_the_f32_sums(platform, rng):
  """The emulated GEMM's bfloat16 operands (E2M1 times E4M3, global scales applied after the
  sums) are exact: it equals the f32 GEMM of the dequantized operands up to the order of the f32
  sums and the global scales' rounding, across a wide range of magnitudes."""
  a = np.asarray(rng.standard_normal((48, 96)) * np.exp(rng.uniform(-20, 20, (48, 96))),
                 np.float32)
  b = np.asarray(rng.standard_normal((40, 96)), np.float32)
  qa, qb = jitted(jax_fp8.nvfp4_quantize, a), jitted(jax_fp8.nvfp4_quantize, b)
  args = (qa.data, qb.data, qa.scale, qb.scale, qa.global_scale,
          qb.global_scale)
  got = np.asarray(jitted(jax_fp8.nvfp4_gemm, *args, out_dtype=jnp.float32), np.float64)
  fa, fb = (np.asarray(jitted(jax_fp8.nvfp4_dequantize, q.data, q.scale, q.global_scale),
                       np.float64) for q in (qa, qb))
  want = fa @ fb.T
  # f32 sums in two orders; two roundings in each dequantized f32 value (scale times global
  # scale, times the E2M1 value) and two in the emulation's global scales.
  bound = (2 * summation_error(96) + 6 * 2.0**-24) * (np.abs(fa) @ np.abs(fb).T)
  assert np.all(np.abs(got - want) <= bound)
  ref = reference_on_cpu(reference.nvfp4_gemm, *args, out_dtype=jnp.float32)
  assert np.all(np.abs(got - ref) <= bound)
  with pytest.raises(ValueError, match=r"b_scales float8_e4m3fn \[rows, K/16\], got b uint8"):
    jax_fp8.nvfp4_gemm(*args[:3], qb.scale[:, :2], *args[4:])
  with pytest.raises(ValueError, match="must share K"):
    jax_fp8.nvfp4_gemm(args[0], args[1][:, :32], args[2], args[3][:, :4], *args[4:])


@pytest.mark.parametrize("call,error,message", [
    (lambda: jax_fp8.nvfp4_quantize(jnp.ones((4, 40))), ValueError,
     r"C a positive multiple of 16.*\(4, 40\)"),
    (lambda: jax_fp8.nvfp4_quantize(jnp.ones((20, 64)), columnwise=True), ValueError,
     "need x's rows R a multiple of 16"),
    (lambda: jax_fp8.nvfp4_quantize(jnp.ones((20, 64)), block_2d=True), ValueError,
     "need x's rows R a multiple of 16"),
    (lambda: jax_fp8.nvfp4_quantize(X, rowwise=False), ValueError,
     "needs rowwise=True or columnwise=True"),
    (lambda: jax_fp8.nvfp4_quantize(X, block_2d=1), TypeError, "block_2d must be a bool"),
    (lambda: jax_fp8.nvfp4_quantize_cuda_kernel(columnwise="no"), TypeError,
     "columnwise must be a bool"),
    (lambda: jax_fp8.nvfp4_quantize_cuda_kernel(rowwise=False), ValueError,
     "needs rowwise=True or columnwise=True"),
    (lambda: jax_fp8.nvfp4_quantize(X, columnwise=True, rht=True, rht_seed=-1), ValueError,
     "seed must be an int in"),
    (lambda: jax_fp8.nvfp4_quantize(X, global_amax=jnp.int32(3)), TypeError,
     r"global_amax must be a float scalar .*, got int32\[\]"),
    (lambda: jax_fp8.nvfp4_quantize(X, global_amax="3"), TypeError,
     "global_amax must be an array, got str"),
    (lambda: jax_fp8.nvfp4_quantize(X, columnwise=True, rht_seed=5), ValueError,
     "rht_seed is the Hadamard transform's seed: it needs rht=True"),
    (lambda: jax_fp8.nvfp4_quantize(X.astype(jnp.int8)), TypeError,
     "x must be float32, bfloat16 or float16, got int8"),
    (lambda: jax_fp8.nvfp4_dequantize(X, jnp.zeros((32, 8), jnp.float8_e4m3fn), jnp.float32(1)),
     TypeError, "data must be uint8"),
    (lambda: jax_fp8.nvfp4_dequantize(jnp.zeros((32, 32), jnp.uint8), jnp.zeros((32, 8)),
                                      jnp.float32(1)), TypeError, "scales must be float8_e4m3fn"),
    (lambda: jax_fp8.nvfp4_dequantize(jnp.zeros((32, 32), jnp.uint8),
                                      jnp.zeros((32, 2), jnp.float8_e4m3fn), jnp.float32(1)),
     ValueError, r"scales must be \[..., C/16\] for data \[..., C/2\]"),
])
def test_bad_input(call, error, message):
  with pytest.raises(error, match=message):
    call()


def test_not_differentiable():
  with pytest.raises(TypeError, match="jax_fp8.nvfp4_quantize is not differentiable"):
    # under jit: the error comes while tracing, where eagerly the grad's operations compile
    jax.jit(jax.grad(lambda x: jax_fp8.nvfp4_quantize(x).scale.astype(jnp.float32).sum()))(X)
