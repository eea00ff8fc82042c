"""quantize / quantize_delayed: bit-identical to jax_fp8.reference on CPU and CUDA."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import assert_same_quantized, bits, on_cpu, poison_allocator, to_device

import jax_fp8
from jax_fp8 import formats, reference

FMTS = ["e4m3", "e5m2"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


def special_values(fmt, dtype):
  """Saturation edges, zeros, subnormals of both formats, NaN and infinities."""
  fmax = jax_fp8.fp8_max(fmt)
  v = [0.0, -0.0, 448.0, 464.0, 465.0, -465.0, 1e4, -1e4, 57344.0, 61440.0, 1e5, np.inf,
       -np.inf, np.nan, fmax, -fmax, 2.0**-9, 2.0**-10, 3 * 2.0**-10, 2.0**-16, 2.0**-17,
       3 * 2.0**-17, 2.0**-6, 2.0**-14, 0.5, 1.0, 1.0625, 1.125, 1.1875, -3.3, 7.5e-3,
       1e-40, -1e-40, 2.0**-127]  # f32 subnormals: count as zero everywhere
  if dtype == jnp.float16:  # keep within float16's range
    v = [min(max(x, -6e4), 6e4) if np.isfinite(x) else x for x in v]
  return to_device(np.array(v, np.float32), dtype)


def check_same(got, want):
  """data and amax of two Quantized (and the scale where both hold one) equal, NaN == NaN."""
  assert_same_quantized(got, want, ["data", "amax", "scale"])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_special_values(platform, fmt, dtype):
  x = special_values(fmt, dtype)
  for scale in (1.0, 0.5, 3.0):
    s = jnp.float32(scale)
    got = jax.jit(jax_fp8.quantize, static_argnums=2)(x, s, fmt)
    check_same(got, on_cpu(lambda x, s: reference.quantize(x, s, fmt), x, s))
  # The saturation policy stated in docs/design.md: beyond max (465 in e4m3) -> max, inf -> max,
  # NaN stays NaN.
  fmax = jax_fp8.fp8_max(fmt)
  q = jax_fp8.quantize(jnp.asarray([fmax * 1.04, np.inf, -np.inf, np.nan], jnp.float32),
                       jnp.float32(1.0), fmt).data
  np.testing.assert_array_equal(np.asarray(q).astype(np.float32)[:3], [fmax, fmax, -fmax])
  assert np.isnan(np.asarray(q).astype(np.float32)[3])


@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("n", [1, 15, 17, 4096, 1_000_003])
def test_random_sizes(platform, rng, fmt, dtype, n):
  x = to_device(rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 300), dtype)
  s = jnp.float32(rng.uniform(0.05, 2.0))
  poison_allocator(n)
  check_same(jax_fp8.quantize(x, s, fmt), on_cpu(lambda x, s: reference.quantize(x, s, fmt), x, s))


def test_f32_subnormals_count_as_zero(platform):
  """Every backend flushes f32 subnormal inputs and scales to zero (XLA's CPU runtime does)."""
  x = jnp.asarray([1e-40, -1e-40, 2.0**-127, 0.0], jnp.float32)
  t = jax_fp8.quantize(x, jnp.float32(np.finfo(np.float32).tiny))
  assert float(t.amax) == 0.0
  np.testing.assert_array_equal(bits(t.data), [0x00, 0x80, 0x00, 0x00])
  ring = jax_fp8.quantize_delayed(x, jax_fp8.ScaleRing.create(2)).ring
  assert float(ring.amax_history[0]) == 0.0 and float(ring.scale) == 1.0


def test_shapes_and_zero(platform, rng):
  x = jnp.asarray(rng.standard_normal((3, 5, 7)), jnp.bfloat16)
  t = jax_fp8.quantize(x, jnp.float32(0.01))
  assert t.data.shape == (3, 5, 7) and t.data.dtype == jnp.float8_e4m3fn and t.amax.shape == ()
  assert t.scale.dtype == jnp.float32 and float(t.scale) == np.float32(0.01)
  assert t.data_t is None and t.scale_t is None and t.global_scale is None
  z = jax_fp8.quantize(jnp.zeros((33,), jnp.float32), jnp.float32(1.0))
  assert float(z.amax) == 0.0 and not np.any(bits(z.data))
  e = jax_fp8.quantize(jnp.zeros((0,), jnp.float32), jnp.float32(1.0))
  assert e.data.shape == (0,) and float(e.amax) == 0.0


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("fmt,margin,length", [("e4m3", 0, 16), ("e5m2", 2, 5), ("e4m3", 1, 1)])
def test_ring_50_steps(platform, rng, algo, fmt, margin, length):
  """quantize_delayed equals the reference over 50 steps, ring and all, from a fresh ring
  (tensors of five sizes in turn: each new size is a compilation of both)."""
  ring = jax_fp8.ScaleRing.create(length, fmt, margin, algo)
  ref_ring = ring
  step = jax.jit(jax_fp8.quantize_delayed)
  for t in range(50):
    mag = float(np.exp(rng.uniform(-6, 6)))
    x = to_device(rng.standard_normal(1000 + 371 * (t % 5)).astype(np.float32) * mag,
                  jnp.bfloat16)
    got = step(x, ring)
    want = on_cpu(reference.quantize_delayed, x, ref_ring)
    check_same(got.tensor, want.tensor)  # the scale used too
    ring, ref_ring = got.ring, want.ring
    for got, want in zip(jax.tree.leaves(ring), jax.tree.leaves(ref_ring)):
      np.testing.assert_array_equal(np.asarray(got), want)
  assert float(ring.steps) == 50


@pytest.mark.parametrize("n,length", [(100_003, 300), (5_000_011, 1024)])
def test_ring_many_blocks(platform, rng, n, length):
  """Large tensors: many blocks race to finalize the ring (and, on step 0, to fill the first
  amax); long histories: the finalize loops over the history."""
  ring = jax_fp8.ScaleRing.create(length, "e4m3", algo="max")
  ref_ring = ring
  for _ in range(3):
    x = jnp.asarray(rng.standard_normal(n).astype(np.float32) * rng.uniform(0.1, 100))
    got = jax_fp8.quantize_delayed(x, ring)
    want = on_cpu(reference.quantize_delayed, x, ref_ring)
    check_same(got.tensor, want.tensor)
    ring, ref_ring = got.ring, want.ring
    for got, want in zip(jax.tree.leaves(ring), jax.tree.leaves(ref_ring)):
      np.testing.assert_array_equal(np.asarray(got), want)


def test_ring_first_step_uses_current_amax(platform):
  """Step 0 scales from the tensor's own amax, not from a default scale of 1."""
  x = jnp.asarray([0.0, 1e-3, -2e-3], jnp.float32)
  out = jax_fp8.quantize_delayed(x, jax_fp8.ScaleRing.create(4, "e4m3"))
  q, ring = out.tensor.data, out.ring
  np.testing.assert_allclose(np.asarray(q).astype(np.float32)[2], -448.0)
  np.testing.assert_allclose(float(ring.scale), 2e-3 / 448, rtol=1e-6)
  np.testing.assert_allclose(np.asarray(ring.amax_history), [2e-3, 0, 0, 0], rtol=1e-6)


@pytest.mark.parametrize("op", ["quantize_delayed", "cast_transpose_delayed"])
@pytest.mark.parametrize("special", ["finite", "nan", "inf"])
def test_observe_writes_the_observation(platform, rng, op, special):
  """observe=True: the kernel writes the ring's observation of the step (the state gradient:
  history shifted with the amax in front, +inf for NaN or inf, steps + 1, scale 0), bit for
  bit as jax_fp8.state.observe, on a fresh ring and on a later one; q and the scale used are
  those of observe=False."""
  fn, ref = getattr(jax_fp8, op), getattr(reference, op)
  x = rng.standard_normal((40, 48)).astype(np.float32)
  x[3, 7] = {"finite": 5.0, "nan": np.nan, "inf": np.inf}[special]
  x = jnp.asarray(x, jnp.bfloat16)
  fresh = jax_fp8.ScaleRing.create(5, "e4m3", margin=1)
  later = on_cpu(lambda r: reference.quantize_delayed(jnp.full((4, 16), 7.0), r).ring, fresh)
  for ring in (fresh, later):
    got, plain = jax.jit(lambda x, r: (fn(x, r, observe=True), fn(x, r)))(x, ring)
    want = on_cpu(lambda x, r: ref(x, r, observe=True), x, ring)
    assert_same_quantized(got.tensor, want.tensor)
    assert_same_quantized(got.tensor, plain.tensor, ["data", "data_t", "scale"])
    for g, w in zip(jax.tree.leaves(got.ring), jax.tree.leaves(want.ring)):
      np.testing.assert_array_equal(np.asarray(g), w)
    assert float(got.ring.steps) == float(ring.steps) + 1 and float(got.ring.scale) == 0


@pytest.mark.parametrize("op", ["quantize_delayed", "cast_transpose_delayed"])
def test_ring_after_all_zero_steps_uses_current_amax(platform, op):
  """A zero-initialized layer's ring (or the gradient's upstream of it) sees zeros first: those
  steps set no scale, so the first step with data still scales from its own amax, not from the
  placeholder scale 1."""
  def run(x, ring):
    out = getattr(jax_fp8, op)(x, ring)
    return out.tensor.data, out.tensor.amax, out.ring

  ring = jax_fp8.ScaleRing.create(4, "e4m3")
  for _ in range(2):
    _, _, ring = jax.jit(run)(jnp.zeros((16, 32), jnp.float32), ring)
  assert float(ring.steps) == 0
  x = jnp.full((16, 32), 1e-3, jnp.float32).at[3, 5].set(-2e-3)
  q, _, ring = jax.jit(run)(x, ring)
  np.testing.assert_allclose(np.asarray(q).astype(np.float32)[3, 5], -448.0)
  np.testing.assert_allclose(float(ring.scale), 2e-3 / 448, rtol=1e-6)
  assert float(ring.steps) == 1
  np.testing.assert_allclose(np.asarray(ring.amax_history), [2e-3, 0, 0, 0], rtol=1e-6)


def test_ring_margin(platform):
  x = jnp.asarray([3.0, -1.0], jnp.float32)
  ring = jax_fp8.quantize_delayed(x, jax_fp8.ScaleRing.create(4, "e4m3", margin=2)).ring
  np.testing.assert_allclose(float(ring.scale), 3.0 * 4 / 448, rtol=1e-6)


def test_ring_edge_cases(platform):
  """All-zero tensor keeps a positive scale; tiny and huge amax give finite scales; NaN / inf
  leave the ring untouched (the state is never poisoned) while q shows the NaN."""
  ring = jax_fp8.ScaleRing.create(4, "e4m3")
  out = jax_fp8.quantize_delayed(jnp.zeros((64,), jnp.float32), ring)
  q, ring = out.tensor.data, out.ring
  # An all-zero step is recorded but not counted: the ring stays on current scaling.
  assert float(ring.scale) == 1.0 and float(ring.steps) == 0 and not np.any(bits(q))
  np.testing.assert_array_equal(np.asarray(ring.amax_history), [0, 0, 0, 0])
  r_tiny = jax_fp8.quantize_delayed(jnp.full((8,), 1e-37, jnp.float32), ring).ring
  assert float(r_tiny.scale) == np.finfo(np.float32).tiny
  r_sub = jax_fp8.quantize_delayed(jnp.full((8,), 1e-44, jnp.float32), ring).ring
  assert float(r_sub.scale) == 1.0  # an f32-subnormal amax counts as zero: scale kept
  r_huge = jax_fp8.quantize_delayed(jnp.full((8,), 3e38, jnp.float32), ring).ring
  assert np.isfinite(float(r_huge.scale)) and float(r_huge.scale) > 0
  before = jax.tree.map(np.asarray, r_huge)
  for bad in (np.nan, np.inf):
    x = jnp.asarray([1.0, bad, 2.0], jnp.float32)
    out = jax_fp8.quantize_delayed(x, r_huge)
    for got, want in zip(jax.tree.leaves(out.ring), jax.tree.leaves(before)):
      np.testing.assert_array_equal(np.asarray(got), want)
    assert not np.isfinite(float(out.tensor.amax))  # the amax itself is reported as computed
  tn = jax_fp8.quantize_delayed(jnp.asarray([1.0, np.nan], jnp.float32), r_huge).tensor
  assert np.isnan(float(tn.amax)) and np.isnan(np.asarray(tn.data.astype(jnp.float32))[1])


def test_quantized_is_a_pytree(platform):
  """Quantized: a frozen pytree whose leaves are its fields that are not None, so it passes
  through jit and tree maps as its arrays do; every quantize op and its twin return one (their
  return types by jax.eval_shape: traced, nothing compiled)."""
  x = jnp.linspace(-3, 3, 64 * 128, dtype=jnp.float32).reshape(64, 128)
  t = jax.jit(jax_fp8.quantize)(x, jnp.float32(0.01))
  assert isinstance(t, jax_fp8.Quantized) and len(jax.tree.leaves(t)) == 3  # data, scale, amax
  doubled = jax.tree.map(lambda v: v * 2, t)
  assert doubled.data_t is None and float(doubled.scale) == np.float32(0.02)
  with pytest.raises(dataclasses.FrozenInstanceError):
    t.scale = jnp.float32(1)
  ring = jax_fp8.ScaleRing.create(4)
  for op, args in ((jax_fp8.group_quantize, (x,)), (jax_fp8.block_quantize, (x,)),
                   (jax_fp8.group_cast_transpose, (x,)), (jax_fp8.mxfp8_quantize, (x,)),
                   (jax_fp8.nvfp4_quantize, (x,))):
    got, want = (jax.eval_shape(f, *args) for f in (op, getattr(reference, op.__name__)))
    assert isinstance(got, jax_fp8.Quantized) and isinstance(want, jax_fp8.Quantized)
  for op in (jax_fp8.quantize_delayed, jax_fp8.cast_transpose_delayed):
    got, want = (jax.eval_shape(f, x, ring) for f in (op, getattr(reference, op.__name__)))
    assert isinstance(got, jax_fp8.DelayedQuantized) and isinstance(got.tensor, jax_fp8.Quantized)
    assert type(want) is type(got) and got.dbias is None and want.dbias is None


def test_bad_inputs():
  with pytest.raises(TypeError, match="x must be float32, bfloat16 or float16"):
    jax_fp8.quantize(jnp.ones(4, jnp.int32), jnp.float32(1))
  with pytest.raises(TypeError, match="scale must be a float32 scalar"):
    jax_fp8.quantize(jnp.ones(4), jnp.ones(2))
  with pytest.raises(ValueError, match="fmt must be one of"):
    jax_fp8.quantize(jnp.ones(4), jnp.float32(1), "e3m4")
  with pytest.raises(TypeError, match="ring must be a jax_fp8.ScaleRing"):
    jax_fp8.quantize_delayed(jnp.ones(4), jnp.float32(1))
  with pytest.raises(ValueError, match="history_len"):
    jax_fp8.ScaleRing.create(0)
  with pytest.raises(ValueError, match="algo"):
    jax_fp8.ScaleRing.create(4, algo="mean")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
def test_amax_forms_agree(rng, dtype):
  """formats.amax's two forms (the CPU's max and NaN search, the other backends' one integer
  max over the magnitude bits) give the same amaxes, whole and along each axis: NaN where a
  NaN is (of either sign), inf, f32 subnormals as zero, -0 as 0."""
  x = np.asarray(rng.standard_normal((6, 40)) * np.exp(rng.uniform(-30, 30, (6, 40))), np.float32)
  x[0, 3], x[1, 5], x[2, 7] = np.nan, -np.inf, -np.nan
  x[3] = np.float32(2.0**-130) * np.sign(x[3])  # f32 subnormals only: amax 0
  x[4] = -0.0
  x = jnp.asarray(x).astype(dtype)
  f32 = np.abs(np.asarray(x.astype(jnp.float32), np.float64))
  f32[f32 < np.finfo(np.float32).tiny] = 0.0
  for axis in (None, 0, 1):
    want = np.where(np.isnan(f32).any(axis=axis), np.nan, np.nanmax(f32, axis=axis, initial=0))
    for form in (formats.amax_and_nan_search, formats.amax_of_bits, formats.amax):
      got = np.asarray(jax.jit(form, static_argnums=1)(x, axis), np.float64)
      np.testing.assert_array_equal(got, want)
