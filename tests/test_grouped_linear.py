"""jax_fp8.grouped_linear: forward and gradients (x, kernels, bias) against f32 ragged_dot per
recipe (delayed, current and block scaling), with group sizes holding zeros, every row in one
expert, sums below M, M not a multiple of 16 (of 128 under block scaling), unaligned groups (the
padded wgrad) and aligned ones; the gradients as the products of the recipe's FP8 operands;
traced sizes with one compilation, scan, delayed-scaling state updates, the compute-dtype path
and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import filled, normwise, on_cpu, roundoff, summation_error, to_device
from test_linear import BWD_TOL, E4M3, E5M2, FWD_TOL, bias_tol, rel

import jax_fp8
from jax_fp8 import formats, reference
from jax_fp8.ops.grouped_gemm import group_bounds
from jax_fp8.state import next_ring

K, N = 32, 48
# Each expert's kernel has its own magnitude, 1e5 apart at the extremes: with one scale for all
# kernels the smallest would fall below E4M3's normal range; with one scale each, every
# expert's output keeps the format's precision (checked group by group).
MAGNITUDES = (1.0, 1e-4, 10.0, 1e-2)
# (M, group sizes over G = 4 experts, aligned): each a case the layer must get right.
CASES = {
    "unaligned": (50, [20, 0, 25, 5], False),  # groups start at rows 20 and 45: padded wgrad
    "zeros": (50, [0, 30, 0, 20], False),
    "one-expert": (50, [0, 0, 50, 0], False),
    "sum-below-m": (50, [7, 13, 0, 11], False),  # rows 31.. in no group: y = 0, dx = 0
    "clipped": (40, [30, -3, 30, 9], False),  # -3 counts as 0, the sum clipped at M
    "aligned": (50, [16, 0, 32, 2], True),  # non-empty groups start at 0, 16, 48
}
RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.CurrentScaling()}
# BlockScaling: K = N = 128 (its multiple); wgrad's groups start at multiples of 128 rows.
BLOCK, BLOCK_TOL = jax_fp8.BlockScaling(), normwise(E4M3, E4M3)  # every operand in e4m3
BLOCK_CASES = {
    # starts 0, 128, 128, 256, the last group clipped at M
    "aligned": (300, [128, 0, 128, 60], True),
    # starts 0, 70, 70, 160, rows 185.. in no group: the padded layout
    "unaligned": (200, [70, 0, 90, 25], False),
}


def problem(rng, m, dtype=jnp.float32, groups=4, k=K, n=N):
  x = to_device(rng.standard_normal((m, k)), dtype)
  scale = np.asarray(MAGNITUDES[:groups])[:, None, None] / np.sqrt(k)
  w = to_device(rng.standard_normal((groups, k, n)) * scale, jnp.float32)
  b = to_device(rng.standard_normal((groups, n)), jnp.float32)
  t = to_device(rng.standard_normal((m, n)), jnp.float32)
  return x, w, b, t


def state_for(recipe, groups=4):
  return jax_fp8.GroupedLinearState.create(groups, recipe) if recipe.stateful else None


def onehot(sizes, m):
  """f32 [M, G]: each row's group (the clipped groups of grouped_gemm), all zero for a row in
  no group."""
  start, end = group_bounds(sizes, m)
  row = jnp.arange(m)[:, None]
  return ((row >= start) & (row < end)).astype(jnp.float32)


@jax.jit
def ragged_f32(x, w, b, sizes):
  """The f32 math: ragged_dot over the clipped groups, each row's group's bias (jitted: one
  program a shape, where eagerly each operation compiles)."""
  start, end = group_bounds(sizes, x.shape[0])
  y = jax.lax.ragged_dot(x.astype(jnp.float32), w, end - start,
                         precision=jax.lax.Precision.HIGHEST)
  return y + onehot(sizes, x.shape[0]) @ b


def loss(x, w, b, state, sizes, t, recipe, aligned=False):
  y = jax_fp8.grouped_linear(x, w, sizes, b, recipe=recipe, state=state, aligned=aligned)
  return jnp.sum(y.astype(jnp.float32) * t)


def loss_f32(x, w, b, sizes, t):
  return jnp.sum(ragged_f32(x, w, b, sizes) * t)


grad_f32 = jax.jit(jax.grad(loss_f32, argnums=(0, 1, 2)))  # the f32 math's dx, dw and db


def rows_of(sizes, m):
  start, end = (np.asarray(v) for v in group_bounds(to_device(sizes, np.int32), m))
  return [slice(s, e) for s, e in zip(start, end)], int(end[-1])


# Every case under delayed scaling; current scaling (the same rules, other scales) on three.
RECIPE_CASES = [("delayed", c) for c in CASES] + [("current", c)
                                                   for c in ("unaligned", "zeros", "aligned")]


@pytest.mark.parametrize("name,case", RECIPE_CASES, ids=[f"{r}-{c}" for r, c in RECIPE_CASES])
def test_forward_and_grads(platform, rng, name, case):
  m, sizes, aligned = CASES[case]
  recipe, dtype = RECIPES[name], jnp.bfloat16 if case == "zeros" else jnp.float32
  check_forward_and_grads(recipe, problem(rng, m, dtype), sizes, aligned, FWD_TOL, BWD_TOL)


@pytest.mark.parametrize("case", ["aligned"])
def test_block_forward_and_grads(platform, rng, case):
  """BlockScaling: 1 x 128 groups of x and of the gradient, each expert kernel in its own
  128 x 128 blocks (the unaligned layout's test: the next one's)."""
  m, sizes, aligned = BLOCK_CASES[case]
  check_forward_and_grads(BLOCK, problem(rng, m, k=128, n=128), sizes, aligned, BLOCK_TOL,
                          BLOCK_TOL)


def check_forward_and_grads(recipe, data, sizes, aligned, fwd_tol, bwd_tol):
  """The layer's output and gradients against the f32 math: normwise within the recipe's
  tolerances (and each expert's alone, whatever its magnitude), zero for rows in no group and
  for an expert with no rows, the bias gradient through the output's rounding."""
  x, w, b, t = data
  (m, _), n, dtype = x.shape, w.shape[2], x.dtype
  gs = to_device(sizes, np.int32)
  state = state_for(recipe)
  forward = jax.jit(lambda x, w, b, s: jax_fp8.grouped_linear(
      x, w, gs, b, recipe=recipe, state=s, aligned=aligned))
  y, y_nb = forward(x, w, b, state), forward(x, w, None, state)
  assert y.shape == (m, n) and y.dtype == dtype
  want, want_nb = on_cpu(ragged_f32, x, w, b, gs), on_cpu(ragged_f32, x, w, 0 * b, gs)
  out = roundoff(dtype)  # the output's own rounding
  groups, end = rows_of(sizes, m)
  y32, y_nb = np.asarray(y.astype(jnp.float32)), np.asarray(y_nb.astype(jnp.float32))
  assert rel(y32, want) < fwd_tol + out
  for g, rows in enumerate(groups):  # each expert within the format, whatever its magnitude
    if rows.stop - rows.start >= 5:
      assert rel(y_nb[rows], want_nb[rows]) < fwd_tol + out, g
  assert np.all(y32[end:] == 0) and np.all(y_nb[end:] == 0)  # rows in no group
  grads = jax.jit(jax.grad(lambda x, w, b, s: loss(x, w, b, s, gs, t, recipe, aligned),
                           argnums=(0, 1, 2, 3)))(x, w, b, state)
  dx, dw, db = (np.asarray(v.astype(jnp.float32)) for v in grads[:3])
  assert grads[0].dtype == dtype and grads[1].dtype == jnp.float32
  want_dx, want_dw, want_db = on_cpu(grad_f32, x, w, b, gs, t)
  assert np.all(dx[end:] == 0)
  for g, rows in enumerate(groups):
    if rows.stop - rows.start >= 5:  # dgrad through each expert's own kernel scale
      assert rel(dx[rows], want_dx[rows]) < bwd_tol + out, g
    if rows.stop == rows.start:
      assert np.all(dw[g] == 0) and np.all(db[g] == 0)  # an expert with no rows: no gradient
    else:
      assert np.all(np.isfinite(dw[g]))
  assert rel(dw, want_dw) < bwd_tol + out
  assert rel(db, want_db) < bias_tol(dtype, m)  # through the output's rounding to dtype


def test_no_rows_and_one_expert(rng):
  """M = 0: an empty output and zero kernel gradients. G = 1 (its one group starts at row 0,
  so wgrad needs no padding) with M = 50 and 43 rows in the group: the f32 math."""
  recipe = jax_fp8.CurrentScaling()
  x, w, b, t = problem(rng, 50, groups=1)
  empty = jax.jit(jax.value_and_grad(lambda w, b: jnp.sum(jax_fp8.grouped_linear(
      x[:0], w, jnp.zeros((1,), jnp.int32), b, recipe=recipe)), argnums=(0, 1)))
  val, (dw0, db0) = empty(w, b)
  assert float(val) == 0 and not np.any(np.asarray(dw0)) and not np.any(np.asarray(db0))
  gs = to_device([43], np.int32)
  dx, dw, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=6)(x, w, b, None, gs,
                                                                            t, recipe)
  want = on_cpu(grad_f32, x, w, b, gs, t)
  assert rel(dx, want[0]) < BWD_TOL and rel(dw, want[1]) < BWD_TOL
  assert rel(db, want[2]) < bias_tol(jnp.float32, 50) and not np.any(np.asarray(dx)[43:])


