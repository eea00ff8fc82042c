"""The NVFP4 family (``NVFP4BlockScaling``, NVIDIA's NVFP4 pretraining report, arXiv
2509.25149, section 4): stateless, a global amax per tensor and step. x along K (fprop, rounded
to nearest) and, through the random Hadamard transform, along M (wgrad); the kernel in 16 x 16
blocks (both directions then hold the same numbers); the gradient stochastically rounded along
N (dgrad) and, transformed, along M (wgrad). The GEMMs are ``nvfp4_gemm`` (emulated on Hopper).
M is padded with zero rows to whole blocks for wgrad. The global amaxes are reduced over the
amax axes as current scaling's are. The MLP is the composition of two linears and XLA's
activation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import sharding
from .._residuals import op_outputs, packed
from ..formats import NVFP4_BLOCK, amax, as_f32
from ..hadamard import hadamard_amax
from ..ops.nvfp4 import nvfp4_gemm, nvfp4_quantize
from ..quantized import Quantized
from ._shared import bias_grad, pad_rows, split_output


@dataclasses.dataclass(frozen=True)
class Static:
  """What the rule is traced for: the recipe, the amax axes, ``dtypes`` as the per-tensor
  family's."""

  recipe: object
  axis_name: tuple[str, ...] | None
  dtypes: tuple


def _rht(recipe) -> dict:
  """nvfp4_quantize's transform arguments for the wgrad operands' copies along M."""
  return {"rht": True, "rht_seed": recipe.rht_seed} if recipe.rht else {}


def _wgrad_copy(q: Quantized) -> Quantized:
  """What the backward keeps of an operand for wgrad: its copy along M (data_t, scale_t) with
  that copy's global scale (the transformed copy's own ``global_scale_t`` under the recipe's
  rht, else ``global_scale``)."""
  if q.global_scale_t is not None:
    return Quantized(data_t=q.data_t, scale_t=q.scale_t, global_scale_t=q.global_scale_t)
  return Quantized(data_t=q.data_t, scale_t=q.scale_t, global_scale=q.global_scale)


def _wgrad_global_scale(q: Quantized):
  """The global scale of ``q``'s copy along M (``_wgrad_copy``)."""
  return q.global_scale if q.global_scale_t is None else q.global_scale_t


def _amaxes(v, recipe, axis_name, transformed: bool):
  """nvfp4_quantize's global amax arguments for v: None (v's own) outside ``axis_name``, else
  v's amax (and its transformed copy's, ``transformed``) max-reduced over the axes."""
  if axis_name is None:
    return {}
  out = {"global_amax": sharding.pmax_keep_nan(amax(v), axis_name)}
  if transformed:
    out["global_amax_t"] = sharding.pmax_keep_nan(
        hadamard_amax(as_f32(v), recipe.rht_seed, axis=0), axis_name)
  return out


def _quantize_x(x, recipe, axis_name, with_grad: bool):
  """x [M, K] quantized along K (fprop, rounded to nearest) and, ``with_grad``, along M for
  wgrad (M padded to 16, through the Hadamard transform under ``recipe.rht``)."""
  if not with_grad:
    return nvfp4_quantize(x, **_amaxes(x, recipe, axis_name, False))
  x = pad_rows(x, NVFP4_BLOCK)
  return nvfp4_quantize(x, columnwise=True, **_rht(recipe),
                        **_amaxes(x, recipe, axis_name, recipe.rht))


def _quantize_kernel(kernel, recipe, axis_name, with_grad: bool):
  """The kernel [K, N] along K (fprop: ``data_t``) and, ``with_grad``, along N (dgrad:
  ``data``), in 16 x 16 blocks under ``recipe.weight_block_2d``, rounded to nearest."""
  return nvfp4_quantize(kernel, rowwise=with_grad, columnwise=True,
                        block_2d=recipe.weight_block_2d,
                        **_amaxes(kernel, recipe, axis_name, False))


def _fprop(qx: Quantized, qk: Quantized, bias, m, dtype):
  y = nvfp4_gemm(qx.data, qk.data_t, qx.scale, qk.scale_t, qx.global_scale, qk.global_scale,
                 out_dtype=jnp.float32)[:m]
  return (y if bias is None else y + bias.astype(jnp.float32)).astype(dtype)


def fold_key(words, data):
  """Threefry key words (uint32 [2]) folded with ``data`` (an int or an int32 scalar), as
  ``jax.random.fold_in`` folds a threefry key, whatever the default PRNG implementation."""
  key = jax.random.wrap_key_data(words, impl="threefry2x32")
  return jax.random.key_data(jax.random.fold_in(key, data))


