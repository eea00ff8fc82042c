"""jax_fp8.linear: forward and gradients against f32 references, state updates, pmap."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import normwise, on_cpu, roundoff, summation_error

import jax_fp8
from jax_fp8 import formats, reference
from jax_fp8.recipes import LINEAR_GEMMS
from jax_fp8.state import next_ring

# Normwise relative error allowed against the f32 math: a product of two independently
# quantized operands, each element within its format's unit roundoff (e4m3 2^-4, e5m2 2^-3)
# of itself; the two roundings add in quadrature (conftest.normwise). Measured on the
# problems here (40 seeds): forward 2.3-3.0%, gradients 5.5-6.4%.
E4M3, E5M2 = roundoff("e4m3"), roundoff("e5m2")
FWD_TOL = normwise(E4M3, E4M3)  # x and kernel in e4m3: 0.064
BWD_TOL = normwise(E5M2, E4M3)  # the e5m2 gradient and an e4m3 operand: 0.101


def bias_tol(dtype, rows: int) -> float:
  """dbias sums the output gradient's rows in f32 (no FP8): t rounded to dtype and the sum
  rounded to dtype (a roundoff each), and the f32 sum's own roundings, a random walk of about
  sqrt(rows) roundoffs of f32."""
  return 2 * roundoff(dtype) + np.sqrt(rows) * roundoff(jnp.float32)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def problem(rng, lead=(4, 9), k=64, n=48, dtype=jnp.float32):
  x = jnp.asarray(rng.standard_normal((*lead, k)), dtype)
  w = jnp.asarray(rng.standard_normal((k, n)) / np.sqrt(k), dtype)
  b = jnp.asarray(rng.standard_normal(n), dtype)
  t = jnp.asarray(rng.standard_normal((*lead, n)), jnp.float32)
  return x, w, b, t


def loss(x, w, b, state, t):
  y = jax_fp8.linear(x, w, b, state=state)
  return jnp.sum(y.astype(jnp.float32) * t)


def loss_f32(x, w, b, t):
  y = x.astype(jnp.float32) @ w.astype(jnp.float32) + b.astype(jnp.float32)
  return jnp.sum(y * t)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_forward_and_grads(platform, rng, dtype):
  x, w, b, t = problem(rng, dtype=dtype)
  state = jax_fp8.LinearState.create()
  y = jax.jit(lambda *a: jax_fp8.linear(*a[:3], state=a[3]))(x, w, b, state)
  assert y.shape == (4, 9, 48) and y.dtype == dtype
  y_f32 = on_cpu(lambda x, w, b: x.astype(jnp.float32) @ w.astype(jnp.float32) + b, x, w, b)
  out = roundoff(dtype)  # the output's own rounding in x's dtype
  assert rel(y.astype(jnp.float32), y_f32) < FWD_TOL + out
  # The unfused reference computes the same quantized forward: only the GEMM's summation order
  # (the reference's f32 sum on the CPU and this platform's, summation_error each, of the
  # products' magnitudes, which quantization grows by at most (1 + 2^-4)^2) and the two
  # results' own roundings to x's dtype (a roundoff each) differ.
  y_ref = on_cpu(lambda *a: reference.linear(*a[:3], state=a[3]), x, w, b, state)
  y_ref = y_ref.astype(np.float32)
  absdot = on_cpu(lambda x, w: jnp.abs(x.astype(jnp.float32)) @ jnp.abs(w.astype(jnp.float32)),
                  x, w)
  orders = summation_error(x.shape[-1]) + summation_error(x.shape[-1], platform)
  bound = 2 * out * np.abs(y_ref) + orders * (1 + E4M3)**2 * absdot
  err = np.abs(np.asarray(y.astype(jnp.float32)) - y_ref)
  assert np.all(err <= bound), np.max(err / bound)
  grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(x, w, b, state, t)
  want = on_cpu(jax.grad(loss_f32, argnums=(0, 1, 2)), x, w, b, t)
  tols = (BWD_TOL + out, BWD_TOL + out, bias_tol(dtype, 36))  # 4 * 9 rows
  for got, ref, name, tol in zip(grads[:3], want, ("dx", "dkernel", "dbias"), tols):
    assert got.dtype == dtype, name
    assert rel(got.astype(jnp.float32), ref) < tol, name


def check_numerical_gradient(fp8_linear, x, w, b, t, tol):
  """Every element of the gradients of ``sum(tanh(fp8_linear(x, w, b)) * t)`` (a nonlinear
  loss) against central differences of the f32 loss, normwise within ``tol``; and the check is
  sharp enough to see a factor-2 error in any of them (a transposed one changes the shape: no
  operand here is square)."""
  def f32_loss(x, w, b):
    return jnp.sum(jnp.tanh(x @ w + b) * t)

  grads = jax.jit(jax.grad(lambda x, w, b: jnp.sum(jnp.tanh(fp8_linear(x, w, b)) * t),
                           argnums=(0, 1, 2)))(x, w, b)
  eps = 1e-2
  for i, (v, g) in enumerate(zip((x, w, b), grads)):
    flat = np.asarray(v, np.float64).ravel()
    numeric = np.empty_like(flat)
    for j in range(flat.size):
      args_up, args_dn = [x, w, b], [x, w, b]
      up, dn = flat.copy(), flat.copy()
      up[j] += eps
      dn[j] -= eps
      args_up[i] = jnp.asarray(up.reshape(v.shape), jnp.float32)
      args_dn[i] = jnp.asarray(dn.reshape(v.shape), jnp.float32)
      numeric[j] = (on_cpu(f32_loss, *args_up) - on_cpu(f32_loss, *args_dn)) / (2 * eps)
    numeric = numeric.reshape(v.shape)
    assert g.shape == v.shape
    assert rel(g, numeric) < tol
    # Twice the gradient would fail the line above: its error is at least 1 - 2 * tol > tol.
    assert rel(2 * np.asarray(g), numeric) > tol


@pytest.mark.parametrize("recipe", ["delayed", "current", "mxfp8"])
def test_numerical_gradient(platform, rng, recipe):
  # The backward's two roundings and the forward's two (x, kernel), which reach dL/dz =
  # t * tanh'(z) too, all in quadrature; central differences add ~eps^2 and f32 noise, under
  # 1e-3. The backward's gradient: e5m2 under HYBRID (delayed and current scaling), e4m3 under
  # MXFP8 (a 1x32 block's RCEIL scale leaves each element an E4M3 normal, within 2^-4 of
  # itself, or a subnormal off by at most 2^-10 of the scale, under 2^-17 of the block's amax).
  x, w, b, t = problem(rng, lead=(8,), k=32, n=64)
  fp8_linear, grad_roundoff = {
      "delayed": (lambda x, w, b: jax_fp8.linear(x, w, b, state=jax_fp8.LinearState.create()),
                  E5M2),
      "current": (lambda x, w, b: jax_fp8.linear(x, w, b, recipe=jax_fp8.CurrentScaling()),
                  E5M2),
      "mxfp8": (lambda x, w, b: jax_fp8.linear(x, w, b, recipe=jax_fp8.MXFP8BlockScaling()),
                E4M3),
  }[recipe]
  check_numerical_gradient(fp8_linear, x, w, b, t, normwise(grad_roundoff, E4M3, E4M3, E4M3))


def test_state_gradient_gives_next_ring(platform, rng):
  """update_state(state, d loss / d state) advances each ring exactly as next_ring does."""
  x, w, b, t = problem(rng)
  state = jax_fp8.LinearState.create()
  step = jax.jit(lambda x, w, b, s, t: jax_fp8.update_state(s, jax.grad(loss, argnums=3)(
      x, w, b, s, t)), donate_argnums=3)
  for _ in range(3):
    ax = on_cpu(formats.amax, x.reshape(-1, 64))
    ak = on_cpu(formats.amax, w)
    ag = on_cpu(formats.amax, t)  # dL/dy = t
    want = [on_cpu(next_ring, r, a) for r, a in ((state.x, ax), (state.kernel, ak),
                                                  (state.grad, ag))]
    state = step(x, w, b, state, t)
    for got_ring, want_ring in zip((state.x, state.kernel, state.grad), want):
      for got, ref in zip(jax.tree.leaves(got_ring), jax.tree.leaves(want_ring)):
        np.testing.assert_array_equal(np.asarray(got), ref)
  assert float(state.x.steps) == 3 and float(state.grad.steps) == 3


def test_rings_move_in_the_kernels(rng):
  """The train step's rings are moved by the cast-transpose kernels alone: they read the rings
  and write the observations to fresh buffers, so the compiled step holds no copy of a ring
  buffer and no jnp ring arithmetic (a concatenate shifting a history) around our calls."""
  x, w, b, t = problem(rng)
  state = jax_fp8.LinearState.create()  # rings of 16: no other f32[16] in this step
  step = jax.jit(lambda x, w, b, s, t: jax.grad(loss, argnums=(1, 3))(x, w, b, s, t))
  hlo = step.lower(x, w, b, state, t).compile().as_text()
  assert hlo.count("custom_call_target=\"jax_fp8_cast_transpose_ring\"") == 3
  assert not re.search(r"f32\[16\]\{0\} (copy|concatenate)\(", hlo)


def test_unused_ring_does_not_roll(rng):
  x, w, b, t = problem(rng)
  s1, s2 = jax_fp8.LinearState.create(), jax_fp8.LinearState.create()
  s2 = dataclasses.replace(s2, x=dataclasses.replace(s2.x, steps=jnp.float32(5)))
  grads = jax.grad(lambda s1, s2: loss(x, w, b, s1, t), argnums=(0, 1))(s1, s2)
  new = jax_fp8.update_state((s1, s2), grads)
  assert float(new[0].x.steps) == 1
  for got, want in zip(jax.tree.leaves(new[1]), jax.tree.leaves(s2)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_shared_state_combines_by_max(rng):
  """A state used by several microbatches in one differentiation records the max amax, not
  the sum: scan over `share`d copies; and `combine_updates` for per-microbatch gradients."""
  x, w, b, t = problem(rng, lead=(3, 16))
  x = x * jnp.asarray([1.0, 5.0, 2.0])[:, None, None]  # microbatch 1 has the largest amax
  state = jax_fp8.LinearState.create()

  def scanned(state):
    def body(c, xs):
      xi, ti, si = xs
      return c + loss(xi, w, b, si, ti), None
    return jax.lax.scan(body, 0.0, (x, t, jax_fp8.share(state, 3)))[0]

  nxt = jax.jit(jax.grad(scanned))(state)
  assert float(nxt.x.amax_history[0]) == float(jnp.max(jnp.abs(x)))  # a max: exact
  assert float(nxt.x.steps) == 1

  per_mb = [jax.grad(loss, argnums=3)(x[i], w, b, state, t[i]) for i in range(3)]
  acc = per_mb[0]
  for g in per_mb[1:]:
    acc = jax_fp8.combine_updates(acc, g)
  for got, ref in zip(jax.tree.leaves(acc), jax.tree.leaves(nxt)):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_pmap_two_devices_identical_rings(rng):
  devices = jax.devices("cpu")[:2]
  assert len(devices) == 2
  x, w, b, t = problem(rng, lead=(2, 16))
  x = x * jnp.asarray([1.0, 3.0])[:, None, None]  # replicas see different amaxes
  state = jax_fp8.LinearState.create()

  def step(x, t, state):
    f = lambda w, b, s: jnp.sum(jax_fp8.linear(x, w, b, state=s, amax_axis_name="r") * t)
    gw, gb, gs = jax.grad(f, argnums=(0, 1, 2))(w, b, state)
    return jax.lax.pmean(gw, "r"), jax.lax.pmean(gb, "r"), jax_fp8.update_state(state, gs)

  rep = jax.tree.map(lambda v: jnp.stack([v, v]), state)
  gw, gb, new = jax.pmap(step, axis_name="r", devices=devices)(x, t, rep)
  for leaf in jax.tree.leaves(new):
    np.testing.assert_array_equal(np.asarray(leaf[0]), np.asarray(leaf[1]))
  assert float(new.x.amax_history[0, 0]) == float(jnp.max(jnp.abs(x)))  # a max: exact
  want = jax.grad(lambda w: sum(loss_f32(x[i], w, b, t[i]) for i in range(2)) / 2)(w)
  assert rel(gw[0], want) < BWD_TOL


def test_bad_inputs(rng):
  x, w, b, _ = problem(rng)
  s = jax_fp8.LinearState.create()
  with pytest.raises(ValueError, match="share K"):
    jax_fp8.linear(x[..., :32], w, b, state=s)
  with pytest.raises(ValueError, match="multiples of 16"):
    jax_fp8.linear(x[..., :24], w[:24], b, state=s)
  with pytest.raises(ValueError, match="bias must be"):
    jax_fp8.linear(x, w, b[:8], state=s)
  with pytest.raises(TypeError, match="state must be a jax_fp8.LinearState"):
    jax_fp8.linear(x, w, b, state={})
  with pytest.raises(ValueError, match="do not match the recipe"):
    jax_fp8.linear(x, w, b, state=s, recipe=jax_fp8.DelayedScaling(fp8_format="e4m3"))
  with pytest.raises(TypeError, match="LinearState.create takes a DelayedScaling"):
    jax_fp8.LinearState.create(jax_fp8.BlockScaling())


@pytest.mark.parametrize("fast", [(), ("fprop",), ("dgrad", "wgrad"), LINEAR_GEMMS],
                         ids=lambda f: "+".join(f) or "none")
def test_fast_accum_reaches_its_gemms(rng, fast):
  """DelayedScaling.fast_accum sets cuBLASLt's fast accumulation on exactly the GEMMs it names
  (read from the CUDA lowering: fprop gives [M, N], dgrad [M, K], wgrad [K, N])."""
  m, k, n = 32, 64, 48
  x, w, b, t = problem(rng, (m,), k, n)
  recipe = jax_fp8.DelayedScaling(fast_accum_gemms=fast)
  f = jax.value_and_grad(lambda x, w, s: jnp.sum(
      jax_fp8.linear(x, w, b, state=s, recipe=recipe) * t), argnums=(0, 1, 2))
  hlo = jax.jit(f).trace(x, w, jax_fp8.LinearState.create(recipe)).lower(
      lowering_platforms=("cuda",)).as_text()
  gemms = re.findall(r"custom_call @jax_fp8_gemm\(.*fast_accum = (\w+).*-> \(tensor<(\d+x\d+)x", hlo)
  names = {f"{m}x{n}": "fprop", f"{m}x{k}": "dgrad", f"{k}x{n}": "wgrad"}
  got = {names[shape]: flag == "true" for flag, shape in gemms}
  assert got == {g: g in fast for g in LINEAR_GEMMS}


def test_fast_accum_linear(platform, rng):
  """With fast accumulation in all three GEMMs the forward and gradients stay within the FP8
  tolerances against the f32 math, plus on CUDA fast accumulation's own bound (K = 1024, where
  the accumulation error shows; the CPU's GEMMs accumulate in f32 either way)."""
  x, w, b, t = problem(rng, lead=(64,), k=1024, n=128)
  recipe = jax_fp8.DelayedScaling(fast_accum_gemms=LINEAR_GEMMS)
  state = jax_fp8.LinearState.create(recipe)
  fp8 = lambda x, w, b: jnp.sum(jax_fp8.linear(x, w, b, state=state, recipe=recipe) * t)
  val, grads = jax.jit(jax.value_and_grad(fp8, argnums=(0, 1, 2)))(x, w, b)
  y = jax.jit(lambda x, w, b: jax_fp8.linear(x, w, b, state=state, recipe=recipe))(x, w, b)

  def fast(a, b, ref):
    """Fast accumulation's error, at most 2^-8 of |a| @ |b| (test_gemm_fast_accum), relative to
    the norm of ``ref`` (the quantized operands' magnitudes within (1 + 2^-3)^2)."""
    if platform == "cpu":
      return 0.0
    absdot = on_cpu(lambda a, b: jnp.abs(a) @ jnp.abs(b), a, b)
    return 2**-8 * (1 + roundoff("e5m2"))**2 * np.linalg.norm(absdot) / np.linalg.norm(ref)

  y_f32 = on_cpu(lambda x, w, b: x @ w + b, x, w, b)
  assert rel(y, y_f32) < FWD_TOL + fast(x, w, y_f32)
  want = on_cpu(jax.grad(loss_f32, argnums=(0, 1, 2)), x, w, b, t)
  products = ((t, w.T), (x.T, t), None)  # dx = t @ w.T, dkernel = x.T @ t; dbias sums t in f32
  for got, ref, name, ab in zip(grads, want, ("dx", "dkernel", "dbias"), products):
    tol = BWD_TOL + fast(*ab, ref) if ab else bias_tol(jnp.float32, 64)
    assert rel(got, ref) < tol, name


