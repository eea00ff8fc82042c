"""The block family (``BlockScaling``, DeepSeek-V3, arXiv 2412.19437, section 3.3): stateless,
E4M3, x and the gradients in 1 x 128 groups, the kernels in 128 x 128 blocks (whose transpose
needs no requantization), cuBLASLt's block-scaled GEMMs.

Linear: x is group cast-transposed (1 x 128 groups along K and, transposed, along M, from one
read; a fused norm computed on the way), each kernel block-quantized, the gradient group
cast-transposed; fprop and dgrad take 1 x 128 x 128 x 128 scales, wgrad 1 x 128 on both
operands. MLP: the activation and its gradient run inside the group cast-transposes of the up
projection's output and of dh (``activation_group_cast_transpose`` and its gradient form); the
bias gradients by XLA (the block kernels take no column sums).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import activations, norms
from .._residuals import op_outputs, packed, read_and_saved
from ..ops import blockwise
from ..ops.gemm import gemm, gemm_bias, gemm_dtype
from ..quantized import Quantized
from ._shared import (bias_grad, cast_grads, cast_uses, input_grad, normalized, normed_residual,
                      split_output)


@dataclasses.dataclass(frozen=True)
class Static:
  """What a rule is traced for (its nondiff argument): the recipe, ``dtypes`` as the
  per-tensor family's, the fused norm and the MLP's activation."""

  recipe: object
  dtypes: tuple
  norm: tuple | None
  activation: str | None = None


def quantize_input(x, norm_params, recipe, norm):
  """x's group cast-transpose (1 x 128 groups along K, 128 x 1 along M, transposed), or with a
  norm its norm's, the row statistics from XLA and the norm applied inside the kernel."""
  if norm is None:
    return blockwise.group_cast_transpose(x, **recipe.kwargs())
  name, epsilon = norm
  return blockwise.norm_group_cast_transpose(x, norms.stats(x, name, epsilon), *norm_params,
                                             norm=name, **recipe.kwargs())


def kernel_fp8(kernel, cast, recipe) -> Quantized:
  """A kernel in 128 x 128 blocks (data [K, N], scale [K/128, N/128]): its block quantization,
  or ``cast``'s (a ``CastKernel``'s)."""
  return cast.fp8 if cast is not None else blockwise.block_quantize(kernel, **recipe.kwargs())


def kernel_saved(kernel, cast, recipe):
  """``kernel_fp8`` for a rule that reads the blocks in its forward GEMM and saves them: where
  the rule quantizes them, both take them from behind ``read_and_saved`` (the quantize reads a
  slice of a scan's xs; with a reader before the barrier, XLA's dynamic-slice fusion ran it
  twice, once for each side); as they are where ``cast`` gave them (the rule's inputs)."""
  blocks = kernel_fp8(kernel, cast, recipe)
  return blocks if cast is not None else read_and_saved(blocks)


def transposed(t: Quantized) -> Quantized:
  """What the backward keeps of a group cast-transposed tensor for wgrad: its transposed copy
  and that copy's scales."""
  return Quantized(data_t=t.data_t, scale_t=t.scale_t)


class LinearSaved(NamedTuple):
  """The linear rule's residuals."""

  x: Quantized  # x transposed: data_t [K, M128], scale_t [K, M128/128]
  kernels: tuple  # Quantized per kernel: data [K, N], scale [K/128, N/128]
  normed: tuple | None
  uses: tuple


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _linear(x, norm_params, kernels, casts, biases, s: Static):
  # Without a gradient no transposed copy is needed: the scales in cuBLASLt's layout.
  qx = blockwise.group_quantize(normalized(x, norm_params, s.norm), scale_layout="col",
                                **s.recipe.kwargs())  # scale [K/128, M]
  out = []
  for kernel, cast, bias in zip(kernels, casts, biases):
    qk = kernel_fp8(kernel, cast, s.recipe)
    out.append(gemm_bias(qx.data, qk.data.T, qx.scale.T, qk.scale.T, bias, s.dtypes[1]))
  return tuple(out)


