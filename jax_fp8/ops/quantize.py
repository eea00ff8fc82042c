"""Per-tensor FP8 quantization: ``quantize`` (a given scale), ``quantize_delayed`` (the scale
ring's, finalized by the kernel's last block) and ``dequantize``.

CUDA kernels: ``csrc/kernels/quantize.cuh``; FFI handlers: ``csrc/ffi/quantize_*``; jnp twins:
``jax_fp8.reference``; tests: ``tests/test_quantize.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import checks, sharding
from ..formats import FLOAT_DTYPES, fp8_dtype
from ..quantized import DelayedQuantized, Quantized
from ..state import ScaleRing
from . import _ring


def _plan_elementwise(mesh, shape, sharding_):
  """x's sharding kept where it splits evenly; the mesh axes it is split over."""
  xs = tuple(sharding.even(mesh, e, d) for e, d in zip(sharding.spec(sharding_, len(shape)),
                                                         shape))
  return xs, sharding.axes(*xs)


def quantize(x: jax.Array, scale: jax.Array, fmt: str = "e4m3") -> Quantized:
  """Per-tensor FP8 quantization with the amax fused in the same pass.

  ``q = saturate(round_nearest_even(x * (1 / scale)))``: values beyond the format's maximum
  (and +-inf) saturate to +-max, NaN stays NaN (canonical 0x7F).

  Args:
    x: any shape, float32 / bfloat16 / float16.
    scale: float32 scalar, the dequantization step (``x ~= q * scale``), a positive normal
      f32 (a Python or NumPy number is checked; a device array is read on the device only:
      a zero scale there turns zeros into NaN).
    fmt: "e4m3" (float8_e4m3fn, max 448) or "e5m2" (float8_e5m2, max 57344).
  Returns:
    ``Quantized``: ``data`` (x's shape, FP8), ``scale`` (the scale given, as an f32 array) and
    ``amax`` (f32 [], max |x|, NaN if x has one).
  Raises:
    TypeError / ValueError at trace time: x not a float array, scale not a float32 scalar (or
    a host number that is not a positive normal f32), an unknown format.
  """
  x = checks.float_input(x)
  scale = checks.scale_f32(scale, "scale")
  fp8_dtype(fmt)
  impl = lambda x, scale: quantize_kernel(x, scale, fmt)

  def plan(mesh, shapes):  # elementwise: x's sharding kept, the amax reduced over it
    xs, over = _plan_elementwise(mesh, x.shape, shapes[0].sharding)

    def lower(x, scale):
      q, a = impl(x, scale)
      return q, sharding.pmax_keep_nan(a, over)
    rep = sharding.named(mesh)
    return lower, (sharding.named(mesh, *xs), rep), (sharding.named(mesh, *xs), rep)

  f = sharding.factors("x", x.ndim)
  q, a = sharding.call("quantize", impl, plan, f"{f}, -> {f}, ", x, scale)
  q, a = sharding.vary_like((q, a), x, scale)
  return Quantized(data=q, scale=scale, amax=a)


def quantize_kernel(x: jax.Array, scale: jax.Array, fmt: str) -> tuple[jax.Array, jax.Array]:
  """The FFI call of ``quantize`` on checked arguments: (q, amax)."""
  q, a, _ = jax.ffi.ffi_call(
      "jax_fp8_quantize",
      (jax.ShapeDtypeStruct(x.shape, fp8_dtype(fmt)), jax.ShapeDtypeStruct((), jnp.float32),
       _ring.SCRATCH),
      vmap_method="sequential",
  )(x, scale)
  return q, a


def quantize_delayed(x: jax.Array, ring: ScaleRing, *, observe: bool = False) -> DelayedQuantized:
  """Delayed-scaling quantize: quantize with the ring's scale, and move the ring in the same
  kernel (its last block records the amax and publishes the next scale; no extra launch).

  On a fresh ring (``steps == 0``) the scale comes from the current amax instead (one extra
  read of x, on that step only).

  Args:
    x: any shape, float32 / bfloat16 / float16.
    ring: a ``ScaleRing``; its ``fmt`` is the output format.
    observe: a bool; False (default) returns the next ring, True the ring's observation of
      this step (the state gradient of ``jax_fp8.state``; for custom layers that follow
      ``jax_fp8.linear``'s state protocol).
  Returns:
    ``DelayedQuantized(tensor, ring, dbias=None)``: ``tensor`` a ``Quantized`` with ``data``
    (x's shape, FP8 in the ring's format), ``scale`` (f32 [], the scale it was quantized with)
    and ``amax`` (f32 [], max |x|, NaN if x has one); ``ring`` the next ring
    (``jax_fp8.state.next_ring(ring, amax)``), or with ``observe=True`` the ring's observation
    of this step (``jax_fp8.state.observe``, the state gradient).
  Raises:
    TypeError / ValueError at trace time: x not a float array, ring not a valid ScaleRing,
    observe not a bool.

  Method: delayed scaling from an amax history (Micikevicius et al., "FP8 Formats for Deep
  Learning", 2022; NVIDIA TransformerEngine's ``DelayedScaling``); the ring's rules are in
  ``jax_fp8.state``.
  """
  x = checks.float_input(x)
  leaves = _ring.check_ring(ring)
  observe = checks.boolean(observe, "observe")
  qdt = fp8_dtype(ring.fmt)

  def impl(x, *leaves):
    q, s, a, *moved, _ = jax.ffi.ffi_call(
        "jax_fp8_quantize_ring",
        (jax.ShapeDtypeStruct(x.shape, qdt),) + _ring.kernel_results(leaves[0].shape[0])
        + (_ring.SCRATCH,),
        vmap_method="sequential",
    )(x, *leaves, **_ring.kernel_attrs(ring, observe))
    return (q, a, *moved, s)

  def plan(mesh, shapes):  # x's sharding kept; the ring replicated and moved alike
    xs, over = _plan_elementwise(mesh, x.shape, shapes[0].sharding)

    def lower(x, *leaves):
      s, ring_in = _ring.sharded_scale(x, ring, leaves, over)
      q, a = quantize_kernel(x, s, ring.fmt)  # the stateless kernel at scale s
      a = sharding.pmax_keep_nan(a, over)
      return (q, a) + _ring.moved(ring_in, a, observe) + (s,)
    rep = sharding.named(mesh)
    return lower, (sharding.named(mesh, *xs),) + (rep,) * 3, (sharding.named(mesh, *xs),) + (
        rep,) * 5

  f = sharding.factors("x", x.ndim)
  outs = sharding.call("quantize_delayed", impl, plan, f"{f}, l, , -> {f}, , l, , , ", x, *leaves)
  q, a, *moved, s = sharding.vary_like(outs, x, ring)
  return DelayedQuantized(Quantized(data=q, scale=s, amax=a), _ring.rebuild(ring, moved))


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """``q * scale`` in ``dtype``. Plain XLA on purpose: it fuses into its consumer, so it costs
  no pass of its own (an FFI kernel could not fuse).

  Args:
    q: FP8 array (float8_e4m3fn or float8_e5m2), any shape.
    scale: float32 scalar (a Python or NumPy number: positive, normal, finite).
    dtype: output dtype (float32 / bfloat16 / float16).
  Raises:
    TypeError at trace time for other dtypes or a non-scalar scale; ValueError for a host
    scale that is not a positive normal f32.
  """
  q = checks.fp8_array(q, "q")
  scale = checks.scale_f32(scale, "scale")
  dtype = checks.dtype(dtype, "dtype", FLOAT_DTYPES)
  return (q.astype(jnp.float32) * scale).astype(dtype)
