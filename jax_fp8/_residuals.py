"""What jax_fp8's custom_vjps hand to a scan: residuals as 32-bit words, outputs behind a barrier.

Under ``lax.scan`` (``nn.scan`` over layers) each residual is stacked over the iterations into
a buffer that XLA first fills with zeros, one element a thread: for 1- and 2-byte elements (the
FP8 copies, the bf16 activations) that fill runs at a quarter and a half of the bandwidth a
4-byte one gets. A residual whose last axis is a whole number of 32-bit words is therefore
saved as uint32 words (``lax.bitcast_convert_type``: the same bytes, no copy) and viewed as its
own dtype again in the backward. Other leaves are saved as they are, and so is a residual that
is one of the rule's own inputs: JAX saves an input without a copy of its own (a scan reuses
its slice of xs), which a bitcast would defeat.

Under scan XLA's GPU compiler also lets a custom call write straight into the stacked buffer a
dynamic-update-slice puts its output in ("dynamic-slice fusion"). When that output is read by
other ops too, jaxlib 0.11.2's compiler runs the custom call a second time for the stack, so a
GEMM whose output the model also saves (a projection its attention keeps for the backward, or
a scan's ys) would run twice a layer, and so would a kernel whose residual the forward reads
(the MLP's pre-activation y, BlockScaling's kernel blocks). Both pass through an optimization
barrier, which that fusion does not look through, so XLA copies the value into its stack
instead: the ops' outputs through ``op_outputs``, those residuals through ``read_and_saved``.
The fusion also takes a custom call together with the slice of the scan's xs it reads (the
kernel's quantization reads its layer's slice of the stacked kernels); such a call whose output
had readers both before and behind the barrier ran twice too, so every reader of its output
takes it from behind the barrier (``families.block.kernel_saved``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_WORD = np.dtype(np.uint32).itemsize


@jax.tree_util.register_pytree_node_class
class _Words:
  """An array saved as uint32 words [..., n * itemsize / 4]; its dtype and shape are static."""

  def __init__(self, words, dtype, shape):
    self.words, self.dtype, self.shape = words, dtype, shape

  def tree_flatten(self):
    return (self.words,), (self.dtype, self.shape)

  @classmethod
  def tree_unflatten(cls, aux, children):
    return cls(children[0], *aux)


def _pack(a):
  if not isinstance(a, jax.Array) or a.ndim == 0 or a.dtype == jnp.bool_:
    return a
  size = a.dtype.itemsize
  if (jax.dtypes.itemsize_bits(a.dtype) != 8 * size or size >= _WORD
      or a.shape[-1] * size % _WORD):
    return a  # sub-byte elements (int4, e2m1), words already, or not whole words
  grouped = a.reshape(*a.shape[:-1], a.shape[-1] * size // _WORD, _WORD // size)
  return _Words(jax.lax.bitcast_convert_type(grouped, jnp.uint32), a.dtype, a.shape)


def _unpack(leaf):
  if not isinstance(leaf, _Words):
    return leaf
  return jax.lax.bitcast_convert_type(leaf.words, leaf.dtype).reshape(leaf.shape)


def op_outputs(ys):
  """The outputs of a jax_fp8 op, each behind its own optimization barrier (the module's
  docstring): the same values."""
  return jax.tree.map(jax.lax.optimization_barrier, ys)


def read_and_saved(v):
  """v, a residual that the forward also reads (the module's docstring): the same value,
  behind an optimization barrier."""
  return jax.lax.optimization_barrier(v)


def packed(fwd, bwd):
  """``(fwd, bwd)`` for ``custom_vjp.defvjp`` with the residuals saved as words: ``fwd(*args)
  -> (out, residuals)`` and ``bwd(*nondiff_args, residuals, cotangents)`` as custom_vjp calls
  them."""

  def packed_fwd(*args):
    out, residuals = fwd(*args)
    inputs = {id(v) for v in jax.tree.leaves(args)}
    return out, jax.tree.map(lambda v: v if id(v) in inputs else _pack(v), residuals)

  def packed_bwd(*args):
    *nondiff, residuals, cotangents = args
    residuals = jax.tree.map(_unpack, residuals, is_leaf=lambda v: isinstance(v, _Words))
    return bwd(*nondiff, residuals, cotangents)

  return packed_fwd, packed_bwd