def test_aligned_groups_clipped_at_m(rng):
  """aligned=True with M = 20 (not a multiple of 16) and sizes summing past M: the second
  group is empty once clipped at M, so its kernel gradient is zero (not the NaN of a group
  starting at row 20, which the transposed copies' 32 columns would hold)."""
  recipe = jax_fp8.CurrentScaling()
  x, w, b, t = problem(rng, 20, groups=2)
  gs = to_device([20, 5], np.int32)
  dx, dw, db = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=(6, 7))(
      x, w, b, None, gs, t, recipe, True)
  want = on_cpu(grad_f32, x, w, b, gs, t)
  assert np.all(np.asarray(dw[1]) == 0) and np.all(np.asarray(db[1]) == 0)
  assert rel(dw[0], want[1][0]) < BWD_TOL and rel(dx, want[0]) < BWD_TOL


def test_padded_wgrad_equals_an_aligned_layout(platform, rng):
  """Unaligned groups (aligned=False) give the kernel and x gradients of the same rows laid out
  aligned by hand (zero rows between the groups, aligned=True): zero rows change no amax, so
  the FP8 operands are the same; only the f32 sums' order may differ."""
  m, sizes = 45, [20, 0, 3, 22]
  x, w, b, t = problem(rng, m)
  recipe = jax_fp8.DelayedScaling()
  gs = to_device(sizes, np.int32)
  padded = [-(-s // 16) * 16 for s in sizes]
  pos = np.concatenate([np.arange(s) + sum(padded[:i]) for i, s in enumerate(sizes)])
  mp = sum(padded)
  xp = jnp.zeros((mp, K), jnp.float32).at[pos].set(x)
  tp = jnp.zeros((mp, N), jnp.float32).at[pos].set(t)
  grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)), static_argnums=(6, 7))
  state = state_for(recipe)
  dx, dw, db = grad(x, w, b, state, gs, t, recipe, False)
  dxp, dwp, dbp = grad(xp, w, b, state, to_device(padded, np.int32), tp, recipe, True)
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(dxp)[pos])  # the same row sums
  # dbias: XLA's f32 sums of each group's rows, with or without the zero rows between
  t_sums = on_cpu(jax.jit(lambda t: jax.ops.segment_sum(jnp.abs(t), jnp.repeat(
      jnp.arange(4), jnp.asarray(sizes), total_repeat_length=m), num_segments=4)), t)
  assert np.all(np.abs(np.asarray(db) - np.asarray(dbp)) <= 2 * summation_error(mp) * t_sums)
  absdot = on_cpu(jax.jit(lambda x, t: jnp.einsum("mk,mn->kn", jnp.abs(x), jnp.abs(t))), x, t)
  bound = 2 * summation_error(mp, platform) * (1 + E4M3) * (1 + E5M2) * absdot
  assert np.all(np.abs(np.asarray(dw) - np.asarray(dwp)) <= bound[None])


