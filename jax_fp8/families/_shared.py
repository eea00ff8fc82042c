"""What several families' rules share: the input norm's two ends, the output cut by ``split``,
zero rows for whole blocks along M, the bias gradient by XLA, the ``CastKernel`` counts, and the
rows' groups of a grouped linear."""

from __future__ import annotations

import itertools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import norms
from ..ops.grouped_gemm import group_bounds
from ..quantized import Quantized


class Cast(NamedTuple):
  """A ``CastKernel`` as a family's rules take it (``cast_kernel.check_cast``): the kernel's FP8
  copies and ``uses``, the zero whose gradient counts the layers' FP8 uses of the cast."""

  fp8: Quantized
  uses: jax.Array


def normalized(x, norm_params, norm):
  """x's norm by XLA in f32 (``norm``: (name, epsilon)), or x without one."""
  if norm is None:
    return x
  return norms.normalize(x, *norm_params, norm=norm[0], epsilon=norm[1])


def input_grad(dx, normed, norm, x_dtype):
  """(dx, the norm parameters' gradients) from the gradient of the GEMMs' input: through the
  norm (its jnp backward, which XLA fuses; ``normed``: the residual (x, norm_params)), or dx
  itself in x's dtype without one."""
  if norm is None:
    return dx.astype(x_dtype), (None, None)
  x, norm_params = normed
  name, epsilon = norm
  _, vjp = jax.vjp(lambda x, g, b: norms.normalize(x, g, b, norm=name, epsilon=epsilon), x,
                   *norm_params)
  dx, *grads = vjp(dx.astype(jnp.float32))
  return dx, tuple(grads)


def normed_residual(x, norm_params, norm):
  """What the backward of a fused norm needs: (x, norm_params), or None without a norm."""
  return None if norm is None else (x, norm_params)


def split_output(ys, split):
  """The one output of ``ys`` cut along its last axis into parts of ``split``'s sizes (None:
  ys as they are)."""
  if split is None:
    return ys
  return tuple(jnp.split(ys[0], list(itertools.accumulate(split))[:-1], axis=-1))


def pad_rows(v, multiple: int):
  """v [M, C] with zero rows appended up to a multiple of ``multiple``: whole MXFP8 / NVFP4
  blocks along M for wgrad. Zeros change no block's amax and add nothing to a sum; NVFP4's
  Hadamard transform, the same on both wgrad operands, cancels in their product whatever the
  rows hold."""
  return jnp.pad(v, ((0, -v.shape[0] % multiple), (0, 0)))


def bias_grad(g, b_dtype):
  """dbias, the column sums of g [M, N] in f32 by XLA, in the bias's dtype (None without a
  bias)."""
  return None if b_dtype is None else jnp.sum(g.astype(jnp.float32), axis=0).astype(b_dtype)


def cast_uses(casts):
  """The ``uses`` of a layer's ``casts`` (each None or a ``Cast``), kept as residuals for
  ``cast_grads``."""
  return tuple(None if c is None else c.uses for c in casts)


def cast_grads(uses):
  """The cotangent of a layer's ``casts`` in its backward, from their ``cast_uses``: one use
  each, none for the FP8 copies."""
  return tuple(None if u is None else Cast(None, jnp.ones_like(u)) for u in uses)


def row_groups(group_sizes, rows: int) -> jax.Array:
  """int32 [rows]: each row's group under ``group_sizes`` [G] (``grouped_gemm``'s groups:
  consecutive from row 0, a negative size counted as 0, clipped to ``rows``), G for a row in no
  group."""
  _, end = group_bounds(group_sizes, rows)
  return jnp.searchsorted(end, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def group_bias(bias, group_sizes, rows: int) -> jax.Array:
  """f32 [rows, N]: the bias [G, N] of each row's group, zero for a row in no group."""
  table = jnp.concatenate([bias.astype(jnp.float32), jnp.zeros((1, bias.shape[1]), jnp.float32)])
  return table[row_groups(group_sizes, rows)]
