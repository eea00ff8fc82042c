"""The one quantized-tensor type: ``Quantized``, what every quantize op of ``jax_fp8.ops`` and its
twin in ``jax_fp8.reference`` return, per-tensor FP8, 1 x 128 groups, 128 x 128 blocks, MXFP8
and NVFP4 alike; and ``DelayedQuantized``, the delayed-scaling ops' result (the tensor, the
moved scale ring and the bias gradient).

This module imports only jax, so the reference can share the type without importing the ops it
checks.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import jax

if TYPE_CHECKING:
  from .state import ScaleRing


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True, eq=False)
class Quantized:
  """A quantized tensor x [R, C] (or [..., C]): its data in one or both directions, their
  scales, and what the quantization measured. A pytree whose leaves are the fields that are
  not None (a None field is no leaf), so it passes through ``jit``, ``vmap``, ``scan`` and
  ``custom_vjp`` as its arrays do. Frozen, compared by identity (``eq=False``: fields are
  arrays); ``dataclasses.replace`` makes a copy with other fields.

  ``x ~= data * scale`` element by element, the scale broadcast over the elements it covers
  (``x ~= data * scale * global_scale`` for NVFP4). ``data_t`` holds x.T's quantization, the
  operand of a GEMM contracting over R (wgrad), with its own scales ``scale_t``.

  Fields by scaling (R, C: x's rows and columns; a field not listed is None):

  - Per-tensor (``quantize``, ``quantize_delayed``, the cast-transposes): ``data`` FP8 x's
    shape; ``scale`` f32 []; ``amax`` f32 [], max |x| (NaN if x has a NaN). The
    cast-transposes add ``data_t`` FP8 [C, ceil16(R)] (data.T with zero columns appended),
    which shares ``scale``: ``scale_t`` is None.
  - 1 x g groups, g = 128 by default (``group_quantize``): ``data`` FP8 [..., K]; ``scale`` f32
    [..., K/g] (or the "col" / "col_tma" layouts, ``group_quantize``'s docstring); UE8M0 scales
    are f32 powers of two. The group cast-transposes (1 x 128 and 128 x 1) add ``data_t`` FP8
    [C, ceil128(R)] and ``scale_t`` f32 [C, ceil128(R)/128]; ``scale`` is then [R, C/128].
  - 128 x 128 blocks (``block_quantize``): ``data`` FP8 [R, C]; ``scale`` f32
    [ceil(R/128), ceil(C/128)] (``data.T`` with ``scale.T`` is x.T's block quantization).
  - MXFP8 (``mxfp8_quantize``): ``data`` FP8 [R, C] and ``scale`` uint8 [R, C/32], E8M0 bytes
    (``x ~= data * 2**(scale - 127)``, 0xFF NaN); ``data_t`` [C, R] and ``scale_t`` uint8
    [C, R/32] with ``columnwise``.
  - NVFP4 (``nvfp4_quantize``): ``data`` uint8 [R, C/2], E2M1 codes packed two a byte (element
    2i in the low nibble of byte i, 2i + 1 in the high one); ``scale`` float8_e4m3fn [R, C/16];
    ``global_scale`` f32 [] (``amax / (448 * 6)``); ``data_t`` uint8 [C, R/2] and ``scale_t``
    [C, R/16] with ``columnwise``; ``global_scale_t`` f32 [], the Hadamard-transformed
    columnwise copy's own global scale (with ``rht``; None: ``data_t`` shares
    ``global_scale``).

  None means "not computed or not kept": a direction not asked for (``data`` / ``scale`` None
  for a columnwise-only quantization, ``data_t`` / ``scale_t`` None for a rowwise one), a
  transposed copy that shares the rowwise scale (``scale_t``, ``global_scale_t``), an amax the
  op does not measure (block-scaled formats), or a part a custom_vjp rule did not save.
  """

  data: jax.Array | None = None
  scale: jax.Array | None = None
  data_t: jax.Array | None = None
  scale_t: jax.Array | None = None
  global_scale: jax.Array | None = None
  global_scale_t: jax.Array | None = None
  amax: jax.Array | None = None


class DelayedQuantized(NamedTuple):
  """The result of the delayed-scaling ops (``quantize_delayed``, ``cast_transpose_delayed``,
  ``activation_cast_transpose``, ``activation_grad_cast_transpose``, ``norm_cast_transpose``),
  which move a scale ring as they quantize.

  Attributes:
    tensor: the ``Quantized`` tensor, per-tensor: ``data``, ``scale`` (f32 [], the ring's scale
      it was quantized with), ``amax`` (f32 [], of what was quantized), and from the
      cast-transposes ``data_t``.
    ring: the next ``ScaleRing`` (``jax_fp8.state.next_ring(ring, amax)``), or with
      ``observe=True`` the ring's observation of this step (the state gradient).
    dbias: f32 [C], the column sums of x (the bias gradient when x is an output gradient), or
      None without ``with_dbias``.
  """

  tensor: Quantized
  ring: ScaleRing
  dbias: jax.Array | None = None