@pytest.mark.parametrize("name", RECIPES)
def test_backward_is_the_quantized_operands_products(platform, rng, name):
  """dx and dkernels are the grouped products of the FP8 operands the recipe makes (x and each
  kernel in E4M3 with their own scales, the output gradient in E5M2), exactly up to the f32
  sums' order: a gradient off by a scale factor, or a kernel quantized with another expert's
  scale, shows here though the normwise bounds might miss it. (On a fresh delayed ring and
  under current scaling the scales are those of the tensors' own amaxes.)"""
  m, sizes = 50, [20, 0, 25, 5]
  x, w, b, t = problem(rng, m)
  recipe, gs = RECIPES[name], to_device(sizes, np.int32)
  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)), static_argnums=6)(x, w, b, state_for(recipe),
                                                                      gs, t, recipe)

  def want(x, w, t, gs):
    fresh = jax_fp8.DelayedScaling().ring
    q = lambda v, fmt: reference.quantize_delayed(v, fresh(fmt)).tensor
    qx, qt = q(x, "e4m3"), q(t, "e5m2")
    qw = jax.vmap(lambda k: q(k, "e4m3"))(w)  # [G, K, N], scale [G]
    x8, t8, w8 = (v.data.astype(jnp.float32) for v in (qx, qt, qw))
    rows, hi = onehot(gs, m), jax.lax.Precision.HIGHEST  # [M, G]
    dx = jnp.einsum("mn,gkn,mg,g->mk", t8, w8, rows, qw.scale, precision=hi) * qt.scale
    dw = jnp.einsum("mk,mn,mg->gkn", x8, t8, rows, precision=hi) * (qx.scale * qt.scale)
    absx = jnp.einsum("mn,gkn,mg,g->mk", jnp.abs(t8), jnp.abs(w8), rows, qw.scale,
                      precision=hi) * qt.scale
    absw = jnp.einsum("mk,mn,mg->gkn", jnp.abs(x8), jnp.abs(t8), rows,
                      precision=hi) * (qx.scale * qt.scale)
    return dx, dw, absx, absw
  want_dx, want_dw, abs_dx, abs_dw = on_cpu(jax.jit(want), x, w, t, gs)
  assert np.all(np.abs(np.asarray(dx) - want_dx)
                <= 2 * summation_error(N, platform) * abs_dx + 1e-30)
  assert np.all(np.abs(np.asarray(dw) - want_dw)
                <= 2 * summation_error(m, platform) * abs_dw + 1e-30)


