"""Expert parallelism on 8 CPU devices: the experts split over a mesh axis give the values and
gradients of one device holding them all, dropless and with a capacity that drops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec as P

from jax_fp8 import moe_routing as mr
from jax_fp8.moe_parallel import expert_parallel

T, D, N, E, K = 24, 16, 32, 8, 2  # tokens per device, model dim, out dim, experts, top-k


def _experts(w):
  return lambda rows, sizes: jax.lax.ragged_dot(rows, w, sizes,
                                                precision=jax.lax.Precision.HIGHEST)


def _one_device(x, logits, w):
  routing = mr.top_k_routing(logits, K)
  perm = mr.permute(x, routing.experts, E)
  return mr.unpermute(_experts(w)(perm.rows, perm.group_sizes), perm, routing.weights)


def _parallel(mesh, capacity=None):
  def local(x, logits, w):
    routing = mr.top_k_routing(logits, K)
    return expert_parallel(x, routing, E, "e", _experts(w), capacity=capacity)
  return jax.shard_map(local, mesh=mesh, in_specs=(P("e"), P("e"), P("e")), out_specs=P("e"))


@pytest.mark.parametrize("devices", [2, 8])
def test_equals_one_device(rng, devices):
  mesh = Mesh(np.array(jax.devices("cpu")[:devices]), ("e",))
  x = jnp.asarray(rng.standard_normal((T * devices, D)), jnp.float32)
  logits = jnp.asarray(rng.standard_normal((T * devices, E)) * 2, jnp.float32)
  w = jnp.asarray(rng.standard_normal((E, D, N)) / 4, jnp.float32)
  ct = jnp.asarray(rng.standard_normal((T * devices, N)), jnp.float32)
  loss = lambda f: lambda x, lg, w: jnp.sum(f(x, lg, w) * ct)
  want, want_g = _one_device(x, logits, w), jax.grad(loss(_one_device), (0, 1, 2))(x, logits, w)
  run = _parallel(mesh)
  got = jax.jit(run)(x, logits, w)
  got_g = jax.jit(jax.grad(loss(run), (0, 1, 2)))(x, logits, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g, h in zip(got_g, want_g):
    np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-5)


def test_capacity_drops_the_overflow(rng):
  """Every token to expert 0 (device 0): with capacity c, each device's first c assignments
  arrive and the rest come back zero."""
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("e",))
  x = jnp.asarray(rng.standard_normal((T * 4, D)), jnp.float32)
  logits = jnp.zeros((T * 4, E)).at[:, 0].set(50.0).at[:, 1].set(40.0)  # experts 0 and 1
  w = jnp.asarray(rng.standard_normal((E, D, N)), jnp.float32)
  cap = 10
  got = np.asarray(jax.jit(_parallel(mesh, capacity=cap))(x, logits, w))
  full = np.asarray(_one_device(x, logits, w))
  routing = mr.top_k_routing(logits, K)
  wts = np.asarray(routing.weights)
  for dev in range(4):
    for t in range(T):
      row = dev * T + t
      # the assignments of a token are consecutive (t * K + j): those past cap are dropped
      kept = [j for j in range(K) if t * K + j < cap]
      want = sum(wts[row, j] * (np.asarray(x[row]) @ np.asarray(w[int(routing.experts[row, j])]))
                 for j in kept) if kept else np.zeros(N)
      np.testing.assert_allclose(got[row], want, rtol=1e-4, atol=1e-4)
  assert not np.allclose(got, full)


def test_bad_input():
  mesh = Mesh(np.array(jax.devices("cpu")[:3]), ("e",))

  def local(x, logits):
    return expert_parallel(x, mr.top_k_routing(logits, K), E, "e", lambda r, s: r)
  run = jax.shard_map(local, mesh=mesh, in_specs=(P("e"), P("e")), out_specs=P("e"))
  with pytest.raises(ValueError, match="num_experts \\(8\\) must be a multiple of the size of "
                                       "axis 'e' \\(3\\)"):
    jax.jit(run)(jnp.zeros((T * 3, D)), jnp.zeros((T * 3, E)))
