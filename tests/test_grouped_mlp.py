"""jax_fp8.grouped_mlp: values and gradients against an f32 ragged_dot model within the FP8
formats' bounds, with group sizes holding zeros, every row in one expert, sums below M, M not a
multiple of 16, aligned and unaligned groups, gated and plain activations, per-tensor and block
scaling; a twin built from jax_fp8.reference's quantizers that equals the layer bit for bit on
CPU, the delayed state's observations included (the activation's amaxes within a few ulps), and
under BlockScaling one within the f32 sums' order; traced sizes with one compilation; the
compute-dtype path below fp8_min_intensity; bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import filled, normwise, reference_on_cpu, roundoff, summation_error, to_device
from test_backward_twins import ACT_ULPS, tree_equal
from test_grouped_linear import onehot, rows_of
from test_linear import bias_tol, rel

import jax_fp8
from jax_fp8 import activations, reference
from jax_fp8.families._shared import group_bias
from jax_fp8.formats import ROW_ALIGN, amax
from jax_fp8.layer_state import MLP_RINGS
from jax_fp8.quantized import Quantized
from jax_fp8.ops.grouped_gemm import group_bounds
from jax_fp8.state import ScaleRing, current, next_ring

E4M3, E5M2 = roundoff("e4m3"), roundoff("e5m2")
# The output: x and kernel_in rounded (gate and up each), the activation's rounding, kernel_out's.
FWD_TOL = normwise(*[E4M3] * 6)
# The gradients: the e5m2 output gradient and the activation gradient's, beside the four e4m3
# roundings of x, the kernels and the activation.
BWD_TOL = normwise(E5M2, E5M2, E4M3, E4M3, E4M3, E4M3)
K, F, D, G = 32, 32, 48, 4
# Each expert's kernel_out has its own magnitude, 1e5 apart at the extremes: each expert's
# output and dx keep the format's precision only with a scale per expert (checked group by
# group). kernel_in's stay within a factor of 4: the activation has one scale for every
# expert's rows, so an expert's act(y) far below the others' would leave E4M3's range.
MAGNITUDES_OUT = (1.0, 1e-4, 10.0, 1e-2)
MAGNITUDES_IN = (1.0, 0.5, 2.0, 1.0)
RECIPES = {"delayed": jax_fp8.DelayedScaling(), "current": jax_fp8.CurrentScaling(),
           "block": jax_fp8.BlockScaling()}
F32 = jnp.float32
# Every f32 product of the twins and the f32 math: on a GPU XLA's default precision rounds f32
# operands to TF32 (10 mantissa bits), far outside the bounds.
HI = jax.lax.Precision.HIGHEST
# BlockScaling: K = F = D = 128 (its multiple); every operand, the gradients too, in e4m3 (in
# 1 x 128 groups or 128 x 128 blocks): the output's bound for the gradients as well.
BLOCK, BLOCK_DIMS = RECIPES["block"], {"k": 128, "f": 128, "d": 128}


def problem(rng, m, activation="swiglu", dtype=F32, k=K, f=F, d=D):
  n = 2 * f if activations.ACTIVATIONS[activation][1] else f
  # put from NumPy (jnp.asarray's conversion, without its compiled copy per shape)
  x = to_device(rng.standard_normal((m, k)), dtype)
  k_in = to_device(rng.standard_normal((G, k, n)) * np.asarray(MAGNITUDES_IN)[:, None, None]
                   / np.sqrt(k), F32)
  k_out = to_device(rng.standard_normal((G, f, d)) * np.asarray(MAGNITUDES_OUT)[:, None, None]
                    / np.sqrt(f), F32)
  b_in = to_device(rng.standard_normal((G, n)) * 0.1, F32)
  b_out = to_device(rng.standard_normal((G, d)) * 0.1, F32)
  t = to_device(rng.standard_normal((m, d)), F32)
  return x, k_in, k_out, b_in, b_out, t


def expert_sums(rows, v):
  """f32 [G, ...]: each expert's rows of v [M, ...] summed (rows: ``onehot``'s [M, G])."""
  return jnp.matmul(rows.T, v, precision=HI)


def mlp_f32(x, k_in, k_out, b_in, b_out, sizes, activation):
  """The f32 math: ragged_dot over the clipped groups, each row's group's biases."""
  start, end = group_bounds(sizes, x.shape[0])
  rows = onehot(sizes, x.shape[0])
  y = (jax.lax.ragged_dot(x.astype(F32), k_in, end - start, precision=HI)
       + jnp.matmul(rows, b_in, precision=HI))
  h = activations.apply(y, activation)
  return jax.lax.ragged_dot(h, k_out, end - start, precision=HI) + jnp.matmul(rows, b_out,
                                                                                precision=HI)


def loss(x, k_in, k_out, b_in, b_out, state, sizes, t, recipe):
  y = jax_fp8.grouped_mlp(x, k_in, k_out, sizes, b_in, b_out, recipe=recipe, state=state)
  return jnp.sum(y.astype(F32) * t)


def loss_f32(x, k_in, k_out, b_in, b_out, sizes, t, activation="swiglu"):
  return jnp.sum(mlp_f32(x, k_in, k_out, b_in, b_out, sizes, activation) * t)


# One function each, so that reference_on_cpu keeps its program for the next call at a shape.
GRAD_F32 = jax.grad(loss_f32, argnums=(0, 1, 2, 3, 4))
GRAD_F32_X_KERNELS = jax.grad(loss_f32, argnums=(0, 1, 2))


def state_for(recipe):
  return jax_fp8.GroupedMlpState.create(G, recipe) if recipe.stateful else None


# name: (M, group sizes over G = 4 experts, aligned, activation, recipe, dtype, biases)
CASES = {
    "zeros": (50, [20, 0, 25, 5], False, "swiglu", "delayed", F32, True),  # unaligned groups
    "one-expert": (50, [0, 0, 50, 0], False, "gelu", "current", jnp.bfloat16, False),
    "sum-below-m": (45, [7, 13, 0, 11], False, "geglu", "current", F32, True),  # rows 31..: none
    # BlockScaling: starts 0, 70, 70, 160 (the layout whose groups start at multiples of 128),
    # rows 185.. in no group
    "block-unaligned": (200, [70, 0, 90, 25], False, "swiglu", "block", F32, True),
    # starts 0, 128, 128, 256, the last group clipped at M
    "block-aligned": (300, [128, 0, 128, 60], True, "gelu", "block", jnp.bfloat16, False),
}  # aligned groups: test_equals_twin, and test_moe's layers against their f32 mixture


@pytest.mark.parametrize("case", CASES)
def test_forward_and_grads(platform, rng, case):
  m, sizes, aligned, act, name, dtype, biases = CASES[case]
  recipe, gs = RECIPES[name], to_device(sizes, np.int32)
  block = recipe is BLOCK
  x, k_in, k_out, b_in, b_out, t = problem(rng, m, act, dtype, **(BLOCK_DIMS if block else {}))
  fwd_tol, bwd_tol = FWD_TOL, FWD_TOL if block else BWD_TOL
  d = k_out.shape[2]
  if not biases:
    b_in, b_out = None, None

  def layer(x, k_in, k_out, b_in, b_out, state):
    y = jax_fp8.grouped_mlp(x, k_in, k_out, gs, b_in, b_out, activation=act, recipe=recipe,
                            state=state, aligned=aligned)
    return jnp.sum(y.astype(F32) * t), y
  (_, y), grads = jax.jit(jax.value_and_grad(layer, argnums=(0, 1, 2, 3, 4), has_aux=True))(
      x, k_in, k_out, b_in, b_out, state_for(recipe))
  assert y.shape == (m, d) and y.dtype == dtype
  bi, bo = (b_in, b_out) if biases else (filled(G, k_in.shape[2]), filled(G, d))
  want = reference_on_cpu(mlp_f32, x, k_in, k_out, bi, bo, gs, activation=act)
  want_grads = reference_on_cpu(GRAD_F32, x, k_in, k_out, bi, bo, gs, t, activation=act)
  # y's rounding to the compute dtype before the activation, and the output's
  out = 2 * roundoff(dtype)
  groups, end = rows_of(sizes, m)
  y32 = np.asarray(y.astype(F32))
  dx, dk_in, dk_out = (np.asarray(v.astype(F32)) for v in grads[:3])
  assert grads[0].dtype == dtype and grads[1].dtype == grads[2].dtype == F32
  assert rel(y32, want) < fwd_tol + out
  assert np.all(y32[end:] == 0) and np.all(dx[end:] == 0)  # rows in no group
  for g, rows in enumerate(groups):  # each expert within the formats, whatever its magnitude
    if rows.stop - rows.start >= 5:
      assert rel(y32[rows], want[rows]) < fwd_tol + out, g
      assert rel(dx[rows], want_grads[0][rows]) < bwd_tol + out, g
      assert rel(dk_in[g], want_grads[1][g]) < bwd_tol + out, g
      assert rel(dk_out[g], want_grads[2][g]) < bwd_tol + out, g
    if rows.stop == rows.start:  # an expert with no rows: no gradient
      assert not np.any(dk_in[g]) and not np.any(dk_out[g]), g
  if biases:
    db_in, db_out = np.asarray(grads[3]), np.asarray(grads[4])
    assert rel(db_in, want_grads[3]) < bwd_tol + out  # sums of the activation's gradient
    assert rel(db_out, want_grads[4]) < bias_tol(dtype, m)  # sums of t rounded to dtype
  else:
    assert grads[3] is None and grads[4] is None


def aligned_layout(sizes, m):
  """wgrad's layout of unaligned groups (design.md, "Row alignment for wgrad"), from the static
  sizes: (the grouped rows, the column each takes, P, the sizes rounded up to ROW_ALIGN):
  each group's columns moved to start at a multiple of 16 in P = round_up(M + 15 G, 16)
  columns, zeros between."""
  start, end = (np.asarray(v) for v in group_bounds(jnp.asarray(sizes, jnp.int32), m))
  padded = -(-(end - start) // ROW_ALIGN) * ROW_ALIGN
  first = np.cumsum(padded) - padded
  rows = np.concatenate([np.arange(s, e) for s, e in zip(start, end)])
  cols = np.concatenate([f + np.arange(e - s) for f, s, e in zip(first, start, end)])
  width = -(-(m + (ROW_ALIGN - 1) * len(sizes)) // ROW_ALIGN) * ROW_ALIGN
  return rows, cols, width, jnp.asarray(padded, jnp.int32)


def cast_ops(platform):
  """The module whose casts the twins run: the reference's on CPU, where the layer's kernels give
  its bytes; on a GPU jax_fp8's own, as the layer's. There XLA:GPU evaluating the reference may
  round an element to the neighbouring FP8 value (an H100 did so for one byte of 49152 in a group
  cast-transpose's transposed copy, where the kernel and XLA:CPU agree), and the device's expf
  may differ from XLA's in the last bit (the activations): an error no bound on the GEMMs' sums
  covers. Each op is held to the reference, run on the CPU, in its own tests."""
  return reference if platform == "cpu" else jax_fp8


def grouped_mlp_twin(x, k_in, k_out, b_in, b_out, gs, g, rings, cur, layout, ops):
  """grouped_mlp's per-tensor forward and backward from the reference (SwiGLU): x [M, K],
  kernels [G, K, 2F] and [G, F, D], biases or None, the output gradient g [M, D]; rings in
  GroupedMlpState's order, the kernels' stacked [G]; cur: CurrentScaling (each ring set to its
  tensor's amax of the step); layout: ``aligned_layout``'s for wgrad, or None (the groups
  aligned); ops: the module whose cast-transposes quantize x, the kernels, act(y) and the
  gradients (``cast_ops``). y and dh come from ``jax_fp8.grouped_gemm``, the layer's GEMM.
  Returns the results (out, dx, dk_in, dk_out, db_in, db_out), the observations, and per GEMM
  result the magnitudes of its products (|a| @ |b| of the dequantized FP8 operands, for the
  bounds off CPU) and its number of terms."""
  rx, rk_in, rg_in, rh, rk_out, rg_out = rings
  m, rows = x.shape[0], onehot(gs, x.shape[0])  # [M, G]

  def cast(v, ring):
    return ops.cast_transpose_delayed(v, current(ring, amax(v)) if cur else ring, observe=True)

  def with_bias(v, b):
    return v if b is None else v + jnp.matmul(rows, b, precision=HI)

  def grouped(a, b, b_scale, gemm=reference.grouped_gemm):  # a.data [M, C], b [G, N, C]
    d = gemm(a.data, b, a.scale, b_scale, gs, out_dtype=F32)
    return d, reference.grouped_gemm(jnp.abs(a.data.astype(F32)), jnp.abs(b.astype(F32)),
                                     a.scale, b_scale, gs, out_dtype=F32)

  def wgrad(a, b):  # over the transposed copies' first M columns, laid out as the layer does
    a_t, b_t, sizes = a.data_t[:, :m], b.data_t[:, :m], gs
    if layout is not None:
      src, cols, width, sizes = layout
      a_t, b_t = (jnp.zeros((v.shape[0], width), v.dtype).at[:, cols].set(v[:, src])
                  for v in (a_t, b_t))
    d = reference.grouped_gemm_wgrad(a_t, b_t, a.scale, b.scale, sizes, out_dtype=F32)
    return d, reference.grouped_gemm_wgrad(jnp.abs(a_t.astype(F32)), jnp.abs(b_t.astype(F32)),
                                           a.scale, b.scale, sizes, out_dtype=F32)

  cx = cast(x, rx)  # [M, K], [K, M16]
  ck_in, ck_out = jax.vmap(cast)(k_in, rk_in), jax.vmap(cast)(k_out, rk_out)  # scales [G]
  qx, qk_in, qk_out = cx.tensor, ck_in.tensor, ck_out.tensor
  y = grouped(qx, qk_in.data_t, qk_in.scale, jax_fp8.grouped_gemm)[0]  # [M, 2F], the layer's
  y = with_bias(y, b_in)
  if cur:
    rh = current(rh, amax(activations.apply(y, "swiglu")))
  ch = ops.activation_cast_transpose(y, rh, activation="swiglu", observe=True)
  qh = ch.tensor  # [M, F], [F, M16]
  out, abs_out = grouped(qh, qk_out.data_t, qk_out.scale)  # [M, D]
  cg = cast(g, rg_out)
  qg = cg.tensor  # [M, D], [D, M16]
  dh = grouped(qg, qk_out.data, qk_out.scale, jax_fp8.grouped_gemm)[0]  # [M, F], the layer's
  dk_out, abs_dk_out = wgrad(qh, qg)  # [G, F, D]
  dy = activations.grad(dh, y, "swiglu")  # [M, 2F]
  if cur:
    rg_in = current(rg_in, amax(dy))
  cdy = ops.activation_grad_cast_transpose(dh, y, rg_in, activation="swiglu", observe=True)
  dx, abs_dx = grouped(cdy.tensor, qk_in.data, qk_in.scale)  # [M, K]
  dk_in, abs_dk_in = wgrad(qx, cdy.tensor)  # [G, K, 2F]
  results = (with_bias(out, b_out), dx, dk_in, dk_out, expert_sums(rows, dy),
             expert_sums(rows, g))
  observed = (cx.ring, ck_in.ring, cdy.ring, ch.ring, ck_out.ring, cg.ring)
  bounds = ((abs_out, F), (abs_dx, 2 * F), (abs_dk_in, m), (abs_dk_out, m),
            (expert_sums(rows, jnp.abs(dy)), m),
            (expert_sums(rows, jnp.abs(g)), m))  # |a| @ |b|, terms
  return results, observed, bounds


@jax.jit
def warm_state(amaxes):
  """A GroupedMlpState after a step of other magnitudes than this one's, so every scale is a
  delayed one: ``amaxes`` f32 [4 + 2 G], the last step's amax of each ring in
  ``MLP_RINGS``' order, G for each kernel's (one per expert)."""
  s, parts = jax_fp8.GroupedMlpState.create(G), jnp.split(amaxes, [1, 1 + G, 2 + G, 3 + G,
                                                                    3 + 2 * G])
  return jax_fp8.GroupedMlpState(*(
      jax.vmap(next_ring)(r, a) if a.shape == (G,) else next_ring(r, a[0])
      for r, a in zip((getattr(s, n) for n in MLP_RINGS), parts)))


TWIN_CASES = {  # (recipe, biases, M, group sizes, aligned)
    "delayed-bias-unaligned": ("delayed", True, 50, [20, 0, 25, 5], False),
    "current-nobias-aligned": ("current", False, 40, [16, 0, 16, 3], True),
}


@pytest.mark.parametrize("case", TWIN_CASES)
def test_equals_twin(platform, rng, case):
  """The layer against ``grouped_mlp_twin``. On CPU the output, dx, both kernels' gradients and
  the state's observations equal the twin's bit for bit: the reference's grouped GEMMs are the
  CPU's f32 sums of the same FP8 operands in the same order, and SwiGLU and its gradient
  quantize to the same bytes in the C++ handler (libm's expf) as in XLA's jnp on CPU (none of
  3 million elements differed); the observations equal too but for the activation's and its
  gradient's amaxes, within ``ACT_ULPS`` (libm's expf and XLA's exp may differ in the last bit:
  one amax did at JAX_FP8_TEST_SEED=11), as in the dense MLP's twin. The bias gradients,
  XLA's segment sums of the output gradient and of the activation's gradient (XLA's in both,
  each program fusing it its own way: ``ACT_ULPS``), against the twin's one-hot products:
  within two orders of an f32 sum. On a GPU every GEMM sums in its own order (the results
  within the bound of their sums) and the twin quantizes with jax_fp8's own kernels
  (``cast_ops``)."""
  name, biases, m, sizes, aligned = TWIN_CASES[case]
  recipe, gs, cur = RECIPES[name], to_device(sizes, np.int32), name == "current"
  x, k_in, k_out, b_in, b_out, g = problem(rng, m)
  if not biases:
    b_in, b_out = None, None
  # x's amax half this step's (x saturates), the kernels' around their own
  state = None if cur else warm_state(to_device(np.concatenate(
      [[1.5], rng.uniform(0.3, 2.0, G), [0.1, 1.0], rng.uniform(0.3, 2.0, G), [1.5]]), F32))

  def layer(x, k_in, k_out, b_in, b_out, state):
    return jax_fp8.grouped_mlp(x, k_in, k_out, gs, b_in, b_out, recipe=recipe, state=state,
                               aligned=aligned)
  out, vjp = jax.jit(lambda *a: jax.vjp(layer, *a))(x, k_in, k_out, b_in, b_out, state)
  got = (out, *jax.jit(vjp)(g))
  rings = state if state is not None else jax_fp8.GroupedMlpState.create(G)  # blank: current
  layout = None if aligned else aligned_layout(sizes, m)
  want, observed, bounds = jax.jit(lambda *a: grouped_mlp_twin(*a, cur, layout,
                                                               cast_ops(platform)))(
      x, k_in, k_out, b_in, b_out, gs, g, tuple(getattr(rings, n) for n in MLP_RINGS))
  names = ("out", "dx", "dk_in", "dk_out", "db_in", "db_out")
  for name, a, b, (absdot, terms) in zip(names, got[:6], want, bounds):
    if name.startswith("db"):
      if not biases:
        assert a is None, name
        continue
      bound = (2 * summation_error(terms) + (ACT_ULPS if name == "db_in" else 0)) * np.asarray(
          absdot)
      assert np.all(np.abs(np.asarray(a) - np.asarray(b)) <= bound), name
    elif platform == "cpu":
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    else:
      bound = ((2 * summation_error(terms, platform) + ACT_ULPS) * np.asarray(absdot)
               + 2 * roundoff(F32) * np.abs(np.asarray(b)))
      assert np.all(np.abs(np.asarray(a) - np.asarray(b)) <= bound), name
  if cur:
    assert got[6] is None
    return
  assert isinstance(got[6], jax_fp8.GroupedMlpState)
  for name, a, b in zip(MLP_RINGS, jax.tree.leaves(
      got[6], is_leaf=lambda r: isinstance(r, ScaleRing)), observed):
    if name in ("grad_in", "hidden"):  # the kernels' expf (libm's on CPU) against XLA's exp
      np.testing.assert_allclose(a.amax_history, b.amax_history, rtol=ACT_ULPS, err_msg=name)
      a, b = (a.scale, a.steps), (b.scale, b.steps)
    tree_equal(a, b)


def block_grouped_mlp_twin(x, k_in, k_out, b_in, b_out, gs, g, groups, activation, ops):
  """grouped_mlp under BlockScaling from the reference: x, act(y), the output gradient and the
  activation's gradient in 1 x 128 groups along their rows for the forward and dgrad GEMMs
  (the group cast-transposes' row-wise copies) and, for wgrad, each expert's rows in 128-row
  groups of their own along M (a group cast-transpose of the expert's rows alone: what the
  layer's layout whose groups start at multiples of 128 quantizes), each expert kernel in its
  own 128 x 128 blocks. y and dh come from ``jax_fp8.grouped_gemm``, the layer's GEMM, each
  row's group's bias added as the layer adds it. ``groups``: the experts' row slices (static);
  ops: the module whose group cast-transposes and block quantization quantize x, the kernels,
  act(y) and the gradients (``cast_ops``). Returns the results (out, dx, dk_in, dk_out, db_in,
  db_out) and per result the magnitudes of its products (|a| @ |b| of the dequantized FP8
  operands) and its number of terms."""
  kw = {"fmt": "e4m3", "eps": BLOCK.eps, "ue8m0": BLOCK.ue8m0}
  m, rows = x.shape[0], onehot(gs, x.shape[0])
  swap = lambda a: jnp.swapaxes(a, 1, 2)  # noqa: E731

  def with_bias(v, b):
    return v if b is None else v + group_bias(b, gs, m)

  def grouped(a, qk, gemm=reference.grouped_gemm):  # a [M, C] in 1 x 128 groups, qk's blocks
    d = gemm(a.data, qk.data, a.scale, qk.scale, gs, out_dtype=F32)
    return d, reference.grouped_gemm(jnp.abs(a.data.astype(F32)), jnp.abs(qk.data.astype(F32)),
                                     a.scale, qk.scale, gs, out_dtype=F32)

  def wgrad(cast_a, cast_b, ins_a, ins_b, shape):  # each expert's rows quantized on their own
    def t(cast, ins, r):
      q = cast(*(v[r] for v in ins))  # data_t [C, R128]
      return q.data_t.astype(F32) * reference.expand_scales(q.scale_t, *q.data_t.shape, 1)
    ds, absds = [], []
    for r in groups:
      if r.stop == r.start:  # an expert with no rows: no gradient
        ds.append(jnp.zeros(shape, F32))
        absds.append(ds[-1])
        continue
      a, b = t(cast_a, ins_a, r), t(cast_b, ins_b, r)
      ds.append(jnp.matmul(a, b.T, precision=HI))
      absds.append(jnp.matmul(jnp.abs(a), jnp.abs(b).T, precision=HI))
    return jnp.stack(ds), jnp.stack(absds)

  cast = lambda v: ops.group_cast_transpose(v, **kw)  # noqa: E731
  act = lambda y: ops.activation_group_cast_transpose(  # noqa: E731
      y, activation=activation, **kw)
  act_grad = lambda dh, y: ops.activation_grad_group_cast_transpose(  # noqa: E731
      dh, y, activation=activation, **kw)
  blocks = jax.vmap(lambda k: ops.block_quantize(k, **kw))
  qk_in, qk_out = blocks(k_in), blocks(k_out)  # [G, K, N], [G, K/128, N/128]; [G, F, D], ...
  qk_in_t, qk_out_t = (Quantized(data=swap(qk.data), scale=swap(qk.scale))
                       for qk in (qk_in, qk_out))
  y = with_bias(grouped(cast(x), qk_in_t, jax_fp8.grouped_gemm)[0], b_in)  # [M, N], the layer's
  out, abs_out = grouped(act(y), qk_out_t)  # [M, D]
  dh = grouped(cast(g), qk_out, jax_fp8.grouped_gemm)[0]  # [M, F], the layer's
  dx, abs_dx = grouped(act_grad(dh, y), qk_in)  # [M, K]
  dk_in, abs_dk_in = wgrad(cast, act_grad, (x,), (dh, y), k_in.shape[1:])  # [G, K, N]
  dk_out, abs_dk_out = wgrad(act, cast, (y,), (g,), k_out.shape[1:])  # [G, F, D]
  dy = activations.grad(dh, y, activation)  # [M, N]
  results = (with_bias(out, b_out), dx, dk_in, dk_out, expert_sums(rows, dy),
             expert_sums(rows, g))
  f = k_out.shape[1]
  bounds = ((abs_out, f), (abs_dx, 2 * f), (abs_dk_in, m), (abs_dk_out, m),
            (expert_sums(rows, jnp.abs(dy)), m), (expert_sums(rows, jnp.abs(g)), m))
  return results, bounds


BLOCK_TWIN_CASES = {  # (biases, M, group sizes, aligned)
    "bias-unaligned": (True, 200, [70, 0, 90, 25], False),
    "nobias-aligned": (False, 300, [128, 0, 128, 60], True),
}


@pytest.mark.parametrize("case", BLOCK_TWIN_CASES)
def test_block_equals_twin(platform, rng, case):
  """The layer under BlockScaling against ``block_grouped_mlp_twin``: out, dx and both kernels'
  gradients within two orders of the f32 sums of the same FP8 operands (and ``ACT_ULPS`` of
  the activation's kernel), the bias gradients as in ``test_equals_twin``. A scale read from
  another block or another expert, a 128-row group straddling two experts, or an activation
  quantized from other rows shows here."""
  biases, m, sizes, aligned = BLOCK_TWIN_CASES[case]
  gs = to_device(sizes, np.int32)
  x, k_in, k_out, b_in, b_out, g = problem(rng, m, **BLOCK_DIMS)
  if not biases:
    b_in, b_out = None, None

  def layer(x, k_in, k_out, b_in, b_out):
    return jax_fp8.grouped_mlp(x, k_in, k_out, gs, b_in, b_out, recipe=BLOCK, aligned=aligned)
  out, vjp = jax.jit(lambda *a: jax.vjp(layer, *a))(x, k_in, k_out, b_in, b_out)
  got = (out, *jax.jit(vjp)(g))
  groups, _ = rows_of(sizes, m)
  want, bounds = jax.jit(lambda *a: block_grouped_mlp_twin(*a, groups, "swiglu",
                                                           cast_ops(platform)))(
      x, k_in, k_out, b_in, b_out, gs, g)
  names = ("out", "dx", "dk_in", "dk_out", "db_in", "db_out")
  for name, a, b, (absdot, terms) in zip(names, got, want, bounds):
    if name.startswith("db") and not biases:
      assert a is None, name
      continue
    bound = ((2 * summation_error(terms, "cpu" if name.startswith("db") else platform)
              + (0 if name == "db_out" else ACT_ULPS)) * np.asarray(absdot)
             + 2 * roundoff(F32) * np.abs(np.asarray(b)))
    err = np.abs(np.asarray(a) - np.asarray(b))
    ratio = err / np.maximum(bound, 1e-30)
    # On failure: the worst element's index and, for a kernel gradient, each expert's worst.
    assert np.all(err <= bound), (name, float(ratio.max()),
                                  np.unravel_index(ratio.argmax(), ratio.shape),
                                  ratio.reshape(len(ratio), -1).max(1) if ratio.ndim == 3 else "")


def test_traced_group_sizes_one_compilation(platform, rng):
  """The sizes are device values: new sizes (unaligned, empty experts, a sum below M) reuse the
  program."""
  m = 40
  x, k_in, k_out, b_in, b_out, t = problem(rng, m)
  recipe = jax_fp8.CurrentScaling()
  f = jax.jit(jax.grad(lambda x, k_in, k_out, gs: loss(x, k_in, k_out, b_in, b_out, None, gs,
                                                       t, recipe), argnums=(0, 1, 2)))
  for sizes in ([10, 10, 10, 10], [0, 40, 0, 0], [3, 0, 17, 5]):
    gs = to_device(sizes, np.int32)
    got = f(x, k_in, k_out, gs)
    want = reference_on_cpu(GRAD_F32_X_KERNELS, x, k_in, k_out, b_in, b_out, gs, t)
    for a, b in zip(got, want):
      assert rel(a, b) < BWD_TOL
  assert f._cache_size() == 1


def test_below_min_intensity_is_the_composition(rng):
  """Below fp8_min_intensity the MLP is XLA's ragged_dot and activation in x's dtype, as the
  composition grouped_linear, the activation, grouped_linear is there, gradients included,
  and no ring moves."""
  m, sizes = 24, [10, 0, 9, 5]
  x, k_in, k_out, b_in, b_out, t = problem(rng, m, "swiglu", jnp.bfloat16)
  gs = to_device(sizes, np.int32)
  recipe = jax_fp8.DelayedScaling(fp8_min_intensity=1e6)
  state = state_for(recipe)
  got = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5)), static_argnums=8)(
      x, k_in, k_out, b_in, b_out, state, gs, t, recipe)

  def composed(x, k_in, k_out, b_in, b_out):
    stateless = jax_fp8.CurrentScaling(fp8_min_intensity=1e6)
    y = jax_fp8.grouped_linear(x, k_in, gs, b_in, recipe=stateless)
    h = activations.apply(y, "swiglu").astype(x.dtype)
    out = jax_fp8.grouped_linear(h, k_out, gs, b_out, recipe=stateless)
    return jnp.sum(out.astype(F32) * t)
  want = jax.jit(jax.grad(composed, argnums=(0, 1, 2, 3, 4)))(x, k_in, k_out, b_in, b_out)
  for a, b in zip(got[:5], want):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  nxt = jax_fp8.update_state(state, got[5])
  assert jax.tree.all(jax.tree.map(lambda a, b: np.array_equal(a, b), nxt, state))


def _bad_cases():
  """Built at collection: zeros (and sizes of 8) put from NumPy, each array of the shape and
  dtype a slice or conversion of the valid ones would have, with no eager JAX operation."""
  x, k_in, k_out = filled(32, K), filled(G, K, 2 * F), filled(G, F, D)
  gs, b_in, b_out = filled(G, dtype=np.int32, fill=8), filled(G, 2 * F), filled(G, D)
  ok = (x, k_in, k_out, gs, b_in, b_out)
  return [
      ("x rank", (filled(1, 32, K),) + ok[1:], {}, ValueError, "x must be \\[M, K\\]"),
      ("x int", (filled(32, K, dtype=np.int32),) + ok[1:], {}, TypeError,
       "x must be float32, bfloat16 or float16, got int32"),
      ("kernel_in K", (x, filled(G, 16, 2 * F)) + ok[2:], {}, ValueError,
       "kernel_in must be \\[G, K, N\\] with x's K=32, got shape \\[4, 16, 64\\]"),
      ("kernel_out int", (x, k_in, filled(G, F, D, dtype=np.int32)) + ok[3:], {}, TypeError,
       "kernel_out must be float32, bfloat16 or float16"),
      ("kernel_out G", (x, k_in, filled(3, F, D)) + ok[3:], {}, ValueError,
       "kernel_out must be \\[G, F, D\\] with kernel_in's G=4, got shape \\[3, 32, 48\\]"),
      ("gated N", (x, filled(G, K, 48)) + ok[2:], {}, ValueError,
       "N = 2F \\(gate and up side by side\\) under 'swiglu'"),
      ("plain N", ok, {"activation": "gelu"}, ValueError, "N = F under 'gelu'"),
      ("activation", ok, {"activation": "relu"}, ValueError, "activation must be one of"),
      ("sizes float", (x, k_in, k_out, filled(G, fill=8), b_in, b_out), {}, TypeError,
       "group_sizes must be int32 \\[G\\], got float32\\[4\\]"),
      ("sizes G", (x, k_in, k_out, filled(3, dtype=np.int32, fill=8), b_in, b_out), {}, ValueError,
       "group_sizes \\[G\\] and kernel_in \\[G, K, N\\] must share G, got group_sizes \\[3\\]"),
      ("bias_in", ok[:4] + (filled(2 * F), b_out), {}, ValueError,
       "bias_in must be \\[G, N\\] = \\[4, 64\\], got \\[64\\]"),
      ("bias_out", ok[:5] + (filled(G, 16),), {}, ValueError,
       "bias_out must be \\[G, D\\] = \\[4, 48\\], got \\[4, 16\\]"),
      ("F not 16", (x, filled(G, K, 48), filled(G, 24, D)) + ok[3:4], {}, ValueError,
       "multiples of 16 .*F=24"),
      ("block F", ok, {"recipe": BLOCK, "state": None}, ValueError,
       "BlockScaling needs K and N multiples of 128 .*got K=32, F=32, D=48"),
      ("block state", (filled(32, 128), filled(G, 128, 256), filled(G, 128, 128), gs),
       {"recipe": BLOCK}, ValueError, "BlockScaling is stateless: pass state=None"),
      ("mxfp8 recipe", ok, {"recipe": jax_fp8.MXFP8BlockScaling(), "state": None}, TypeError,
       "grouped_mlp takes a DelayedScaling, a CurrentScaling or a BlockScaling .*got "
       "MXFP8BlockScaling: no grouped FP8 GEMM takes its scales"),
      ("state type", ok, {"state": jax_fp8.GroupedLinearState.create(G)}, TypeError,
       "state must be a jax_fp8.GroupedMlpState \\(GroupedMlpState.create\\(4, recipe\\)\\), "
       "got GroupedLinearState"),
      ("no state", ok, {"state": None}, TypeError,
       "state must be a jax_fp8.GroupedMlpState .*got NoneType"),
      ("state G", ok, {"state": jax_fp8.GroupedMlpState.create(3)}, ValueError,
       "state.kernel_in must hold one ring per expert.*G=4"),
      ("state recipe", ok,
       {"state": jax_fp8.GroupedMlpState.create(G, jax_fp8.DelayedScaling(history_len=4))},
       ValueError, "do not match the recipe"),
      ("state to current", ok, {"recipe": jax_fp8.CurrentScaling()}, ValueError,
       "CurrentScaling is stateless"),
      ("aligned", ok, {"aligned": 1}, TypeError, "aligned must be a bool, got int 1"),
  ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_inputs(case):
  _, args, kwargs, error, match = case
  kwargs = {"recipe": jax_fp8.DelayedScaling(), "state": jax_fp8.GroupedMlpState.create(G),
            **kwargs}
  with pytest.raises(error, match=match):
    jax.eval_shape(lambda: jax_fp8.grouped_mlp(*args, **kwargs))