@pytest.mark.parametrize("case", ["unaligned"])
def test_block_backward_is_the_quantized_operands_products(platform, rng, case):
  """Under BlockScaling the output is the unfused twin's (the same FP8 operands, up to the f32
  sums' order and the roundings to x's dtype), and dx and dkernels are the grouped products of
  the FP8 operands the recipe makes, up to the f32 sums' order: the output gradient in 1 x 128
  groups along N (dgrad) and, with x, in 128-row groups along M starting at each expert's first
  row (wgrad: each expert's rows quantized on their own, as the padded layout does), each
  expert kernel in its own 128 x 128 blocks. A block scale read from another block or another
  expert, or a 128-row group straddling two experts, shows here."""
  m, sizes, aligned = BLOCK_CASES[case]
  x, w, b, t = problem(rng, m, k=128, n=128)
  gs = to_device(sizes, np.int32)
  y, vjp = jax.jit(lambda x, w: jax.vjp(lambda x, w: jax_fp8.grouped_linear(
      x, w, gs, b, recipe=BLOCK, aligned=aligned), x, w))(x, w)
  dx, dw = jax.jit(vjp)(t)
  groups, _ = rows_of(sizes, m)
  kw = {"fmt": "e4m3", "eps": BLOCK.eps, "ue8m0": BLOCK.ue8m0}
  hi = jax.lax.Precision.HIGHEST

  def dequantized(q, scale, block_rows):
    return q.astype(jnp.float32) * reference.expand_scales(scale, *q.shape, block_rows)

  def want(x, w, t):
    qw = jax.vmap(lambda k: reference.block_quantize(k, **kw))(w)  # [G, K, N], [G, 1, 1]
    w8 = jax.vmap(lambda q, s: dequantized(q, s, 128))(qw.data, qw.scale)
    qt = reference.group_quantize(t, **kw)  # [M, N], [M, N/128]
    t8 = dequantized(qt.data, qt.scale, 1)
    rows = onehot(gs, m)  # [M, G]
    dx = jnp.einsum("mn,gkn,mg->mk", t8, w8, rows, precision=hi)
    absx = jnp.einsum("mn,gkn,mg->mk", jnp.abs(t8), jnp.abs(w8), rows, precision=hi)
    dw, absw = [], []
    for r in groups:  # each expert's rows in their own 128-row groups along M
      qx = reference.group_cast_transpose(x[r], **kw)  # data_t [K, R128]
      qg = reference.group_cast_transpose(t[r], **kw)  # data_t [N, R128]
      x8, g8 = dequantized(qx.data_t, qx.scale_t, 1), dequantized(qg.data_t, qg.scale_t, 1)
      dw.append(jnp.matmul(x8, g8.T, precision=hi))
      absw.append(jnp.matmul(jnp.abs(x8), jnp.abs(g8).T, precision=hi))
    return dx, jnp.stack(dw), absx, jnp.stack(absw)
  want_dx, want_dw, abs_dx, abs_dw = on_cpu(jax.jit(want), x, w, t)
  assert np.all(np.abs(np.asarray(dx) - want_dx)
                <= 2 * summation_error(128, platform) * abs_dx + 1e-30)
  assert np.all(np.abs(np.asarray(dw) - want_dw)
                <= 2 * summation_error(m, platform) * abs_dw + 1e-30)
  want_y = on_cpu(jax.jit(lambda *a: reference.block_grouped_linear(*a, recipe=BLOCK)), x, w,
                  gs, b)
  absdot = on_cpu(jax.jit(lambda x, w: ragged_f32(jnp.abs(x), jnp.abs(w),
                                                  jnp.zeros_like(w[:, 0]), gs)), x, w)
  bound = (2 * roundoff(x.dtype) * np.abs(want_y)
           + 2 * summation_error(128, platform) * (1 + E4M3)**2 * absdot)
  assert np.all(np.abs(np.asarray(y) - want_y) <= bound)


