"""The block family's grouped rules (``BlockScaling``, DeepSeek-V3, arXiv 2412.19437, section
3.3): the rows of x in consecutive groups, group g multiplied by expert kernel g, every GEMM a
block-scaled grouped FP8 GEMM (``grouped_gemm``, ``grouped_gemm_wgrad``), E4M3 throughout and
stateless.

Linear, forward: x is group cast-transposed (1 x 128 groups along K for the forward GEMM and,
from the same read, 128 x 1 groups along M written transposed for wgrad); the expert kernels
[G, K, N] are block-quantized as one [G K, N] tensor (K is a multiple of 128, so no 128 x 128
block straddles two experts and each expert's blocks are its own block quantization, in one
launch); then one grouped GEMM ``y = x @ kernels[g]`` per group against the blocks transposed,
each row's group's bias added in f32 before the output's one rounding. Backward: the output
gradient is group cast-transposed once and feeds dgrad (its 1 x 128 groups along N against the
kernels' blocks as they are) and wgrad (the 128-row groups of x and of the gradient along M);
dbias sums the gradient's rows per group in f32 (XLA). Only FP8 copies and their scales are
saved: x transposed and the kernels' blocks.

MLP (the gated expert MLP of a mixture of experts), as ``block``'s dense MLP: the up
projection as the linear's forward, then ``activation_group_cast_transpose`` reads its output y
once and writes ``act(y)`` in both directions' groups, the down projection's grouped GEMM on
its 1 x 128 groups; in the backward the down projection's dgrad dh and y are read once by
``activation_grad_group_cast_transpose``, which writes the up projection's output gradient for
its dgrad and wgrad. The bias gradients are XLA's per-group sums (the output gradient's rows,
and for bias_in the activation's gradient from dh and y, where a bias exists). Saved: x and
act(y) transposed, both kernels' blocks, and y in the compute dtype.

wgrad's 128-row groups must not straddle two experts, so every non-empty group starts at a
multiple of ``BLOCK_ROW_ALIGN`` (128) rows of the transposed copies. Where the caller has not
promised that (``aligned=False``), what each group cast-transpose reads (x, the output
gradient; y, and dh with y, in the MLP) is first laid out with each group's rows starting at a
multiple of 128 (``aligned_columns``: P = round_up(M + 127 G, 128) rows, zero rows between the
groups, which every cast here maps to zeros; a gather of each in its own dtype), since the
transposed copies' scales depend on where the groups lie; the forward and dgrad GEMMs take the
row-wise FP8 copies' rows back in x's order (a gather of FP8 bytes and their scales: a row's
1 x 128 groups are its own wherever it lies, so these are the bytes of its own group
quantization).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import activations
from .._residuals import op_outputs, packed, read_and_saved
from ..formats import BLOCK_ROW_ALIGN
from ..ops import blockwise
from ..ops.grouped_gemm import grouped_gemm, grouped_gemm_wgrad
from ..quantized import Quantized
from ._shared import aligned_positions, gemm_out, group_bias, group_bias_grad, wgrad_layout
from .block import transposed


@dataclasses.dataclass(frozen=True)
class Static:
  """What a rule is traced for (its one nondiff argument): the recipe; ``dtypes``, the linear's
  (x's, the output's, the kernels', the bias's or None) or the MLP's (x's, the output's,
  kernel_in's, kernel_out's, bias_in's, bias_out's, None for no bias); ``aligned``, the
  caller's promise that every non-empty group starts at a multiple of ``BLOCK_ROW_ALIGN``;
  ``activation``, the MLP's."""

  recipe: object
  dtypes: tuple
  aligned: bool
  activation: str | None = None


class Layout(NamedTuple):
  """Where the group cast-transposes of one rule read the grouped rows (``_layout``)."""

  src: jax.Array | None  # [P] the row each aligned position takes; None: the rows as they lie
  sizes: jax.Array  # [G] int32, the groups' sizes in the transposed copies' columns
  back: jax.Array | None  # [M] the aligned position of each row (P for a row in no group)


