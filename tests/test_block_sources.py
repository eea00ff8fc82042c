"""Block scaling's group cast-transpose of a norm, an activation and the gradient through it
(norm_group_cast_transpose, activation_group_cast_transpose,
activation_grad_group_cast_transpose): what the per-tensor cast-transposes fuse, in 1 x 128 /
128 x 1 groups.

The norm is byte-identical to jax_fp8.reference on every platform (csrc/norm.h rounds each
product and sum on its own). The activations are computed with the platform's exp and tanh, so
they are checked within the bound of tests/test_activation.py, group by group: each dequantized
element within one step of the format's grid of its own group's scale, plus 2^-12 of the
tensor's amax (where the platforms' f32 activations differ by an ulp of tanh near +-1, whose
cancellation makes tiny values' relative error large); each scale within 2^-16, plus 2^-12 of
the tensor's amax over fmt_max."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import (bits, covering_cases, on_cpu, poison_allocator, reference_on_cpu,
                      roundoff)

import jax_fp8
from jax_fp8 import activations, norms, reference

NORMS = ["rmsnorm", "layernorm"]
ACTS = ["silu", "gelu", "swiglu", "geglu"]
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]
# What is quantized, [R, C]: one row; rows past a multiple of 128 (qt's zero padding) and
# three column groups; 8 x 8 tiles.
SHAPES = [(1, 128), (129, 384), (1000, 1024)]
# Every activation with every dtype, the shape varied so that every pair of the three occurs.
ACTIVATION_CASES = covering_cases({"activation": ACTS, "dtype": DTYPES}, {"shape": SHAPES})
SUBNORMAL_STEP = {"e4m3": 2.0**-9, "e5m2": 2.0**-16}  # the smallest step, times the scale
F32_ULPS = 2.0**-12  # of the amax: where the platforms' f32 activations may differ
SCALE_RTOL = 2.0**-16


def both_directions(t):
  """A group cast-transpose's ``Quantized`` as [data, scale, data_t, scale_t]; its other fields
  must be None."""
  assert t.amax is None and t.global_scale is None and t.global_scale_t is None
  return [t.data, t.scale, t.data_t, t.scale_t]


def assert_same(got, want):
  """Two ``Quantized`` (data, scale, data_t, scale_t) byte for byte (FP8) and bit for bit (f32
  scales)."""
  for g, w in zip(both_directions(got), both_directions(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
    np.testing.assert_array_equal(g.view(np.uint8) if g.dtype.itemsize == 1 else g.view(np.uint32),
                                  w.view(np.uint8) if w.dtype.itemsize == 1 else w.view(np.uint32))


def assert_close(got, want, fmt):
  """The module docstring's bound, in both directions; qt's padding columns zero bytes."""
  assert [g.shape for g in both_directions(got)] == [w.shape for w in both_directions(want)]
  amax = float(np.max(want.scale)) * jax_fp8.fp8_max(fmt)  # the largest group's, the tensor's
  for a, sa, b, sb in ((got.data, got.scale, want.data, want.scale),
                       (got.data_t, got.scale_t, want.data_t, want.scale_t)):
    np.testing.assert_allclose(np.asarray(sa), sb, rtol=SCALE_RTOL,
                               atol=F32_ULPS * amax / jax_fp8.fp8_max(fmt))
    scale = np.repeat(np.asarray(sa, np.float64), 128, axis=1)
    ref_scale = np.repeat(np.asarray(sb, np.float64), 128, axis=1)
    deq = np.asarray(a, np.float64) * scale
    ref = np.asarray(b, np.float64) * ref_scale
    bound = (2 * roundoff(fmt) * np.maximum(np.abs(deq), np.abs(ref))
             + SUBNORMAL_STEP[fmt] * np.maximum(scale, ref_scale) + F32_ULPS * amax)
    assert np.all(np.abs(deq - ref) <= bound), np.max(np.abs(deq - ref) / bound)
  assert not bits(got.data_t)[:, got.data.shape[0]:].any(), \
      "data_t's padding columns must be zero bytes"


def output_shapes(r, c):
  r128 = -(-r // 128) * 128
  return [(r, c), (r, c // 128), (c, r128), (c, r128 // 128)]


@pytest.mark.parametrize("shape,dtype,norm", covering_cases({"shape": SHAPES, "dtype": DTYPES},
                                                          {"norm": NORMS}))
def test_norm_matches_reference_bytes(platform, rng, norm, dtype, shape):
  r, c = shape
  x = jnp.asarray(rng.standard_normal(shape) * 3 + 1, dtype)
  gamma = jnp.asarray(1 + 0.5 * rng.standard_normal(c), dtype)
  beta = jnp.asarray(0.5 * rng.standard_normal(c), dtype) if norm == "layernorm" else None
  row_stats = jnp.asarray(on_cpu(lambda x: norms.stats(x, norm, 1e-6), x))  # one copy, both
  ue8m0 = (DTYPES.index(dtype) + NORMS.index(norm)) % 2 == 1  # each norm with and without
  op = jax.jit(jax_fp8.norm_group_cast_transpose, static_argnames=("norm", "ue8m0"))
  poison_allocator(c * -(-r // 128) * 128)
  got = op(x, row_stats, gamma, beta, norm=norm, ue8m0=ue8m0)
  want = reference_on_cpu(reference.norm_group_cast_transpose, x, row_stats, gamma, beta,
                          norm=norm, ue8m0=ue8m0)
  assert [g.shape for g in both_directions(got)] == output_shapes(r, c)
  assert_same(got, want)
  assert not bits(got.data_t)[:, r:].any(), "data_t's padding columns must be zero bytes"


@pytest.mark.parametrize("activation,dtype,shape", ACTIVATION_CASES)
def test_activation_matches_reference(platform, rng, activation, dtype, shape):
  gated = activations.ACTIVATIONS[activation][1]
  r, c = shape
  y = jnp.asarray(rng.standard_normal((r, 2 * c if gated else c)) * 3, dtype)
  fmt = "e5m2" if dtype == jnp.float16 else "e4m3"  # BlockScaling's, and the other one
  op = jax.jit(jax_fp8.activation_group_cast_transpose, static_argnames=("activation", "fmt"))
  poison_allocator(c * -(-r // 128) * 128)
  got = op(y, activation=activation, fmt=fmt)
  want = reference_on_cpu(reference.activation_group_cast_transpose, y, activation=activation,
                          fmt=fmt)
  assert [g.shape for g in both_directions(got)] == output_shapes(r, c)
  assert_close(got, want, fmt)


@pytest.mark.parametrize("activation,dtype,shape", ACTIVATION_CASES)
def test_activation_grad_matches_reference(platform, rng, activation, dtype, shape):
  """Gated, the gradient is [dgate | dup] [R, 2C], each 128-column group inside one half."""
  gated = activations.ACTIVATIONS[activation][1]
  r, c = shape
  y = jnp.asarray(rng.standard_normal((r, 2 * c if gated else c)) * 3, dtype)
  dh = jnp.asarray(rng.standard_normal((r, c)), dtype)
  fmt = "e5m2" if dtype == jnp.float32 else "e4m3"  # BlockScaling's, and the other one
  op = jax.jit(jax_fp8.activation_grad_group_cast_transpose,
               static_argnames=("activation", "fmt"))
  poison_allocator(y.shape[1] * -(-r // 128) * 128)
  got = op(dh, y, activation=activation, fmt=fmt)
  want = reference_on_cpu(reference.activation_grad_group_cast_transpose, dh, y,
                          activation=activation, fmt=fmt)
  assert [g.shape for g in both_directions(got)] == output_shapes(r, y.shape[1])
  assert_close(got, want, fmt)


def test_plain_source_is_group_cast_transpose(platform, rng):
  """The norm with unit gamma and its statistics set to rsigma = 1 quantizes x itself: the same
  bytes as group_cast_transpose (the plain source and the norm source read x alike)."""
  x = jnp.asarray(rng.standard_normal((200, 256)), jnp.bfloat16)
  ones = jnp.ones((200, 1), jnp.float32)
  got = jax_fp8.norm_group_cast_transpose(x, ones, jnp.ones(256, jnp.float32), None,
                                          norm="rmsnorm")
  assert_same(got, jax_fp8.group_cast_transpose(x))


@pytest.mark.parametrize("call,error,match", [
    (lambda x, st, g: jax_fp8.norm_group_cast_transpose(x[:, :64], st, g[:64], None,
                                                        norm="rmsnorm"),
     ValueError, "C a positive multiple of 128"),
    (lambda x, st, g: jax_fp8.norm_group_cast_transpose(x, st.astype(jnp.bfloat16), g, None,
                                                        norm="rmsnorm"),
     TypeError, "row_stats must be float32"),
    (lambda x, st, g: jax_fp8.norm_group_cast_transpose(x, st, g, g, norm="rmsnorm"),
     TypeError, "beta must be None under 'rmsnorm'"),
    (lambda x, st, g: jax_fp8.norm_group_cast_transpose(x, st, g, None, norm="batchnorm"),
     ValueError, "norm must be one of"),
    (lambda x, st, g: jax_fp8.activation_group_cast_transpose(x, activation="swiglu"),
     ValueError,
     r"\[R, 2C\] \(\[gate \| up\] of a gated activation\) with C a positive multiple of 128"),
    (lambda x, st, g: jax_fp8.activation_group_cast_transpose(x, activation="relu"),
     ValueError, "activation"),
    (lambda x, st, g: jax_fp8.activation_grad_group_cast_transpose(x, x, activation="swiglu"),
     ValueError, r"y must be \[8, 768\] for dh \[8, 384\] under 'swiglu'"),
    (lambda x, st, g: jax_fp8.activation_grad_group_cast_transpose(
        x, x.astype(jnp.float16), activation="silu"), TypeError, "y must have dh's dtype"),
    (lambda x, st, g: jax_fp8.activation_group_cast_transpose(x, activation="silu", ue8m0=1),
     TypeError, "ue8m0"),
    (lambda x, st, g: jax_fp8.activation_group_cast_transpose(x, activation="silu", fmt="e3m4"),
     ValueError, "fmt"),
])
def test_bad_arguments_raise_at_trace_time(call, error, match):
  x = jnp.ones((8, 384), jnp.bfloat16)
  st = jnp.ones((8, 1), jnp.float32)
  g = jnp.ones((384,), jnp.float32)
  with pytest.raises(error, match=match):
    jax.eval_shape(call, x, st, g)