def test_forward_matches_reference_twin(platform, rng):
  """The unfused twin quantizes the same way: only the GEMM's summation order and the two
  results' rounding to x's dtype differ (as test_linear's forward)."""
  m, sizes = 50, [20, 0, 25, 5]
  x, w, b, _ = problem(rng, m, jnp.bfloat16)
  gs, state = to_device(sizes, np.int32), state_for(jax_fp8.DelayedScaling())
  y = jax.jit(lambda *a: jax_fp8.grouped_linear(*a[:3], a[3], recipe=jax_fp8.DelayedScaling(),
                                                state=a[4]))(x, w, gs, b, state)
  want = on_cpu(jax.jit(lambda *a: reference.grouped_linear(*a[:4], state=a[4])), x, w, gs, b,
                state).astype(np.float32)
  absdot = on_cpu(lambda x, w, gs: ragged_f32(jnp.abs(x), jnp.abs(w), jnp.zeros_like(w[:, 0]),
                                              gs), x, w, gs)
  bound = (2 * roundoff(jnp.bfloat16) * np.abs(want)
           + 2 * summation_error(K, platform) * (1 + E4M3)**2 * absdot)
  assert np.all(np.abs(np.asarray(y.astype(jnp.float32)) - want) <= bound)


def test_traced_group_sizes_one_compilation(rng):
  """The sizes are device values: new sizes (unaligned, empty experts) reuse the program."""
  m = 40
  x, w, b, t = problem(rng, m)
  recipe = jax_fp8.CurrentScaling()
  f = jax.jit(jax.grad(lambda x, w, b, gs: loss(x, w, b, None, gs, t, recipe),
                       argnums=(0, 1, 2)))
  for sizes in ([10, 10, 10, 10], [0, 40, 0, 0], [3, 0, 17, 5]):
    gs = to_device(sizes, np.int32)
    got = f(x, w, b, gs)
    want = on_cpu(grad_f32, x, w, b, gs, t)
    assert rel(got[1], want[1]) < BWD_TOL and rel(got[0], want[0]) < BWD_TOL
  assert f._cache_size() == 1


