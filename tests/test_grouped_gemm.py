"""grouped_gemm and grouped_gemm_wgrad against their f32 references: every operand pair and
output, group sizes with zeros, one group holding every row, sums below and above M, negative
sizes, traced sizes changing with one compilation, scan, sharding and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ACCUMULATION, on_cpu, poison_allocator, summation_error
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


def _bound(twin, a, b, *rest, out_dtype=jnp.float32):
  """(want, bound): the f32 twin's result and the elementwise bound of an FP8 GEMM's output:
  the output's rounding plus the tensor cores' accumulation (``ACCUMULATION`` of the sum of
  the products' magnitudes, which the twin of |a| and |b| gives)."""
  twin32 = lambda *v: twin(*v, out_dtype=jnp.float32)  # noqa: E731
  want = on_cpu(twin32, a, b, *rest)
  absolute = lambda v: jnp.abs(v.astype(jnp.float32)).astype(v.dtype)  # noqa: E731
  absdot = on_cpu(lambda a, b, *v: twin32(absolute(a), absolute(b), *v), a, b, *rest)
  return want, RTOL[out_dtype] * np.abs(want) + ACCUMULATION * absdot + 1e-6


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
  group_sizes = jnp.asarray(SIZES[sizes], jnp.int32)
  want, bound = _bound(reference.grouped_gemm, a, b, sa, sb, group_sizes, out_dtype=out_dtype)
  poison_allocator(m * n * jnp.dtype(out_dtype).itemsize)
  got = jax.jit(jax_fp8.grouped_gemm, static_argnames="out_dtype")(a, b, sa, sb, group_sizes,
                                                                   out_dtype=out_dtype)
  assert got.shape == (m, n) and got.dtype == out_dtype
  _check_close(got, want, bound)
  end = min(m, sum(max(s, 0) for s in SIZES[sizes]))
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
      ("out f16", rows, (a, b, 1.0, 1.0, s), {"out_dtype": jnp.float16}, TypeError,
       "out_dtype must be one of bfloat16, float32, got float16"),
      ("wgrad M", wgrad, (a_t[:, :40], b_t[:, :40], 1.0, 1.0, s), {}, ValueError,
       "M must be a multiple of 16 \\(FP8 GEMM alignment\\), got M=40"),
      ("wgrad M mismatch", wgrad, (a_t, b_t[:, :32], 1.0, 1.0, s), {}, ValueError,
       "a_t must be \\[K, M\\] and b_t \\[N, M\\]"),
      ("wgrad per-group scale", wgrad, (a_t, b_t, 1.0, jnp.ones(2, jnp.float32), s), {},
       TypeError, "b_scale must be a float32 scalar, got float32\\[2\\]"),
  ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs(case):
  _, fn, args, kwargs, error, match = case
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda: fn(*args, **kwargs))