def _linear_fwd(x, norm_params, kernels, casts, biases, s: Static):
  qx = quantize_input(x, norm_params, s.recipe, s.norm)  # [M, K], [K, M128]
  ys, saved = [], []
  for kernel, cast, bias in zip(kernels, casts, biases):
    qk = kernel_saved(kernel, cast, s.recipe)  # [K, N], [K/128, N/128]
    ys.append(gemm_bias(qx.data, qk.data.T, qx.scale, qk.scale.T, bias, s.dtypes[1]))
    saved.append(qk)
  return tuple(ys), LinearSaved(transposed(qx), tuple(saved),
                                normed_residual(x, norm_params, s.norm), cast_uses(casts))


def _linear_bwd(s: Static, res: LinearSaved, gs):
  x_dtype, _, k_dtypes, b_dtypes = s.dtypes
  dx, dks, dbs = None, [], []
  for g, qk, k_dtype, b_dtype in zip(gs, res.kernels, k_dtypes, b_dtypes):
    qg = blockwise.group_cast_transpose(g, **s.recipe.kwargs())  # [M, N], [N, M128]
    dxi = gemm(qg.data, qk.data, qg.scale, qk.scale,
               out_dtype=gemm_dtype(x_dtype))  # dgrad: 1x128 . 128x128
    dx = dxi if dx is None else dx + dxi
    dks.append(gemm(res.x.data_t, qg.data_t, res.x.scale_t, qg.scale_t,
                    out_dtype=gemm_dtype(k_dtype)).astype(k_dtype))
    dbs.append(bias_grad(g, b_dtype))
  dx, dnorm = input_grad(dx, res.normed, s.norm, x_dtype)
  return dx, dnorm, tuple(dks), cast_grads(res.uses), tuple(dbs)


_linear.defvjp(*packed(_linear_fwd, _linear_bwd))


def linear(x2, norm_params, kernels, casts, biases, rings, recipe, axis_name, dtypes, norm,
           words, split):
  """The family's FP8 linear of x2 [M, K] (no rings, no amax axes, no key): the outputs, cut
  by ``split``."""
  del rings, axis_name, words
  ys = _linear(x2, norm_params, kernels, casts, biases, Static(recipe, dtypes, norm))
  return split_output(op_outputs(ys), split)


class MlpSaved(NamedTuple):
  """The MLP rule's residuals."""

  x: Quantized  # x transposed: data_t [K, M128], scale_t
  k_in: Quantized  # data [K, N], scale [K/128, N/128]
  y: jax.Array  # the up projection's output [M, N], in the compute dtype
  h: Quantized  # act(y) transposed: data_t [F, M128], scale_t
  k_out: Quantized  # data [F, D], scale [F/128, D/128]
  normed: tuple | None
  uses: tuple


