"""cast_transpose_delayed: both layouts, amax and ring bit-identical to the reference; dbias
within the f32 summation error bound of the exact column sums, and bit-identical between the
CUDA kernel and the CPU handler (one summation order)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (assert_same_quantized, bits, covering_cases, filled, on_cpu,
                      poison_allocator, summation_error, to_device)

import jax_fp8
from jax_fp8 import reference

# (2100, 2096): 33 x 33 = 1089 tiles, more than the persistent grid's 8 blocks on each of an
# H200's 132 SMs, so blocks walk several tiles.
SHAPES = [(1, 16), (15, 32), (17, 48), (64, 64), (100, 208), (1000, 1040), (2100, 2096), (0, 16)]
# Every shape with every input dtype; the format and dbias vary so that every pair of the four
# factors occurs (24 cases for the 96 combinations).
CASES = covering_cases({"shape": SHAPES, "dtype": [jnp.float32, jnp.bfloat16, jnp.float16]},
                       {"fmt": ["e4m3", "e5m2"], "with_dbias": [False, True]})


@pytest.mark.parametrize("shape,dtype,fmt,with_dbias", CASES)
def test_matches_reference(platform, rng, fmt, dtype, shape, with_dbias):
  ring = jax_fp8.ScaleRing.create(8, fmt, margin=1)
  ref_ring = ring
  step = jax.jit(jax_fp8.cast_transpose_delayed, static_argnames="with_dbias")
  for t in range(3):  # the fresh step, then delayed steps
    x = rng.standard_normal(shape).astype(np.float32) * np.exp(rng.uniform(-3, 3))
    if x.size:
      x.flat[rng.integers(x.size)] = 6e4  # saturates e4m3 (and stays finite in float16)
    x = to_device(x, dtype)
    poison_allocator(x.size)
    if platform == "cuda":  # the CPU handler's dbias, to compare bit for bit
      cpu_db = on_cpu(lambda x, r: step(x, r, with_dbias=with_dbias).dbias, x, ring)
    out = step(x, ring, with_dbias=with_dbias)
    ref = on_cpu(
        lambda x, r: reference.cast_transpose_delayed(x, r, with_dbias=with_dbias), x, ref_ring)
    t, db, ring, ref_ring = out.tensor, out.dbias, out.ring, ref.ring
    assert t.data.shape == shape and t.data_t.shape == (shape[1], -(-shape[0] // 16) * 16)
    assert_same_quantized(t, ref.tensor)  # data, data_t, amax and the scale used
    for got, want in zip(jax.tree.leaves(ring), jax.tree.leaves(ref_ring)):
      np.testing.assert_array_equal(np.asarray(got), want)
    if with_dbias:  # f32 sums of R terms in any order: within gamma_R of their magnitudes
      xf = np.asarray(x, np.float64)
      bound = summation_error(shape[0]) * np.abs(xf).sum(axis=0)
      assert np.all(np.abs(np.asarray(db, np.float64) - xf.sum(axis=0)) <= bound)
      if platform == "cuda":
        np.testing.assert_array_equal(np.asarray(db), cpu_db)  # one summation order on both
    else:
      assert db is None


def test_bad_inputs():
  ring = jax_fp8.ScaleRing.create(4)
  with pytest.raises(ValueError, match="positive multiple of 16"):
    jax_fp8.cast_transpose_delayed(jnp.ones((4, 24)), ring)
  with pytest.raises(ValueError, match="positive multiple of 16"):
    jax_fp8.cast_transpose_delayed(jnp.ones((4, 2, 16)), ring)
  with pytest.raises(TypeError, match="ring must be"):
    jax_fp8.cast_transpose_delayed(jnp.ones((4, 16)), None)


# x in parts: column counts of 2 to 4 parts (a 64-column tile straddles parts in most).
PART_COLS = [(16, 16), (48, 16, 80), (64, 64, 64), (16, 112, 32, 48)]


@pytest.mark.parametrize("rows,cols,dtype", covering_cases(
    {"rows": [1, 100, 2100], "cols": PART_COLS}, {"dtype": [jnp.float32, jnp.bfloat16,
                                                           jnp.float16]}))
def test_parts_match_their_concatenation(platform, rng, dtype, cols, rows):
  """x in parts gives the bytes of their concatenation's cast-transpose, dbias and ring
  included, on the fresh step and a delayed one; both match the reference."""
  ring = jax.tree.map(jnp.asarray, jax_fp8.ScaleRing.create(8, "e5m2"))
  step = jax.jit(lambda xs, r: jax_fp8.cast_transpose_delayed(xs, r, with_dbias=True))
  for _ in range(2):
    parts = [(rng.standard_normal((rows, c)) * np.exp(rng.uniform(-3, 3))).astype(dtype)
             for c in cols]
    xs = [to_device(p) for p in parts]
    poison_allocator(rows * sum(cols))
    got = step(xs, ring)
    whole = step(to_device(np.concatenate(parts, axis=1)), ring)
    want = on_cpu(lambda xs, r: reference.cast_transpose_delayed(xs, r, with_dbias=True), xs,
                  ring)
    assert_same_quantized(got.tensor, whole.tensor)
    assert_same_quantized(got.tensor, want.tensor)
    for g, w in zip(jax.tree.leaves((got.ring, got.dbias)),
                    jax.tree.leaves((whole.ring, whole.dbias))):
      np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    for g, r in zip(jax.tree.leaves(got.ring), jax.tree.leaves(want.ring)):
      np.testing.assert_array_equal(np.asarray(g), r)
    xf = np.concatenate(parts, axis=1).astype(np.float64)  # dbias: any order
    bound = summation_error(rows) * np.abs(xf).sum(axis=0)
    assert np.all(np.abs(np.asarray(got.dbias, np.float64) - xf.sum(axis=0)) <= bound)
    ring = got.ring


def test_parts_keep_a_nan_visible(platform):
  xs = [jnp.ones((32, 16), jnp.bfloat16), jnp.ones((32, 32), jnp.bfloat16).at[5, 17].set(jnp.nan)]
  got = jax.jit(jax_fp8.cast_transpose_delayed)(xs, jax_fp8.ScaleRing.create(4))
  assert np.isnan(float(got.tensor.amax))


def test_parts_bad_inputs():
  ring = jax_fp8.ScaleRing.create(4)
  x = jnp.ones((4, 16))
  with pytest.raises(ValueError, match="1 to 4 arrays, got 5"):
    jax_fp8.cast_transpose_delayed([x] * 5, ring)
  with pytest.raises(ValueError, match="1 to 4 arrays, got 0"):
    jax_fp8.cast_transpose_delayed([], ring)
  with pytest.raises(TypeError, match=r"x\[1\] must have x\[0\]'s dtype float32, got bfloat16"):
    jax_fp8.cast_transpose_delayed((x, x.astype(jnp.bfloat16)), ring)
  with pytest.raises(ValueError, match=r"x\[1\] must have x\[0\]'s 4 rows"):
    jax_fp8.cast_transpose_delayed((x, jnp.ones((5, 16))), ring)
  with pytest.raises(ValueError, match=r"x\[1\] must be \[R, C\] with C a positive multiple of 16"):
    jax_fp8.cast_transpose_delayed((x, jnp.ones((4, 8))), ring)
  with pytest.raises(TypeError, match=r"x\[0\] must be float32"):
    jax_fp8.cast_transpose_delayed((x.astype(jnp.int32), x), ring)


def test_a_list_of_rows_is_one_array():
  """A list of Python rows (no arrays in it) is x itself, as every op takes it, not x in
  parts."""
  ring = jax_fp8.ScaleRing.create(4)
  rows = np.arange(64, dtype=np.float32).reshape(4, 16)
  got = jax_fp8.cast_transpose_delayed(rows.tolist(), ring)
  want = jax_fp8.cast_transpose_delayed(jnp.asarray(rows), ring)
  np.testing.assert_array_equal(bits(got.tensor.data), bits(want.tensor.data))
  np.testing.assert_array_equal(
      bits(reference.cast_transpose_delayed(rows.tolist(), ring).tensor.data),
      bits(want.tensor.data))


# The cast-transpose's sources under vmap, each over a stack of 3 slices: its arguments
# (fn's, before the ring) and what fn quantizes. Every kind of buffer the handler views is
# batched in one: x itself with dbias, x in parts (the remaining arguments), the gradient
# through an activation (y), a norm (its row statistics and gamma).
VMAP_SOURCES = {
    "x": (lambda x, r: jax_fp8.cast_transpose_delayed(x, r, with_dbias=True, observe=True),
          [(40, 48)]),
    "parts": (lambda a, b, r: jax_fp8.cast_transpose_delayed([a, b], r), [(40, 16), (40, 32)]),
    "swiglu_grad": (lambda dh, y, r: jax_fp8.activation_grad_cast_transpose(
        dh, y, r, activation="swiglu", with_dbias=True), [(40, 32), (40, 64)]),
    "rmsnorm": (lambda x, stats, gamma, r: jax_fp8.norm_cast_transpose(
        x, stats, gamma, None, r, norm="rmsnorm"), [(40, 48), (40, 1), (48,)]),
}


@pytest.mark.parametrize("source,batched", [("x", "all"), ("x", "x"), ("x", "ring"),
                                            ("parts", "all"), ("swiglu_grad", "x"),
                                            ("rmsnorm", "all")])
def test_vmap_is_the_op_on_each_slice(platform, rng, source, batched):
  """jax.vmap (one call for the stack, csrc/ffi/items.h): each slice's outputs, ring and dbias
  are the op's on that slice with its own amax, bit for bit; an argument vmap does not batch
  (the inputs, or the ring) is read by every slice. The slices' magnitudes differ by 2^6, and
  the ring is past its first step, so a scale or ring taken from the wrong slice shows."""
  fn, shapes = VMAP_SOURCES[source]
  stack = 3
  ins = [to_device(rng.standard_normal((stack,) + s).astype(np.float32)
                   * np.exp2(6.0 * np.arange(stack)).reshape((stack,) + (1,) * len(s)))
         for s in shapes]
  if source == "rmsnorm":  # positive row statistics
    ins[1] = jnp.abs(ins[1])
  ring = jax_fp8.cast_transpose_delayed(filled(16, 16, fill=3.0),
                                        jax_fp8.ScaleRing.create(4, "e5m2")).ring
  rings = jax.tree.map(lambda v: jnp.stack([v * (i + 1) for i in range(stack)]), ring)
  ins_axis = None if batched == "ring" else 0
  ring_axis = None if batched == "x" else 0
  args = [x[0] if ins_axis is None else x for x in ins] + [ring if ring_axis is None else rings]
  batched = jax.jit(jax.vmap(fn, in_axes=(ins_axis,) * len(ins) + (ring_axis,)))
  poison_allocator(jax.eval_shape(batched, *args).tensor.data.size)  # q's bytes
  got = batched(*args)
  one = jax.jit(fn)
  for i in range(stack):
    at = lambda v, axis: v if axis is None else jax.tree.map(lambda a: a[i], v)
    want = one(*[at(x, ins_axis) for x in args[:-1]], at(args[-1], ring_axis))
    assert_same_quantized(at(got.tensor, 0), want.tensor)
    for g, w in zip(jax.tree.leaves((got.ring, got.dbias)), jax.tree.leaves((want.ring,
                                                                              want.dbias))):
      np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(w))


def test_nested_vmap_is_the_op_on_each_slice(platform, rng):
  """Two vmaps (two leading batch dimensions, the ring batched by the outer one only, its two
  rings past their first step and different): one kernel call, no loop, and each slice is the
  op on that slice, its ring included."""
  x = to_device(rng.standard_normal((2, 3, 20, 16)).astype(np.float32) * 10.0)
  ring = jax_fp8.cast_transpose_delayed(filled(16, 16, fill=3.0), jax_fp8.ScaleRing.create(4)).ring
  rings = jax.tree.map(lambda v: jnp.stack([v, 4 * v]), ring)
  fn = jax.jit(jax.vmap(jax.vmap(jax_fp8.cast_transpose_delayed, in_axes=(0, None))))
  hlo = fn.lower(x, rings).as_text()
  assert hlo.count("jax_fp8_cast_transpose_ring") == 1 and "while" not in hlo
  got = fn(x, rings)
  one = jax.jit(jax_fp8.cast_transpose_delayed)
  for i, j in np.ndindex(2, 3):
    want = one(x[i, j], jax.tree.map(lambda v: v[i], rings))
    assert_same_quantized(jax.tree.map(lambda a: a[i, j], got.tensor), want.tensor)
    for g, w in zip(jax.tree.leaves(got.ring), jax.tree.leaves(want.ring)):
      np.testing.assert_array_equal(np.asarray(g[i, j]), np.asarray(w))
