"""Cast-transpose: one read of x [R, C] writes both FP8 layouts that Hopper's TN-only FP8 GEMMs
need (the row-major copy for fprop / dgrad, the transposed one for wgrad), with the amax fused,
the scale ring moved by the kernel's last block, and optionally the bias gradient.

CUDA kernel: ``csrc/kernels/cast_transpose.cuh``; FFI handlers: ``csrc/ffi/cast_transpose_*``;
jnp twin: ``jax_fp8.reference.cast_transpose_delayed``; tests: ``tests/test_cast_transpose.py``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .. import _ffi, checks, sharding
from ..formats import fp8_dtype
from ..state import ScaleRing
from . import _ring

_TILE_ROWS = _ffi.CONSTANTS["dbias_tile_rows"]  # rows of one dbias partial (the kernel's tile)
_QT_ROWS = _ffi.CONSTANTS["qt_row_multiple"]  # qt's columns: R rounded up to this
_COLS = _ffi.CONSTANTS["col_multiple"]  # x's columns: whole 16-element vectors


class CastTransposed(NamedTuple):
  """``cast_transpose_delayed``'s result.

  Attributes:
    q: [R, C] FP8 in the ring's format.
    qt: [C, ceil16(R)] FP8, q.T with zero columns appended up to a multiple of 16 rows of x
      (so it feeds a GEMM contracting over R directly).
    amax: f32 [], max |x| (NaN if x has a NaN).
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
  if x.ndim != 2 or x.shape[1] <= 0 or x.shape[1] % _COLS:
    raise ValueError(f"x must be [R, C] with C a positive multiple of {_COLS}, got shape "
                     f"{x.shape}")
  leaves = _ring.check_ring(ring)
  with_dbias = checks.boolean(with_dbias, "with_dbias")
  observe = checks.boolean(observe, "observe")
  qdt = fp8_dtype(ring.fmt)

  def impl(x, *leaves):
    rows, cols = x.shape
    partial_rows, dbias_cols = (-(-rows // _TILE_ROWS), cols) if with_dbias else (0, 0)
    padded = -(-rows // _QT_ROWS) * _QT_ROWS
    q, qt, s, a, *moved, _, dbias, _ = jax.ffi.ffi_call(
        "jax_fp8_cast_transpose_ring",
        (jax.ShapeDtypeStruct(x.shape, qdt), jax.ShapeDtypeStruct((cols, padded), qdt))
        + _ring.kernel_results(leaves[0].shape[0])
        + (jax.ShapeDtypeStruct((partial_rows, dbias_cols), jnp.float32),  # dbias partials
           jax.ShapeDtypeStruct((dbias_cols,), jnp.float32), _ring.SCRATCH),
        vmap_method="sequential",
    )(x, *leaves, **_ring.kernel_attrs(ring, observe), with_dbias=with_dbias)
    return (q, qt, a, *moved, s) + ((dbias,) if with_dbias else ())

  def plan(mesh, shapes):
    # Rows split in multiples of 16 (qt's padding is then the global one), columns in
    # multiples of 16 (the kernel's); qt split as x transposed; the ring replicated.
    r, c = sharding.spec(shapes[0].sharding, 2)
    r, c = sharding.even(mesh, r, x.shape[0], _QT_ROWS), sharding.even(mesh, c, x.shape[1], _COLS)
    over = sharding.axes(r, c)

    def lower(x, *leaves):
      s, ring_in = _ring.sharded_scale(x, ring, leaves, over)
      # The kernel at scale s: a one-entry ring past its first step, whose update is dropped.
      outs = impl(x, jnp.zeros((1,), jnp.float32), s, jnp.ones((), jnp.float32))
      q, qt, a = outs[0], outs[1], sharding.pmax_keep_nan(outs[2], over)
      dbias = (jax.lax.psum(outs[7], sharding.axes(r)),) if with_dbias else ()
      return (q, qt, a) + _ring.moved(ring_in, a, observe) + (s,) + dbias
    rep = sharding.named(mesh)
    outs = (sharding.named(mesh, r, c), sharding.named(mesh, c, r)) + (rep,) * 5 + (
        (sharding.named(mesh, c),) if with_dbias else ())
    return lower, (sharding.named(mesh, r, c), rep, rep, rep), outs

  padded = x.shape[0] % _QT_ROWS != 0
  rule = f"r c, l, , -> r c, c {'p' if padded else 'r'}, , l, , , " + (", c" if with_dbias else "")
  outs = sharding.call("cast_transpose_delayed", impl, plan, rule, x, *leaves)
  q, qt, a, *moved = sharding.vary_like(outs, x, ring)
  dbias = moved.pop() if with_dbias else None
  s = moved.pop()
  return CastTransposed(q, qt, a, _ring.rebuild(ring, moved), dbias, s)
