"""grouped_gemm and grouped_gemm_wgrad against their f32 references, with per-tensor and block
scales: every operand pair and output, group sizes with zeros, one group holding every row,
sums below and above M, negative sizes, misaligned wgrad groups, traced sizes changing with one
compilation, scan, sharding and bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ACCUMULATION, on_cpu, poison_allocator, reference_on_cpu, summation_error
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from test_gemm import PAIRS, RTOL, fp8_operand

import jax_fp8
from jax_fp8 import reference

# Group sizes over M = 200 rows and G = 4 groups, each a case the kernels must get right.
SIZES = {
    "balanced": [50, 50, 50, 50],
    "zeros": [0, 120, 0, 80],
    "one-group": [0, 0, 200, 0],
    "sum-below-m": [30, 7, 0, 100],  # rows 137.. belong to no group: zero
    "sum-above-m": [90, 90, 90, 90],  # clipped at 200: the last group is empty
    "negative": [60, -5, 70, 10],  # -5 counts as 0
}
# wgrad groups start at multiples of 16 (ROW_ALIGN) over M = 192 rows.
WGRAD_SIZES = {
    "balanced": [48, 48, 48, 48],
    "zeros": [0, 128, 0, 64],
    "one-group": [192, 0, 0, 0],
    "sum-below-m": [32, 16, 0, 96],
    "ragged-last": [64, 64, 16, 5],  # the last group's size need not be a multiple of 16
}


# Block scales: the rows form's groups at any row (a 1 x 128 group lies within one row) over
# M = 200, K = 384 (three groups along K) and N = 176 (each b[g]'s second block of rows
# ragged); wgrad's groups at multiples of 128 (BLOCK_ROW_ALIGN) over M = 384.
BLOCK_SIZES = {
    "zeros-negative-sum-below-m": [30, 0, -5, 100],  # rows 0, 30..130; rows 130.. in no group
    "one-group": [0, 0, 200, 0],
}
BLOCK_WGRAD_SIZES = {
    "zeros-ragged-last-sum-below-m": [128, 0, 128, 37],  # the last group ends at row 293
    "one-group": [384, 0, 0, 0],
}


def block_scales(rng, shape):
  """Positive f32 scales spread over 2^-8 .. 2^8, so that a scale read from another group or
  block shows in the result."""
  return jnp.asarray(2.0 ** rng.uniform(-8, 8, shape), jnp.float32)


def _bound(twin, a, b, *rest, out_dtype=jnp.float32):
  """(want, bound): the f32 twin's result and the elementwise bound of an FP8 GEMM's output:
  the output's rounding plus the tensor cores' accumulation (``ACCUMULATION`` of the sum of
  the products' magnitudes, which the twin of |a| and |b| gives; with block scales, positive,
  each product scaled by its own)."""
  want = reference_on_cpu(twin, a, b, *rest, out_dtype=jnp.float32)
  return want, RTOL[out_dtype] * np.abs(want) + ACCUMULATION * _absdot(twin, a, b, *rest) + 1e-6


def _absdot(twin, a, b, *rest):
  """The f32 twin of |a| and |b|: the sums of the products' magnitudes."""
  return reference_on_cpu(_of_magnitudes(twin), a, b, *rest, out_dtype=jnp.float32)


@functools.cache
def _of_magnitudes(twin):
  """``twin`` of the operands' magnitudes (one function per twin, so it is jitted once)."""
  def of_magnitudes(a, b, *rest, out_dtype):
    absolute = lambda v: jnp.abs(v.astype(jnp.float32)).astype(v.dtype)  # noqa: E731
    return twin(absolute(a), absolute(b), *rest, out_dtype=out_dtype)
  return of_magnitudes


def _check_close(got, want, bound):
  got = np.asarray(jnp.asarray(got, jnp.float32))
  assert np.all(np.isfinite(got))
  assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) / bound)


@pytest.mark.parametrize("fa,fb", PAIRS)
@pytest.mark.parametrize("out_dtype", [jnp.bfloat16, jnp.float32], ids=["bfloat16", "float32"])
@pytest.mark.parametrize("sizes", SIZES, ids=list(SIZES))
@pytest.mark.parametrize("per_group_scale", [False, True], ids=["scale", "scale-per-group"])
def test_grouped_gemm_matches_f32(platform, rng, fa, fb, out_dtype, sizes, per_group_scale):
  m, k, n, g = 200, 128, 48, 4
  a, b = fp8_operand(rng, (m, k), fa), fp8_operand(rng, (g, n, k), fb)
  sa = jnp.float32(rng.uniform(0.01, 2))
  sb = jnp.asarray(rng.uniform(0.01, 2, g) if per_group_scale else rng.uniform(0.01, 2),
                   jnp.float32)
  _check_rows_form(a, b, sa, sb, SIZES[sizes], out_dtype)