def test_vmap_is_each_item(platform, rng):
  """Under jax.vmap (x batched with the kernels and sizes shared, or the sizes batched too),
  the gradients of x and the kernels are each item's own call, bit for bit, and so is the loss
  up to its sum's order (XLA may sum a batch of losses in another order on a GPU): two orders
  differ by at most twice the f32 summation error of its terms' magnitudes."""
  m, items = 40, 2
  x, w, b, t = problem(rng, items * m)
  x, t = x.reshape(items, m, K), t.reshape(items, m, N)
  sizes = to_device([[10, 10, 10, 10], [3, 0, 17, 5]], np.int32)
  recipe = jax_fp8.CurrentScaling()
  f = jax.value_and_grad(lambda x, w, gs, t: loss(x, w, b, None, gs, t, recipe), argnums=(0, 1))
  for gs_axis, gs in ((None, sizes[1]), (0, sizes)):
    got = jax.jit(jax.vmap(f, in_axes=(0, None, gs_axis, 0)))(x, w, gs, t)
    for i in range(items):
      want = jax.jit(f)(x[i], w, gs if gs_axis is None else gs[i], t[i])
      y = jax.jit(jax_fp8.grouped_linear, static_argnames="recipe")(
          x[i], w, gs if gs_axis is None else gs[i], b, recipe=recipe)
      magnitudes = float(jnp.sum(jnp.abs(y.astype(jnp.float32) * t[i])))  # the sum's terms
      assert abs(float(got[0][i]) - float(want[0])) <= (2 * summation_error(m * N, platform)
                                                        * magnitudes)
      for g, v in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
        np.testing.assert_array_equal(np.asarray(g[i]), np.asarray(v))


def test_jit_grad_inside_scan(rng):
  """Microbatches in a lax.scan, each with its own group sizes, one delayed state ``share``d
  over them: the gradients sum, the rings record the max amax of x over the microbatches."""
  m, n_mb = 32, 3
  x, w, b, t = problem(rng, n_mb * m)
  x = x.reshape(n_mb, m, K) * jnp.asarray([1.0, 4.0, 2.0])[:, None, None]
  t = t.reshape(n_mb, m, N)
  sizes = to_device([[8, 8, 8, 8], [0, 32, 0, 0], [5, 11, 0, 16]], np.int32)
  recipe = jax_fp8.DelayedScaling()
  state = state_for(recipe)

  def total(w, b, state):
    def body(c, xs):
      xi, ti, gi, si = xs
      return c + loss(xi, w, b, si, gi, ti, recipe), None
    return jax.lax.scan(body, 0.0, (x, t, sizes, jax_fp8.share(state, n_mb)))[0]

  dw, db, ds = jax.jit(jax.grad(total, argnums=(0, 1, 2)))(w, b, state)
  want = on_cpu(jax.jit(jax.grad(lambda w, b: sum(
      loss_f32(x[i], w, b, sizes[i], t[i]) for i in range(n_mb)), argnums=(0, 1))), w, b)
  assert rel(dw, want[0]) < BWD_TOL
  assert rel(db, want[1]) < bias_tol(jnp.float32, n_mb * m)
  assert float(ds.x.amax_history[0]) == np.max(np.abs(np.asarray(x)))  # a max: exact
  np.testing.assert_array_equal(np.asarray(ds.kernels.steps), np.ones(4))


def test_delayed_state_two_steps(rng):
  """update_state(state, d loss / d state) advances x's and the gradient's ring and every
  expert's kernel ring (with its own kernel's amax) exactly as next_ring does, step after
  step."""
  m, sizes = 50, [20, 0, 25, 5]
  x, w, b, t = problem(rng, m)
  gs = to_device(sizes, np.int32)
  recipe = jax_fp8.DelayedScaling()
  state = state_for(recipe)
  step = jax.jit(lambda x, w, s: jax_fp8.update_state(
      s, jax.grad(loss, argnums=3)(x, w, b, s, gs, t, recipe)))
  amax, ring = jax.jit(formats.amax), jax.jit(next_ring)  # one program each, not one an op
  for _ in range(2):
    amax_g = on_cpu(amax, t)  # dL/dy = t (every row is in a group here)
    want_x = on_cpu(ring, state.x, on_cpu(amax, x))
    want_g = on_cpu(ring, state.grad, amax_g)
    want_k = on_cpu(jax.vmap(ring), state.kernels, on_cpu(jax.vmap(amax), w))
    state = step(x, w, state)
    for got_ring, want_ring in ((state.x, want_x), (state.grad, want_g), (state.kernels, want_k)):
      for got, ref in zip(jax.tree.leaves(got_ring), jax.tree.leaves(want_ring)):
        np.testing.assert_array_equal(np.asarray(got), ref)
    w = w * 2.0  # the next step's kernels: every expert's ring sees a new amax
  assert state.kernels.scale.shape == (4,) and float(state.kernels.steps[0]) == 2
  scales = np.asarray(state.kernels.scale)
  assert scales[2] / scales[1] > 1e4  # one scale per expert, as far apart as the kernels


