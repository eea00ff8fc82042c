"""Expert parallelism on 8 CPU devices: the experts split over a mesh axis give the values and
gradients of one device holding them all, dropless and with a capacity that drops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import to_device
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
  x = to_device(rng.standard_normal((T * devices, D)), np.float32)
  logits = to_device(rng.standard_normal((T * devices, E)) * 2, np.float32)
  w = to_device(rng.standard_normal((E, D, N)) / 4, np.float32)
  ct = to_device(rng.standard_normal((T * devices, N)), np.float32)
  loss = lambda f: lambda x, lg, w: jnp.sum(f(x, lg, w) * ct)  # noqa: E731
  # each side's value and gradient under one jit (eagerly, every operation compiles)
  with_grad = lambda f: jax.jit(lambda *a: (f(*a), jax.grad(loss(f), (0, 1, 2))(*a)))  # noqa: E731
  want, want_g = with_grad(_one_device)(x, logits, w)
  got, got_g = with_grad(_parallel(mesh))(x, logits, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  for g, h in zip(got_g, want_g):
    np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-5)


def test_capacity_drops_the_overflow(rng):
  """Every token to expert 0 (device 0): with capacity c, each device's first c assignments
  arrive and the rest come back zero."""
  mesh = Mesh(np.array(jax.devices("cpu")[:4]), ("e",))
  x = to_device(rng.standard_normal((T * 4, D)), np.float32)
  logits_np = np.zeros((T * 4, E), np.float32)
  logits_np[:, 0], logits_np[:, 1] = 50.0, 40.0  # experts 0 and 1
  logits = to_device(logits_np)
  w = to_device(rng.standard_normal((E, D, N)), np.float32)
  cap = 10
  got = np.asarray(jax.jit(_parallel(mesh, capacity=cap))(x, logits, w))
  full = np.asarray(jax.jit(_one_device)(x, logits, w))
  routing = jax.tree.map(np.asarray, jax.jit(mr.top_k_routing, static_argnums=1)(logits, K))
  wts, experts, x_np, w_np = routing.weights, routing.experts, np.asarray(x), np.asarray(w)
  for dev in range(4):
    for t in range(T):
      row = dev * T + t
      # the assignments of a token are consecutive (t * K + j): those past cap are dropped
      kept = [j for j in range(K) if t * K + j < cap]
      want = sum(wts[row, j] * (x_np[row] @ w_np[int(experts[row, j])])
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
    jax.jit(run)(np.zeros((T * 3, D), np.float32), np.zeros((T * 3, E), np.float32))