def _check_rows_form(a, b, sa, sb, sizes, out_dtype):
  """grouped_gemm (the output poisoned first) within the bound of its f32 twin, and zero in the
  rows after the last group."""
  (m, _), n = a.shape, b.shape[1]
  group_sizes = jnp.asarray(sizes, jnp.int32)
  want, bound = _bound(reference.grouped_gemm, a, b, sa, sb, group_sizes, out_dtype=out_dtype)
  poison_allocator(m * n * jnp.dtype(out_dtype).itemsize)
  got = jax.jit(jax_fp8.grouped_gemm, static_argnames="out_dtype")(a, b, sa, sb, group_sizes,
                                                                   out_dtype=out_dtype)
  assert got.shape == (m, n) and got.dtype == out_dtype
  _check_close(got, want, bound)
  end = min(m, sum(max(s, 0) for s in sizes))
  assert np.all(np.asarray(got)[end:] == 0)  # rows in no group: zero, written


@pytest.mark.parametrize("fa,fb", PAIRS)
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("sizes", WGRAD_SIZES, ids=list(WGRAD_SIZES))
def test_grouped_gemm_wgrad_matches_f32(platform, rng, fa, fb, out_dtype, sizes):
  m, k, n, g = 192, 64, 48, 4
  a_t, b_t = fp8_operand(rng, (k, m), fa), fp8_operand(rng, (n, m), fb)
  sa, sb = jnp.float32(rng.uniform(0.01, 2)), jnp.float32(rng.uniform(0.01, 2))
  group_sizes = jnp.asarray(WGRAD_SIZES[sizes], jnp.int32)
  # the accumulation bound of each group's own sum of products
  want, bound = _bound(reference.grouped_gemm_wgrad, a_t, b_t, sa, sb, group_sizes,
                       out_dtype=out_dtype)
  poison_allocator(g * k * n * jnp.dtype(out_dtype).itemsize)
  got = jax.jit(jax_fp8.grouped_gemm_wgrad, static_argnames="out_dtype")(
      a_t, b_t, sa, sb, group_sizes, out_dtype=out_dtype)
  assert got.shape == (g, k, n) and got.dtype == out_dtype
  _check_close(got, want, bound)
  for i, s in enumerate(WGRAD_SIZES[sizes]):
    if s == 0:
      assert np.all(np.asarray(got[i]) == 0)  # an empty group's gradient: zero, written


def test_grouped_gemm_wgrad_misaligned_group_is_nan(platform, rng):
  """A non-empty group starting at a row that is not a multiple of 16 is NaN, on every
  platform; the groups around it are computed, an empty one is zero."""
  m, k, n = 64, 32, 32
  a_t, b_t = fp8_operand(rng, (k, m), "e4m3"), fp8_operand(rng, (n, m), "e4m3")
  group_sizes = jnp.asarray([10, 0, 22, 32], jnp.int32)  # starts 0, 10, 10, 32
  got = np.asarray(jax.jit(jax_fp8.grouped_gemm_wgrad)(a_t, b_t, 1.0, 1.0, group_sizes))
  one = jnp.float32(1)
  want, bound = _bound(reference.grouped_gemm_wgrad, a_t, b_t, one, one, group_sizes)
  assert np.isnan(got[2]).all() and np.isnan(want[2]).all()
  assert np.all(got[1] == 0)
  for i in (0, 3):
    _check_close(got[i], want[i], bound[i])