def test_pmap_two_devices_identical_rings(rng):
  """Data parallel: each replica its own rows and group sizes, the experts and the state
  replicated; amax_axis_name makes every replica record the same rings (x's front amax the max
  over the replicas, each expert's ring its kernel's)."""
  devices = jax.devices("cpu")[:2]
  m = 32
  x, w, b, t = problem(rng, 2 * m)
  x = x.reshape(2, m, K) * jnp.asarray([1.0, 3.0])[:, None, None]  # replicas see other amaxes
  t = t.reshape(2, m, N)
  sizes = to_device([[10, 0, 22, 0], [0, 16, 5, 11]], np.int32)
  recipe = jax_fp8.DelayedScaling()
  state = state_for(recipe)

  def step(x, t, gs, state):
    f = lambda w, b, s: jnp.sum(jax_fp8.grouped_linear(
        x, w, gs, b, recipe=recipe, state=s, amax_axis_name="r") * t)
    gw, gb, gst = jax.grad(f, argnums=(0, 1, 2))(w, b, state)
    return jax.lax.pmean(gw, "r"), jax.lax.pmean(gb, "r"), jax_fp8.update_state(state, gst)

  rep = jax.tree.map(lambda v: jnp.stack([v, v]), state)
  gw, gb, new = jax.pmap(step, axis_name="r", devices=devices)(x, t, sizes, rep)
  for leaf in jax.tree.leaves(new):
    np.testing.assert_array_equal(np.asarray(leaf[0]), np.asarray(leaf[1]))
  assert float(new.x.amax_history[0, 0]) == np.max(np.abs(np.asarray(x)))  # a max: exact
  want = on_cpu(jax.jit(jax.grad(lambda w: sum(
      loss_f32(x[i], w, b, sizes[i], t[i]) for i in range(2)) / 2)), w)
  assert rel(gw[0], want) < BWD_TOL


def test_below_min_intensity_is_ragged_dot(rng):
  """Below fp8_min_intensity the layer is XLA's ragged_dot in x's dtype, gradients included,
  and no ring moves."""
  m, sizes = 24, [10, 0, 9, 5]
  x, w, b, t = problem(rng, m, jnp.bfloat16)
  gs = to_device(sizes, np.int32)
  recipe = jax_fp8.DelayedScaling(fp8_min_intensity=1e6)
  state = state_for(recipe)
  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)), static_argnums=6)(x, w, b, state, gs, t,
                                                                         recipe)

  def plain(x, w, b):
    y = jax.lax.ragged_dot(x, w.astype(x.dtype), gs)
    y = y.astype(jnp.float32) + jnp.repeat(b, np.asarray(sizes), axis=0, total_repeat_length=m)
    return jnp.sum(y.astype(x.dtype).astype(jnp.float32) * t)
  want = jax.jit(jax.grad(plain, argnums=(0, 1, 2)))(x, w, b)
  for g, wg in zip(got[:3], want):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(wg))
  nxt = jax.jit(jax_fp8.update_state)(state, got[3])
  assert jax.tree.all(jax.tree.map(lambda a, c: np.array_equal(a, c), nxt, state))


