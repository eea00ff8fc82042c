"""Block scaling (DeepSeek-V3 recipe): group_quantize, block_quantize and group_cast_transpose
bit-identical to jax_fp8.reference on CPU and CUDA (q bytes and scales, NaN == NaN), the edge
policy with its values stated, dequantization error within the format's half-ulp, trace-time
errors, and PDL on / off giving the same bits."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (PLATFORMS, bits, jitted, on_cpu, poison_allocator, reference_on_cpu,
                      roundoff, to_device)

import jax_fp8
from jax_fp8 import formats, reference
from jax_fp8.ops import blockwise

FMTS = ["e4m3", "e5m2"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
DTYPE_IDS = lambda d: jnp.dtype(d).name  # noqa: E731
GROUP_SIZES = [16, 32, 64, 128]
LAYOUTS = ["row", "col", "col_tma"]
EPS = 1e-10
HALF_ULP = {fmt: roundoff(fmt) for fmt in FMTS}  # relative rounding error of a normal value
# Half the subnormal step, relative to the scale (e4m3 step 2^-9, e5m2 step 2^-16).
HALF_SUBNORMAL = {fmt: float(jnp.finfo(jax_fp8.fp8_dtype(fmt)).smallest_subnormal) / 2
                  for fmt in FMTS}
# The f32 steps around the rounding, x * f32(1 / scale) (two roundings) and q * scale (one),
# each 2^-24 of a value within (1 + 2^-3) of |x|: at most 4 * 2^-24 of |x| in all.
F32_STEPS = 4 * roundoff(jnp.float32)


def eps_scale(fmt, eps=EPS):
  """The scale of an all-zero group: eps * f32(1 / fmt_max), in f32 as the kernels compute it."""
  return np.float32(eps) * (np.float32(1) / np.float32(jax_fp8.fp8_max(fmt)))


def rand_rows(rng, shape, dtype, zero_group=None):
  """Normal values with per-row magnitudes spanning many orders (2^-40..2^40 for f32 / bf16,
  so some groups fall below eps; 2^-10..2^10 for f16) and a milder per-column spread, some exact
  zeros, f32 subnormals (which count as zero) and optionally one all-zero group."""
  lo, hi = (-10, 10) if dtype == jnp.float16 else (-40, 40)
  x = rng.standard_normal(shape).astype(np.float32)
  x *= (2.0 ** rng.uniform(lo, hi, size=(*shape[:-1], 1))).astype(np.float32)
  x *= (2.0 ** rng.uniform(-3, 3, size=shape[-1])).astype(np.float32)
  flat = x.reshape(-1)
  flat[rng.integers(flat.size, size=max(1, flat.size // 50))] = 0.0
  if dtype != jnp.float16:
    flat[rng.integers(flat.size, size=max(1, flat.size // 100))] = np.float32(1e-40)
  if zero_group is not None:
    x.reshape(-1, shape[-1])[0, :zero_group] = 0.0
  # NumPy's conversion (ml_dtypes'), no compilation: XLA's bits on these values (no NaN), but
  # perhaps for the f32 subnormals, which the kernels and the reference read as zero either way
  return to_device(x, dtype)


def assert_same(got, want):
  """Two ``Quantized`` (or sequences of arrays) equal: the same fields None, arrays with their
  shapes and dtypes; FP8 byte for byte; f32 NaN-equal with the sign of every zero equal too."""
  if isinstance(got, jax_fp8.Quantized):
    names = [f.name for f in dataclasses.fields(got)]
    assert [getattr(got, n) is None for n in names] == [getattr(want, n) is None for n in names]
    got, want = ([getattr(t, n) for n in names if getattr(t, n) is not None]
                 for t in (got, want))
  for g, w in zip(got, want, strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
    if g.dtype.itemsize == 1:
      np.testing.assert_array_equal(bits(g), bits(w))
    else:
      np.testing.assert_array_equal(g, w)
      np.testing.assert_array_equal(np.signbit(g) & ~np.isnan(g), np.signbit(w) & ~np.isnan(w))


def to_f32(a):
  """FP8 values as f32, exactly, by NumPy (ml_dtypes): no eager conversion to compile."""
  return np.asarray(a).astype(np.float32)


# ------------------------------------------------------------------------------------------
# Bit-identical to the reference.

@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_group_quantize_matches_reference(platform, rng, fmt, dtype):
  """Every group size with every scale layout (UE8M0 on for half of them, off for the other
  half, swapped between the formats), each on one of: a single row, a 1-D x, leading batch
  dims, M not a multiple of 4 (col_tma padding), a larger M (the shape rotates with the format
  and dtype)."""
  gq = jax.jit(blockwise.group_quantize,
               static_argnames=("group_size", "fmt", "ue8m0", "scale_layout"))
  shapes = [(1, 128), (256,), (2, 3, 256), (5, 384), (64, 512)]
  offset = 3 * FMTS.index(fmt) + DTYPES.index(dtype)
  xs = [rand_rows(rng, shape, dtype, zero_group=16) for shape in shapes]
  combos = [(gs, layout) for gs in GROUP_SIZES for layout in LAYOUTS]
  for i, (gs, layout) in enumerate(combos):
    x = xs[(i + offset) % len(shapes)]
    ue8m0 = bool((i + FMTS.index(fmt)) % 2)
    shape, m = x.shape, int(np.prod(x.shape[:-1]))
    kw = dict(group_size=gs, fmt=fmt, ue8m0=ue8m0, scale_layout=layout)
    poison_allocator(x.size)
    got = gq(x, **kw)
    assert_same(got, reference_on_cpu(reference.group_quantize, x, **kw))
    s = got.scale
    groups = shape[-1] // gs
    assert s.shape == {"row": (*shape[:-1], groups), "col": (groups, m),
                       "col_tma": (groups, -(-m // 4) * 4)}[layout]
    if layout == "col_tma":  # the padding columns are zero scales, +0.0 exactly
      assert not np.any(np.asarray(s)[:, m:].view(np.uint32))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_group_quantize_large(platform, rng, fmt, dtype):
  """1000 x 1024 (and 1001 rows: col_tma pads 3) with rows spanning orders of magnitude."""
  for shape, gs, layout, ue8m0 in [((1000, 1024), 128, "row", False),
                                   ((1001, 1024), 16, "col_tma", True)]:
    x = rand_rows(rng, shape, dtype)
    kw = dict(group_size=gs, fmt=fmt, ue8m0=ue8m0, scale_layout=layout)
    poison_allocator(x.size)
    got = blockwise.group_quantize(x, **kw)
    assert_same(got, reference_on_cpu(reference.group_quantize, x, **kw))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_block_quantize_matches_reference(platform, rng, fmt, dtype):
  """Ragged R and C (edge blocks scaled by the elements they hold), UE8M0 on / off."""
  bq = jax.jit(blockwise.block_quantize, static_argnames=("fmt", "ue8m0"))
  shapes = [(200, 144), (1, 16), (129, 256), (256, 384), (1000, 1040)]
  for i, shape in enumerate(shapes):
    x = rand_rows(rng, shape, dtype)
    ue8m0 = bool((i + DTYPES.index(dtype)) % 2)
    poison_allocator(x.size)
    got = bq(x, fmt=fmt, ue8m0=ue8m0)
    assert_same(got, reference_on_cpu(reference.block_quantize, x, fmt=fmt, ue8m0=ue8m0))
    assert got.scale.shape == (-(-shape[0] // 128), -(-shape[1] // 128))


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_group_cast_transpose_matches_reference(platform, rng, fmt, dtype):
  """Both directions byte for byte; qt's padding columns (R up to a multiple of 128) are
  zero bytes; the row direction equals group_quantize's."""
  gct = jax.jit(blockwise.group_cast_transpose, static_argnames=("fmt", "ue8m0"))
  for i, shape in enumerate([(200, 128), (1, 256), (129, 384), (256, 128), (1000, 1024)]):
    r, c = shape
    r128 = -(-r // 128) * 128
    x = rand_rows(rng, shape, dtype, zero_group=128)
    ue8m0 = bool((i + DTYPES.index(dtype)) % 2)
    poison_allocator(c * r128)
    got = gct(x, fmt=fmt, ue8m0=ue8m0)
    assert_same(got, reference_on_cpu(reference.group_cast_transpose, x, fmt=fmt, ue8m0=ue8m0))
    assert (got.data.shape, got.scale.shape, got.data_t.shape, got.scale_t.shape) == (
        (r, c), (r, c // 128), (c, r128), (c, r128 // 128))
    assert got.amax is None and got.global_scale is None
    assert not np.any(bits(got.data_t)[:, r:]), "data_t's padding columns must be zero bytes"
    assert_same((got.data, got.scale), jax.tree.leaves(blockwise.group_quantize(
        x, fmt=fmt, ue8m0=ue8m0)))


def test_group_cast_transpose_padding_is_zero_even_next_to_nan(platform):
  """qt's padding columns are zero bytes even when the column's last group holds a NaN (whose
  scale is NaN, so quantizing the padding would give NaN)."""
  x = np.ones((200, 128), np.float32)
  x[150, 7] = np.nan
  x = to_device(x)
  poison_allocator(256 * 128)
  got = jax_fp8.group_cast_transpose(x)
  qt = bits(got.data_t)
  assert np.isnan(np.asarray(got.scale_t)[7, 1])
  assert np.all(qt[:, 200:] == 0)
  assert np.all(qt[7, 128:200] == 0x7F)  # the NaN group itself: NaN bytes
  want = reference_on_cpu(reference.group_cast_transpose, x)
  np.testing.assert_array_equal(qt, bits(want.data_t))


def test_block_quantize_transpose_is_block_quantize_of_transpose(platform, rng):
  """The docstring's claim: data.T with scale.T is the block quantization of w.T."""
  for shape in [(256, 384), (208, 144)]:
    w = rand_rows(rng, shape, jnp.bfloat16)
    q = blockwise.block_quantize(w)
    qt = blockwise.block_quantize(w.T)
    np.testing.assert_array_equal(bits(q.data).T, bits(qt.data))
    np.testing.assert_array_equal(np.asarray(q.scale).T, np.asarray(qt.scale))


def test_vmap(platform, rng):
  """vmap runs the ops one slice at a time: each slice's result is the op's on that slice."""
  x = rand_rows(rng, (3, 5, 256), jnp.bfloat16)
  got = jax.vmap(lambda x: blockwise.group_quantize(x, scale_layout="col_tma"))(x)
  assert got.data.shape == (3, 5, 256) and got.scale.shape == (3, 2, 8)
  for i in range(3):
    assert_same(jax.tree.map(lambda v: v[i], got),
                blockwise.group_quantize(x[i], scale_layout="col_tma"))
  assert_same(jax.vmap(blockwise.block_quantize)(x),
              reference_on_cpu(jax.vmap(reference.block_quantize), x))


# ------------------------------------------------------------------------------------------
# The edge policy, with its values.

@pytest.mark.parametrize("fmt", FMTS)
def test_edge_policy(platform, fmt):
  """All-zero group -> scale eps / fmt_max and zero bytes; f32 subnormals count as zero; NaN in
  a group -> NaN scale (the group is NaN); inf (no NaN) -> inf scale (dequantizes to NaN);
  the amax maps to +-fmt_max; an amax under eps is floored at eps."""
  fmax = jax_fp8.fp8_max(fmt)
  x = np.zeros((5, 256), np.float32)
  # row 0: group 0 all zeros; group 1 f32 subnormals and signed zeros
  x[0, 128:134] = [1e-40, -1e-40, 2.0**-127, -(2.0**-149), 0.0, -0.0]
  # row 1: group 0 holds a NaN (and an inf); group 1 holds inf and -inf, no NaN
  x[1, :128] = np.linspace(-3, 3, 128)
  x[1, 7], x[1, 9] = np.nan, np.inf
  x[1, 128:] = np.linspace(-2, 2, 128)
  x[1, 130], x[1, 140] = np.inf, -np.inf
  # row 2: the amax positive in group 0, negative in group 1
  x[2] = np.linspace(-1, 1, 256) * 0.37
  x[2, 17], x[2, 200] = 1.7, -2.9
  # row 3: amax below eps (floored at eps), both groups
  x[3] = np.linspace(-1, 1, 256) * 3e-11
  # row 4: amax exactly eps (-eps): scale eps / fmt_max, -eps -> -fmt_max
  x[4, 5], x[4, 250] = np.float32(EPS), -np.float32(EPS)
  got = blockwise.group_quantize(to_device(x), fmt=fmt)
  q8, s = bits(got.data), np.asarray(got.scale)
  qf = to_f32(got.data)
  assert s.dtype == np.float32 and s.shape == (5, 2)
  zero_s = eps_scale(fmt)
  assert s[0, 0] == zero_s and s[0, 1] == zero_s
  assert not np.any(q8[0, :128])
  np.testing.assert_array_equal(q8[0, 128:134], [0x00, 0x80, 0x00, 0x80, 0x00, 0x80])
  assert np.isnan(s[1, 0]) and np.all(q8[1, :128] == 0x7F)
  assert s[1, 1] == np.inf
  with np.errstate(invalid="ignore"):
    deq = qf[1, 128:] * s[1, 1]
  assert np.all(np.isnan(deq)), "a group holding inf must dequantize to NaN"
  s2 = np.float32(1.7) * (np.float32(1) / np.float32(fmax))
  assert s[2, 0] == s2 and s[2, 1] == np.float32(2.9) * (np.float32(1) / np.float32(fmax))
  assert qf[2, 17] == fmax and qf[2, 200] == -fmax
  assert np.all(np.abs(qf[2]) <= fmax)
  assert s[3, 0] == zero_s and s[3, 1] == zero_s
  assert np.all(np.abs(qf[3]) < fmax)  # floored: the amax no longer reaches fmt_max
  assert s[4, 0] == zero_s and s[4, 1] == zero_s
  assert qf[4, 5] == fmax and qf[4, 250] == -fmax

  # ue8m0 keeps NaN and inf, rounds the eps scale up to a power of two.
  su = np.asarray(blockwise.group_quantize(to_device(x), fmt=fmt, ue8m0=True).scale)
  assert np.isnan(su[1, 0]) and su[1, 1] == np.inf
  assert su[0, 0] == np.float32(2.0 ** np.ceil(np.log2(np.float64(zero_s))))

  # The same policy for 128 x 128 blocks and for both directions of the cast-transpose.
  w = np.zeros((256, 256), np.float32)
  w[:128, 128:] = 1.0
  w[5, 130] = np.nan
  w[128:, :128] = -2.0
  w[200, 3] = -np.inf
  w[128:, 128:] = 0.5
  w[255, 255] = 1e-40
  blocks = blockwise.block_quantize(to_device(w), fmt=fmt)
  qb, sb = blocks.data, np.asarray(blocks.scale)
  assert sb[0, 0] == zero_s and not np.any(bits(qb)[:128, :128])
  assert np.isnan(sb[0, 1]) and np.all(bits(qb)[:128, 128:] == 0x7F)
  assert sb[1, 0] == np.inf
  assert sb[1, 1] == np.float32(0.5) * (np.float32(1) / np.float32(fmax))
  assert np.all(to_f32(qb)[128:255, 128:] == fmax)

  xt = np.zeros((130, 128), np.float32)  # row 0 zero, column 1 NaN, column 2 inf (tile 1)
  xt[1:, 3] = 1.0
  xt[4, 1], xt[129, 2] = np.nan, np.inf
  both = blockwise.group_cast_transpose(to_device(xt), fmt=fmt)
  sr, qt, st = np.asarray(both.scale), both.data_t, np.asarray(both.scale_t)
  assert sr[0, 0] == zero_s and np.isnan(sr[4, 0]) and sr[129, 0] == np.inf
  assert st[0, 0] == zero_s and st[0, 1] == zero_s and not np.any(bits(qt)[0])
  assert np.isnan(st[1, 0]) and st[1, 1] == zero_s
  assert st[2, 0] == zero_s and st[2, 1] == np.inf
  assert st[3, 0] == np.float32(1) * (np.float32(1) / np.float32(fmax))
  assert st[3, 1] == st[3, 0] and np.all(to_f32(qt)[3, 1:130] == fmax)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_edge_policy_other_dtypes(platform, dtype):
  """Zero, NaN, inf and amax groups in bf16 / f16 inputs as in f32."""
  fmax = jax_fp8.fp8_max("e4m3")
  x = np.zeros((2, 256), np.float32)
  x[0, 128:] = np.linspace(-1, 1, 128) * 3
  x[0, 140] = -5.0
  x[1, :128] = 1.0
  x[1, 3] = np.nan
  x[1, 130] = np.inf
  got = blockwise.group_quantize(to_device(x, dtype), group_size=32)  # NaN kept by NumPy
  q, s, qf = got.data, np.asarray(got.scale), to_f32(got.data)
  zero_s = eps_scale("e4m3")
  np.testing.assert_array_equal(s[0, :4], zero_s)
  assert np.all(bits(q)[0, :128] == 0)
  assert s[0, 4] == np.float32(5.0) * (np.float32(1) / np.float32(fmax)) and qf[0, 140] == -fmax
  assert np.isnan(s[1, 0]) and np.all(np.isnan(qf[1, :32]))
  np.testing.assert_array_equal(s[1, 1:4], np.float32(1) / np.float32(fmax))
  with np.errstate(invalid="ignore"):
    assert s[1, 4] == np.inf and np.all(np.isnan(qf[1, 128:160] * s[1, 4]))


@pytest.mark.parametrize("fmt", FMTS)
def test_ue8m0_scales_are_powers_of_two(platform, rng, fmt):
  """With ue8m0 every finite scale is an exact power of two, >= the plain scale and < twice it;
  q stays within the format (the amax maps at most to fmt_max)."""
  fmax = jax_fp8.fp8_max(fmt)
  x = rand_rows(rng, (64, 512), jnp.float32, zero_group=128)
  cases = [  # (the op, a direction's data and scale fields)
      (lambda **kw: blockwise.group_quantize(x, group_size=32, **kw), "data", "scale"),
      (lambda **kw: blockwise.block_quantize(x[:, :400], **kw), "data", "scale"),
      (lambda **kw: blockwise.group_cast_transpose(x, **kw), "data", "scale"),
      (lambda **kw: blockwise.group_cast_transpose(x, **kw), "data_t", "scale_t"),
  ]
  for fn, data, scale in cases:
    plain, up = getattr(fn(fmt=fmt), scale), fn(fmt=fmt, ue8m0=True)
    plain, su, q = np.asarray(plain), np.asarray(getattr(up, scale)), to_f32(getattr(up, data))
    assert np.all(np.isfinite(su)) and np.all(su > 0)
    mant, _ = np.frexp(su)
    assert np.all(mant == 0.5), su[mant != 0.5]
    assert np.all(su >= plain) and np.all(su < 2 * plain)
    assert np.all(np.abs(q) <= fmax)
    # an exact power of two stays as it is
    np.testing.assert_array_equal(su[plain == su], plain[plain == su])


@pytest.mark.parametrize("fmt", FMTS)
def test_ue8m0_finite_inputs_stay_finite(platform, rng, fmt):
  """Groups and blocks whose amax lies above 1.75 * 2^127 get the top ue8m0 scale 2^(128 -
  emax), where an element rounding to 2^emax would dequantize to inf: their elements saturate at
  the largest FP8 value below 2^emax (e4m3 240, e5m2 28672; formats.top_scale_saturate), bit
  for bit as the reference, in every op and direction. Elements up to the largest f32, either
  sign; the other groups as before."""
  big = np.finfo(np.float32).max
  x = np.asarray(rng.standard_normal((256, 256)), np.float32)
  x[0:128, 0:128] = rng.uniform(0.9 * big, big, (128, 128)) * rng.choice([-1, 1], (128, 128))
  x[0, 0:4], x[1, 0:4] = [big, -big, 3.3e38, -3.3e38], 1.76 * 2.0**127
  x = to_device(x)
  top = {"e4m3": (2.0**120, 240.0), "e5m2": (2.0**113, 28672.0)}[fmt]
  ops = {"group_quantize": dict(group_size=128), "block_quantize": {},
         "group_cast_transpose": {}}
  for name, kw in ops.items():
    poison_allocator(x.size)
    got = jitted(getattr(blockwise, name), x, fmt=fmt, ue8m0=True, **kw)
    assert_same(got, reference_on_cpu(getattr(reference, name), x, fmt=fmt, ue8m0=True, **kw))
    pairs = [(got.data, got.scale)] + [(got.data_t, got.scale_t)] * (got.data_t is not None)
    for data, scale in pairs:  # data_t: x transposed, its top groups at the same corner
      full = np.asarray(expand_scales(scale, *data.shape, 128 if name == "block_quantize" else 1))
      d = to_f32(data) * full
      assert np.all(np.isfinite(d)), name
      assert full[0, 0] == top[0] and d[0, 0] == top[1] * top[0], name
      assert np.all(full[128:, 128:] < top[0]), name


# ------------------------------------------------------------------------------------------
# Dequantization round trip.

def check_roundtrip(x, deq, scales_full, fmt):
  """|x - q * scale| within half an ulp of the format: per element 2^-4 (e4m3) or 2^-3 (e5m2)
  of |x| (or half a subnormal step of the scale), so per group within that fraction of the
  group amax; plus F32_STEPS of |x| for the f32 arithmetic around the rounding. In f64."""
  x, deq, scales_full = (np.asarray(v, np.float64) for v in (x, deq, scales_full))
  err = np.abs(x - deq)
  bound = ((HALF_ULP[fmt] + F32_STEPS) * np.abs(x)
           + HALF_SUBNORMAL[fmt] * scales_full * (1 + F32_STEPS))
  assert np.all(err <= bound), np.max(err / np.maximum(bound, 1e-300))
  return err


# reference.expand_scales jitted: one program per shape, where eagerly each operation compiles.
expand_scales = jax.jit(reference.expand_scales, static_argnums=(1, 2, 3))


@pytest.mark.parametrize("fmt", FMTS)
def test_dequantize_roundtrip(platform, rng, fmt):
  for dtype in DTYPES:
    for ue8m0 in (False, True):
      x = rand_rows(rng, (300, 512), dtype)
      xf = reference_on_cpu(formats.as_f32, x)  # the values the kernels see (f32 subnormals -> 0)
      # the ops and expand_scales jitted (conftest.jitted): eagerly each compiles piecewise
      for gs in (128, 32):
        got = jitted(blockwise.group_quantize, x, group_size=gs, fmt=fmt, ue8m0=ue8m0)
        q, s = got.data, got.scale
        if gs == 128:
          full = np.asarray(expand_scales(s, 300, 512, 1))
        else:
          full = np.repeat(np.asarray(s), gs, axis=-1)
        deq = to_f32(q) * full
        err = check_roundtrip(xf, deq, full, fmt)
        amax = np.abs(xf).reshape(300, -1, gs).max(-1)
        gerr = err.reshape(300, -1, gs).max(-1)
        floor = np.maximum(amax, np.float32(EPS))  # a group under eps: the error is tiny anyway
        # (a subnormal's error, half a step of a scale below 2 * floor / fmt_max, is far less)
        assert np.all(gerr <= (HALF_ULP[fmt] + F32_STEPS) * floor.astype(np.float64))
        qmax = np.abs(to_f32(q)).reshape(300, -1, gs).max(-1)
        fmax = jax_fp8.fp8_max(fmt)
        if not ue8m0:  # the group amax maps to fmt_max (unless floored at eps)
          np.testing.assert_array_equal(qmax[amax >= np.float32(EPS)], fmax)
        assert np.all(qmax <= fmax) and np.all(qmax[amax >= np.float32(EPS)] >= fmax / 2)
      blocks = jitted(blockwise.block_quantize, to_device(np.asarray(x)[:, :400]), fmt=fmt,
                      ue8m0=ue8m0)
      full = np.asarray(expand_scales(blocks.scale, 300, 400, 128))
      check_roundtrip(xf[:, :400], to_f32(blocks.data) * full, full, fmt)
      both = jitted(blockwise.group_cast_transpose, x, fmt=fmt, ue8m0=ue8m0)
      full = np.asarray(expand_scales(both.scale_t, 512, 384, 1))
      deq_t = to_f32(both.data_t) * full
      check_roundtrip(xf.T, deq_t[:, :300], full[:, :300], fmt)
      assert not np.any(deq_t[:, 300:])


# ------------------------------------------------------------------------------------------
# Trace-time errors.

def test_bad_inputs():
  x = jnp.ones((4, 256), jnp.float32)
  gq, bq, gct = blockwise.group_quantize, blockwise.block_quantize, blockwise.group_cast_transpose
  with pytest.raises(ValueError, match="last axis must be a multiple of group_size=128"):
    gq(jnp.ones((4, 200)))
  with pytest.raises(ValueError, match="last axis must be a multiple of group_size=64"):
    gq(jnp.ones((4, 96)), group_size=64)
  with pytest.raises(ValueError, match=r"group_size must be one of \(16, 32, 64, 128\), got 48"):
    gq(x, group_size=48)
  with pytest.raises(ValueError, match="scale_layout must be one of"):
    gq(x, scale_layout="colmajor")
  with pytest.raises(ValueError, match="fmt must be one of"):
    gq(x, fmt="e3m4")
  for bad in (0.0, -1e-10, float("nan"), float("inf"), 1e-45, 1e39):  # 1e39: inf in f32
    for fn in (gq, bq, gct):
      with pytest.raises(ValueError, match="eps must be finite and at least fmt_max"):
        fn(x, eps=bad)
  for fn, name in ((gq, "x"), (bq, "w"), (gct, "x")):
    with pytest.raises(TypeError, match=f"{name} must be float32, bfloat16 or float16"):
      fn(jnp.ones((4, 256), jnp.int32))
  with pytest.raises(TypeError, match="group_size must be a Python int"):
    gq(x, group_size=128.0)
  with pytest.raises(ValueError, match="C a positive multiple of 128"):
    gct(jnp.ones((4, 144)))
  with pytest.raises(ValueError, match="C a positive multiple of 16"):
    bq(jnp.ones((4, 24)))
  with pytest.raises(ValueError, match=r"w must be \[R, C\]"):
    bq(jnp.ones((256,)))
  with pytest.raises(ValueError, match=r"x must be \[R, C\]"):
    gct(jnp.ones((2, 4, 128)))
  with pytest.raises(ValueError, match=r"w must be \[R, C\]"):
    bq(jnp.ones((4, 0)))
  # under jit the errors come at trace time too
  with pytest.raises(ValueError, match="group_size"):
    jax.jit(lambda x: gq(x, group_size=48))(x)


def test_empty_rows(platform):
  """No rows: empty outputs of the right shapes (col_tma: no padding either)."""
  x = jnp.zeros((0, 256), jnp.bfloat16)
  t = blockwise.group_quantize(x)
  assert t.data.shape == (0, 256) and t.scale.shape == (0, 2)
  assert blockwise.group_quantize(x, scale_layout="col_tma").scale.shape == (2, 0)
  t = blockwise.block_quantize(x)
  assert t.data.shape == (0, 256) and t.scale.shape == (0, 2)
  t = blockwise.group_cast_transpose(x)
  assert (t.data.shape, t.scale.shape, t.data_t.shape, t.scale_t.shape) == (
      (0, 256), (0, 2), (256, 0), (256, 0))


# ------------------------------------------------------------------------------------------
# Programmatic Dependent Launch on and off give the same bits.

@pytest.mark.parametrize("platform", [PLATFORMS[1]], indirect=True)  # a CUDA launch attribute
def test_pdl_on_off_same_bits(platform, rng, monkeypatch):
  x = jnp.asarray(rng.standard_normal((256, 512)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((384, 512)) * 0.05, jnp.bfloat16)

  @jax.jit
  def chain(x, w):
    qx = blockwise.group_quantize(x)
    qw = blockwise.block_quantize(w)
    y = jax_fp8.gemm(qx.data, qw.data, qx.scale, qw.scale, out_dtype=jnp.bfloat16)
    qy = blockwise.group_quantize(y, group_size=64, scale_layout="col_tma")
    return qx.data, qx.scale, qw.data, qw.scale, y, qy.data, qy.scale

  def run():
    jax.clear_caches()  # a compiled executable (or command buffer) keeps what it saw
    return jax.tree.map(np.asarray, chain(x, w))

  try:
    monkeypatch.setenv("JAX_FP8_PDL", "0")
    off = run()
    monkeypatch.delenv("JAX_FP8_PDL", raising=False)
    on = run()
  finally:
    monkeypatch.undo()
    jax.clear_caches()
  for a, b in zip(off, on, strict=True):
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
  assert np.all(np.isfinite(on[4].astype(np.float32)))


@pytest.mark.parametrize("spec", [("d",), (None, "m"), ("d", "m"), ("d", "d2")],
                         ids=["rows", "cols", "rows_cols", "uneven_rows"])
def test_sharded_jit_bit_identical(rng, spec):
  """Under a plain jit over 8 CPU devices the quantizers run on the local pieces (whole groups
  and blocks on each device, a dimension gathered where its pieces would cut them) and give
  one device's bytes and scales."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices("cpu")[:8]).reshape(2, 2, 2), ("d", "m", "d2"))
  rows = 384 if spec != ("d", "d2") else 200  # 200: rows not in whole 128-row blocks
  x = to_device(rng.standard_normal((rows, 512)) * 3, jnp.bfloat16)  # NumPy's rounding, XLA's
  xs = jax.device_put(x, NamedSharding(mesh, P(*spec)))
  ops = {
      "row": lambda x: blockwise.group_quantize(x, group_size=64),
      "col": lambda x: blockwise.group_quantize(x, scale_layout="col"),
      "col_tma": lambda x: blockwise.group_quantize(x, scale_layout="col_tma", ue8m0=True),
      "block": blockwise.block_quantize,
      "cast_transpose": blockwise.group_cast_transpose,
  }
  for name, op in ops.items():
    got = jax.jit(op)(xs)
    want = on_cpu(op, x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
      assert g.shape == w.shape, name
      np.testing.assert_array_equal(bits(g) if g.dtype.itemsize == 1 else np.asarray(g),
                                    bits(w) if w.dtype.itemsize == 1 else w, err_msg=name)
