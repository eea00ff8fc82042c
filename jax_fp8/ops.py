"""Stateless FP8 primitives: validate, shape the results, call the FFI target.

Each op has a plain-jnp twin of the same name in ``jax_fp8.reference`` (the spec and test
oracle). CUDA kernels: ``csrc/kernels``; FFI handlers: ``csrc/ffi``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi  # registers the FFI targets
from . import reference, sharding
from .sharding import varying_axes
from .scaling import MAX_HISTORY, ScaleRing, fp8_dtype, next_ring, scale_for_step

_FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
_SCRATCH = jax.ShapeDtypeStruct((3,), jnp.uint32)  # QuantizeScratch in csrc/kernels/quantize.cuh
_GEMM_WORKSPACE = jax.ShapeDtypeStruct((32 << 20,), jnp.uint8)  # cuBLASLt workspace
_ALGO_ID = {"max": 0, "most_recent": 1}


def _vary_like(outs, *ins):
  """Mark FFI results as varying over the shard_map axes their inputs vary over: each device
  computes its own (ffi_call itself types its results as invariant)."""
  axes = varying_axes(*ins)
  if not axes:
    return outs

  def vary(o):
    missing = tuple(sorted(axes - varying_axes(o)))
    return jax.lax.pcast(o, missing, to="varying") if missing else o
  return jax.tree.map(vary, outs)


def _check_input(x, name="x"):
  _ffi.check_backend()
  x = jnp.asarray(x)
  if x.dtype not in _FLOAT_DTYPES:
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
  return x


def _check_scalar_f32(v, name):
  v = jnp.asarray(v)
  if v.shape != () or v.dtype != jnp.float32:
    raise TypeError(f"{name} must be a float32 scalar, got {v.dtype}{list(v.shape)}")
  return v


def _check_ring(ring):
  if not isinstance(ring, ScaleRing):
    raise TypeError(f"ring must be a jax_fp8.ScaleRing, got {type(ring).__name__}")
  hist = jnp.asarray(ring.amax_history)
  if hist.ndim != 1 or not 1 <= hist.shape[0] <= MAX_HISTORY or hist.dtype != jnp.float32:
    raise ValueError(f"ring.amax_history must be float32 [L] with 1 <= L <= {MAX_HISTORY}, "
                     f"got {hist.dtype}{list(hist.shape)}")
  return hist, _check_scalar_f32(ring.scale, "ring.scale"), _check_scalar_f32(ring.steps,
                                                                                "ring.steps")


def quantize(x: jax.Array, scale: jax.Array, fmt: str = "e4m3") -> tuple[jax.Array, jax.Array]:
  """Per-tensor FP8 quantization with the amax fused in the same pass.

  ``q = saturate(round_nearest_even(x * (1 / scale)))``: values beyond the format's maximum
  (and +-inf) saturate to +-max, NaN stays NaN (canonical 0x7F).

  Args:
    x: any shape, float32 / bfloat16 / float16.
    scale: float32 scalar, the dequantization step (``x ~= q * scale``), > 0.
    fmt: "e4m3" (float8_e4m3fn, max 448) or "e5m2" (float8_e5m2, max 57344).
  Returns:
    ``(q, amax)``: q has x's shape in the FP8 dtype; amax is f32 [] = max |x| (NaN if x has
    a NaN).
  Raises:
    TypeError / ValueError at trace time for a wrong dtype, a non-scalar scale or an unknown
    format.
  """
  x = _check_input(x)
  scale = _check_scalar_f32(scale, "scale")
  fp8_dtype(fmt)  # an unknown format raises here, at trace time
  impl = lambda x, scale: _quantize_kernel(x, scale, fmt)

  def plan(mesh, shapes):  # elementwise: x's sharding kept, the amax reduced over it
    xs = tuple(sharding.even(mesh, e, d) for e, d in zip(sharding.spec(shapes[0].sharding,
                                                                       x.ndim), x.shape))
    over = sharding.axes(*xs)
    lower = lambda x, scale: (lambda q, a: (q, sharding.pmax_keep_nan(a, over)))(*impl(x, scale))
    rep = sharding.named(mesh)
    return lower, (sharding.named(mesh, *xs), rep), (sharding.named(mesh, *xs), rep)

  f = sharding.factors("x", x.ndim)
  q, amax = sharding.call(impl, plan, f"{f}, -> {f}, ", x, scale)
  return _vary_like((q, amax), x, scale)


def _quantize_kernel(x, scale, fmt):
  q, amax, _ = jax.ffi.ffi_call(
      "jax_fp8_quantize",
      (jax.ShapeDtypeStruct(x.shape, fp8_dtype(fmt)), jax.ShapeDtypeStruct((), jnp.float32),
       _SCRATCH),
      vmap_method="sequential",
  )(x, scale)
  return q, amax


def _ring_scale(x, ring_leaves, statics, over):
  """The scale every device quantizes with: the ring's, or on a fresh ring the one from the
  amax of x over all devices (computed on that step only)."""
  hist, scale, steps = ring_leaves
  ring = ScaleRing(hist, scale, steps, *statics)
  first = jax.lax.cond(steps == 0,
                       lambda x: sharding.pmax_keep_nan(reference.amax(x), over),
                       lambda x: jnp.zeros((), jnp.float32), x)
  return scale_for_step(ring, first), ring


def _ring_outputs(ring, amax):
  nxt = next_ring(ring, amax)
  return nxt.amax_history, nxt.scale, nxt.steps


def quantize_delayed(x: jax.Array, ring: ScaleRing) -> tuple[jax.Array, jax.Array, ScaleRing]:
  """Delayed-scaling quantize: quantize with the ring's scale and finalize the ring in the
  same kernel (its last block records the amax and publishes the next scale; no extra launch).

  On a fresh ring (``steps == 0``) the scale comes from the current amax instead. The ring
  buffers are updated in place (``input_output_aliases``); donate them in jit to avoid a copy.

  Args:
    x: any shape, float32 / bfloat16 / float16.
    ring: a ``ScaleRing``; its ``fmt`` is the output format.
  Returns:
    ``(q, amax, next_ring)``, with ``next_ring == jax_fp8.scaling.next_ring(ring, amax)``.
  """
  x = _check_input(x)
  hist, scale, steps = _check_ring(ring)
  qdt = fp8_dtype(ring.fmt)
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  statics = (ring.fmt, ring.margin, ring.algo)

  def impl(x, hist, scale, steps):
    q, amax, hist, scale, steps, _ = jax.ffi.ffi_call(
        "jax_fp8_quantize_ring",
        (jax.ShapeDtypeStruct(x.shape, qdt), f32(()), f32(hist.shape), f32(()), f32(()),
         _SCRATCH),
        input_output_aliases={1: 2, 2: 3, 3: 4},
        vmap_method="sequential",
    )(x, hist, scale, steps, margin=np.int64(ring.margin), algo=np.int64(_ALGO_ID[ring.algo]))
    return q, amax, hist, scale, steps

  def plan(mesh, shapes):  # x's sharding kept; the ring replicated and advanced alike
    xs = tuple(sharding.even(mesh, e, d) for e, d in zip(sharding.spec(shapes[0].sharding,
                                                                       x.ndim), x.shape))
    over = sharding.axes(*xs)

    def lower(x, *ring_leaves):
      s, ring_in = _ring_scale(x, ring_leaves, statics, over)
      q, amax = _quantize_kernel(x, s, ring.fmt)  # the stateless kernel at scale s
      amax = sharding.pmax_keep_nan(amax, over)
      return (q, amax) + _ring_outputs(ring_in, amax)
    rep = sharding.named(mesh)
    return lower, (sharding.named(mesh, *xs), rep, rep, rep), (sharding.named(mesh, *xs),) + (
        rep,) * 4

  f = sharding.factors("x", x.ndim)
  q, amax, hist, scale, steps = sharding.call(impl, plan, f"{f}, l, , -> {f}, , l, , ", x, hist,
                                              scale, steps)
  q, amax, hist, scale, steps = _vary_like((q, amax, hist, scale, steps), x, ring)
  return q, amax, dataclasses.replace(ring, amax_history=hist, scale=scale, steps=steps)


def cast_transpose_delayed(x: jax.Array, ring: ScaleRing, *, with_dbias: bool = False):
  """Delayed-scaling quantize that writes both layouts in one read: the row-major FP8 copy and
  the transposed one (Hopper's FP8 GEMMs are TN-only, so the forward / dgrad use ``q`` and the
  wgrad ``qt``), with the amax fused and the ring finalized by the last block, as in
  ``quantize_delayed``. With ``with_dbias`` it also returns the column sums of x (the bias
  gradient when x is the output gradient), from the same read.

  Args:
    x: [R, C] float32 / bfloat16 / float16, C a positive multiple of 16.
    ring: a ``ScaleRing``; its ``fmt`` is the output format.
    with_dbias: also return ``sum(x, axis=0)`` in f32.
  Returns:
    ``(q, qt, amax, next_ring, dbias)``: q [R, C] FP8; qt [C, ceil16(R)] FP8 (= q.T with zero
    columns appended up to a multiple of 16 rows of x, so it feeds a GEMM contracting over R
    directly); amax f32 []; dbias f32 [C] or None.
  Raises:
    TypeError / ValueError at trace time: dtype, rank, C not a positive multiple of 16.
  """
  x = _check_input(x)
  if x.ndim != 2 or x.shape[1] <= 0 or x.shape[1] % 16:
    raise ValueError(f"x must be [R, C] with C a positive multiple of 16, got shape {x.shape}")
  hist, scale, steps = _check_ring(ring)
  qdt = fp8_dtype(ring.fmt)
  f32 = lambda shape: jax.ShapeDtypeStruct(shape, jnp.float32)
  statics = (ring.fmt, ring.margin, ring.algo)

  def impl(x, hist, scale, steps):
    rows, cols = x.shape
    partial_rows = -(-rows // 64) if with_dbias else 0  # 64-row tiles of the kernel
    # Outputs 7 and 9 are the kernel's scratch: the per-tile dbias partials, and the amax and
    # completion counters.
    q, qt, amax, hist, scale, steps, _, dbias, _ = jax.ffi.ffi_call(
        "jax_fp8_cast_transpose_ring",
        (jax.ShapeDtypeStruct(x.shape, qdt), jax.ShapeDtypeStruct((cols, -(-rows // 16) * 16), qdt),
         f32(()), f32(hist.shape), f32(()), f32(()),
         f32((partial_rows, cols if with_dbias else 0)), f32((cols if with_dbias else 0,)),
         _SCRATCH),
        input_output_aliases={1: 3, 2: 4, 3: 5},
        vmap_method="sequential",
    )(x, hist, scale, steps, margin=np.int64(ring.margin), algo=np.int64(_ALGO_ID[ring.algo]),
      with_dbias=bool(with_dbias))
    return (q, qt, amax, hist, scale, steps) + ((dbias,) if with_dbias else ())

  def plan(mesh, shapes):
    # Rows split in multiples of 16 (qt's padding is then the global one), columns in
    # multiples of 16 (the kernel's); qt split as x transposed; the ring replicated.
    r, c = sharding.spec(shapes[0].sharding, 2)
    r, c = sharding.even(mesh, r, x.shape[0], 16), sharding.even(mesh, c, x.shape[1], 16)
    over = sharding.axes(r, c)

    def lower(x, *ring_leaves):
      s, ring_in = _ring_scale(x, ring_leaves, statics, over)
      # The kernel at scale s: a one-entry ring past its first step, whose update is dropped.
      outs = impl(x, jnp.zeros((1,), jnp.float32), s, jnp.ones((), jnp.float32))
      dbias = tuple(jax.lax.psum(d, sharding.axes(r)) for d in outs[6:])
      amax = sharding.pmax_keep_nan(outs[2], over)
      return outs[:2] + (amax,) + _ring_outputs(ring_in, amax) + dbias
    rep = sharding.named(mesh)
    outs = (sharding.named(mesh, r, c), sharding.named(mesh, c, r)) + (rep,) * 4 + (
        (sharding.named(mesh, c),) if with_dbias else ())
    return lower, (sharding.named(mesh, r, c), rep, rep, rep), outs

  rows16 = -(-x.shape[0] // 16) * 16
  qt_rows = "r" if rows16 == x.shape[0] else "p"  # a padded qt shares no factor with x
  rule = f"r c, l, , -> r c, c {qt_rows}, , l, , " + (", c" if with_dbias else "")
  outs = sharding.call(impl, plan, rule, x, hist, scale, steps)
  q, qt, amax, hist, scale, steps, *dbias = _vary_like(outs, x, ring)
  dbias = dbias[0] if with_dbias else None
  return q, qt, amax, dataclasses.replace(ring, amax_history=hist, scale=scale, steps=steps), dbias


def dequantize(q: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
  """``q * scale`` in ``dtype``. Plain XLA on purpose: it fuses into its consumer, so it costs
  no pass of its own (an FFI kernel could not fuse).

  Args:
    q: FP8 array (float8_e4m3fn or float8_e5m2), any shape.
    scale: float32 scalar.
    dtype: output dtype (float32 / bfloat16 / float16).
  """
  q = jnp.asarray(q)
  if q.dtype not in FP8_DTYPES:
    raise TypeError(f"q must be float8_e4m3fn or float8_e5m2, got {q.dtype}")
  scale = _check_scalar_f32(scale, "scale")
  if jnp.dtype(dtype) not in _FLOAT_DTYPES:
    raise TypeError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
  return (q.astype(jnp.float32) * scale).astype(dtype)



def _scale_mode(a_scale, b_scale, m, n, k):
  """0 for per-tensor scales; 1 for a [M, K/128] with b [ceil(N/128), K/128] (128 x 128
  blocks); 2 for a [M, K/128] with b [N, K/128] (1 x 128 groups). Raises otherwise."""
  a_scale, b_scale = jnp.asarray(a_scale), jnp.asarray(b_scale)
  for name, v in (("a_scale", a_scale), ("b_scale", b_scale)):
    if v.dtype != jnp.float32:
      raise TypeError(f"{name} must be float32, got {v.dtype}")
  if a_scale.shape == () and b_scale.shape == ():
    return 0, a_scale, b_scale
  kb = k // 128
  modes = {(-(-n // 128), kb): 1, (n, kb): 2}
  if k % 128 or a_scale.shape != (m, kb) or b_scale.shape not in modes:
    want = (f"a_scale [M, K/128] = [{m}, {kb}] and b_scale [ceil(N/128), K/128] = "
            f"[{-(-n // 128)}, {kb}] (128 x 128 blocks) or [N, K/128] = [{n}, {kb}] (1 x 128 "
            f"groups)" if k % 128 == 0 else f"K={k} is not")
    raise ValueError(f"scales must be float32 scalars (per-tensor), or block scales with K a "
                     f"multiple of 128: {want}; got a_scale {list(a_scale.shape)} and b_scale "
                     f"{list(b_scale.shape)} with K={k}")
  return modes[b_scale.shape], a_scale, b_scale


def _check_gemm(a, b, a_scale, b_scale, bias, out_dtype, out_scale):
  _ffi.check_backend()
  a, b = jnp.asarray(a), jnp.asarray(b)
  for name, v in (("a", a), ("b", b)):
    if v.dtype not in FP8_DTYPES:
      raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {v.dtype}")
    if v.ndim != 2:
      raise ValueError(f"{name} must be 2-D, got shape {v.shape}")
  if a.dtype == b.dtype == jnp.float8_e5m2:
    raise TypeError("e5m2 x e5m2 GEMMs are not supported (cuBLASLt has none); use e4m3 for "
                    "one operand")
  if a.shape[1] != b.shape[1]:
    raise ValueError(f"a [M, K] and b [N, K] must share K (TN layout), got a {a.shape} and "
                     f"b {b.shape}")
  m, k, n = a.shape[0], a.shape[1], b.shape[0]
  if k % 16 or n % 16:
    raise ValueError(f"K and N must be multiples of 16 (cuBLASLt FP8 alignment), got K={k}, "
                     f"N={n}; pad the operands")
  mode, a_scale, b_scale = _scale_mode(a_scale, b_scale, m, n, k)
  if mode and not a.dtype == b.dtype == jnp.float8_e4m3fn:
    raise TypeError(f"block-scaled GEMMs take e4m3 operands (the DeepSeek-V3 recipe; the only "
                    f"pair tested on cuBLASLt's block-scaled path), got {a.dtype} x {b.dtype}")
  out_dtype = jnp.dtype(out_dtype)
  fp8_out = out_dtype == jnp.float8_e4m3fn
  if out_dtype not in _FLOAT_DTYPES and not fp8_out:
    raise TypeError(f"out_dtype must be bfloat16, float16, float32 or float8_e4m3fn, got "
                    f"{out_dtype}")
  if fp8_out:
    if out_scale is None:
      raise TypeError("out_dtype float8_e4m3fn needs out_scale (the output's dequantization "
                      "step, a float32 scalar)")
    out_scale = _check_scalar_f32(out_scale, "out_scale")
    if mode:
      raise ValueError("out_dtype float8_e4m3fn takes per-tensor scales only, got block scales")
  elif out_scale is not None:
    raise TypeError(f"out_scale applies to out_dtype float8_e4m3fn only, got out_dtype "
                    f"{out_dtype}")
  if bias is not None:
    bias = jnp.asarray(bias)
    if out_dtype == jnp.float32:
      raise TypeError("a fused bias needs out_dtype bfloat16, float16 or float8_e4m3fn "
                      "(cuBLASLt's FP8 epilogue); add an f32 bias after the GEMM")
    bias_dtype = jnp.dtype(jnp.bfloat16) if fp8_out else out_dtype
    if bias.shape != (n,) or bias.dtype != bias_dtype:
      raise ValueError(f"bias must be [{n}] {bias_dtype}, got {bias.dtype}{list(bias.shape)}")
  return a, b, a_scale, b_scale, bias, out_dtype, out_scale, mode


def gemm(a: jax.Array, b: jax.Array, a_scale: jax.Array, b_scale: jax.Array, *,
         bias: jax.Array | None = None, out_dtype=jnp.bfloat16,
         out_scale: jax.Array | None = None,
         fast_accum: bool = False) -> jax.Array | tuple[jax.Array, jax.Array]:
  """FP8 GEMM in TN layout with f32 accumulation: ``(a_scale * b_scale) * a @ b.T + bias``,
  with per-tensor or block scales, into a 16/32-bit output or into e4m3 with its amax.

  CUDA: cuBLASLt (scales read on the device, bias in the epilogue, heuristic algorithm chosen
  once per shape; block scales through its VEC128 / BLK128x128 modes, cuBLASLt >= 12.9, the
  DeepSeek-V3 recipe; an e4m3 output through its D scale and amax-D epilogue, as
  TransformerEngine's FP8-output GEMMs). CPU: XLA's f32 dot on the upcast (for block scales:
  dequantized) operands.

  Args:
    a: [M, K] float8_e4m3fn or float8_e5m2.
    b: [N, K] float8_e4m3fn or float8_e5m2 (not both e5m2).
    a_scale, b_scale: the operands' dequantization steps, float32. Per-tensor: two scalars.
      Block scaling (K a multiple of 128): a_scale [M, K/128] (1 x 128 groups of a's rows) and
      b_scale [ceil(N/128), K/128] (128 x 128 blocks, weights) or [N, K/128] (1 x 128 groups,
      as in wgrad); ``jax_fp8.group_quantize`` / ``block_quantize`` / ``group_cast_transpose``
      make them. Block scales need e4m3 operands and no ``fast_accum``. On CUDA a
      block-scaled GEMM with M not a multiple of 4 runs on a copy of a padded with zero rows
      (cuBLASLt takes no other).
    bias: optional [N] in ``out_dtype`` (bfloat16 or float16), or bfloat16 for an e4m3 output.
    out_dtype: bfloat16 (default), float16, float32, or float8_e4m3fn (per-tensor scales
      only) so a layer hands FP8 straight to the next.
    out_scale: the e4m3 output's dequantization step, float32 scalar, required with
      ``out_dtype=float8_e4m3fn`` and rejected otherwise: the output is
      ``saturate(rne(d * (1 / out_scale)))``, like ``quantize(d, out_scale)``. With a bias,
      cuBLASLt (13.1) adds it in bf16 before the cast, so d and its amax can be off the f32
      result by about 2^-7 relative (0.74% measured on the H200); the CPU path is exact.
    fast_accum: let Hopper's FP8 tensor cores accumulate without periodic promotion to f32
      (cuBLASLt ``FAST_ACCUM``): faster, less accurate for large K. CPU ignores it.
  Returns:
    [M, N] in ``out_dtype``; for an e4m3 output the pair ``(d [M, N] e4m3, amax f32 [])``
    where amax is max |d| before the cast, in f32 (the next scale's input, as
    ``quantize`` returns it; on CUDA cuBLASLt's amax-D).
  Raises:
    TypeError / ValueError at trace time: wrong dtypes, ranks, K mismatch, K or N not a
    multiple of 16, scales of shapes that match no scale mode, block scales with e5m2 operands,
    fast_accum or an e4m3 output, a bias with f32 output or of the wrong shape or dtype,
    out_scale missing for an e4m3 output or given for another, a fast_accum not a bool.
  """
  a, b, a_scale, b_scale, bias, out_dtype, out_scale, mode = _check_gemm(
      a, b, a_scale, b_scale, bias, out_dtype, out_scale)
  fp8_out = out_scale is not None
  if not isinstance(fast_accum, (bool, np.bool_)):
    raise TypeError(f"fast_accum must be a bool, got {fast_accum!r}")
  if mode and fast_accum:
    raise ValueError("fast_accum applies to per-tensor scales only: block-scaled GEMMs promote "
                     "to f32 at every 128-element group")
  (m, k), n = a.shape, b.shape[0]
  args = (a, b, a_scale, b_scale) + (() if out_scale is None else (out_scale,))

  def finish(d, out_scale=None, out=out_dtype):  # f32 -> out (and its amax for an e4m3 out)
    return reference.quantize(d, out_scale) if fp8_out else d.astype(out)

  if 0 in (m, n, a.shape[1]):  # nothing to multiply: no library call
    d = jnp.zeros((m, n), jnp.float32) + (0 if bias is None else bias.astype(jnp.float32))
    return _vary_like(finish(d, out_scale), *args, bias)

  def on_cuda(a, b, a_scale, b_scale, *rest, out=out_dtype):
    (m, _), n = a.shape, b.shape[0]  # this device's piece under a sharded jit
    bias = rest[fp8_out:]
    bias_arg = bias[0] if bias else jnp.zeros((0,), jnp.bfloat16 if fp8_out else out_dtype)
    # cuBLASLt multiplies by its D scale: the reciprocal, computed as quantize computes it.
    d_scale = (1.0 / rest[0]).reshape(1) if fp8_out else jnp.zeros((0,), jnp.float32)
    rows = m
    if mode:  # the layouts cuBLASLt reads (csrc/ffi/gemm_cuda.cc)
      rows = -(-m // 4) * 4  # it takes block-scaled GEMMs only for M % 4 == 0: zero rows
      a = jnp.pad(a, ((0, rows - m), (0, 0)))
      a_scale = jnp.pad(a_scale, ((0, rows - m), (0, 0))).T  # [K/128, M], M contiguous
      if mode == 1:  # [ceil(N/128), K/128] with rows padded to 16 bytes
        b_scale = jnp.pad(b_scale, ((0, 0), (0, -b_scale.shape[1] % 4)))
      else:  # [K/128, N], N contiguous
        b_scale = b_scale.T
    d, amax_d, _ = jax.ffi.ffi_call(
        "jax_fp8_gemm",
        (jax.ShapeDtypeStruct((rows, n), out),
         jax.ShapeDtypeStruct((int(fp8_out),), jnp.float32), _GEMM_WORKSPACE),
        vmap_method="sequential",
    )(a, b, a_scale, b_scale, bias_arg, d_scale, has_bias=bool(bias),
      fast_accum=bool(fast_accum), scale_mode=np.int64(mode))
    out = (d[:m], amax_d[0]) if fp8_out else d[:m]
    return _vary_like(out, a, b, a_scale, b_scale, *rest)

  def on_cpu(a, b, a_scale, b_scale, *rest, out=out_dtype):
    (m, k), n = a.shape, b.shape[0]
    bias = rest[fp8_out:]
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    if mode:  # block scales: dequantize each operand, then one f32 dot
      a = a * reference.expand_scales(a_scale, m, k, 1)
      b = b * reference.expand_scales(b_scale, n, k, 128 if mode == 1 else 1)
      a_scale = b_scale = jnp.float32(1)
    acc = jax.lax.dot_general(a, b,
                              (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    d = acc * (a_scale * b_scale)
    if bias:
      d = d + bias[0].astype(jnp.float32)
    return finish(d, *rest[:fp8_out], out=out)

  def kernel(out):
    return lambda *v: jax.lax.platform_dependent(*v, cuda=functools.partial(on_cuda, out=out),
                                                 default=functools.partial(on_cpu, out=out))
  impl = kernel(out_dtype)

  def plan(mesh, shapes):
    # M and N keep a's and b's row sharding (on distinct axes); a K split alike in a and b
    # is kept for a 16/32-bit output (block scales: whole 128-groups on each device): the
    # local products summed in f32, then the bias added and the result cast once.
    am, ak = sharding.spec(shapes[0].sharding, 2)
    bn, bk = sharding.spec(shapes[1].sharding, 2)
    am = sharding.even(mesh, am, m)
    bn = sharding.even(mesh, bn, n, 128 if mode == 1 else 16)
    if set(sharding.axes(bn)) & set(sharding.axes(am)):
      bn = None
    same_k = sharding.axes(ak) == sharding.axes(bk)
    kk = sharding.even(mesh, ak, k, 128 if mode else 16) if same_k and not fp8_out else None
    if set(sharding.axes(kk)) & set(sharding.axes(am, bn)):
      kk = None
    rep = sharding.named(mesh)
    ins = (sharding.named(mesh, am, kk), sharding.named(mesh, bn, kk))
    ins += (rep, rep) if not mode else (sharding.named(mesh, am, kk), sharding.named(mesh, bn, kk))
    ins += (rep,) * fp8_out + ((sharding.named(mesh, bn),) if bias is not None else ())
    outs = (sharding.named(mesh, am, bn),) + (rep,) * fp8_out
    over_k, over_mn = sharding.axes(kk), sharding.axes(am, bn)

    def lower(*v):
      if not over_k:
        out = impl(*v)
        return (out[0], sharding.pmax_keep_nan(out[1], over_mn)) if fp8_out else out
      d = jax.lax.psum(kernel(jnp.float32)(*v[:4]), over_k)
      return (d if bias is None else d + v[4].astype(jnp.float32)).astype(out_dtype)
    return lower, ins, outs[0] if not fp8_out else outs

  if mode:  # K and the scales' K/128 as one factor, N and its blocks too (mode 1)
    nf, nbf = sharding.grouped("n", n) if mode == 1 else ("n", "n")
    rule = f"m (kb k1), {nf} (kb k1), m kb, {nbf} kb"
  else:
    nf, rule = "n", "m k, n k, , "
  rule += ", " * fp8_out + (f", {nf}" if bias is not None else "") + f" -> m {nf}" + ", " * fp8_out
  sizes = {"k1": 128, **({"n1": 128} if mode == 1 and n % 128 == 0 else {})} if mode else {}
  args += (bias,) if bias is not None else ()
  return sharding.call(impl, plan, rule, *args,
                       reduction_factors=("kb", "k1") if mode else ("k",), **sizes)