def test_huge_group_sizes_saturate(platform, rng):
  """Sizes whose int32 running sum would pass 2^31 - 1 clip at M as the docs say (the first
  group takes every row, the rest are empty), in both forms and in the reference, on every
  platform: the same bits as sizes [M, 0, 0, 0]."""
  m, k, n = 64, 32, 32
  huge = jnp.asarray([2**31 - 1, 2**31 - 1, 16, 16], jnp.int32)
  plain = jnp.asarray([m, 0, 0, 0], jnp.int32)
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (4, n, k), "e4m3")
  b_scale = jnp.arange(1.0, 5.0, dtype=jnp.float32)
  rows = jax.jit(jax_fp8.grouped_gemm)
  np.testing.assert_array_equal(np.asarray(rows(a, b, 1.0, b_scale, huge), np.float32),
                                np.asarray(rows(a, b, 1.0, b_scale, plain), np.float32))
  a_t, b_t = fp8_operand(rng, (k, m), "e4m3"), fp8_operand(rng, (n, m), "e4m3")
  wgrad = jax.jit(jax_fp8.grouped_gemm_wgrad)
  np.testing.assert_array_equal(np.asarray(wgrad(a_t, b_t, 1.0, 1.0, huge)),
                                np.asarray(wgrad(a_t, b_t, 1.0, 1.0, plain)))
  one = jnp.float32(1)
  np.testing.assert_array_equal(
      reference_on_cpu(reference.grouped_gemm_wgrad, a_t, b_t, one, one, huge),
      reference_on_cpu(reference.grouped_gemm_wgrad, a_t, b_t, one, one, plain))


@pytest.mark.parametrize("sizes,out_dtype", [
    ("zeros-negative-sum-below-m", jnp.bfloat16), ("one-group", jnp.float32)],
    ids=["zeros-negative-sum-below-m-bfloat16", "one-group-float32"])
