"""State updates: observations combine by max exactly, whatever each use saw."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import normwise, roundoff, summation_error
from jax.sharding import Mesh, PartitionSpec as P

import jax_fp8
from jax_fp8.state import next_ring, observe

INF = np.inf


def ring_after(amaxes, algo="max", length=4):
  """A ring that has recorded `amaxes` (oldest first)."""
  r = jax_fp8.ScaleRing.create(length, "e4m3", algo=algo)
  for a in amaxes:
    r = next_ring(r, jnp.float32(a))
  return r


def assert_rings_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history,uses,step_amax", [
    ([], [0.0, 10.0], 10.0),          # fresh ring, one use saw only zeros
    ([100.0], [0.0, 10.0], 10.0),     # most_recent must give 10/448, not 100/448
    ([5.0, 7.0], [3.0, 2.0, 1.0], 3.0),
    ([5.0], [np.nan, 3.0], np.nan),   # any non-finite use: the step is non-finite
    ([5.0], [INF, 3.0], INF),
])
def test_combined_observations_equal_next_ring_of_max(algo, history, uses, step_amax):
  ring = ring_after(history, algo)
  obs = [observe(ring, jnp.float32(a)) for a in uses]
  by_combine = obs[0]
  for o in obs[1:]:
    by_combine = jax_fp8.combine_updates(by_combine, o)
  stacked = jax.tree.map(lambda *v: jnp.stack(v), *obs)
  _, share_vjp = jax.vjp(lambda r: jax_fp8.share(r, len(uses)), ring)
  by_share, = share_vjp(stacked)
  want = next_ring(ring, jnp.float32(step_amax))
  assert_rings_equal(jax_fp8.update_state(ring, by_combine), want)
  assert_rings_equal(jax_fp8.update_state(ring, by_share), want)


def test_unused_and_zero_gradient():
  ring = ring_after([2.0, 3.0])
  zero = jax.tree.map(jnp.zeros_like, ring)
  assert_rings_equal(jax_fp8.update_state(ring, zero), ring)
  one = observe(ring, jnp.float32(1.0))
  assert_rings_equal(jax_fp8.update_state(ring, jax_fp8.combine_updates(zero, one)),
                     next_ring(ring, jnp.float32(1.0)))


def test_swapped_arguments(rng):
  """update_state(state_grads, state), the arguments swapped, would publish a zero scale
  (every output of the next step zero): outside a jit it raises, naming the order."""
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
  state = jax_fp8.LinearState.create()
  grads = jax.grad(lambda s: jnp.sum(jax_fp8.linear(x, w, state=s)))(state)
  jax_fp8.update_state(state, grads)
  with pytest.raises(ValueError, match=r"state.x.scale is 0: a ring.s scale is positive.*"
                                       r"update_state\(state, state_grads\), the state first"):
    jax_fp8.update_state(grads, state)
  with pytest.raises(ValueError, match=r"state_grads.x.scale is not 0"):
    jax_fp8.update_state(state, state)


def test_zero_initialized_kernel_stays_on_current_scaling(rng):
  """A layer whose kernel starts at zero (LoRA's B, say): the kernel ring records the zero
  step but does not count it, so its next step scales from that step's own amax."""
  x = jnp.asarray(rng.standard_normal((32, 64)), jnp.float32)
  w = jnp.zeros((64, 48), jnp.float32)
  state = jax_fp8.LinearState.create()
  y, vjp = jax.vjp(lambda s: jax_fp8.linear(x, w, state=s), state)
  new = jax_fp8.update_state(state, vjp(jnp.ones_like(y))[0])
  assert float(new.kernel.steps) == 0 and float(new.kernel.scale) == 1.0
  assert float(new.x.steps) == 1 and float(new.grad.steps) == 1
  # Small weights: with the placeholder scale 1 they would fall into E4M3's subnormals
  # (below 2^-6) and mostly round to zero (an error near 1); scaled from their own amax, x and
  # kernel each within 2^-4 of themselves, the product within the two roundings in
  # quadrature (conftest.normwise; measured ~4%).
  w2 = jnp.asarray(rng.standard_normal((64, 48)) * 1e-3, jnp.float32)
  y2 = jax_fp8.linear(x, w2, state=new)
  err = np.linalg.norm(y2 - x @ w2) / np.linalg.norm(x @ w2)
  assert err < normwise(roundoff("e4m3"), roundoff("e4m3")), err


def test_summed_observations_record_an_upper_bound(rng):
  """vmap over a shared state sums the observations (JAX's rule); update_state records the
  sum of the amaxes, never less than their max, and the rest of the history stays right."""
  x = jnp.asarray(rng.standard_normal((3, 16, 32)), jnp.float32)
  x = x * jnp.asarray([1.0, 4.0, 2.0])[:, None, None]
  w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32) / 6
  state = jax_fp8.LinearState.create()
  state = dataclasses.replace(state, x=ring_after([7.0, 9.0], length=16))
  f = lambda s: jnp.sum(jax.vmap(lambda xi: jax_fp8.linear(xi, w, state=s))(x))
  new = jax_fp8.update_state(state, jax.grad(f)(state))
  amaxes = np.abs(np.asarray(x)).reshape(3, -1).max(axis=1)
  # Three positive f32 terms summed in two orders.
  np.testing.assert_allclose(float(new.x.amax_history[0]), amaxes.sum(),
                             rtol=2 * summation_error(3))
  assert float(new.x.amax_history[0]) >= amaxes.max()
  np.testing.assert_array_equal(np.asarray(new.x.amax_history[1:3]), [9.0, 7.0])
  assert float(new.x.steps) == 3