def _bad_cases():
  """Built at collection: zeros (and sizes of 8) put from NumPy, each array of the shape and
  dtype a slice or conversion of the valid ones would have, with no eager JAX operation."""
  x, w = filled(32, K), filled(4, K, N)
  gs, b = filled(4, dtype=np.int32, fill=8), filled(4, N)
  delayed, current = jax_fp8.DelayedScaling(), jax_fp8.CurrentScaling()
  state = jax_fp8.GroupedLinearState.create(4, delayed)
  per_recipe = ("grouped_linear takes a DelayedScaling, a CurrentScaling or a BlockScaling "
                ".*got {}: no grouped FP8 GEMM takes its scales").format
  return [
      ("x rank", (filled(1, 32, K), w, gs, b), {"state": state}, ValueError,
       "x must be \\[M, K\\]"),
      ("x int", (filled(32, K, dtype=np.int32), w, gs, b), {"state": state}, TypeError,
       "x must be float32, bfloat16 or float16"),
      ("kernels rank", (x, filled(K, N), gs, b), {"state": state}, ValueError,
       "kernels must be \\[G, K, N\\] with x's K=32"),
      ("K mismatch", (x, filled(4, 16, N), gs, b), {"state": state}, ValueError,
       "kernels must be \\[G, K, N\\] with x's K=32, got shape \\[4, 16, 48\\]"),
      ("sizes float", (x, w, filled(4, fill=8), b), {"state": state}, TypeError,
       "group_sizes must be int32 \\[G\\], got float32"),
      ("sizes rank", (x, w, filled(1, 4, dtype=np.int32, fill=8), b), {"state": state}, TypeError,
       "group_sizes must be int32 \\[G\\]"),
      ("G mismatch", (x, w, filled(3, dtype=np.int32, fill=8), b), {"state": state}, ValueError,
       "group_sizes \\[G\\] and kernels \\[G, K, N\\] must share G, got group_sizes \\[3\\]"),
      ("bias shape", (x, w, gs, filled(N)), {"state": state}, ValueError,
       "bias must be \\[G, N\\] = \\[4, 48\\], got \\[48\\]"),
      ("N not 16", (x, filled(4, K, 40), gs, None), {"state": state}, ValueError,
       "multiples of 16 .*N=40"),
      ("block K", (x, w, gs, b), {"recipe": jax_fp8.BlockScaling()}, ValueError,
       "BlockScaling needs K and N multiples of 128 .*got K=32, N=48"),
      ("block state", (filled(32, 128), filled(4, 128, 128), gs, None),
       {"recipe": jax_fp8.BlockScaling(), "state": state}, ValueError,
       "BlockScaling is stateless: pass state=None"),
      ("block amax axis", (filled(32, 128), filled(4, 128, 128), gs, None),
       {"recipe": jax_fp8.BlockScaling(), "amax_axis_name": "batch"}, ValueError,
       "BlockScaling reduces no amax"),
      ("mxfp8 recipe", (x, w, gs, b), {"recipe": jax_fp8.MXFP8BlockScaling()}, TypeError,
       per_recipe("MXFP8BlockScaling")),
      ("nvfp4 recipe", (x, w, gs, b), {"recipe": jax_fp8.NVFP4BlockScaling()}, TypeError,
       per_recipe("NVFP4BlockScaling")),
      ("recipe class", (x, w, gs, b), {"recipe": jax_fp8.CurrentScaling}, TypeError,
       "pass an instance"),
      ("state type", (x, w, gs, b), {"state": jax_fp8.LinearState.create()}, TypeError,
       "state must be a jax_fp8.GroupedLinearState"),
      ("no state", (x, w, gs, b), {}, TypeError, "state must be a jax_fp8.GroupedLinearState"),
      ("state G", (x, w, gs, b), {"state": jax_fp8.GroupedLinearState.create(3, delayed)},
       ValueError, "state.kernels must hold one ring per expert.*G=4"),
      ("state recipe", (x, w, gs, b),
       {"state": jax_fp8.GroupedLinearState.create(4, jax_fp8.DelayedScaling(history_len=4))},
       ValueError, "do not match the recipe"),
      ("state to current", (x, w, gs, b), {"recipe": current, "state": state}, ValueError,
       "CurrentScaling is stateless"),
      ("aligned", (x, w, gs, b), {"state": state, "aligned": 1}, TypeError,
       "aligned must be a bool"),
  ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs(case):
  _, args, kwargs, error, match = case
  kwargs = {"recipe": jax_fp8.DelayedScaling(), **kwargs}
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda: jax_fp8.grouped_linear(*args, **kwargs))


@pytest.mark.parametrize("cls", [jax_fp8.GroupedLinearState, jax_fp8.GroupedMlpState],
                         ids=lambda c: c.__name__)
def test_state_create_errors(cls):
  with pytest.raises(TypeError, match="groups must be a Python int"):
    cls.create(4.0)
  with pytest.raises(TypeError, match=f"{cls.__name__}.create takes a DelayedScaling"):
    cls.create(4, jax_fp8.CurrentScaling())