def test_fast_accum_rejects_and_orders():
  for bad, error in ((("fprop", "fprop"), ValueError), (("forward",), ValueError),
                     ("fprop", TypeError), ((["fprop"],), TypeError), (None, TypeError)):
    with pytest.raises(error, match="DelayedScaling.fast_accum_gemms must be a tuple"):
      jax_fp8.DelayedScaling(fast_accum_gemms=bad)
  recipe = jax_fp8.DelayedScaling(fast_accum_gemms=("wgrad", "fprop"))
  assert recipe.fast_accum_gemms == ("fprop", "wgrad")
  for same in (("fprop", "wgrad"), ["wgrad", "fprop"], {"fprop", "wgrad"}):
    assert jax_fp8.DelayedScaling(fast_accum_gemms=same) == recipe
  assert hash(jax_fp8.DelayedScaling(fast_accum_gemms=[])) == hash(jax_fp8.DelayedScaling())


@pytest.mark.parametrize("recipe_cls", [jax_fp8.DelayedScaling, jax_fp8.BlockScaling])
def test_fp8_min_intensity(platform, rng, recipe_cls):
  """Below the recipe's intensity the linear is XLA's in x's dtype, gradients included, and no
  ring moves; at or above it, FP8 (the rings observe the step)."""
  m, n, k = 64, 128, 256
  intensity = m * n * k / (m * k + k * n + m * n)  # 36.57
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((k, n)) / 16, jnp.float32)
  b = jnp.asarray(rng.standard_normal(n), jnp.float32)
  t = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  block = recipe_cls is jax_fp8.BlockScaling
  state = None if block else jax_fp8.LinearState.create()

  def run(threshold):
    recipe = recipe_cls(fp8_min_intensity=threshold)
    f = lambda x, w, b, s: jnp.sum(jax_fp8.linear(x, w, b, state=s, recipe=recipe).astype(
        jnp.float32) * t)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3)))(x, w, b, state)

  def plain(x, w, b):
    return jnp.sum((x @ w.astype(x.dtype) + b.astype(x.dtype)).astype(jnp.float32) * t)
  want_val, want_grads = jax.jit(jax.value_and_grad(plain, argnums=(0, 1, 2)))(x, w, b)

  val, grads = run(intensity * 1.01)
  assert float(val) == float(want_val)
  for g, wg in zip(grads[:3], want_grads):
    assert g.dtype == wg.dtype and np.array_equal(np.asarray(g), np.asarray(wg))
  if not block:
    nxt = jax_fp8.update_state(state, grads[3])
    assert jax.tree.all(jax.tree.map(lambda a, c: np.array_equal(a, c), nxt, state))

  val8, grads8 = run(intensity)  # the threshold itself runs FP8
  assert float(val8) != float(want_val)
  # The bf16 reference rounds twice itself (dL/dy to bf16, the product): 2 * 2^-8 more. The
  # dkernel's operands: x and an e5m2 gradient per tensor, x and an e4m3 one per block.
  fp8_tol = FWD_TOL if block else BWD_TOL
  assert rel(grads8[1], want_grads[1]) < fp8_tol + 2 * roundoff(jnp.bfloat16)
  if not block:
    assert float(jax_fp8.update_state(state, grads8[3]).x.steps) == 1.0


