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

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, activations, checks, norms, sharding
from ..formats import amax, fp8_dtype
from ..state import ScaleRing
from . import _ring

_TILE_ROWS = _ffi.CONSTANTS["dbias_tile_rows"]  # rows of one dbias partial (the kernel's tile)
_QT_ROWS = _ffi.CONSTANTS["qt_row_multiple"]  # qt's columns: R rounded up to this
_COLS = _ffi.CONSTANTS["col_multiple"]  # x's columns: whole 16-element vectors


class CastTransposed(NamedTuple):
  """The result of ``cast_transpose_delayed`` and of the activation cast-transposes (x: what
  was quantized).

  Attributes:
    q: [R, C] FP8 in the ring's format.
    qt: [C, ceil16(R)] FP8, q.T with zero columns appended up to a multiple of 16 rows of x
      (so it feeds a GEMM contracting over R directly).
    amax: f32 [], max |x| (NaN if x has a NaN), of what was quantized.
    ring: the next ring, or with ``observe=True`` the ring's observation (state gradient).
    dbias: f32 [C], the column sums of x (the bias gradient when x is the output gradient),
      or None without ``with_dbias``.
    scale: f32 [], the scale q and qt were quantized with.
  """
  q: jax.Array
  qt: jax.Array
  amax: jax.Array
  ring: ScaleRing
  dbias: jax.Array | None
  scale: jax.Array


def cast_transpose_delayed(x: jax.Array, ring: ScaleRing, *, with_dbias: bool = False,
                           observe: bool = False) -> CastTransposed:
  """Delayed-scaling quantize of ``x [R, C]`` into both layouts from one read, as
  ``quantize_delayed`` for the scale and the ring.

  Args:
    x: [R, C] float32 / bfloat16 / float16, C a positive multiple of 16.
    ring: a ``ScaleRing``; its ``fmt`` is the output format.
    with_dbias: a bool; also return ``sum(x, axis=0)`` in f32 from the same read.
    observe: a bool; True returns the ring's observation of this step instead of the next ring
      (what ``jax_fp8.linear`` sends to ``update_state`` as the state gradient).
  Returns:
    ``CastTransposed(q, qt, amax, ring, dbias, scale)``.
  Raises:
    TypeError / ValueError at trace time: dtype, rank, C not a positive multiple of 16, ring
    not a valid ScaleRing, with_dbias or observe not a bool.
  """
  x = checks.float_input(x)
  _check_2d(x, "x", _COLS)
  return _cast_transpose("cast_transpose_delayed", x, None, ring, with_dbias, observe, None)


