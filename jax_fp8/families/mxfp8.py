"""The MXFP8 family (``MXFP8BlockScaling``, OCP MX v1.0): stateless, every GEMM operand in
1 x 32 blocks along the GEMM's contraction dimension with E8M0 scales, each quantized from the
tensor itself in the direction its GEMM contracts (x along K for fprop and along M for wgrad,
the gradient along N and M, the kernel along K and N), both directions from one read. The GEMMs
are ``mxfp8_gemm`` (emulated on Hopper). M is padded with zero rows to whole blocks for wgrad.
The MLP is the composition of two linears and XLA's activation.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .._residuals import op_outputs, packed
from ..formats import MX_BLOCK
from ..ops.mxfp8 import mxfp8_gemm, mxfp8_quantize
from ..quantized import Quantized
from ._shared import bias_grad, pad_rows, split_output


@dataclasses.dataclass(frozen=True)
class Static:
  """What the rule is traced for: ``dtypes`` as the per-tensor family's."""

  dtypes: tuple


def _fprop(qx: Quantized, qk: Quantized, bias, m, dtype):
  y = mxfp8_gemm(qx.data, qk.data_t, qx.scale, qk.scale_t, out_dtype=jnp.float32)
  return (y[:m] if bias is None else y[:m] + bias.astype(jnp.float32)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _linear(x, kernels, biases, s: Static):
  # Without a gradient: x along K (rowwise) and each kernel along K (its columns) only.
  qx = mxfp8_quantize(x)
  return tuple(_fprop(qx, mxfp8_quantize(k, rowwise=False, columnwise=True), b, x.shape[0],
                      s.dtypes[1]) for k, b in zip(kernels, biases))


class LinearSaved(NamedTuple):
  """The linear rule's residuals."""

  x: Quantized  # x along M: data_t [K, M32], scale_t
  kernels: tuple  # Quantized per kernel: data [K, N], scale: along N, for dgrad


def _linear_fwd(x, kernels, biases, s: Static):
  qx = mxfp8_quantize(pad_rows(x, MX_BLOCK), columnwise=True)  # along K (fprop), M (wgrad)
  ys, saved = [], []
  for kernel, bias in zip(kernels, biases):
    qk = mxfp8_quantize(kernel, columnwise=True)  # along N (dgrad) and along K (fprop)
    ys.append(_fprop(qx, qk, bias, x.shape[0], s.dtypes[1]))
    saved.append(Quantized(data=qk.data, scale=qk.scale))
  return tuple(ys), LinearSaved(Quantized(data_t=qx.data_t, scale_t=qx.scale_t), tuple(saved))


def _linear_bwd(s: Static, res: LinearSaved, gs):
  x_dtype, _, k_dtypes, b_dtypes = s.dtypes
  dx, dks, dbs = None, [], []
  for g, qk, k_dtype, b_dtype in zip(gs, res.kernels, k_dtypes, b_dtypes):
    qg = mxfp8_quantize(pad_rows(g, MX_BLOCK), columnwise=True)  # along N (dgrad), M (wgrad)
    dxi = mxfp8_gemm(qg.data, qk.data, qg.scale, qk.scale, out_dtype=jnp.float32)  # [M32, K]
    dx = dxi if dx is None else dx + dxi
    dks.append(mxfp8_gemm(res.x.data_t, qg.data_t, res.x.scale_t, qg.scale_t,
                          out_dtype=k_dtype))  # [K, N]
    dbs.append(bias_grad(g, b_dtype))
  return dx[:gs[0].shape[0]].astype(x_dtype), tuple(dks), tuple(dbs)


_linear.defvjp(*packed(_linear_fwd, _linear_bwd))


def linear(x2, norm_params, kernels, casts, biases, rings, recipe, axis_name, dtypes, norm,
           words, split):
  """The family's MXFP8 linear of x2 [M, K] (the norm, if any, applied by XLA before): the
  outputs, cut by ``split``."""
  del norm_params, casts, rings, recipe, axis_name, norm, words
  return split_output(op_outputs(_linear(x2, kernels, biases, Static(dtypes))), split)