def test_block_grouped_gemm_matches_f32(platform, rng, sizes, out_dtype):
  """1 x 128 groups of a with 128 x 128 blocks of each b[g], groups at any row offset."""
  m, k, n, g = 200, 384, 176, 4
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (g, n, k), "e4m3")
  sa, sb = block_scales(rng, (m, k // 128)), block_scales(rng, (g, 2, k // 128))
  _check_rows_form(a, b, sa, sb, BLOCK_SIZES[sizes], out_dtype)


@pytest.mark.parametrize("sizes", BLOCK_WGRAD_SIZES, ids=list(BLOCK_WGRAD_SIZES))
def test_block_grouped_gemm_wgrad_matches_f32(platform, rng, sizes):
  """Both operands in 1 x 128 groups along the grouped rows, each group's starting at a
  multiple of 128; K and N not multiples of 128."""
  m, k, n, g = 384, 48, 80, 4
  a_t, b_t = fp8_operand(rng, (k, m), "e4m3"), fp8_operand(rng, (n, m), "e4m3")
  sa, sb = block_scales(rng, (k, m // 128)), block_scales(rng, (n, m // 128))
  group_sizes = jnp.asarray(BLOCK_WGRAD_SIZES[sizes], jnp.int32)
  want, bound = _bound(reference.grouped_gemm_wgrad, a_t, b_t, sa, sb, group_sizes)
  poison_allocator(g * k * n * 4)
  got = jax.jit(jax_fp8.grouped_gemm_wgrad)(a_t, b_t, sa, sb, group_sizes)
  assert got.shape == (g, k, n) and got.dtype == jnp.float32
  _check_close(got, want, bound)
  for i, s in enumerate(BLOCK_WGRAD_SIZES[sizes]):
    if s == 0:
      assert np.all(np.asarray(got[i]) == 0)  # an empty group's gradient: zero, written


def test_block_grouped_gemm_wgrad_misaligned_group_is_nan(platform, rng):
  """Under block scales a non-empty group starting at a row that is not a multiple of 128 is
  NaN, on every platform (its 1 x 128 groups would straddle two groups); a group that ends
  inside a 128-row group is computed, an empty one is zero."""
  m, k, n = 256, 32, 32
  a_t, b_t = fp8_operand(rng, (k, m), "e4m3"), fp8_operand(rng, (n, m), "e4m3")
  sa, sb = block_scales(rng, (k, 2)), block_scales(rng, (n, 2))
  group_sizes = jnp.asarray([100, 0, 28, 128], jnp.int32)  # starts 0, 100, 100, 128
  got = np.asarray(jax.jit(jax_fp8.grouped_gemm_wgrad)(a_t, b_t, sa, sb, group_sizes))
  want, bound = _bound(reference.grouped_gemm_wgrad, a_t, b_t, sa, sb, group_sizes)
  assert np.isnan(got[2]).all() and np.isnan(want[2]).all()
  assert np.all(got[1] == 0)
  for i in (0, 3):
    _check_close(got[i], want[i], bound[i])


def test_traced_sizes_one_compilation(platform, rng):
  """Group sizes are device values: new sizes reuse the compiled program, inside scan too."""
  m, k, n, g = 64, 32, 32, 3
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (g, n, k), "e4m3")
  f = jax.jit(lambda s: jax_fp8.grouped_gemm(a, b, 1.0, 1.0, s, out_dtype=jnp.float32))
  patterns = [[64, 0, 0], [16, 16, 32], [0, 0, 10]]
  one = jnp.float32(1)
  bounds = [_bound(reference.grouped_gemm, a, b, one, one, jnp.asarray(s, jnp.int32))
            for s in patterns]
  for s, (want, bound) in zip(patterns, bounds):
    _check_close(f(jnp.asarray(s, jnp.int32)), want, bound)
  assert f._cache_size() == 1

  def body(carry, s):
    return carry + jax_fp8.grouped_gemm(a, b, 1.0, 1.0, s, out_dtype=jnp.float32), None
  total, _ = jax.jit(lambda ss: jax.lax.scan(body, jnp.zeros((m, n)), ss))(
      jnp.asarray(patterns, jnp.int32))
  # three sums, each within its bound, and the f32 adds of the scan (a roundoff each)
  want = sum(w for w, _ in bounds)
  _check_close(total, want, sum(b for _, b in bounds) + 3 * 2.0**-24 * np.abs(want))


def test_sharded_jit_equals_one_device(rng):
  """Under a sharded jit, b split over N (and a_t over K, b_t over N for wgrad) keeps its
  split; the values equal one device's."""
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("x",))
  m, k, n, g = 64, 32, 64, 2
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (g, n, k), "e4m3")
  a_t, b_t = fp8_operand(rng, (k, m), "e4m3"), fp8_operand(rng, (n, m), "e5m2")
  s = jnp.asarray([40, 24], jnp.int32)
  with jax.default_device(jax.devices("cpu")[0]):
    one = jax_fp8.grouped_gemm(a, b, 1.0, 1.0, s, out_dtype=jnp.float32)
    one_w = jax_fp8.grouped_gemm_wgrad(a_t, b_t, 1.0, 1.0, s)
  b_s = jax.device_put(b, NamedSharding(mesh, P(None, "x", None)))
  got = jax.jit(lambda a, b, s: jax_fp8.grouped_gemm(a, b, 1.0, 1.0, s,
                                                     out_dtype=jnp.float32))(a, b_s, s)
  assert got.sharding.spec[1] == "x"
  # the same f32 sums, perhaps in another order: two orders of K (or M) terms of |a| |b|
  one32 = jnp.float32(1)
  absolute = lambda v: jnp.abs(v.astype(jnp.float32)).astype(v.dtype)  # noqa: E731
  absdot = on_cpu(lambda a, b: reference.grouped_gemm(absolute(a), absolute(b), one32, one32, s,
                                                      out_dtype=jnp.float32), a, b)
  assert np.all(np.abs(np.asarray(got) - np.asarray(one)) <= 2 * summation_error(k) * absdot)
  a_ts = jax.device_put(a_t, NamedSharding(mesh, P("x", None)))
  got_w = jax.jit(lambda a, b, s: jax_fp8.grouped_gemm_wgrad(a, b, 1.0, 1.0, s))(a_ts, b_t, s)
  absdot_w = on_cpu(lambda a, b: reference.grouped_gemm_wgrad(absolute(a), absolute(b), one32,
                                                              one32, s), a_t, b_t)
  got_w, one_w = np.asarray(got_w), np.asarray(one_w)
  np.testing.assert_array_equal(np.isnan(got_w), np.isnan(one_w))  # group 1 starts at row 40
  finite = ~np.isnan(one_w)
  assert np.all(np.abs(got_w - one_w)[finite] <= 2 * summation_error(m) * absdot_w[finite])


def test_block_sharded_jit_equals_one_device(rng):
  """Block scales under a sharded jit: b split over N in whole 128-row blocks (b_scale with
  it), and for wgrad a_t over K (a_scale with it); the values equal one device's."""
  mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("x",))
  m, k, n, g = 64, 256, 256, 2
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (g, n, k), "e4m3")
  sa, sb = block_scales(rng, (m, 2)), block_scales(rng, (g, 2, 2))
  a_t, b_t = fp8_operand(rng, (k, 128), "e4m3"), fp8_operand(rng, (n, 128), "e4m3")
  sa_t, sb_t = block_scales(rng, (k, 1)), block_scales(rng, (n, 1))
  s = jnp.asarray([40, 24], jnp.int32)
  s_w = jnp.asarray([128, 0], jnp.int32)
  rows = lambda *v: jax_fp8.grouped_gemm(*v, out_dtype=jnp.float32)  # noqa: E731
  with jax.default_device(jax.devices("cpu")[0]):
    one = rows(a, b, sa, sb, s)
    one_w = jax_fp8.grouped_gemm_wgrad(a_t, b_t, sa_t, sb_t, s_w)
  split = lambda v, *spec: jax.device_put(v, NamedSharding(mesh, P(*spec)))  # noqa: E731
  got = jax.jit(rows)(a, split(b, None, "x", None), sa, split(sb, None, "x", None), s)
  assert got.sharding.spec[1] == "x"
  got_w = jax.jit(jax_fp8.grouped_gemm_wgrad)(split(a_t, "x", None), b_t, split(sa_t, "x", None),
                                              sb_t, s_w)
  assert got_w.sharding.spec[1] == "x"
  # each element the same dequantized products summed in f32, perhaps in another order
  for twin, ops, out, one_out, terms in (
      (reference.grouped_gemm, (a, b, sa, sb, s), got, one, k),
      (reference.grouped_gemm_wgrad, (a_t, b_t, sa_t, sb_t, s_w), got_w, one_w, 128)):
    assert np.all(np.abs(np.asarray(out) - np.asarray(one_out))
                  <= 2 * summation_error(terms) * _absdot(twin, *ops))


