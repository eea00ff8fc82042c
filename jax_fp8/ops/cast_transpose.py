"""Cast-transpose: one read of x [R, C] writes both FP8 layouts that Hopper's TN-only FP8 GEMMs
need (the row-major copy for fprop / dgrad, the transposed one for wgrad), with the amax fused,
the scale ring moved by the kernel's last block, and optionally the bias gradient. The same
kernel can quantize an MLP's activation of x (``activation_cast_transpose``), the gradient
through it (``activation_grad_cast_transpose``) or a norm of x (``norm_cast_transpose``), so
none of them costs a pass of its own.

CUDA kernel: ``csrc/kernels/cast_transpose.cuh``; FFI handlers: ``csrc/ffi/cast_transpose_*``;
activations: ``csrc/activation.h`` and ``jax_fp8.activations``; norms: ``csrc/norm.h`` and
``jax_fp8.norms``; jnp twins: ``jax_fp8.reference.cast_transpose_delayed`` /
``activation_cast_transpose`` / ``activation_grad_cast_transpose`` / ``norm_cast_transpose``;
tests: ``tests/test_cast_transpose.py``, ``tests/test_activation.py``, ``tests/test_norm.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import _ffi, checks, sharding
from ..formats import amax_of_parts, fp8_dtype
from ..quantized import DelayedQuantized, Quantized
from ..state import ScaleRing
from . import _ring, sources

_TILE_ROWS = _ffi.CONSTANTS["dbias_tile_rows"]  # rows of one dbias partial (the kernel's tile)
QT_ROW_MULTIPLE = _ffi.CONSTANTS["qt_row_multiple"]  # qt's columns: R rounded up to this
_COLS = sources.COL_MULTIPLE  # x's columns


def cast_transpose_delayed(x, ring: ScaleRing, *, with_dbias: bool = False,
                           observe: bool = False) -> DelayedQuantized:
  """Delayed-scaling quantize of ``x [R, C]`` into both layouts from one read, as
  ``quantize_delayed`` for the scale and the ring.

  Args:
    x: [R, C] float32 / bfloat16 / float16, C a positive multiple of 16; or x in parts, a
      tuple / list of 1 to 4 arrays [R, C_i] of one dtype, each C_i a positive multiple of 16,
      quantized as their concatenation [R, sum C_i] (which is never stored: the kernel reads
      each part where it lies), e.g. the gradients of q, k and v from one projection. (A
      list of Python rows, no arrays in it, is one array, as elsewhere.)
    ring: a ``ScaleRing``; its ``fmt`` is the output format.
    with_dbias: a bool; also return ``sum(x, axis=0)`` in f32 from the same read.
    observe: a bool; True returns the ring's observation of this step instead of the next ring
      (what ``jax_fp8.linear`` sends to ``update_state`` as the state gradient).
  Returns:
    ``DelayedQuantized(tensor, ring, dbias)``: ``tensor`` a ``Quantized`` with ``data`` [R, C]
    FP8 in the ring's format, ``data_t`` [C, ceil16(R)] FP8 (data.T with zero columns appended
    up to a multiple of 16 rows of x, so it feeds a GEMM contracting over R directly), ``scale``
    (f32 [], the scale both were quantized with; ``scale_t`` None) and ``amax`` (f32 [], max
    |x|, NaN if x has a NaN); ``ring`` the next ring, or with ``observe=True`` the ring's
    observation (state gradient); ``dbias`` f32 [C], the column sums of x, or None without
    ``with_dbias``.
  Raises:
    TypeError / ValueError at trace time: dtype, rank, C not a positive multiple of 16, parts
    of different dtypes or row counts, none or more than 4 of them, ring not a valid
    ScaleRing, with_dbias or observe not a bool.

  Under ``jax.vmap`` (this op and the three below) each slice is quantized on its own, with its
  own amax and ring (e.g. a stack of expert kernels [G, K, N] with a stacked ring), all in one
  call that writes the stacked outputs in place.

  Method: TransformerEngine's cast-transpose (both FP8 layouts a linear's GEMMs read, from one
  read of x), with ``quantize_delayed``'s delayed scaling.
  """
  source = sources.parts(x, _COLS) if sources.in_parts(x) else sources.plain(x, _COLS)
  return _cast_transpose("cast_transpose_delayed", source, ring, with_dbias, observe)


def activation_cast_transpose(y: jax.Array, ring: ScaleRing, *, activation: str,
                              observe: bool = False) -> DelayedQuantized:
  """``cast_transpose_delayed`` of ``activation(y)`` (``jax_fp8.activations``), computed in f32
  inside the kernel from one read of the pre-activation y: an MLP's hidden activation written
  straight into the down projection's FP8 inputs, never stored in y's dtype.

  Args:
    y: [R, C] float32 / bfloat16 / float16 (gated activations: [R, 2C] = [gate | up]), C a
      positive multiple of 16.
    ring: a ``ScaleRing``; its ``fmt`` is the output format.
    activation: "silu", "gelu", "swiglu" or "geglu".
    observe: as in ``cast_transpose_delayed``.
  Returns:
    ``DelayedQuantized`` of the [R, C] activation, as ``cast_transpose_delayed`` (dbias None).
  Raises:
    TypeError / ValueError at trace time: dtype, rank, shape, unknown activation, ring,
    observe not a bool.

  The activation is computed with libm's exp and tanh by the CPU handler and with the GPU's
  hardware exp and reciprocal by the CUDA kernel: outputs match
  ``jax_fp8.reference.activation_cast_transpose`` within the bound of docs/design.md ("The
  fused MLP"), not byte for byte.

  Method: the activations of ``jax_fp8.activations`` (their papers named there), fused with
  the cast-transpose as TransformerEngine fuses its activation casts.
  """
  return _cast_transpose("activation_cast_transpose", sources.activation(y, activation, _COLS),
                         ring, False, observe)


def activation_grad_cast_transpose(dh: jax.Array, y: jax.Array, ring: ScaleRing, *,
                                   activation: str, with_dbias: bool = False,
                                   observe: bool = False) -> DelayedQuantized:
  """``cast_transpose_delayed`` of the gradient through ``activation`` (``jax_fp8.activations
  .grad``), computed in f32 inside the kernel from ``dh`` and the pre-activation ``y``: the
  up projection's FP8 output gradient in both layouts from one read of each, with its amax and
  optionally its column sums (the up projection's bias gradient).

  Args:
    dh: [R, C] float32 / bfloat16 / float16, the activation output's gradient; C a positive
      multiple of 16.
    y: the pre-activation, dh's dtype: [R, C], or [R, 2C] ([gate | up]) for a gated
      activation.
    ring: a ``ScaleRing``; its ``fmt`` is the output format (E5M2 under HYBRID).
    activation: "silu", "gelu", "swiglu" or "geglu".
    with_dbias, observe: as in ``cast_transpose_delayed``.
  Returns:
    ``DelayedQuantized`` of the gradient, as ``cast_transpose_delayed``: y's shape ([R, 2C] =
    [dgate | dup] when gated).
  Raises:
    TypeError / ValueError at trace time: dtypes, ranks, shapes, unknown activation, ring,
    with_dbias or observe not a bool.

  Matches ``jax_fp8.reference.activation_grad_cast_transpose`` within the bound of
  docs/design.md ("The fused MLP"), as ``activation_cast_transpose`` does.
  """
  return _cast_transpose("activation_grad_cast_transpose",
                         sources.activation_grad(dh, y, activation, _COLS), ring, with_dbias,
                         observe)


def norm_cast_transpose(x: jax.Array, row_stats: jax.Array, gamma: jax.Array,
                        beta: jax.Array | None, ring: ScaleRing, *, norm: str,
                        observe: bool = False) -> DelayedQuantized:
  """``cast_transpose_delayed`` of the norm of x (``jax_fp8.norms``), computed in f32 inside
  the kernel from one read of x and its row statistics: a layer's input norm written straight
  into its GEMM's FP8 inputs, never stored in x's dtype.

  Args:
    x: [R, C] float32 / bfloat16 / float16, C a positive multiple of 16.
    row_stats: f32 [R, S], ``jax_fp8.norms.stats(x, norm, epsilon)``: RMSNorm [rsigma] (S = 1),
      LayerNorm [mu, rsigma] (S = 2).
    gamma: [C] float32 / bfloat16 / float16.
    beta: [C] for LayerNorm, None for RMSNorm.
    ring: a ``ScaleRing``; its ``fmt`` is the output format.
    norm: "rmsnorm" or "layernorm".
    observe: as in ``cast_transpose_delayed``.
  Returns:
    ``DelayedQuantized`` of the [R, C] norm, as ``cast_transpose_delayed`` (dbias None).
  Raises:
    TypeError / ValueError at trace time: dtypes, ranks, shapes, unknown norm, beta given to
    RMSNorm or missing for LayerNorm, ring, observe not a bool.

  Byte-identical to ``jax_fp8.reference.norm_cast_transpose`` on every platform (csrc/norm.h
  rounds each product and sum on its own).

  Method: RMSNorm after Zhang & Sennrich (2019), LayerNorm after Ba et al. (2016), fused with
  the cast-transpose as TransformerEngine's ``LayerNormLinear`` fuses its norm.
  """
  return _cast_transpose("norm_cast_transpose",
                         sources.norm(x, row_stats, gamma, beta, norm, _COLS), ring, False,
                         observe)


def _cast_transpose(op, source: sources.Source, ring, with_dbias, observe) -> DelayedQuantized:
  """The ops' kernel call on a checked source (``jax_fp8.ops.sources``)."""
  leaves = _ring.check_ring(ring)
  with_dbias = checks.boolean(with_dbias, "with_dbias")
  observe = checks.boolean(observe, "observe")
  qdt = fp8_dtype(ring.fmt)
  inputs = source.inputs
  rows, cols = source.shape(*inputs)

  def impl(*args):
    ins, leaves = args[:len(inputs)], args[len(inputs):]
    rows, cols = source.shape(*ins)  # of this piece, under a sharded jit
    partial_rows, dbias_cols = (-(-rows // _TILE_ROWS), cols) if with_dbias else (0, 0)
    padded = -(-rows // QT_ROW_MULTIPLE) * QT_ROW_MULTIPLE
    q, qt, s, a, *moved, _, dbias, _ = jax.ffi.ffi_call(
        "jax_fp8_cast_transpose_ring",
        (jax.ShapeDtypeStruct((rows, cols), qdt), jax.ShapeDtypeStruct((cols, padded), qdt))
        + _ring.kernel_results(leaves[0].shape[0])
        + (jax.ShapeDtypeStruct((partial_rows, dbias_cols), jnp.float32),  # dbias partials
           jax.ShapeDtypeStruct((dbias_cols,), jnp.float32), _ring.SCRATCH),
        vmap_method="expand_dims",  # one call for a batch (csrc/ffi/items.h)
    )(*source.kernel_args(*ins), *leaves, *source.more_parts(*ins),
      **_ring.kernel_attrs(ring, observe),
      with_dbias=with_dbias, **source.attrs())
    return (q, qt, a, *moved, s) + ((dbias,) if with_dbias else ())

  def plan(mesh, shapes):
    # Rows split in multiples of 16 (qt's padding is then the global one), columns in
    # multiples of 16 (the kernel's) where the source allows it; qt split as the output
    # transposed; the ring replicated.
    r, c = sharding.spec(shapes[0].sharding, 2)
    r = sharding.even(mesh, r, rows, QT_ROW_MULTIPLE)
    c = sharding.even(mesh, c, cols, _COLS) if source.splits_columns() else None
    over = sharding.axes(r, c)

    def lower(*args):
      xs, leaves = args[:len(inputs)], args[len(inputs):]
      # A fresh ring's scale from the global amax: of x itself, or of the kernel's own values
      # (this piece run once at scale 1), so it is the scale one device's kernel would take.
      local_amax = (amax_of_parts if source.plain else
                    lambda xs: impl(*xs, jnp.zeros((1,), jnp.float32), jnp.ones((), jnp.float32),
                                    jnp.ones((), jnp.float32))[2])
      s, ring_in = _ring.sharded_scale(xs, ring, leaves, over, local_amax)
      # The kernel at scale s: a one-entry ring past its first step, whose update is dropped.
      outs = impl(*xs, jnp.zeros((1,), jnp.float32), s, jnp.ones((), jnp.float32))
      q, qt, a = outs[0], outs[1], sharding.pmax_keep_nan(outs[2], over)
      dbias = (jax.lax.psum(outs[7], sharding.axes(r)),) if with_dbias else ()
      return (q, qt, a) + _ring.moved(ring_in, a, observe) + (s,) + dbias
    rep = sharding.named(mesh)
    outs = (sharding.named(mesh, r, c), sharding.named(mesh, c, r)) + (rep,) * 5 + (
        (sharding.named(mesh, c),) if with_dbias else ())
    return lower, source.shardings(mesh, r, c) + (rep, rep, rep), outs

  padded = rows % QT_ROW_MULTIPLE != 0
  p = "p" if padded else "r"
  rule = f"{source.rule('r', 'c')}, l, , -> r c, c {p}, , l, , , " + (", c" if with_dbias else "")
  outs = sharding.call(op, impl, plan, rule, *inputs, *leaves)
  q, qt, a, *moved = sharding.vary_like(outs, *inputs, ring)
  dbias = moved.pop() if with_dbias else None
  s = moved.pop()
  return DelayedQuantized(Quantized(data=q, scale=s, data_t=qt, amax=a),
                          _ring.rebuild(ring, moved), dbias)
