"""The backward of the per-tensor recipes (DelayedScaling, CurrentScaling) and of BlockScaling,
pinned by twins: the forward output, dgrad, wgrad, the bias gradients and (DelayedScaling) the
state gradient of ``linear``, ``multi_linear`` and ``mlp`` rebuilt from ``jax_fp8.reference``'s
quantizers and a GEMM on the FP8 operands, as test_mxfp8_block_scaling's and
test_nvfp4_block_scaling's "the GEMMs equal the twins" do. Plus per-element checks of the
gradients against central differences of the f64 math.

On CPU the layers' GEMM is XLA's f32 dot of the upcast FP8 operands, then the scales
(``formats.apply_scales``; block scales multiplied in first): ``reference.gemm`` and
``reference.block_gemm`` compute that same dot of the same operands, so the twins' GEMMs are
bit-identical and asserted equal. Only the bias gradients of the per-tensor cast-transposes
are summed in another order (the kernels add per-64-row partials; the twin's jnp.sum its
own): within twice an f32 sum's bound of each other. On a GPU every GEMM sums in its own order:
within ``summation_error`` of |a| @ |b| (the FP8 operands' magnitudes). The MLP twins take the
two GEMMs whose outputs are quantized again (the up projection's y and the down projection's
dgrad dh) from ``jax_fp8.gemm``, the layer's own GEMM: on CPU that is reference.gemm's dot; on a
GPU a y summed in another order would round some elements of the FP8 activation (and of its
gradient) to the neighbouring E4M3 value, an error no bound on the sum covers."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ACCUMULATION, roundoff, summation_error

import jax_fp8
from jax_fp8 import activations, norms, reference
from jax_fp8.formats import amax
from jax_fp8.ops.gemm import gemm_bias
from jax_fp8.state import current, next_ring

F32 = jnp.float32


def rand(rng, shape, scale=1.0):
  return jnp.asarray(rng.standard_normal(shape) * scale, F32)


# The activation and its gradient: the kernels' expf / tanhf (the C library's on CPU, CUDA's)
# and XLA's exp / tanh in the twin differ by a few f32 ulps, so an activation's scale (from its
# amax) may differ by as much, moving every product of the GEMMs that read it: 8 roundoffs of
# |a| @ |b| covers four ulps of both operands. (An FP8 element whose f32 value lies within
# those ulps of a rounding boundary would round the other way: about 2^-20 of the elements.)
ACT_ULPS = 8 * roundoff(jnp.float32)


def close(platform, got, want, a=None, b=None, what="", act=False):
  """got == want bit for bit on CPU (the same f32 dot), else within two orders of an f32 sum
  of a @ b (the FP8 operands, upcast; scaled: ``want``'s own magnitude bounds the scales');
  ``act``: an operand from the activation's kernel, within ACT_ULPS more."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  assert got.shape == want.shape, what
  if platform == "cpu" and a is not None and not act:
    np.testing.assert_array_equal(got, want, err_msg=what)
    return
  if a is None:  # a column sum (dbias) of b [M, N]: two orders of M terms
    bound = 2 * summation_error(b.shape[0]) * np.abs(np.asarray(b, np.float64)).sum(0)
  else:
    absdot = np.abs(np.asarray(a, np.float64)) @ np.abs(np.asarray(b, np.float64))
    bound = ((2 * summation_error(a.shape[1], platform) + (ACT_ULPS if act else 0)) * absdot
             + 2 * roundoff(F32) * np.abs(want))
  err = np.abs(got - want)
  assert np.all(err <= bound), (what, np.max(err / np.maximum(bound, 1e-30)))