def test_not_differentiable(rng):
  a, b = fp8_operand(rng, (32, 32), "e4m3"), fp8_operand(rng, (2, 32, 32), "e4m3")
  s = jnp.asarray([16, 16], jnp.int32)
  with pytest.raises(TypeError, match="jax_fp8.grouped_gemm is not differentiable"):
    jax.grad(lambda sa: jax_fp8.grouped_gemm(a, b, sa, 1.0, s, out_dtype=jnp.float32).sum())(
        jnp.float32(1))


def _bad_cases():
  e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
  a, b = jnp.zeros((64, 32), e4), jnp.zeros((2, 48, 32), e4)
  a_t, b_t = jnp.zeros((32, 64), e4), jnp.zeros((48, 64), e4)
  s = jnp.asarray([32, 32], jnp.int32)
  rows = jax_fp8.grouped_gemm
  wgrad = jax_fp8.grouped_gemm_wgrad
  return [
      ("bf16 a", rows, (a.astype(jnp.bfloat16), b, 1.0, 1.0, s), {}, TypeError,
       "a must be float8_e4m3fn or float8_e5m2, got bfloat16"),
      ("e5m2 pair", rows, (a.astype(e5), b.astype(e5), 1.0, 1.0, s), {}, TypeError,
       "e5m2 x e5m2"),
      ("b rank", rows, (a, b[0], 1.0, 1.0, s), {}, ValueError, "b \\[G, N, K\\]"),
      ("G mismatch", rows, (a, b, 1.0, 1.0, jnp.asarray([64], jnp.int32)), {}, ValueError,
       "b must be \\[G, N, K\\] = \\[1, N, 32\\]"),
      ("K mismatch", rows, (a, b[:, :, :16], 1.0, 1.0, s), {}, ValueError,
       "\\[2, N, 32\\]"),
      ("N not 16", rows, (a, b[:, :40], 1.0, 1.0, s), {}, ValueError,
       "N must be a multiple of 16 \\(FP8 GEMM alignment\\), got N=40"),
      ("sizes dtype", rows, (a, b, 1.0, 1.0, s.astype(jnp.int64 if jax.config.x64_enabled
                                                       else jnp.float32)), {}, TypeError,
       "group_sizes must be int32 \\[G\\]"),
      ("sizes rank", rows, (a, b, 1.0, 1.0, s[None]), {}, TypeError,
       "group_sizes must be int32 \\[G\\]"),
      ("no groups", rows, (a, b[:0], 1.0, 1.0, s[:0]), {}, ValueError,
       "1 to 1024 groups, got 0"),
      ("b_scale shape", rows, (a, b, 1.0, jnp.ones(3, jnp.float32), s), {}, TypeError,
       "b_scale must be a float32 scalar or \\[G\\] = \\[2\\]"),
      ("a_scale zero", rows, (a, b, 0.0, 1.0, s), {}, ValueError,
       "a_scale must be a positive normal finite float32"),
      ("b_scale numpy zero", rows, (a, b, 1.0, np.float32(0), s), {}, ValueError,
       "b_scale must be a positive normal finite float32 .* got np.float32\\(0.0\\)"),
      ("b_scale list with a zero", rows, (a, b, 1.0, [1.0, 0.0], s), {}, ValueError,
       "b_scale must be a positive normal finite float32 .* in every element"),
      ("b_scale numpy negative per group", rows, (a, b, 1.0, -np.ones(2, np.float32), s), {},
       ValueError, "b_scale must be a positive normal finite float32 .* in every element"),
      ("out f16", rows, (a, b, 1.0, 1.0, s), {"out_dtype": jnp.float16}, TypeError,
       "out_dtype must be one of bfloat16, float32, got float16"),
      ("wgrad M", wgrad, (a_t[:, :40], b_t[:, :40], 1.0, 1.0, s), {}, ValueError,
       "M must be a multiple of 16 \\(FP8 GEMM alignment\\), got M=40"),
      ("wgrad M mismatch", wgrad, (a_t, b_t[:, :32], 1.0, 1.0, s), {}, ValueError,
       "a_t must be \\[K, M\\] and b_t \\[N, M\\]"),
      ("wgrad per-group scale", wgrad, (a_t, b_t, 1.0, jnp.ones(2, jnp.float32), s), {},
       TypeError, "b_scale must be a float32 scalar with a per-tensor a_scale, got "
       "float32\\[2\\]"),
  ] + _block_bad_cases()