@pytest.mark.parametrize("bad,error", [(-1.0, ValueError), (float("inf"), ValueError),
                                       (float("nan"), ValueError), ("900", TypeError),
                                       (True, TypeError)])
def test_fp8_min_intensity_rejects(bad, error):
  for cls in (jax_fp8.DelayedScaling, jax_fp8.BlockScaling):
    with pytest.raises(error, match=f"{cls.__name__}.fp8_min_intensity must be"):
      cls(fp8_min_intensity=bad)


def test_fp8_min_intensity_any_shape(rng):
  """A layer sent to XLA by fp8_min_intensity takes any K and N (the FP8 rules apply to FP8
  layers only); empty K runs there too, giving the bias."""
  x = jnp.asarray(rng.standard_normal((4, 24)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((24, 40)), jnp.float32)
  for recipe in (jax_fp8.DelayedScaling(fp8_min_intensity=900),
                 jax_fp8.BlockScaling(fp8_min_intensity=900)):
    state = jax_fp8.LinearState.create(recipe) if isinstance(recipe, jax_fp8.DelayedScaling) \
        else None
    np.testing.assert_array_equal(jax_fp8.linear(x, w, state=state, recipe=recipe), x @ w)
  with pytest.raises(ValueError, match="multiples of 16 .cuBLASLt's FP8 GEMM alignment"):
    jax_fp8.linear(x, w, state=jax_fp8.LinearState.create())
  b = jnp.asarray(rng.standard_normal(32), jnp.float32)
  y = jax_fp8.linear(jnp.ones((3, 0)), jnp.ones((0, 32)), b, state=jax_fp8.LinearState.create())
  np.testing.assert_array_equal(y, jnp.broadcast_to(b, (3, 32)))