def gradient_key(words, i, g, axis_name):
  """The key of kernel i's gradient g: the call's key folded with i, then with this device's
  index along the axes g varies over (under a typed shard_map; under pmap or an untyped
  shard_map, where the types tell nothing, along ``axis_name``), so that devices holding
  different rows or columns of a gradient draw different bits at the same local coordinates
  and replicas of one gradient draw the same."""
  words = fold_key(words, i)
  axes = tuple(sorted(sharding.varying_axes(g))) or axis_name
  return words if not axes else fold_key(words, jax.lax.axis_index(axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _linear(x, kernels, biases, words, s: Static):
  qx = _quantize_x(x, s.recipe, s.axis_name, False)
  return tuple(_fprop(qx, _quantize_kernel(k, s.recipe, s.axis_name, False), b, x.shape[0],
                      s.dtypes[1]) for k, b in zip(kernels, biases))


class LinearSaved(NamedTuple):
  """The linear rule's residuals."""

  x: Quantized  # x along M: data_t, scale_t and their global scale (``_wgrad_copy``)
  kernels: tuple  # Quantized per kernel: data, scale, global_scale: along N, for dgrad
  words: jax.Array | None  # the call's key words


def _linear_fwd(x, kernels, biases, words, s: Static):
  qx = _quantize_x(x, s.recipe, s.axis_name, True)
  ys, saved = [], []
  for kernel, bias in zip(kernels, biases):
    qk = _quantize_kernel(kernel, s.recipe, s.axis_name, True)
    ys.append(_fprop(qx, qk, bias, x.shape[0], s.dtypes[1]))
    saved.append(Quantized(data=qk.data, scale=qk.scale, global_scale=qk.global_scale))
  return tuple(ys), LinearSaved(_wgrad_copy(qx), tuple(saved), words)


def _linear_bwd(s: Static, res: LinearSaved, gs):
  recipe, axis_name = s.recipe, s.axis_name
  qx = res.x
  x_dtype, _, k_dtypes, b_dtypes = s.dtypes
  if recipe.stochastic_rounding and res.words is None:
    raise ValueError("NVFP4BlockScaling(stochastic_rounding=True) rounds the gradients at "
                     "random: pass key= (a fresh jax.random key each step) to linear / "
                     "multi_linear / mlp, or rngs={'stochastic_rounding': key} to a Flax "
                     "layer's apply (under nn.scan / nn.vmap also split_rngs="
                     "{'stochastic_rounding': True})")
  dx, dks, dbs = None, [], []
  for i, (g, qk, k_dtype, b_dtype) in enumerate(zip(gs, res.kernels, k_dtypes, b_dtypes)):
    m, g16 = g.shape[0], pad_rows(g, NVFP4_BLOCK)
    sr = ({"stochastic_rounding": True, "key": gradient_key(res.words, i, g, axis_name)}
          if recipe.stochastic_rounding else {})
    qg = nvfp4_quantize(g16, columnwise=True, **sr, **_rht(recipe),
                        **_amaxes(g16, recipe, axis_name, recipe.rht))  # along N and M
    dxi = nvfp4_gemm(qg.data, qk.data, qg.scale, qk.scale, qg.global_scale, qk.global_scale,
                     out_dtype=jnp.float32)[:m]  # dgrad [M, K]
    dx = dxi if dx is None else dx + dxi
    dks.append(nvfp4_gemm(qx.data_t, qg.data_t, qx.scale_t, qg.scale_t, _wgrad_global_scale(qx),
                          _wgrad_global_scale(qg), out_dtype=k_dtype))  # wgrad [K, N]
    dbs.append(bias_grad(g, b_dtype))
  return dx.astype(x_dtype), tuple(dks), tuple(dbs), None


_linear.defvjp(*packed(_linear_fwd, _linear_bwd))


def linear(x2, norm_params, kernels, casts, biases, rings, recipe, axis_name, dtypes, norm,
           words, split):
  """The family's NVFP4 linear of x2 [M, K] (the norm, if any, applied by XLA before; ``words``:
  the key words of the gradients' stochastic rounding, or None): the outputs, cut by
  ``split``."""
  del norm_params, casts, rings, norm
  ys = _linear(x2, kernels, biases, words, Static(recipe, axis_name, dtypes))
  return split_output(op_outputs(ys), split)