def test_tied_layer_via_share(rng):
  """One layer applied twice in a step: `share` makes its rings record the larger amax."""
  x = jnp.asarray(rng.standard_normal((16, 32)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((32, 32)), jnp.float32) / 6
  state = jax_fp8.LinearState.create()

  def f(s):
    two = jax_fp8.share(s, 2)
    first = jax.tree.map(lambda v: v[0], two)
    second = jax.tree.map(lambda v: v[1], two)
    h = jax_fp8.linear(x, w, state=first)
    return jnp.sum(jax_fp8.linear(3 * h, w, state=second))

  new = jax_fp8.update_state(state, jax.grad(f)(state))
  h = jax_fp8.linear(x, w, state=state)  # what the second use saw
  want = max(float(jnp.max(jnp.abs(x))), float(jnp.max(jnp.abs(3 * h))))
  assert float(new.x.amax_history[0]) == want  # maxima of the same values: exact
  assert float(new.x.steps) == 1 and float(new.kernel.steps) == 1


def test_shard_map_data_parallel(rng):
  """shard_map over 2 devices with the amax reduced over the axis: identical rings on both."""
  mesh = Mesh(np.array(jax.devices("cpu")[:2]), ("data",))
  x = jnp.asarray(rng.standard_normal((2, 16, 32)), jnp.float32)
  x = x * jnp.asarray([1.0, 3.0])[:, None, None]
  w = jnp.asarray(rng.standard_normal((32, 16)), jnp.float32) / 6
  state = jax_fp8.LinearState.create()

  def step(x, w, state):
    f = lambda w, s: jnp.sum(jax_fp8.linear(x[0], w, state=s, amax_axis_name="data"))
    gw, gs = jax.grad(f, argnums=(0, 1))(w, state)  # gw: summed over the devices
    return gw, jax_fp8.update_state(state, gs)

  gw, new = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("data"), P(), P()),
                                  out_specs=(P(), P())))(x, w, state)
  assert float(new.x.amax_history[0]) == float(jnp.max(jnp.abs(x)))  # a max: exact
  want = jnp.sum(x, axis=(0, 1))[:, None] * jnp.ones((1, 16))
  # dL/dy = 1 is exact in e5m2, so gw sums the 32 e4m3 copies of x's rows: each within 2^-4
  # of itself, or half e4m3's smallest subnormal step (2^-10) of the scale amax / 448 below
  # 2^-6; plus the f32 sums' order.
  n, u = 32, roundoff("e4m3")
  absum = np.abs(np.asarray(x)).sum(axis=(0, 1))[:, None]
  scale = float(jnp.max(jnp.abs(x))) / jax_fp8.fp8_max("e4m3")
  half_step = float(jnp.finfo(jnp.float8_e4m3fn).smallest_subnormal) / 2
  bound = (u + 2 * summation_error(n) * (1 + u)) * absum + n * half_step * scale
  assert np.all(np.abs(np.asarray(gw) - np.asarray(want)) <= bound)
  with pytest.raises(ValueError, match="pass them as amax_axis_name"):
    jax.jit(jax.shard_map(lambda x, w, s: jax_fp8.linear(x[0], w, state=s), mesh=mesh,
                          in_specs=(P("data"), P(), P()), out_specs=P("data")))(x, w, state)