def _block_bad_cases():
  e4, e5, f32 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32
  a, b = jnp.zeros((64, 256), e4), jnp.zeros((2, 48, 256), e4)
  sa, sb = jnp.ones((64, 2), f32), jnp.ones((2, 1, 2), f32)
  a_t, b_t = jnp.zeros((32, 256), e4), jnp.zeros((48, 256), e4)
  sa_t, sb_t = jnp.ones((32, 2), f32), jnp.ones((48, 2), f32)
  s = jnp.asarray([32, 32], jnp.int32)
  rows, wgrad = jax_fp8.grouped_gemm, jax_fp8.grouped_gemm_wgrad
  return [
      ("block a_scale shape", rows, (a, b, sa[:, :1], sb, s), {}, ValueError,
       "a_scale must be \\[M, K/128\\] = \\[64, 2\\] \\(1 x 128 groups of a's rows\\) with "
       "block scales, got \\[64, 1\\]"),
      ("block b_scale shape", rows, (a, b, sa, jnp.ones((2, 48, 2), f32), s), {}, ValueError,
       "b_scale must be \\[G, ceil\\(N/128\\), K/128\\] = \\[2, 1, 2\\] .* got \\[2, 48, 2\\]"),
      ("block b_scale per-tensor", rows, (a, b, sa, 1.0, s), {}, ValueError,
       "b_scale must be \\[G, ceil\\(N/128\\), K/128\\] = \\[2, 1, 2\\] .* got \\[\\]"),
      ("block scale dtype", rows, (a, b, sa.astype(jnp.bfloat16), sb, s), {}, TypeError,
       "a_scale must be float32, got bfloat16\\[64, 2\\]"),
      ("block e5m2", rows, (a, b.astype(e5), sa, sb, s), {}, TypeError,
       "block-scaled grouped GEMMs take e4m3 operands .* got a float8_e4m3fn and b "
       "float8_e5m2"),
      ("block K", rows, (a[:, :64], b[:, :, :64], sa[:, :1], sb[:, :, :1], s), {}, ValueError,
       "block scales need K a multiple of 128 .* got K=64"),
      ("wgrad block M", wgrad, (a_t[:, :144], b_t[:, :144], sa_t, sb_t, s), {}, ValueError,
       "block scales need M a multiple of 128 .* got M=144"),
      ("wgrad block a_scale shape", wgrad, (a_t, b_t, sa_t[:, :1], sb_t, s), {}, ValueError,
       "a_scale must be \\[K, M/128\\] = \\[32, 2\\] .* got \\[32, 1\\]"),
      ("wgrad block b_scale shape", wgrad, (a_t, b_t, sa_t, sb_t.T, s), {}, ValueError,
       "b_scale must be \\[N, M/128\\] = \\[48, 2\\] .* got \\[2, 48\\]"),
  ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs(case):
  _, fn, args, kwargs, error, match = case
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda: fn(*args, **kwargs))
