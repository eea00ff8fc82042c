"""Routing and token permutation of the mixture-of-experts layers: every token's copy in its
experts' blocks, blocks aligned and padded with zeros, the round trip and its gradient, the
load-balancing loss at its known values, skewed routing, out-of-range ids and bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_fp8 import moe_routing as mr


def _check_layout(x, experts, perm, num_experts, align):
  x, experts = np.asarray(x), np.asarray(experts)
  rows, sizes, slots = (np.asarray(v) for v in perm)
  starts = np.cumsum(sizes) - sizes
  assert np.all(starts % align == 0) and np.all(sizes % align == 0)
  assert rows.shape[0] == mr.permuted_rows(*experts.shape, num_experts, align)
  assert sizes.sum() <= rows.shape[0]
  used = np.zeros(rows.shape[0], bool)
  for t, j in np.ndindex(*experts.shape):
    e, s = experts[t, j], slots[t, j]
    assert starts[e] <= s < starts[e] + sizes[e]
    np.testing.assert_array_equal(rows[s], x[t])
    assert not used[s]
    used[s] = True
  assert np.all(rows[~used] == 0)  # padding and rows past the blocks: zero
  for e in range(num_experts):  # within a block, tokens keep their order
    tokens = [t for t, j in np.ndindex(*experts.shape) if experts[t, j] == e]
    placed = sorted(tokens, key=lambda t: slots[t][list(experts[t]).index(e)])
    assert placed == tokens


@pytest.mark.parametrize("tokens,num_experts,top_k,align", [
    (37, 5, 2, 16), (64, 8, 1, 16), (50, 4, 4, 128), (1, 3, 3, 16)])
def test_permute_layout(rng, tokens, num_experts, top_k, align):
  x = jnp.asarray(rng.standard_normal((tokens, 8)), jnp.float32)
  routing = mr.top_k_routing(jnp.asarray(rng.standard_normal((tokens, num_experts))), top_k)
  assert routing.experts.dtype == jnp.int32
  for row in np.asarray(routing.experts):
    assert len(set(row)) == top_k  # distinct experts per token
  np.testing.assert_allclose(np.asarray(routing.weights).sum(-1), 1, rtol=1e-6)
  perm = jax.jit(mr.permute, static_argnames=("num_experts", "align"))(
      x, routing.experts, num_experts=num_experts, align=align)
  _check_layout(x, routing.experts, perm, num_experts, align)


def test_skewed_and_empty_experts(rng):
  """Every token to expert 2 (experts 0, 1, 3 empty): one block, the others of size 0."""
  x = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)
  experts = jnp.full((40, 1), 2, jnp.int32)
  perm = mr.permute(x, experts, 4)
  np.testing.assert_array_equal(np.asarray(perm.group_sizes), [0, 0, 48, 0])
  _check_layout(x, experts, perm, 4, 16)


def test_round_trip_and_gradient(rng):
  """unpermute(permute(x)) with weights w gives x * sum(w); its gradient is sum(w) per token,
  and the weights' gradient is the rows' dot with the cotangent."""
  t, d, e, k = 33, 8, 6, 3
  x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
  routing = mr.top_k_routing(jnp.asarray(rng.standard_normal((t, e))), k, normalize=False)

  def f(x, w):
    perm = mr.permute(x, routing.experts, e)
    return mr.unpermute(perm.rows * 3.0, perm, w)
  y = f(x, routing.weights)
  np.testing.assert_allclose(y, 3 * x * np.asarray(routing.weights).sum(-1, keepdims=True),
                             rtol=1e-6)
  ct = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
  gx, gw = jax.grad(lambda x, w: jnp.sum(f(x, w) * ct), argnums=(0, 1))(x, routing.weights)
  np.testing.assert_allclose(gx, 3 * ct * np.asarray(routing.weights).sum(-1, keepdims=True),
                             rtol=1e-5)
  np.testing.assert_allclose(gw, 3 * np.repeat(np.sum(np.asarray(x * ct), -1, keepdims=True),
                                               k, axis=1), rtol=1e-5)


def test_out_of_range_expert_ids_read_back_zero(rng):
  x = jnp.asarray(rng.standard_normal((4, 16)), jnp.float32)
  experts = jnp.asarray([[0], [7], [-1], [1]], jnp.int32)  # 7 and -1: no such expert
  perm = mr.permute(x, experts, 2)
  np.testing.assert_array_equal(np.asarray(perm.group_sizes), [16, 16])
  y = mr.unpermute(perm.rows, perm, jnp.ones((4, 1)))
  np.testing.assert_array_equal(np.asarray(y[1:3]), 0)
  np.testing.assert_array_equal(np.asarray(y)[[0, 3]], np.asarray(x)[[0, 3]])


def test_load_balancing_loss_values():
  """1 under uniform routing; E when every token goes to one expert with probability 1."""
  e, t = 4, 8
  uniform = mr.Routing(jnp.ones((t, 1)), jnp.arange(t, dtype=jnp.int32)[:, None] % e,
                       jnp.full((t, e), 1 / e))
  np.testing.assert_allclose(mr.load_balancing_loss(uniform), 1.0, rtol=1e-6)
  collapsed = mr.top_k_routing(jnp.tile(jnp.asarray([[50.0, 0, 0, 0]]), (t, 1)), 1)
  np.testing.assert_allclose(mr.load_balancing_loss(collapsed), e, rtol=1e-6)
  g = jax.grad(lambda lg: mr.load_balancing_loss(mr.top_k_routing(lg, 2)))(
      jnp.asarray(np.random.default_rng(0).standard_normal((t, e)), jnp.float32))
  assert np.all(np.isfinite(g)) and np.any(g != 0)


def _permuted():
  """(rows, permutation, weights) of 4 tokens over 3 experts, top 2."""
  routing = mr.top_k_routing(jnp.arange(12.0).reshape(4, 3), 2)
  perm = mr.permute(jnp.ones((4, 8)), routing.experts, 3)
  return perm.rows, perm, routing.weights


@pytest.mark.parametrize("call,error,match", [
    (lambda: mr.top_k_routing(jnp.zeros((4,)), 1), TypeError, "logits must be a float"),
    (lambda: mr.top_k_routing(jnp.zeros((4, 3), jnp.int32), 1), TypeError,
     "logits must be a float"),
    (lambda: mr.top_k_routing(jnp.zeros((4, 3)), 4), ValueError, "top_k"),
    (lambda: mr.top_k_routing(jnp.zeros((4, 3)), 1, normalize=1), TypeError, "normalize"),
    (lambda: mr.permute(jnp.zeros((4, 8)), jnp.zeros((4, 2)), 3), TypeError,
     "experts must be int32 \\[T, k\\] with T = 4"),
    (lambda: mr.permute(jnp.zeros((4, 8)), jnp.zeros((5, 2), jnp.int32), 3), TypeError,
     "with T = 4"),
    (lambda: mr.permute(jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), 3, align=24),
     ValueError, "align must be a multiple of 16"),
    (lambda: mr.permute(jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), 0), ValueError,
     "num_experts"),
    (lambda: mr.top_k_routing(jnp.zeros((4, 0)), 1), ValueError,
     "logits must be \\[T, E\\] with E >= 1 experts, got \\[4, 0\\]"),
    (lambda: mr.permuted_rows(8, 2, 4, align=0), ValueError, "align must be an int >= 16"),
    (lambda: mr.load_balancing_loss((1, 2, 3)), TypeError,
     "routing must be a jax_fp8.moe_routing.Routing .* got tuple"),
    (lambda: mr.unpermute(*_permuted()[:2], _permuted()[2][:, :1]), ValueError,
     "weights must be \\[T, k\\] as the permutation's slots \\[4, 2\\], got float32\\[4, 1\\]"),
    (lambda: mr.unpermute(_permuted()[0][:, 0], *_permuted()[1:]), ValueError,
     "rows must be \\[R, N\\] with the permutation's R=64"),
    (lambda: mr.unpermute(_permuted()[0].astype(jnp.int32), *_permuted()[1:]), TypeError,
     "rows must be a float array, got int32"),
    (lambda: mr.unpermute(_permuted()[0], None, _permuted()[2]), TypeError,
     "permutation must be a jax_fp8.moe_routing.Permutation .* got NoneType"),
])
def test_bad_input(call, error, match):
  with pytest.raises(error, match=match):
    call()