def activation_cast_transpose(y: jax.Array, ring: ScaleRing, *, activation: str,
                              observe: bool = False) -> CastTransposed:
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
    ``CastTransposed`` of the [R, C] activation (dbias None).
  Raises:
    TypeError / ValueError at trace time: dtype, rank, shape, unknown activation, ring,
    observe not a bool.

  The activation is computed with libm's exp and tanh by the CPU handler and with the GPU's
  hardware exp and reciprocal by the CUDA kernel: outputs match
  ``jax_fp8.reference.activation_cast_transpose`` within the bound of docs/design.md ("The
  fused MLP"), not byte for byte.
  """
  y = checks.float_input(y, "y")
  gated = activations.check(activation)[1]
  _check_2d(y, "y", 2 * _COLS if gated else _COLS,
            " ([gate | up] of a gated activation)" if gated else "")
  return _cast_transpose("activation_cast_transpose", y, None, ring, False, observe, activation)


def activation_grad_cast_transpose(dh: jax.Array, y: jax.Array, ring: ScaleRing, *,
                                   activation: str, with_dbias: bool = False,
                                   observe: bool = False) -> CastTransposed:
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
    ``CastTransposed`` of the gradient, y's shape ([R, 2C] = [dgate | dup] when gated).
  Raises:
    TypeError / ValueError at trace time: dtypes, ranks, shapes, unknown activation, ring,
    with_dbias or observe not a bool.

  Matches ``jax_fp8.reference.activation_grad_cast_transpose`` within the bound of
  docs/design.md ("The fused MLP"), as ``activation_cast_transpose`` does.
  """
  dh = checks.float_input(dh, "dh")
  y = checks.float_input(y, "y")
  gated = activations.check(activation)[1]
  _check_2d(dh, "dh", _COLS)
  if y.dtype != dh.dtype:
    raise TypeError(f"y must have dh's dtype {dh.dtype}, got {y.dtype}")
  want = (dh.shape[0], dh.shape[1] * (2 if gated else 1))
  if y.shape != want:
    raise ValueError(f"y must be {list(want)} for dh {list(dh.shape)} under {activation!r}, "
                     f"got {list(y.shape)}")
  return _cast_transpose("activation_grad_cast_transpose", dh, y, ring, with_dbias, observe,
                         activation)


def norm_cast_transpose(x: jax.Array, row_stats: jax.Array, gamma: jax.Array,
                        beta: jax.Array | None, ring: ScaleRing, *, norm: str,
                        observe: bool = False) -> CastTransposed:
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
    ``CastTransposed`` of the [R, C] norm (dbias None).
  Raises:
    TypeError / ValueError at trace time: dtypes, ranks, shapes, unknown norm, beta given to
    RMSNorm or missing for LayerNorm, ring, observe not a bool.

  Byte-identical to ``jax_fp8.reference.norm_cast_transpose`` on every platform (csrc/norm.h
  rounds each product and sum on its own).
  """
  x = checks.float_input(x)
  _check_2d(x, "x", _COLS)
  gamma, beta = norms.check_params(norm, gamma, beta, x.shape[1])
  row_stats = checks.array(row_stats, "row_stats")
  per_row = 2 if norms.centered(norm) else 1
  if row_stats.dtype != jnp.float32:
    raise TypeError(f"row_stats must be float32 (jax_fp8.norms.stats), got {row_stats.dtype}")
  if row_stats.shape != (x.shape[0], per_row):
    raise ValueError(f"row_stats must be [{x.shape[0]}, {per_row}] (jax_fp8.norms.stats under "
                     f"{norm!r}), got {list(row_stats.shape)}")
  affine = (jnp.stack([gamma, beta]) if beta is not None else gamma[None]).astype(jnp.float32)
  return _cast_transpose("norm_cast_transpose", x, None, ring, False, observe, None, norm,
                         row_stats, affine)


def _check_2d(x, name: str, multiple: int, what: str = "") -> None:
  if x.ndim != 2 or x.shape[1] <= 0 or x.shape[1] % multiple:
    raise ValueError(f"{name} must be [R, C]{what} with C a positive multiple of {multiple}, "
                     f"got shape {x.shape}")


def _cast_transpose(op, x, y, ring, with_dbias, observe, activation,
                    norm=None, row_stats=None, affine=None) -> CastTransposed:
  """The ops' kernel call: x quantized (activation and norm None), or the activation (a name of
  ``jax_fp8.activations``) of x, or with y the gradient through it (x = dh), or the norm (a
  name of ``jax_fp8.norms``) of x from its row_stats [R, S] and affine [S, C] (f32)."""
  leaves = _ring.check_ring(ring)
  with_dbias = checks.boolean(with_dbias, "with_dbias")
  observe = checks.boolean(observe, "observe")
  qdt = fp8_dtype(ring.fmt)
  act_id, gated = (activations.check(activation) if activation is not None else
                   (_ffi.CONSTANTS["activation_none"], False))
  norm_id = norms.check(norm) if norm is not None else _ffi.CONSTANTS["norm_none"]
  grad = y is not None
  plain = activation is None and norm is None
  out_cols = lambda x, y: (x.shape[1] if activation is None else y.shape[1] if grad  # noqa: E731
                           else x.shape[1] // 2 if gated else x.shape[1])
  rows, cols = x.shape[0], out_cols(x, y)
  inputs = (x, y) if grad else (x, row_stats, affine) if norm is not None else (x,)

  def impl(*args):
    x, leaves = args[0], args[len(inputs):]
    y = args[1] if grad else jnp.zeros((0,), x.dtype)
    st, af = args[1:3] if norm is not None else (jnp.zeros((0, 0), jnp.float32),) * 2
    rows, cols = x.shape[0], out_cols(x, y)  # of this piece, under a sharded jit
    partial_rows, dbias_cols = (-(-rows // _TILE_ROWS), cols) if with_dbias else (0, 0)
    padded = -(-rows // _QT_ROWS) * _QT_ROWS
    q, qt, s, a, *moved, _, dbias, _ = jax.ffi.ffi_call(
        "jax_fp8_cast_transpose_ring",
        (jax.ShapeDtypeStruct((rows, cols), qdt), jax.ShapeDtypeStruct((cols, padded), qdt))
        + _ring.kernel_results(leaves[0].shape[0])
        + (jax.ShapeDtypeStruct((partial_rows, dbias_cols), jnp.float32),  # dbias partials
           jax.ShapeDtypeStruct((dbias_cols,), jnp.float32), _ring.SCRATCH),
        vmap_method="sequential",
    )(x, y, st, af, *leaves, **_ring.kernel_attrs(ring, observe), with_dbias=with_dbias,
      activation=np.int64(act_id), gated=gated, grad=grad, norm=np.int64(norm_id))
    return (q, qt, a, *moved, s) + ((dbias,) if with_dbias else ())

  def plan(mesh, shapes):
    # Rows split in multiples of 16 (qt's padding is then the global one), columns in
    # multiples of 16 (the kernel's) where each output column needs only its own input
    # columns (not across a gated activation's [gate | up] halves; a norm's row statistics
    # come in whole); qt split as the output transposed; the ring replicated.
    r, c = sharding.spec(shapes[0].sharding, 2)
    r = sharding.even(mesh, r, rows, _QT_ROWS)
    c = None if gated else sharding.even(mesh, c, cols, _COLS)
    over = sharding.axes(r, c)

    def lower(*args):
      xs, leaves = args[:len(inputs)], args[len(inputs):]
      # A fresh ring's scale from the global amax: of x itself, or of the kernel's own values
      # (this piece run once at scale 1), so it is the scale one device's kernel would take.
      local_amax = (amax if plain else
                    lambda xs: impl(*xs, jnp.zeros((1,), jnp.float32), jnp.ones((), jnp.float32),
                                    jnp.ones((), jnp.float32))[2])
      s, ring_in = _ring.sharded_scale(xs[0] if plain else xs, ring, leaves, over, local_amax)
      # The kernel at scale s: a one-entry ring past its first step, whose update is dropped.
      outs = impl(*xs, jnp.zeros((1,), jnp.float32), s, jnp.ones((), jnp.float32))
      q, qt, a = outs[0], outs[1], sharding.pmax_keep_nan(outs[2], over)
      dbias = (jax.lax.psum(outs[7], sharding.axes(r)),) if with_dbias else ()
      return (q, qt, a) + _ring.moved(ring_in, a, observe) + (s,) + dbias
    rep = sharding.named(mesh)
    outs = (sharding.named(mesh, r, c), sharding.named(mesh, c, r)) + (rep,) * 5 + (
        (sharding.named(mesh, c),) if with_dbias else ())
    ins = ((sharding.named(mesh, r, c),) * len(inputs) if norm is None else
           (sharding.named(mesh, r, c), sharding.named(mesh, r, None),
            sharding.named(mesh, None, c)))
    return lower, ins + (rep, rep, rep), outs

  padded = rows % _QT_ROWS != 0
  p = "p" if padded else "r"
  if norm is not None:  # elementwise, given each row's statistics and each column's affine
    ins, out = "r c, r s, s c", "c"
  elif activation is None or not gated:  # elementwise: the columns of x (and y) are the output's
    ins, out = "r c" + (", r c" if grad else ""), "c"
  else:  # gated: output columns come from both halves of the input's
    ins, out = ("r h, r c" if grad else "r c2"), "c"
  rule = (f"{ins}, l, , -> r {out}, {out} {p}, , l, , , " + (f", {out}" if with_dbias else ""))
  outs = sharding.call(op, impl, plan, rule, *inputs, *leaves)
  q, qt, a, *moved = sharding.vary_like(outs, *inputs, ring)
  dbias = moved.pop() if with_dbias else None
  s = moved.pop()
  return CastTransposed(q, qt, a, _ring.rebuild(ring, moved), dbias, s)