def _mlp_forward(x, norm_params, k_in, k_out, casts, b_in, b_out, s: Static):
  """out, and what the backward needs."""
  kw = s.recipe.kwargs()
  qx = quantize_input(x, norm_params, s.recipe, s.norm)  # [M, K], [K, M128]
  qk_in = kernel_saved(k_in, casts[0], s.recipe)  # [K, N], [K/128, N/128]
  y = gemm_bias(qx.data, qk_in.data.T, qx.scale, qk_in.scale.T, b_in, s.dtypes[1])  # [M, N]
  qh = blockwise.activation_group_cast_transpose(y, activation=s.activation, **kw)  # [M, F]
  qk_out = kernel_saved(k_out, casts[1], s.recipe)  # [F, D], [F/128, D/128]
  out = gemm_bias(qh.data, qk_out.data.T, qh.scale, qk_out.scale.T, b_out,
                  s.dtypes[1])  # [M, D]
  return out, MlpSaved(transposed(qx), qk_in, read_and_saved(y), transposed(qh), qk_out,
                       normed_residual(x, norm_params, s.norm), cast_uses(casts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _mlp(x, norm_params, k_in, k_out, casts, b_in, b_out, s: Static):
  return _mlp_forward(x, norm_params, k_in, k_out, casts, b_in, b_out, s)[0]


def _mlp_bwd(s: Static, res: MlpSaved, g):
  x_dtype, _, k_in_dtype, k_out_dtype, b_in_dtype, b_out_dtype = s.dtypes
  kw = s.recipe.kwargs()
  y = res.y
  qg = blockwise.group_cast_transpose(g, **kw)  # [M, D], [D, M128]
  dh = gemm(qg.data, res.k_out.data, qg.scale, res.k_out.scale,
            out_dtype=gemm_dtype(y.dtype)).astype(y.dtype)  # [M, F]
  dk_out = gemm(res.h.data_t, qg.data_t, res.h.scale_t, qg.scale_t,
                out_dtype=gemm_dtype(k_out_dtype)).astype(k_out_dtype)
  qdy = blockwise.activation_grad_group_cast_transpose(
      dh, y, activation=s.activation, **kw)  # [M, N], [N, M128]
  dx = gemm(qdy.data, res.k_in.data, qdy.scale, res.k_in.scale,
            out_dtype=gemm_dtype(x_dtype))  # [M, K]
  dk_in = gemm(res.x.data_t, qdy.data_t, res.x.scale_t, qdy.scale_t,
               out_dtype=gemm_dtype(k_in_dtype)).astype(k_in_dtype)
  # dy's bias gradient from dh and y by XLA.
  db_in = None if b_in_dtype is None else jnp.sum(
      activations.grad(dh, y, s.activation), axis=0).astype(b_in_dtype)
  dx, dnorm = input_grad(dx, res.normed, s.norm, x_dtype)
  return dx, dnorm, dk_in, dk_out, cast_grads(res.uses), db_in, bias_grad(g, b_out_dtype)


_mlp.defvjp(*packed(_mlp_forward, _mlp_bwd))


def mlp(x2, norm_params, k_in, k_out, casts, b_in, b_out, rings, recipe, activation, axis_name,
        dtypes, norm, words):
  """The family's fused FP8 MLP of x2 [M, K]: out [M, D]."""
  del rings, axis_name, words
  return op_outputs(_mlp(x2, norm_params, k_in, k_out, casts, b_in, b_out,
                         Static(recipe, dtypes, norm, activation)))


# CastKernel: the kernel's 128 x 128 blocks (q [K, N], scale [K/128, N/128]), made once a step:
# a Quantized with data and scale.

def cast_fields(k: int, n: int) -> dict:
  """A ``CastKernel``'s FP8 fields under this family: name -> (dtype, shape) (None: absent)."""
  return {"q": (jnp.float8_e4m3fn, (k, n)), "qt": None,
          "scale": (jnp.float32, (k // blockwise.BLOCK, n // blockwise.BLOCK))}


def cast(kernel, ring, recipe, axis_name):
  """The ``Quantized`` blocks of ``kernel`` for a ``CastKernel`` (data, scale; no data_t: the
  blocks serve both GEMMs), and no observation."""
  del ring, axis_name
  return blockwise.block_quantize(kernel, **recipe.kwargs()), None


# Fp8Weight (inference): the kernel's blocks transposed, [N, K] with [ceil(N/128), K/128] scales.

def quantize_weight(kernel, recipe) -> Quantized:
  """``kernel`` [K, N] in 128 x 128 blocks, transposed: data [N, K], scale [N/128, K/128]."""
  qk = blockwise.block_quantize(kernel, **recipe.kwargs())  # [K, N], [K/128, N/128]
  return Quantized(data=qk.data.T, scale=qk.scale.T)


def weight_scale_shape(n: int, k: int) -> tuple:
  """The shape of an ``Fp8Weight``'s scale for an [N, K] weight: one per 128 x 128 block."""
  return (-(-n // blockwise.BLOCK), k // blockwise.BLOCK)


def weight_input(recipe, axis_name):
  """A function of (x2 [M, K], None: no ring) giving x2's ``Quantized`` (data [M, K], scale
  [M, K/128]) for the weights' GEMMs: x in 1 x 128 groups, as in training (the scales quantized
  in cuBLASLt's M-contiguous layout, transposed back)."""
  del axis_name

  def quantize_x(x2, x_ring):
    del x_ring
    qx = blockwise.group_quantize(x2, scale_layout="col", **recipe.kwargs())
    return Quantized(data=qx.data, scale=qx.scale.T)
  return quantize_x
