"""The per-tensor family (``DelayedScaling``, ``CurrentScaling``): one scale per tensor, set by a
scale ring, cuBLASLt's FP8 GEMMs.

Linear, forward: x and each kernel are quantized to E4M3 with their rings by cast-transposes
(one read writes both the row-major and the transposed FP8 copy, since Hopper's FP8 GEMMs are
TN-only), then one FP8 GEMM each with the bias in its epilogue. Backward: each output gradient
is cast-transposed once (E5M2 under the HYBRID format), the same read giving dbias, and feeds
dgrad (``dx = g @ kernel.T``) and wgrad (``dkernel = x.T @ g``). Only FP8 copies are saved: x
transposed (for wgrad) and the kernels (for dgrad). The rings' observations of the step,
written by the cast-transposes themselves, leave the rule as the gradient with respect to the
state (``jax_fp8.update_state`` makes them the next rings). Under current scaling each ring is
a blank one set to its tensor's amax of this step just before its quantization, and its
observation is dropped (zero gradient).

MLP: ``activation_cast_transpose`` reads the up projection's output y once and writes
``act(y)`` in both FP8 layouts; in the backward ``activation_grad_cast_transpose`` reads dh and
y once and writes the up projection's output gradient (TransformerEngine's LayerNormMLP fuses
the same steps). A fused input norm runs inside x's cast-transpose (``norm_cast_transpose``).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import activations, norms, sharding
from .._residuals import op_outputs, packed, read_and_saved
from ..formats import amax, amax_of_parts
from ..ops.cast_transpose import (activation_cast_transpose, activation_grad_cast_transpose,
                                  cast_transpose_delayed, norm_cast_transpose)
from ..ops.gemm import gemm, gemm_bias, gemm_dtype
from ..ops.quantize import quantize, quantize_delayed
from ..quantized import DelayedQuantized, Quantized
from ..state import ScaleRing, current, scale_from_amax
from ._shared import (cast_grads, cast_uses, input_grad, normalized, normed_residual,
                      split_output)


@dataclasses.dataclass(frozen=True)
class Static:
  """What a rule is traced for (its one nondiff argument). ``dtypes``: (x's, the outputs', the
  kernels', the biases' (None for none)); ``current``: current scaling (blank rings);
  ``split``: the one output's parts; ``activation``: the MLP's."""

  axis_name: tuple[str, ...] | None
  dtypes: tuple
  fast_accum: tuple[str, ...]
  norm: tuple | None
  current: bool
  split: tuple[int, ...] | None = None
  activation: str | None = None


def shared(observations, states, axis_name):
  """Observations of rings that the devices of ``axis_name`` share, combined over them by an
  elementwise max (exact for observations: they differ only in the front amax, +inf for NaN or
  inf), in one collective, so every device records the same step; typed like their rings
  (``states``: the rings, in the observations' structure)."""
  if axis_name is None:
    return observations
  leaves, tree = jax.tree.flatten(observations)
  flat = jax.lax.pmax(jnp.concatenate([jnp.ravel(v) for v in leaves]), axis_name)
  parts = jnp.split(flat, list(itertools.accumulate(v.size for v in leaves))[:-1])
  out = jax.tree.unflatten(tree, [p.reshape(v.shape) for p, v in zip(parts, leaves)])
  return jax.tree.map(sharding.vary_like, out, states,
                      is_leaf=lambda v: isinstance(v, ScaleRing))


def scaled(ring, value, current_, axis_name):
  """The ring to quantize ``value`` (an array, or a tuple of parts) with: ``ring`` itself
  (delayed scaling), or under current scaling ``ring`` set to the scale of value's amax,
  max-reduced over ``axis_name``."""
  if not current_:
    return ring
  a = amax_of_parts(value) if isinstance(value, tuple) else amax(value)
  return current(ring, a if axis_name is None else sharding.pmax_keep_nan(a, axis_name))


def zero_like(rings):
  """Zeros in the rings' structure and types: the gradient of current scaling's blank rings."""
  return jax.tree.map(jnp.zeros_like, rings)


def blank_rings(recipe, fmts):
  """Current scaling's rings, one per format in ``fmts`` ("fwd" or "bwd")."""
  return tuple(recipe.ring(recipe.fwd_fmt if f == "fwd" else recipe.bwd_fmt) for f in fmts)


def quantize_input(x, norm_params, ring, norm):
  """x's cast-transpose (observing its ring), or with a norm its norm's, the row statistics
  from XLA and the norm applied inside the kernel."""
  if norm is None:
    return cast_transpose_delayed(x, ring, observe=True)
  name, epsilon = norm
  return norm_cast_transpose(x, norms.stats(x, name, epsilon), *norm_params, ring, norm=name,
                             observe=True)


def kernel_fp8(kernel, cast, ring, current_, axis_name) -> DelayedQuantized:
  """A kernel for the GEMMs (its tensor: data [K, N], data_t [N, K], scale; as ``ring`` the
  ring's observation): its cast-transpose, or ``cast``'s (a ``CastKernel``'s copies, its ring
  observed by ``cast_kernel``'s backward) with a zero observation."""
  if cast is not None:
    return DelayedQuantized(cast.fp8, zero_like(ring))
  return cast_transpose_delayed(kernel, scaled(ring, kernel, current_, axis_name), observe=True)


def transposed(t: Quantized) -> Quantized:
  """What the backward keeps of a tensor for wgrad: its transposed copy and the scale."""
  return Quantized(data_t=t.data_t, scale=t.scale)


def rowwise(t: Quantized) -> Quantized:
  """What the backward keeps of a kernel for dgrad: its row-major copy and the scale."""
  return Quantized(data=t.data, scale=t.scale)


# Linear: one or several kernels sharing the input x, cast-transposed once for all of them.
# ``rings`` = (x's ring, the kernels' rings, the output gradients' rings), the last two tuples
# in the kernels' order.

class LinearSaved(NamedTuple):
  """The linear rule's residuals."""

  x: Quantized  # x transposed: data_t e4m3 [K, M16], scale
  kernels: tuple  # Quantized per kernel: data e4m3 [K, N_i], scale
  normed: tuple | None  # (x, norm_params) of a fused norm
  uses: tuple  # the CastKernels' uses
  grad_rings: tuple
  x_observed: ScaleRing
  kernels_observed: tuple


def _forward(x, norm_params, kernels, casts, biases, rings, s: Static):
  """ys (the one output cut as ``s.split`` says), what the backward needs, and the x and
  kernel rings' observations."""
  rx, rks, _ = rings
  if s.current:
    rx = scaled(rx, normalized(x, norm_params, s.norm), s.current, s.axis_name)
  cx = quantize_input(x, norm_params, rx, s.norm)  # data [M, K], data_t [K, M16] e4m3
  cks = [kernel_fp8(k, c, r, s.current, s.axis_name)
         for k, c, r in zip(kernels, casts, rks)]  # [K, N]
  qx = cx.tensor
  ys = split_output(tuple(gemm_bias(qx.data, ck.tensor.data_t, qx.scale, ck.tensor.scale, b,
                                    s.dtypes[1], "fprop" in s.fast_accum)
                          for ck, b in zip(cks, biases)), s.split)
  saved = (transposed(qx), tuple(rowwise(ck.tensor) for ck in cks),
           normed_residual(x, norm_params, s.norm), cast_uses(casts))
  return ys, saved, (cx.ring, tuple(ck.ring for ck in cks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _linear(x, norm_params, kernels, casts, biases, rings, s: Static):
  return _forward(x, norm_params, kernels, casts, biases, rings, s)[0]


def _linear_fwd(x, norm_params, kernels, casts, biases, rings, s: Static):
  ys, saved, observed = _forward(x, norm_params, kernels, casts, biases, rings, s)
  # Current scaling drops the observations: its blank rings get zero gradients.
  observed = zero_like(rings[:2]) if s.current else shared(observed, rings[:2], s.axis_name)
  return ys, LinearSaved(*saved, zero_like(rings[2]) if s.current else rings[2], *observed)


def _linear_bwd(s: Static, res: LinearSaved, gs):
  x_dtype, _, k_dtypes, b_dtypes = s.dtypes
  if s.split is not None:  # the parts' gradients, quantized where they lie
    gs = (tuple(gs),)
  dx, dks, dbs, rgs = None, [], [], []
  for g, qk, ring, k_dtype, b_dtype in zip(gs, res.kernels, res.grad_rings, k_dtypes,
                                          b_dtypes):
    # One quantization of g feeds both GEMMs; the same read gives dbias.
    cg = cast_transpose_delayed(g, scaled(ring, g, s.current, s.axis_name),
                                with_dbias=b_dtype is not None, observe=True)
    qg = cg.tensor
    dxi = gemm(qg.data, qk.data, qg.scale, qk.scale, out_dtype=gemm_dtype(x_dtype),
               fast_accum="dgrad" in s.fast_accum)  # dgrad [M, K]
    dx = dxi if dx is None else dx + dxi  # summed as autodiff sums a shared input's gradients
    dks.append(gemm(res.x.data_t, qg.data_t, res.x.scale, qg.scale,
                    out_dtype=gemm_dtype(k_dtype),
                    fast_accum="wgrad" in s.fast_accum).astype(k_dtype))  # wgrad [K, N]
    dbs.append(None if b_dtype is None else cg.dbias.astype(b_dtype))
    rgs.append(cg.ring)
  rgs = res.grad_rings if s.current else shared(tuple(rgs), res.grad_rings, s.axis_name)
  dx, dnorm = input_grad(dx, res.normed, s.norm, x_dtype)
  return (dx, dnorm, tuple(dks), cast_grads(res.uses), tuple(dbs),
          (res.x_observed, res.kernels_observed, rgs))


_linear.defvjp(*packed(_linear_fwd, _linear_bwd))


def linear(x2, norm_params, kernels, casts, biases, rings, recipe, axis_name, dtypes, norm,
           words, split):
  """The family's FP8 linear of x2 [M, K] (``rings``: the state's (x, kernels, grads), None
  under current scaling; ``words``: unused, no key is drawn): the outputs, cut by ``split``."""
  del words
  current_ = not recipe.stateful
  if current_:
    rings = (recipe.ring(recipe.fwd_fmt), blank_rings(recipe, ("fwd",) * len(kernels)),
             blank_rings(recipe, ("bwd",) * len(kernels)))
  s = Static(axis_name, dtypes, recipe.fast_accum_gemms, norm, current_, split)
  return op_outputs(_linear(x2, norm_params, kernels, casts, biases, rings, s))


# MLP: rings (x, kernel_in, grad_in, hidden, kernel_out, grad_out), MlpState's order.
MLP_RING_FMTS = ("fwd", "fwd", "bwd", "fwd", "fwd", "bwd")


class MlpSaved(NamedTuple):
  """The MLP rule's residuals."""

  x: Quantized  # x transposed: data_t [K, M16], scale
  k_in: Quantized  # data [K, N], scale
  y: jax.Array  # the up projection's output [M, N], in the compute dtype
  h: Quantized  # act(y) transposed: data_t [F, M16], scale
  k_out: Quantized  # data [F, D], scale
  normed: tuple | None
  uses: tuple


def _mlp_forward(x, norm_params, k_in, k_out, casts, b_in, b_out, rings, s: Static):
  """out, what the backward needs, and the forward rings' observations (x, kernel_in, hidden,
  kernel_out). Under current scaling each ring is first set to its tensor's scale (the
  activation's amax from XLA's activation of y)."""
  rx, rk_in, _, rh, rk_out, _ = rings
  fast = "fprop" in s.fast_accum
  if s.current:
    rx = scaled(rx, normalized(x, norm_params, s.norm), s.current, s.axis_name)
  cx = quantize_input(x, norm_params, rx, s.norm)  # [M, K], [K, M16]
  ck_in = kernel_fp8(k_in, casts[0], rk_in, s.current, s.axis_name)  # [K, N], [N, K]
  qx, qk_in = cx.tensor, ck_in.tensor
  y = gemm_bias(qx.data, qk_in.data_t, qx.scale, qk_in.scale, b_in, s.dtypes[1],
                fast)  # [M, N]
  if s.current:
    rh = scaled(rh, activations.apply(y, s.activation), s.current, s.axis_name)
  ch = activation_cast_transpose(y, rh, activation=s.activation, observe=True)  # [M, F]
  ck_out = kernel_fp8(k_out, casts[1], rk_out, s.current, s.axis_name)  # [F, D], [D, F]
  qh, qk_out = ch.tensor, ck_out.tensor
  out = gemm_bias(qh.data, qk_out.data_t, qh.scale, qk_out.scale, b_out, s.dtypes[1],
                  fast)  # [M, D]
  saved = MlpSaved(transposed(qx), rowwise(qk_in), read_and_saved(y), transposed(qh),
                   rowwise(qk_out), normed_residual(x, norm_params, s.norm), cast_uses(casts))
  return out, saved, (cx.ring, ck_in.ring, ch.ring, ck_out.ring)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8,))
def _mlp(x, norm_params, k_in, k_out, casts, b_in, b_out, rings, s: Static):
  return _mlp_forward(x, norm_params, k_in, k_out, casts, b_in, b_out, rings, s)[0]


def _mlp_fwd(x, norm_params, k_in, k_out, casts, b_in, b_out, rings, s: Static):
  out, saved, observed = _mlp_forward(x, norm_params, k_in, k_out, casts, b_in, b_out, rings,
                                      s)
  forward_rings, grad_rings = tuple(rings[i] for i in (0, 1, 3, 4)), (rings[2], rings[5])
  if s.current:  # the observations are dropped: the blank rings get zero gradients
    return out, (saved, zero_like(grad_rings), zero_like(forward_rings))
  return out, (saved, grad_rings, shared(observed, forward_rings, s.axis_name))


def _mlp_bwd(s: Static, res, g):
  saved, grad_rings, observed = res
  rg_in, rg_out = grad_rings
  x_dtype, _, k_in_dtype, k_out_dtype, b_in_dtype, b_out_dtype = s.dtypes
  y = saved.y
  cg = cast_transpose_delayed(g, scaled(rg_out, g, s.current, s.axis_name),
                              with_dbias=b_out_dtype is not None, observe=True)
  qg = cg.tensor
  dh = gemm(qg.data, saved.k_out.data, qg.scale, saved.k_out.scale,
            out_dtype=gemm_dtype(y.dtype), fast_accum="dgrad" in s.fast_accum
            ).astype(y.dtype)  # [M, F]
  dk_out = gemm(saved.h.data_t, qg.data_t, saved.h.scale, qg.scale,
                out_dtype=gemm_dtype(k_out_dtype),
                fast_accum="wgrad" in s.fast_accum).astype(k_out_dtype)  # [F, D]
  if s.current:
    rg_in = scaled(rg_in, activations.grad(dh, y, s.activation), s.current, s.axis_name)
  cdy = activation_grad_cast_transpose(dh, y, rg_in, activation=s.activation,
                                       with_dbias=b_in_dtype is not None, observe=True)
  qdy = cdy.tensor
  dx = gemm(qdy.data, saved.k_in.data, qdy.scale, saved.k_in.scale,
            out_dtype=gemm_dtype(x_dtype), fast_accum="dgrad" in s.fast_accum)  # [M, K]
  dk_in = gemm(saved.x.data_t, qdy.data_t, saved.x.scale, qdy.scale,
               out_dtype=gemm_dtype(k_in_dtype),
               fast_accum="wgrad" in s.fast_accum).astype(k_in_dtype)  # [K, N]
  db_in = None if b_in_dtype is None else cdy.dbias.astype(b_in_dtype)
  db_out = None if b_out_dtype is None else cg.dbias.astype(b_out_dtype)
  rg = grad_rings if s.current else shared((cdy.ring, cg.ring), grad_rings, s.axis_name)
  ox, ok_in, oh, ok_out = observed
  dx, dnorm = input_grad(dx, saved.normed, s.norm, x_dtype)
  return (dx, dnorm, dk_in, dk_out, cast_grads(saved.uses), db_in, db_out,
          (ox, ok_in, rg[0], oh, ok_out, rg[1]))


_mlp.defvjp(*packed(_mlp_fwd, _mlp_bwd))


def mlp(x2, norm_params, k_in, k_out, casts, b_in, b_out, rings, recipe, activation, axis_name,
        dtypes, norm, words):
  """The family's fused FP8 MLP of x2 [M, K] (``rings``: the state's six in ``MLP_RING_FMTS``'
  order, None under current scaling): out [M, D]."""
  del words
  current_ = not recipe.stateful
  if current_:
    rings = blank_rings(recipe, MLP_RING_FMTS)
  s = Static(axis_name, dtypes, recipe.fast_accum_gemms, norm, current_, activation=activation)
  return op_outputs(_mlp(x2, norm_params, k_in, k_out, casts, b_in, b_out, rings, s))


# CastKernel: the kernel's FP8 copies (q [K, N], qt [N, K], scale []), made once a step: a
# Quantized with data, data_t and scale.

def cast_fields(k: int, n: int) -> dict:
  """A ``CastKernel``'s FP8 fields under this family: name -> (dtype, shape) (None: absent)."""
  return {"q": (jnp.float8_e4m3fn, (k, n)), "qt": (jnp.float8_e4m3fn, (n, k)),
          "scale": (jnp.float32, ())}


def cast(kernel, ring, recipe, axis_name):
  """The ``Quantized`` copies of ``kernel`` for a ``CastKernel`` (data [K, N], data_t [N, K],
  scale []), and its ring's observation (None under current scaling, whose ring is blank)."""
  current_ = not recipe.stateful
  ck = kernel_fp8(kernel, None, recipe.ring(recipe.fwd_fmt) if current_ else ring, current_,
                  axis_name)
  t = ck.tensor
  return (Quantized(data=t.data, scale=t.scale, data_t=t.data_t),
          None if current_ else shared(ck.ring, ring, axis_name))


# Fp8Weight (inference): the kernel transposed [N, K] with one E4M3 scale.

def quantize_weight(kernel, recipe) -> Quantized:
  """``kernel`` [K, N] transposed and quantized (data [N, K], scale []): current scaling of the
  trained kernel, its amax onto 448 with the recipe's margin."""
  scale = scale_from_amax(amax(kernel), jnp.float32(1), "e4m3", recipe.margin)
  return quantize(kernel.T, scale, "e4m3")


def weight_scale_shape(n: int, k: int) -> tuple:
  """The shape of an ``Fp8Weight``'s scale for an [N, K] weight: one scale."""
  return ()


def weight_input(recipe, axis_name):
  """A function of (x2 [M, K], the state's x ring or None) giving x2's ``Quantized`` (data
  [M, K], scale []) for the weights' GEMMs: x quantized with the ring (delayed scaling: the
  scale the training run last set), or without one (current scaling) with the scale of its own
  amax."""
  def quantize_x(x2, x_ring):
    if x_ring is None:
      x_ring = scaled(recipe.ring(recipe.fwd_fmt), x2, True, axis_name)
    return quantize_delayed(x2, x_ring).tensor
  return quantize_x