class Operand(NamedTuple):
  """A group cast-transposed tensor v [M, C] as the grouped GEMMs take it."""

  rows: Quantized  # data [M, C], scale [M, C/128], in v's row order
  t: Quantized  # data_t [C, P], scale_t [C, P/128], groups starting at multiples of 128
  sizes: jax.Array  # [G] int32, the groups' sizes in ``t``'s columns


def _layout(group_sizes, rows: int, aligned: bool) -> Layout:
  """The rule's layout of the grouped rows: as they lie where the groups start at multiples of
  ``BLOCK_ROW_ALIGN`` (``wgrad_layout``: the caller's promise, no rows or one group), else
  ``aligned_columns``' and its inverse."""
  src, sizes = wgrad_layout(group_sizes, rows, aligned, BLOCK_ROW_ALIGN)
  back = None if src is None else aligned_positions(group_sizes, rows, BLOCK_ROW_ALIGN)
  return Layout(src, sizes, back)


def _operand(cast, inputs, layout: Layout) -> Operand:
  """``cast(*inputs)``, a group cast-transpose of tensors whose rows are the grouped rows (x;
  the gradient; y; dh and y), for the grouped GEMMs: of the inputs as they lie, or of their
  rows moved into ``layout``'s aligned positions (zero rows between the groups), the row-wise
  copy's rows then taken back into the inputs' order."""
  if layout.src is None:
    q = cast(*inputs)  # [M, C], [C, M128]
    return Operand(Quantized(data=q.data, scale=q.scale), transposed(q), layout.sizes)
  q = cast(*(jnp.take(v, layout.src, axis=0, mode="fill", fill_value=0)
             for v in inputs))  # [P, C], [C, P]
  take = lambda a: jnp.take(a, layout.back, axis=0, mode="fill", fill_value=0)  # noqa: E731
  return Operand(Quantized(data=take(q.data), scale=take(q.scale)), transposed(q), layout.sizes)


def _group_cast(recipe):
  """x's or a gradient's group cast-transpose under ``recipe``."""
  return functools.partial(blockwise.group_cast_transpose, **recipe.kwargs())


