"""The capacity-factor MoE peers of the benchmarks (``jax_fp8.demo.capacity_moe``) against the
dropless BF16 twin (``Bf16MoeMlp``, ragged_dot): the same parameters from one seed and, when
no assignment is dropped, the same values within bf16's roundings (with Flax's FP8 einsums
within e4m3's); the dispatch's slot priority, its count of dropped assignments, and bad
arguments."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import normwise, roundoff

from jax_fp8.demo.capacity_moe import CapacityMoeMlp, dispatch, expert_capacity
from jax_fp8.demo.model import Config
from jax_fp8.demo.train import INTERMEDIATES, sown
from jax_fp8.demo.twins import LOAD_BALANCING, Bf16MoeMlp

E, K, H, D, S, G = 4, 2, 32, 64, 16, 3  # experts, top k, expert width, model width, group, groups
BF16, E4M3 = roundoff(jnp.bfloat16), roundoff("e4m3")
# The capacity path runs the twin's bf16 GEMMs on the same rows (bit for bit on the CPU; on a
# GPU another algorithm may round h, the activation and the output another way: three bf16
# roundings), rounds the combine weights to bf16 (at most u of each of a token's two terms,
# whose magnitudes' norm is at most sqrt(2) |y| for uncorrelated terms), and each output is
# rounded once (u each).
BF16_TOL = (2 + math.sqrt(2)) * BF16 + normwise(BF16, BF16, BF16)
# Flax's FP8 einsums: x and w_in (gate and up each), the activation's product, a and w_out
# rounded to e4m3.
FP8_TOL = normwise(*[E4M3] * 6)


def rel(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return np.linalg.norm(a - b) / np.linalg.norm(b)


def test_no_drop_equals_the_ragged_dot_twin(rng):
  """With capacity factor E / k every expert has a slot for every token of a group: nothing
  is dropped and each peer computes the twin's mixture, in BF16 within bf16's roundings and
  with FP8 experts within e4m3's; both create the twin's parameters from one seed."""
  h = jnp.asarray(rng.standard_normal((G, S, D)), jnp.bfloat16)
  twin = Bf16MoeMlp(E, K, H)
  params = jax.jit(twin.init)(jax.random.key(0), h)["params"]
  want = jax.jit(twin.apply)({"params": params}, h)
  for fp8, tol in ((False, BF16_TOL), (True, FP8_TOL)):
    layer = CapacityMoeMlp(E, K, H, capacity_factor=E / K, fp8=fp8)
    v = {"params": params}
    if fp8:  # its Fp8Einsums' scales and amax histories; the twin's parameters
      v = jax.jit(layer.init)(jax.random.key(0), h)
      assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), v["params"], params))
    y, state = jax.jit(lambda v, h: layer.apply(v, h, mutable=[INTERMEDIATES]))(v, h)
    assert y.shape == h.shape and y.dtype == jnp.bfloat16
    (dropped,), (aux,) = (sown(state[INTERMEDIATES], n) for n in ("dropped_assignments",
                                                                  LOAD_BALANCING))
    assert int(dropped[0]) == 0 and abs(float(aux[0]) - 1) < 0.5  # a fresh router: near 1
    assert rel(y, want) <= tol, (fp8, rel(y, want), tol)


def test_dispatch_priority():
  """Slots go to every token's first choice in token order, then to the second choices: with
  2 slots, token 2's first choice (expert 0, full after tokens 0 and 1) and token 3's second
  (expert 0 again) are dropped; each kept assignment fills one slot with its weight."""
  experts = jnp.array([[[0, 1], [0, 2], [0, 1], [2, 0]]], jnp.int32)  # [G=1, S=4, k=2]
  weights = jnp.array([[[0.6, 0.4], [0.7, 0.3], [0.5, 0.5], [0.9, 0.1]]], jnp.float32)
  got = dispatch(experts, weights, 3, 2, jnp.float32)
  want = np.zeros((1, 4, 3, 2), np.float32)  # [G, S, E, C]: (token, expert, slot) -> weight
  for t, e, c, w in ((0, 0, 0, 0.6), (1, 0, 1, 0.7), (3, 2, 0, 0.9), (0, 1, 0, 0.4),
                     (1, 2, 1, 0.3), (2, 1, 1, 0.5)):
    want[0, t, e, c] = w
  np.testing.assert_array_equal(got.combine, want)
  np.testing.assert_array_equal(got.dispatch, want > 0)
  assert int(got.dropped) == 2


@pytest.mark.parametrize("factor", [0.25, 1.0, 1.25])
def test_dropped_count(rng, factor):
  """On random routing each expert keeps min(its assignments, C) of a group's, so the count
  of dropped ones is the sum of the overflows; no slot holds two tokens."""
  c = expert_capacity(S, K, E, factor)
  experts = jnp.asarray(np.argsort(rng.random((G, S, E)), -1)[..., :K], jnp.int32)
  got = dispatch(experts, jnp.ones((G, S, K), jnp.float32), E, c)
  counts = np.stack([np.bincount(g.ravel(), minlength=E) for g in np.asarray(experts)])
  assert int(got.dropped) == np.maximum(counts - c, 0).sum()
  assert np.asarray(got.dispatch, np.float32).sum(1).max() <= 1  # [G, E, C]: a token a slot
  np.testing.assert_array_equal(np.asarray(got.dispatch, np.float32).sum((1, 3)),
                                np.minimum(counts, c))


def test_expert_capacity():
  assert expert_capacity(2048, 2, 8, 1.25) == 640 and expert_capacity(2048, 8, 256, 1.25) == 80
  assert expert_capacity(16, 2, 4, 2.0) == expert_capacity(16, 2, 4, 50.0) == 16  # E / k: all
  assert expert_capacity(4, 1, 64, 0.01) == 1


@pytest.mark.parametrize("fields,error,match", [
    (dict(capacity_factor=0.0), ValueError, r"capacity_factor must be > 0, got 0.0"),
    (dict(capacity_factor="1"), TypeError, r"capacity_factor must be a number"),
    (dict(fp8=1), TypeError, r"CapacityMoeMlp.fp8 must be a bool"),
])
def test_bad_arguments(fields, error, match):
  with pytest.raises(error, match=match):
    CapacityMoeMlp(E, K, H, **fields).init(jax.random.key(0), jnp.ones((S, D)))
  with pytest.raises(ValueError, match=r"takes h \[..., S, D\] .* got \[64\]"):
    CapacityMoeMlp(E, K, H).init(jax.random.key(0), jnp.ones((D,)))


@pytest.mark.parametrize("fields,match", [
    (dict(linear="fp8", moe_experts=4, moe_capacity_factor=1.25),
     r"moe_capacity_factor runs the einsum MoE of linear \['flax', 'flax_fp8'\] .* not linear "
     r"'fp8'"),
    (dict(linear="flax", moe_experts=4, moe_capacity_factor=-1.0),
     r"moe_capacity_factor must be > 0, got -1.0"),
    (dict(linear="flax", moe_capacity_factor=1.25), r"applies with moe_experts > 0"),
    (dict(linear="flax_fp8", moe_experts=4), r"or a moe_capacity_factor with linear"),
])
def test_model_config_rejects_a_capacity_it_has_no_layer_for(fields, match):
  llama = dict(fuse_norm=False, qkv="separate", mlp="separate", activation="swiglu")
  with pytest.raises(ValueError, match=match):
    Config(128, 2, 1, 32, **llama, **fields)