def close_through_norm(platform, got, want, what):
  """A gradient through the norm's backward (XLA's jnp, the same ops in both, but fused and
  its row sums of K terms ordered as each program's fusion decides): normwise within two
  orders of those sums, 2 * summation_error(K) (measured on CPU: about 1e-7); on a GPU the
  dgrad under it sums in another order too (ACCUMULATION of the products' magnitudes, for
  these well-scaled problems within 2^-12 of the result's norm, times (1 + 2^-3)^2 for the
  quantized operands)."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  k = max(got.shape[-1], 128)
  gpu = 0.0 if platform == "cpu" else 2 * ACCUMULATION * (1 + roundoff("e5m2"))**2
  err = np.linalg.norm(got - want) / np.linalg.norm(want)
  assert err <= 2 * summation_error(k) + gpu, (what, err)


def tree_equal(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def tn(a, b, sa, sb, bias=None):
  """``a @ b.T`` of FP8 operands with per-tensor scales: reference.gemm in f32."""
  return reference.gemm(a, b, sa, sb, bias=bias, out_dtype=F32)


def deq(q, s):
  """The FP8 operand's values: the error bound's magnitudes."""
  return np.asarray(q, np.float64) * float(s)


# --- the per-tensor recipes ----------------------------------------------------------------


def warm(ring, a_prev):
  """``ring`` after one step whose amax was ``a_prev``: its next scale is a delayed one."""
  return next_ring(ring, jnp.float32(a_prev))


def per_tensor_twin(x2, ws, bs, ts, rings, cur, norm=None, gamma=None, beta=None, eps=1e-6):
  """linear / multi_linear's per-tensor forward and backward from the reference: x2 [M, K],
  ws the kernels [K, N_i], bs their biases (or None), ts the outputs' gradients [M, N_i];
  rings (x's, the kernels', the gradients'); cur: CurrentScaling (each ring set to its
  tensor's amax of the step). norm: None or its name, with gamma, beta and eps. Returns ys, dx,
  dws, dbs, dnorm (gamma's and beta's gradients), the observations, and the operands."""
  rx, rks, rgs = rings
  name = norm
  if norm is not None:
    if cur:
      rx = current(rx, amax(norms.normalize(x2, gamma, beta, norm=name, epsilon=eps)))
    cx = reference.norm_cast_transpose(x2, norms.stats(x2, name, eps), gamma, beta, rx,
                                       norm=name, observe=True)
  else:
    cx = reference.cast_transpose_delayed(x2, current(rx, amax(x2)) if cur else rx,
                                          observe=True)
  ys, dx, dws, dbs, oks, ogs, ops = [], None, [], [], [], [], []
  qx = cx.tensor
  for w, b, t, rk, rg in zip(ws, bs, ts, rks, rgs):
    ck = reference.cast_transpose_delayed(w, current(rk, amax(w)) if cur else rk, observe=True)
    qk = ck.tensor
    ys.append(tn(qx.data, qk.data_t, qx.scale, qk.scale, bias=b))  # fprop [M, N]
    cg = reference.cast_transpose_delayed(t, current(rg, amax(t)) if cur else rg,
                                          with_dbias=b is not None, observe=True)
    qg = cg.tensor
    dxi = tn(qg.data, qk.data, qg.scale, qk.scale)  # dgrad [M, K]
    dx = dxi if dx is None else dx + dxi
    dws.append(tn(qx.data_t, qg.data_t, qx.scale, qg.scale))  # wgrad [K, N] over M padded to 16
    dbs.append(cg.dbias)
    oks.append(ck.ring)
    ogs.append(cg.ring)
    ops.append((qx, qk, qg))
  dnorm = None
  if norm is not None:
    _, vjp = jax.vjp(lambda x, g, b: norms.normalize(x, g, b, norm=name, epsilon=eps), x2,
                     gamma, beta)
    dx, *dnorm = vjp(dx)
  return ys, dx, dws, dbs, dnorm, (cx.ring, tuple(oks), tuple(ogs)), ops


def check_per_tensor(platform, got, want, ts, bs):
  """The layer's (ys, dx, dws, dbs) against the twin's, operand by operand."""
  ys, dx, dws, dbs = got
  wys, wdx, wdws, wdbs, _, _, ops = want
  wdx_parts = []
  for i, (qx, qk, qg) in enumerate(ops):  # the operands' Quantized
    close(platform, ys[i], wys[i], deq(qx.data, qx.scale), deq(qk.data_t, qk.scale).T, f"y{i}")
    close(platform, dws[i], wdws[i], deq(qx.data_t, qx.scale), deq(qg.data_t, qg.scale).T,
          f"dw{i}")
    wdx_parts.append((deq(qg.data, qg.scale), deq(qk.data, qk.scale).T))
    if bs[i] is not None:
      close(platform, dbs[i], wdbs[i], b=np.asarray(ts[i]), what=f"db{i}")
  if len(ops) == 1:
    close(platform, dx, wdx, *wdx_parts[0], "dx")
  else:  # a sum of the kernels' dgrads: the bound of one GEMM over all their N
    close(platform, dx, wdx, np.concatenate([a for a, _ in wdx_parts], 1),
          np.concatenate([b for _, b in wdx_parts], 0), "dx")


CASES = [
    pytest.param("delayed", True, None, id="delayed-bias"),
    pytest.param("delayed", False, "rmsnorm", id="delayed-nobias-rmsnorm"),
    pytest.param("current", True, None, id="current-bias"),
    pytest.param("current", False, None, id="current-nobias"),
]


def linear_state(rng):
  """LinearState rings after a step of other magnitudes than this one's: x's scale from an
  amax half this step's (so x saturates where |x| is above its old amax), the kernel's and the
  gradient's from larger ones."""
  s = jax_fp8.LinearState.create()
  return jax_fp8.LinearState(warm(s.x, 1.5), warm(s.kernel, 1.0), warm(s.grad, 8.0))


@pytest.mark.parametrize("recipe,bias,norm", CASES)
def test_linear_equals_twin(platform, rng, recipe, bias, norm):
  m, k, n = 36, 64, 48
  x, w, t = rand(rng, (m, k)), rand(rng, (k, n), k**-0.5), rand(rng, (m, n))
  b = rand(rng, (n,)) if bias else None
  gamma = 1 + 0.5 * rand(rng, (k,)) if norm else None
  cur = recipe == "current"
  state = None if cur else linear_state(rng)
  rec = jax_fp8.CurrentScaling() if cur else jax_fp8.DelayedScaling()
  nkw = {"norm": norm, "gamma": gamma, "epsilon": 1e-6} if norm else {}

  def layer(x, w, b, gamma, state):
    kw = dict(nkw, gamma=gamma) if norm else {}
    return jax_fp8.linear(x, w, b, state=state, recipe=rec, **kw)

  y, vjp = jax.jit(lambda *a: jax.vjp(layer, *a))(x, w, b, gamma, state)
  dx, dw, db, dgamma, dstate = jax.jit(vjp)(t)

  rings = (jax_fp8.DelayedScaling().ring("e4m3"),) * 2 + (jax_fp8.DelayedScaling().ring("e5m2"),)
  rings = (rings[0], (rings[1],), (rings[2],)) if cur else (state.x, (state.kernel,),
                                                           (state.grad,))
  want = jax.jit(per_tensor_twin, static_argnums=(5, 6))(x, (w,), (b,), (t,), rings, cur, norm,
                                                        gamma)
  if norm:  # dx through the norm's backward; the rest as without a norm
    close_through_norm(platform, dx, want[1], "dx")
    want = (*want[:1], np.asarray(dx), *want[2:])
  check_per_tensor(platform, ((y,), dx, (dw,), (db,)), want, (t,), (b,))
  if norm:
    close_through_norm(platform, dgamma, want[4][0], "dgamma")
  if cur:
    assert dstate is None
  else:
    ox, (ok,), (og,) = want[5]
    tree_equal(dstate, jax_fp8.LinearState(ox, ok, og))


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_multi_linear_equals_twin(platform, rng, recipe):
  """Two kernels on one input (one with a bias): x quantized once, dx the sum of the dgrads."""
  m, k, ns = 20, 32, (48, 16)
  x = rand(rng, (m, k))
  ws = tuple(rand(rng, (k, n), k**-0.5) for n in ns)
  bs = (rand(rng, (ns[0],)), None)
  ts = tuple(rand(rng, (m, n)) * s for n, s in zip(ns, (1.0, 4.0)))
  cur = recipe == "current"
  rec = jax_fp8.CurrentScaling() if cur else jax_fp8.DelayedScaling()
  if cur:
    state = None
    r = rec.ring("e4m3"), rec.ring("e5m2")
    rings = (r[0], (r[0], r[0]), (r[1], r[1]))
  else:
    s = jax_fp8.MultiLinearState.create(2)
    state = jax_fp8.MultiLinearState(warm(s.x, 2.0), (warm(s.kernels[0], 0.3),
                                                       warm(s.kernels[1], 1.0)),
                                     (warm(s.grads[0], 2.0), warm(s.grads[1], 30.0)))
    rings = (state.x, state.kernels, state.grads)

  def layer(x, ws, bs, state):
    return jax_fp8.multi_linear(x, ws, bs, state=state, recipe=rec)

  ys, vjp = jax.jit(lambda *a: jax.vjp(layer, *a))(x, ws, bs, state)
  dx, dws, dbs, dstate = jax.jit(vjp)(ts)
  want = jax.jit(per_tensor_twin, static_argnums=(5,))(x, ws, bs, ts, rings, cur)
  check_per_tensor(platform, (ys, dx, dws, dbs), want, ts, bs)
  assert dbs[1] is None
  if not cur:
    ox, oks, ogs = want[5]
    tree_equal(dstate, jax_fp8.MultiLinearState(ox, oks, ogs))


def mlp_twin(x2, k_in, k_out, b_in, b_out, g, rings, cur, activation):
  """mlp's per-tensor forward and backward from the reference; rings in MlpState's order (x,
  kernel_in, grad_in, hidden, kernel_out, grad_out). Returns (out, y, dh), the gradients,
  the observations and the operands of each GEMM (for the bounds off CPU)."""
  rx, rk_in, rg_in, rh, rk_out, rg_out = rings
  cx = reference.cast_transpose_delayed(x2, current(rx, amax(x2)) if cur else rx, observe=True)
  ck_in = reference.cast_transpose_delayed(k_in, current(rk_in, amax(k_in)) if cur else rk_in,
                                           observe=True)
  qx, qk_in = cx.tensor, ck_in.tensor
  y = gemm_bias(qx.data, qk_in.data_t, qx.scale, qk_in.scale, b_in, F32)  # [M, N], the layer's
  if cur:
    rh = current(rh, amax(activations.apply(y, activation)))
  ch = reference.activation_cast_transpose(y, rh, activation=activation, observe=True)
  ck_out = reference.cast_transpose_delayed(k_out,
                                            current(rk_out, amax(k_out)) if cur else rk_out,
                                            observe=True)
  qh, qk_out = ch.tensor, ck_out.tensor
  out = tn(qh.data, qk_out.data_t, qh.scale, qk_out.scale, bias=b_out)  # [M, D]
  cg = reference.cast_transpose_delayed(g, current(rg_out, amax(g)) if cur else rg_out,
                                        with_dbias=b_out is not None, observe=True)
  qg = cg.tensor
  dh = gemm_bias(qg.data, qk_out.data, qg.scale, qk_out.scale, None, F32)  # dgrad [M, F]
  dk_out = tn(qh.data_t, qg.data_t, qh.scale, qg.scale)  # [F, D]
  if cur:
    rg_in = current(rg_in, amax(activations.grad(dh, y, activation)))
  cdy = reference.activation_grad_cast_transpose(dh, y, rg_in, activation=activation,
                                                 with_dbias=b_in is not None, observe=True)
  qdy = cdy.tensor
  dx = tn(qdy.data, qk_in.data, qdy.scale, qk_in.scale)  # [M, K]
  dk_in = tn(qx.data_t, qdy.data_t, qx.scale, qdy.scale)  # [K, N]
  obs = (cx.ring, ck_in.ring, cdy.ring, ch.ring, ck_out.ring, cg.ring)
  ops = {"out": (qh.data, qh.scale, qk_out.data_t, qk_out.scale),
         "dx": (qdy.data, qdy.scale, qk_in.data, qk_in.scale),
         "dk_in": (qx.data_t, qx.scale, qdy.data_t, qdy.scale),
         "dk_out": (qh.data_t, qh.scale, qg.data_t, qg.scale)}
  return (out, dx, dk_in, dk_out, cdy.dbias, cg.dbias), obs, ops, activations.grad(dh, y,
                                                                                     activation)


@pytest.mark.parametrize("recipe,bias", [("delayed", True), ("delayed", False),
                                         ("current", True)],
                         ids=["delayed-bias", "delayed-nobias", "current-bias"])
def test_mlp_equals_twin(platform, rng, recipe, bias):
  m, k, f, d, act = 24, 32, 32, 16, "swiglu"
  x, g = rand(rng, (m, k)), rand(rng, (m, d))
  k_in, k_out = rand(rng, (k, 2 * f), k**-0.5), rand(rng, (f, d), f**-0.5)
  b_in, b_out = (rand(rng, (2 * f,), 0.1), rand(rng, (d,), 0.1)) if bias else (None, None)
  cur = recipe == "current"
  rec = jax_fp8.CurrentScaling() if cur else jax_fp8.DelayedScaling()
  if cur:
    state = None
    fwd, bwd = rec.ring("e4m3"), rec.ring("e5m2")
    rings = (fwd, fwd, bwd, fwd, fwd, bwd)
  else:
    s = jax_fp8.MlpState.create()
    state = jax_fp8.MlpState(warm(s.x, 2.0), warm(s.kernel_in, 0.5), warm(s.grad_in, 0.1),
                             warm(s.hidden, 1.0), warm(s.kernel_out, 1.0),
                             warm(s.grad_out, 1.5))
    rings = tuple(getattr(state, name) for name in
                  ("x", "kernel_in", "grad_in", "hidden", "kernel_out", "grad_out"))

  def layer(x, k_in, k_out, b_in, b_out, state):
    return jax_fp8.mlp(x, k_in, k_out, b_in, b_out, activation=act, state=state, recipe=rec)

  out, vjp = jax.jit(lambda *a: jax.vjp(layer, *a))(x, k_in, k_out, b_in, b_out, state)
  dx, dk_in, dk_out, db_in, db_out, dstate = jax.jit(vjp)(g)
  want, obs, ops, dy = jax.jit(mlp_twin, static_argnums=(7, 8))(
      x, k_in, k_out, b_in, b_out, g, rings, cur, act)
  for name, got, ref in zip(("out", "dx", "dk_in", "dk_out"), (out, dx, dk_in, dk_out), want):
    a, sa, b_, sb = ops[name]
    close(platform, got, ref, deq(a, sa), deq(b_, sb).T, name, act=True)
  if bias:  # dy from the activation's gradient (ACT_ULPS of each term), then summed
    close(platform, db_in, want[4], np.ones((1, m)), np.asarray(dy), "db_in", act=True)
    close(platform, db_out, want[5], b=np.asarray(g), what="db_out")
  else:
    assert db_in is None and db_out is None
  if cur:
    assert dstate is None
  else:  # the activation's and its gradient's amaxes within a few ulps (ACT_ULPS)
    for name, got, ref in zip(("x", "kernel_in", "grad_in", "hidden", "kernel_out", "grad_out"),
                              jax.tree.leaves(dstate, is_leaf=lambda r: isinstance(
                                  r, jax_fp8.ScaleRing)), obs):
      if name in ("grad_in", "hidden"):
        np.testing.assert_allclose(got.amax_history, ref.amax_history, rtol=ACT_ULPS,
                                   err_msg=name)
        tree_equal((got.scale, got.steps), (ref.scale, ref.steps))
      else:
        tree_equal(got, ref)


# --- BlockScaling --------------------------------------------------------------------------

BLOCK = jax_fp8.BlockScaling()
KW = {"fmt": "e4m3", "eps": BLOCK.eps, "ue8m0": BLOCK.ue8m0}


def bg(a, b, sa, sb, bias=None):
  """Block-scaled ``a @ b.T`` in f32 (reference.block_gemm)."""
  return reference.block_gemm(a, b, sa, sb, bias=bias, out_dtype=F32)


def block_deq(q, s, block_rows):
  """A block-scaled operand's values [R, C] (scales [ceil(R / block_rows), C/128])."""
  r, c = q.shape
  return q.astype(F32) * reference.expand_scales(s, r, c, block_rows)


def block_linear_twin(x2, ws, bs, ts, norm=None, gamma=None, beta=None, eps=1e-6):
  """linear / multi_linear under BlockScaling from the reference: x and the gradients in
  1 x 128 groups both ways (group_cast_transpose), the kernels in 128 x 128 blocks."""
  if norm is None:
    cx = reference.group_cast_transpose(x2, **KW)  # [M, K], [K, M128]
  else:
    name = norm
    cx = reference.norm_group_cast_transpose(
        x2, norms.stats(x2, name, eps), gamma, beta, norm=name, **KW)
  ys, dx, dws, dbs, ops = [], None, [], [], []
  for w, b, t in zip(ws, bs, ts):
    ck = reference.block_quantize(w, **KW)  # [K, N], [K/128, N/128]
    ys.append(bg(cx.data, ck.data.T, cx.scale, ck.scale.T, bias=b))
    cg = reference.group_cast_transpose(t, **KW)  # [M, N], [N, M128]
    dxi = bg(cg.data, ck.data, cg.scale, ck.scale)  # dgrad: 1 x 128 groups . 128 x 128 blocks
    dx = dxi if dx is None else dx + dxi
    dws.append(bg(cx.data_t, cg.data_t, cx.scale_t, cg.scale_t))  # wgrad over M padded to 128
    dbs.append(None if b is None else jnp.sum(t, axis=0))
    ops.append(((block_deq(cx.data, cx.scale, 1), block_deq(ck.data.T, ck.scale.T, 128).T),
                (block_deq(cg.data, cg.scale, 1), block_deq(ck.data, ck.scale, 128).T),
                (block_deq(cx.data_t, cx.scale_t, 1), block_deq(cg.data_t, cg.scale_t, 1).T)))
  dnorm = None
  if norm is not None:
    _, vjp = jax.vjp(lambda x, g, b: norms.normalize(x, g, b, norm=name, epsilon=eps), x2,
                     gamma, beta)
    dx, *dnorm = vjp(dx)
  return ys, dx, dws, dbs, dnorm, ops


@pytest.mark.parametrize("bias,norm", [(True, None), (False, "layernorm")],
                         ids=["bias", "nobias-layernorm"])
def test_block_linear_equals_twin(platform, rng, bias, norm):
  m, k, n = 40, 128, 256
  x, t = rand(rng, (m, k)), rand(rng, (m, n))
  w = rand(rng, (k, n), k**-0.5) * jnp.asarray(10.0 ** rng.uniform(-2, 2, (1, n // 128)).repeat(
      128, 1), F32)  # the two 128-column blocks of the kernel on their own scales
  b = rand(rng, (n,)) if bias else None
  gamma = 1 + 0.5 * rand(rng, (k,)) if norm else None
  beta = 0.5 * rand(rng, (k,)) if norm else None

  def layer(x, w, b, gamma, beta):
    kw = {"norm": norm, "gamma": gamma, "beta": beta, "epsilon": 1e-6} if norm else {}
    return jax_fp8.linear(x, w, b, recipe=BLOCK, **kw)

  y, vjp = jax.jit(lambda *a: jax.vjp(layer, *a))(x, w, b, gamma, beta)
  dx, dw, db, dgamma, dbeta = jax.jit(vjp)(t)
  ys, wdx, dws, dbs, dnorm, ops = jax.jit(block_linear_twin, static_argnums=(4,))(
      x, (w,), (b,), (t,), norm, gamma, beta)
  (fa, fb), (da, db_), (wa, wb) = ops[0]
  close(platform, y, ys[0], fa, fb, "y")
  close(platform, dw, dws[0], wa, wb, "dw")
  if norm:  # dx through the norm's backward, by XLA in both
    for name, got, ref in (("dx", dx, wdx), ("dgamma", dgamma, dnorm[0]),
                           ("dbeta", dbeta, dnorm[1])):
      close_through_norm(platform, got, ref, name)
  else:
    close(platform, dx, wdx, da, db_, "dx")
    close(platform, db, dbs[0], np.ones((1, m)), np.asarray(t), "db")


def test_block_multi_linear_equals_twin(platform, rng):
  m, k, ns = 20, 128, (128, 256)
  x = rand(rng, (m, k))
  ws = tuple(rand(rng, (k, n), k**-0.5) for n in ns)
  bs = (None, rand(rng, (ns[1],)))
  ts = tuple(rand(rng, (m, n)) * s for n, s in zip(ns, (1.0, 1e-3)))
  ys, vjp = jax.jit(lambda *a: jax.vjp(lambda x, ws, bs: jax_fp8.multi_linear(
      x, ws, bs, recipe=BLOCK), *a))(x, ws, bs)
  dx, dws, dbs = jax.jit(vjp)(ts)
  wys, wdx, wdws, wdbs, _, ops = jax.jit(block_linear_twin)(x, ws, bs, ts)
  for i in range(2):
    close(platform, ys[i], wys[i], *ops[i][0], f"y{i}")
    close(platform, dws[i], wdws[i], *ops[i][2], f"dw{i}")
  close(platform, dx, wdx, np.concatenate([o[1][0] for o in ops], 1),
        np.concatenate([o[1][1] for o in ops], 0), "dx")
  assert dbs[0] is None
  close(platform, dbs[1], wdbs[1], np.ones((1, m)), np.asarray(ts[1]), "db1")


def block_mlp_twin(x2, k_in, k_out, b_in, b_out, g, activation):
  """mlp under BlockScaling from the reference: the activation and its gradient inside the
  group cast-transposes, the bias gradients by XLA."""
  cx = reference.group_cast_transpose(x2, **KW)
  ck_in = reference.block_quantize(k_in, **KW)
  y = gemm_bias(cx.data, ck_in.data.T, cx.scale, ck_in.scale.T, b_in, F32)  # the layer's
  ch = reference.activation_group_cast_transpose(y, activation=activation, **KW)
  ck_out = reference.block_quantize(k_out, **KW)
  out = bg(ch.data, ck_out.data.T, ch.scale, ck_out.scale.T, bias=b_out)
  cg = reference.group_cast_transpose(g, **KW)
  dh = gemm_bias(cg.data, ck_out.data, cg.scale, ck_out.scale, None, F32)
  dk_out = bg(ch.data_t, cg.data_t, ch.scale_t, cg.scale_t)
  cdy = reference.activation_grad_group_cast_transpose(
      dh, y, activation=activation, **KW)
  dx = bg(cdy.data, ck_in.data, cdy.scale, ck_in.scale)
  dk_in = bg(cx.data_t, cdy.data_t, cx.scale_t, cdy.scale_t)
  dy = activations.grad(dh, y, activation)
  db_in = None if b_in is None else jnp.sum(dy, axis=0)
  db_out = None if b_out is None else jnp.sum(g, axis=0)
  ops = {"out": (block_deq(ch.data, ch.scale, 1),
                 block_deq(ck_out.data.T, ck_out.scale.T, 128).T),
         "dx": (block_deq(cdy.data, cdy.scale, 1), block_deq(ck_in.data, ck_in.scale, 128).T),
         "dk_in": (block_deq(cx.data_t, cx.scale_t, 1),
                   block_deq(cdy.data_t, cdy.scale_t, 1).T),
         "dk_out": (block_deq(ch.data_t, ch.scale_t, 1), block_deq(cg.data_t, cg.scale_t, 1).T)}
  return (out, dx, dk_in, dk_out, db_in, db_out), ops, dy


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_block_mlp_equals_twin(platform, rng, bias):
  m, k, f, d, act = 24, 128, 128, 128, "swiglu"
  x, g = rand(rng, (m, k)), rand(rng, (m, d))
  k_in, k_out = rand(rng, (k, 2 * f), k**-0.5), rand(rng, (f, d), f**-0.5)
  b_in, b_out = (rand(rng, (2 * f,), 0.1), rand(rng, (d,), 0.1)) if bias else (None, None)
  layer = lambda *a: jax_fp8.mlp(*a, activation=act, recipe=BLOCK)  # noqa: E731
  out, vjp = jax.jit(lambda *a: jax.vjp(layer, *a))(x, k_in, k_out, b_in, b_out)
  grads = jax.jit(vjp)(g)
  want, ops, dy = jax.jit(block_mlp_twin, static_argnums=(6,))(
      x, k_in, k_out, b_in, b_out, g, act)
  for name, got, ref in zip(("out", "dx", "dk_in", "dk_out"), (out, *grads[:3]), want):
    close(platform, got, ref, *ops[name], name, act=True)
  if bias:  # XLA's activation gradient in both, summed as each program's fusion orders it
    close(platform, grads[3], want[4], b=np.asarray(dy), what="db_in")
    close(platform, grads[4], want[5], np.ones((1, m)), np.asarray(g), "db_out")
  else:
    assert grads[3] is None and grads[4] is None