def _kernels_fp8(kernels, recipe) -> Quantized:
  """The expert kernels [G, K, N] in 128 x 128 blocks, each its own: data [G, K, N], scale
  [G, K/128, N/128] (one block quantization of the [G K, N] stack), behind ``read_and_saved``
  (the forward GEMM reads them and the backward keeps them)."""
  groups, k, n = kernels.shape
  q = blockwise.block_quantize(kernels.reshape(groups * k, n), **recipe.kwargs())
  return read_and_saved(Quantized(data=q.data.reshape(groups, k, n),
                                  scale=q.scale.reshape(groups, k // blockwise.BLOCK, -1)))


def _fprop(qa: Quantized, qk: Quantized, bias, group_sizes, out_dtype) -> jax.Array:
  """The forward GEMM: qa.data [M, K] (scale [M, K/128]) against each row's expert's blocks
  qk [G, K, N] transposed, the bias [G, N] of each row's group (none for a row in no group)
  added in f32 before the one rounding to ``out_dtype``: [M, N]."""
  y = grouped_gemm(qa.data, jnp.swapaxes(qk.data, 1, 2), qa.scale, jnp.swapaxes(qk.scale, 1, 2),
                   group_sizes, out_dtype=gemm_out(out_dtype) if bias is None else jnp.float32)
  if bias is not None:
    y = y + group_bias(bias, group_sizes, qa.data.shape[0])
  return y.astype(out_dtype)


def _dgrad(qg: Quantized, qk: Quantized, group_sizes, dtype) -> jax.Array:
  """dgrad: the gradient's qg.data [M, N] (scale [M, N/128]) against each row's expert's blocks
  qk [G, K, N] as they are: [M, K] in ``dtype``."""
  return grouped_gemm(qg.data, qk.data, qg.scale, qk.scale, group_sizes,
                      out_dtype=gemm_out(dtype)).astype(dtype)  # dgrad [M, K]


def _wgrad(a: Quantized, b: Operand, dtype) -> jax.Array:
  """wgrad: ``d[g] = a[:, rows of g] @ b[:, rows of g].T`` of the transposed copies a.data_t
  [K, P] and b.t.data_t [N, P] (one layout, b's sizes): [G, K, N] in ``dtype``."""
  return grouped_gemm_wgrad(a.data_t, b.t.data_t, a.scale_t, b.t.scale_t, b.sizes,
                            out_dtype=gemm_out(dtype)).astype(dtype)  # wgrad [G, K, N]


def _check_kernels(**kernels) -> None:
  """ValueError where an expert stack's G K rows exceed what one block quantization takes."""
  for name, k in kernels.items():
    blockwise.check_rows(f"{name}, block-quantized as one [G K, N] tensor,",
                         k.shape[0] * k.shape[1])


# Linear.

class Saved(NamedTuple):
  """The linear rule's residuals."""

  x: Quantized  # x transposed in wgrad's layout: data_t [K, P], scale_t [K, P/128]
  kernels: Quantized  # data [G, K, N], scale [G, K/128, N/128]


def _forward(x, kernels, bias, group_sizes, s: Static):
  """y and what the backward needs."""
  qx = _operand(_group_cast(s.recipe), (x,), _layout(group_sizes, x.shape[0], s.aligned))
  qk = _kernels_fp8(kernels, s.recipe)  # [G, K, N], [G, K/128, N/128]
  y = _fprop(qx.rows, qk, bias, group_sizes, s.dtypes[1])  # [M, N]
  return y, Saved(qx.t, qk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _grouped_linear(x, kernels, bias, group_sizes, s: Static):
  return _forward(x, kernels, bias, group_sizes, s)[0]


def _grouped_linear_fwd(x, kernels, bias, group_sizes, s: Static):
  y, saved = _forward(x, kernels, bias, group_sizes, s)
  return y, (saved, group_sizes)


def _grouped_linear_bwd(s: Static, res, g):
  saved, group_sizes = res
  x_dtype, _, k_dtype, b_dtype = s.dtypes
  qg = _operand(_group_cast(s.recipe), (g,), _layout(group_sizes, g.shape[0], s.aligned))
  dx = _dgrad(qg.rows, saved.kernels, group_sizes, x_dtype)  # [M, K]
  dk = _wgrad(saved.x, qg, k_dtype)  # [G, K, N]
  return dx, dk, group_bias_grad(g, group_sizes, b_dtype), None


_grouped_linear.defvjp(*packed(_grouped_linear_fwd, _grouped_linear_bwd))


def grouped_linear(x, kernels, bias, group_sizes, rings, recipe, axis_name, dtypes, aligned):
  """The family's FP8 grouped linear of x [M, K] (in the compute dtype) against kernels
  [G, K, N] (no rings, no amax axes): y [M, N] in ``dtypes[1]``. ValueError where G K exceeds
  what one block quantization takes."""
  del rings, axis_name
  _check_kernels(kernels=kernels)
  return op_outputs(_grouped_linear(x, kernels, bias, group_sizes,
                                    Static(recipe, dtypes, aligned)))


# MLP.

class MlpSaved(NamedTuple):
  """The MLP rule's residuals."""

  x: Quantized  # x transposed in wgrad's layout: data_t [K, P], scale_t [K, P/128]
  k_in: Quantized  # data [G, K, N], scale [G, K/128, N/128]
  y: jax.Array  # the up projection's output [M, N], in the compute dtype
  h: Quantized  # act(y) transposed in wgrad's layout: data_t [F, P], scale_t [F, P/128]
  k_out: Quantized  # data [G, F, D], scale [G, F/128, D/128]


def _mlp_forward(x, k_in, k_out, b_in, b_out, group_sizes, s: Static):
  """out and what the backward needs."""
  out_dtype = s.dtypes[1]
  layout = _layout(group_sizes, x.shape[0], s.aligned)
  qx = _operand(_group_cast(s.recipe), (x,), layout)  # [M, K], [K, P]
  qk_in = _kernels_fp8(k_in, s.recipe)  # [G, K, N], [G, K/128, N/128]
  y = _fprop(qx.rows, qk_in, b_in, group_sizes, out_dtype)  # [M, N]
  act = functools.partial(blockwise.activation_group_cast_transpose, activation=s.activation,
                          **s.recipe.kwargs())
  qh = _operand(act, (y,), layout)  # [M, F], [F, P]
  qk_out = _kernels_fp8(k_out, s.recipe)  # [G, F, D], [G, F/128, D/128]
  out = _fprop(qh.rows, qk_out, b_out, group_sizes, out_dtype)  # [M, D]
  return out, MlpSaved(qx.t, qk_in, read_and_saved(y), qh.t, qk_out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def _grouped_mlp(x, k_in, k_out, b_in, b_out, group_sizes, s: Static):
  return _mlp_forward(x, k_in, k_out, b_in, b_out, group_sizes, s)[0]


def _grouped_mlp_fwd(x, k_in, k_out, b_in, b_out, group_sizes, s: Static):
  out, saved = _mlp_forward(x, k_in, k_out, b_in, b_out, group_sizes, s)
  return out, (saved, group_sizes)


def _grouped_mlp_bwd(s: Static, res, g):
  saved, group_sizes = res
  x_dtype, _, k_in_dtype, k_out_dtype, b_in_dtype, b_out_dtype = s.dtypes
  y = saved.y
  layout = _layout(group_sizes, g.shape[0], s.aligned)
  qg = _operand(_group_cast(s.recipe), (g,), layout)  # [M, D], [D, P]
  dh = _dgrad(qg.rows, saved.k_out, group_sizes, y.dtype)  # [M, F]
  dk_out = _wgrad(saved.h, qg, k_out_dtype)  # [G, F, D]
  act_grad = functools.partial(blockwise.activation_grad_group_cast_transpose,
                               activation=s.activation, **s.recipe.kwargs())
  qdy = _operand(act_grad, (dh, y), layout)  # [M, N], [N, P]
  dx = _dgrad(qdy.rows, saved.k_in, group_sizes, x_dtype)  # [M, K]
  dk_in = _wgrad(saved.x, qdy, k_in_dtype)  # [G, K, N]
  db_in = None if b_in_dtype is None else group_bias_grad(
      activations.grad(dh, y, s.activation), group_sizes, b_in_dtype)  # XLA's, from dh and y
  return dx, dk_in, dk_out, db_in, group_bias_grad(g, group_sizes, b_out_dtype), None


_grouped_mlp.defvjp(*packed(_grouped_mlp_fwd, _grouped_mlp_bwd))


def grouped_mlp(x, k_in, k_out, b_in, b_out, group_sizes, rings, recipe, activation, axis_name,
                dtypes, aligned):
  """The family's fused FP8 grouped MLP of x [M, K] (in the compute dtype) with kernel_in
  [G, K, N] and kernel_out [G, F, D] (no rings, no amax axes): out [M, D] in ``dtypes[1]``.
  ValueError where a kernel stack's G K or G F exceeds what one block quantization takes."""
  del rings, axis_name
  _check_kernels(kernel_in=k_in, kernel_out=k_out)
  return op_outputs(_grouped_mlp(x, k_in, k_out, b_in, b_out, group_sizes,
                                 Static(recipe, dtypes, aligned, activation)))
