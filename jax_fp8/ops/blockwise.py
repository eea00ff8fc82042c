"""Block-scaled FP8 quantization (the DeepSeek-V3 recipe): validate, shape, call the FFI target.

Scales are f32, one per group of 128 (or ``group_size``) consecutive elements along a row
("per-token group", activations and gradients) or per 128 x 128 block (weights):
``scale = max(amax, eps) * f32(1 / fmt_max)``, optionally rounded up to a power of two
(UE8M0), and ``q = saturate(rne(x * (1 / scale)))``; under UE8M0 the top scale's elements
saturate below 2**emax (``formats.top_scale_saturate``), so no finite input dequantizes to inf.
(vLLM and SGLang divide by fmt_max instead; the two differ by one ulp in about half of the
non-UE8M0 scales.) A group holding NaN or inf gets a NaN / inf scale, so it dequantizes to NaN
rather than to silent finite values. Source: DeepSeek-V3 technical report (arXiv 2412.19437),
section 3.3; the per-token-group kernels of vLLM and SGLang.

The group cast-transpose can also quantize a norm of x, an MLP's activation or the gradient
through it on the way (``norm_group_cast_transpose`` and the activation ones; the sources of
``jax_fp8.ops.sources``), as the per-tensor cast-transposes do.

CUDA kernels: ``csrc/kernels/group_quantize.cuh`` and ``block_quantize.cuh`` (PDL-launched);
FFI handlers ``csrc/ffi/group_quantize_*`` and ``block_quantize_*``; jnp twins of the same names
in ``jax_fp8.reference``; tests: ``tests/test_blockwise.py``, ``tests/test_block_sources.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, checks, sharding
from . import sources
from ..formats import BLOCK, GROUP_EPS, fp8_dtype
from ..quantized import Quantized

_LAYOUTS = {"row": _ffi.CONSTANTS["layout_row"], "col": _ffi.CONSTANTS["layout_col"],
            "col_tma": _ffi.CONSTANTS["layout_col_tma"]}
_GROUP_SIZES = tuple(_ffi.CONSTANTS["group_sizes"])
_MAX_TILE_ROWS = _ffi.CONSTANTS["max_tile_rows"]  # CUDA's limit on gridDim.y


def check_rows(name: str, rows: int) -> None:
  """CUDA's limit on gridDim.y: one row of the kernel's grid per 128 rows."""
  if -(-rows // BLOCK) > _MAX_TILE_ROWS:
    raise ValueError(f"{name} has {rows} rows; at most {_MAX_TILE_ROWS * BLOCK} (one row of the "
                     f"kernel's grid per 128 rows)")


def group_quantize(x: jax.Array, *, group_size: int = BLOCK, fmt: str = "e4m3",
                   eps: float = GROUP_EPS, ue8m0: bool = False, scale_layout: str = "row") -> Quantized:
  """Per-token-group FP8 quantization: one scale per ``group_size`` consecutive elements of
  the last axis.

  Args:
    x: [..., K] float32 / bfloat16 / float16, K a multiple of ``group_size``.
    group_size: 16, 32, 64 or 128.
    fmt: "e4m3" or "e5m2".
    eps: floor of the group amax (an all-zero group gets scale eps * f32(1 / fmt_max)); at
      least fmt_max * FLT_MIN, finite in f32.
    ue8m0: round every scale up to a power of two (UE8M0, as DeepSeek-V3 / DeepGEMM use).
    scale_layout: "row" -> scales [..., K/g], the layout ``jax_fp8.gemm`` takes; "col" ->
      [K/g, M] (M = the product of the leading dims), the M-contiguous layout cuBLASLt and
      DeepGEMM read in memory (give ``gemm`` its transpose, ``scales.T``: the two transposes
      cancel in XLA); "col_tma" -> [K/g, ceil4(M)], with zero scales in the padding
      (16-byte aligned columns for TMA).
  Returns:
    ``Quantized``: ``data`` [..., K] in the FP8 dtype; ``scale`` f32 in the chosen layout.
  Raises:
    TypeError / ValueError at trace time: dtype, K not a multiple of group_size, group_size,
    fmt, eps or scale_layout out of range.
  """
  x = checks.float_input(x)
  if checks.integer(group_size, "group_size") not in _GROUP_SIZES:
    raise ValueError(f"group_size must be one of {_GROUP_SIZES}, got {group_size!r}")
  if x.ndim < 1 or x.shape[-1] % group_size:
    raise ValueError(f"x's last axis must be a multiple of group_size={group_size}, got shape "
                     f"{x.shape}")
  checks.one_of(scale_layout, "scale_layout", _LAYOUTS)
  qdt, eps = fp8_dtype(fmt), checks.group_eps(eps, fmt)
  ue8m0 = checks.boolean(ue8m0, "ue8m0")
  *lead, k = x.shape
  m = int(np.prod(lead, dtype=np.int64))
  row = scale_layout == "row"

  def impl(x):
    *lead, k = x.shape
    m = int(np.prod(lead, dtype=np.int64))
    shape = {"row": (*lead, k // group_size), "col": (k // group_size, m),
             "col_tma": (k // group_size, -(-m // 4) * 4)}
    return jax.ffi.ffi_call(
        "jax_fp8_group_quantize",
        (jax.ShapeDtypeStruct(x.shape, qdt),
         jax.ShapeDtypeStruct(shape[scale_layout], jnp.float32)),
        vmap_method="sequential",
    )(x, group_size=np.int64(group_size), eps=eps, ue8m0=bool(ue8m0),
      layout=np.int64(_LAYOUTS[scale_layout]))

  def plan(mesh, shapes):  # groups stay whole on each device; no collective
    *lead_s, ks = sharding.spec(shapes[0].sharding, x.ndim)
    ks = sharding.even(mesh, ks, k, group_size)
    lead_s = [sharding.even(mesh, e, d) for e, d in zip(lead_s, lead)]
    if not row:  # the scales' M is the leading dims flattened: only the first may stay split
      first = lead_s[0] if lead_s else None
      if scale_layout == "col_tma":  # and its padding to 4 must be the global one
        first = sharding.even(mesh, first, m, 4)
      lead_s = [first] + [None] * (len(lead_s) - 1) if lead_s else []
    xs = sharding.named(mesh, *lead_s, ks)
    ss = xs if row else sharding.named(mesh, ks, lead_s[0] if lead_s else None)
    return impl, (xs,), (xs, ss)

  f = sharding.factors("x", x.ndim - 1)
  m_factor = f if x.ndim == 2 else "m"  # a 2-D x's rows are the scales' M
  rule = f"{f} (g k1) -> {f} (g k1), " + (f"{f} g" if row else f"g {m_factor}")
  q, s = sharding.call("group_quantize", impl, plan, rule, x, k1=int(group_size))
  q, s = sharding.vary_like((q, s), x)
  return Quantized(data=q, scale=s)


def block_quantize(w: jax.Array, *, fmt: str = "e4m3", eps: float = GROUP_EPS,
                   ue8m0: bool = False) -> Quantized:
  """128 x 128 block FP8 quantization (weights in the DeepSeek-V3 recipe): one scale per block.

  Since a block's scale does not depend on the direction, ``data.T`` with ``scale.T`` is the
  block quantization of ``w.T``: the transposed operand costs an FP8 transpose, no requantize.

  Args:
    w: [R, C] float32 / bfloat16 / float16, C a positive multiple of 16.
    fmt, eps, ue8m0: as in ``group_quantize``.
  Returns:
    ``Quantized``: ``data`` [R, C] FP8; ``scale`` f32 [ceil(R/128), ceil(C/128)], edge blocks
    scaled by the elements they hold.
  Raises:
    TypeError / ValueError at trace time: dtype, rank, C, block, fmt or eps out of range,
    more than 65535 * 128 rows.
  """
  w = sources.plain(w, sources.COL_MULTIPLE, "w").inputs[0]
  check_rows("w", w.shape[0])
  qdt, eps = fp8_dtype(fmt), checks.group_eps(eps, fmt)
  ue8m0 = checks.boolean(ue8m0, "ue8m0")

  def impl(w):
    r, c = w.shape
    return jax.ffi.ffi_call(
        "jax_fp8_block_quantize",
        (jax.ShapeDtypeStruct(w.shape, qdt),
         jax.ShapeDtypeStruct((-(-r // BLOCK), -(-c // BLOCK)), jnp.float32)),
        vmap_method="sequential",
    )(w, eps=eps, ue8m0=bool(ue8m0))

  def plan(mesh, shapes):  # whole blocks on each device; no collective
    r, c = sharding.spec(shapes[0].sharding, 2)
    ws = sharding.named(mesh, sharding.even(mesh, r, w.shape[0], BLOCK),
                        sharding.even(mesh, c, w.shape[1], BLOCK))
    return impl, (ws,), (ws, ws)

  (rf, rb), (cf, cb) = sharding.grouped("r", w.shape[0]), sharding.grouped("c", w.shape[1])
  sizes = {f"{d}1": BLOCK for d, size in (("r", w.shape[0]), ("c", w.shape[1]))
           if size % BLOCK == 0}
  rule = f"{rf} {cf} -> {rf} {cf}, {rb} {cb}"
  q, s = sharding.call("block_quantize", impl, plan, rule, w, **sizes)
  q, s = sharding.vary_like((q, s), w)
  return Quantized(data=q, scale=s)


def group_cast_transpose(x: jax.Array, *, fmt: str = "e4m3", eps: float = GROUP_EPS,
                         ue8m0: bool = False) -> Quantized:
  """Both directions of 128-element group quantization from one read of ``x [R, C]``: 1 x 128
  groups along its rows (the forward and dgrad operand) and 128 x 1 groups along its columns,
  written transposed (the wgrad operand, which contracts over R). The backward's
  "transposed-direction" quantization of DeepSeek-V3 (section 3.3), fused like a cast-transpose.

  Args:
    x: [R, C] float32 / bfloat16 / float16, C a positive multiple of 128.
    fmt, eps, ue8m0: as in ``group_quantize``.
  Returns:
    ``Quantized``: ``data`` [R, C] FP8 with ``scale`` f32 [R, C/128]; ``data_t`` [C, R128] FP8
    (R128 = R rounded up to 128, zero columns appended) with ``scale_t`` f32 [C, R128/128].
    (The kernel stores both scale grids outer-dimension-contiguous, as cuBLASLt reads them; the
    transposes here cancel against ``gemm``'s.)
  Raises:
    TypeError / ValueError at trace time: dtype, rank, C, fmt or eps out of range, more than
    65535 * 128 rows.
  """
  return _group_cast_transpose("group_cast_transpose", sources.plain(x, BLOCK), fmt, eps, ue8m0)


def norm_group_cast_transpose(x: jax.Array, row_stats: jax.Array, gamma: jax.Array,
                              beta: jax.Array | None, *, norm: str, fmt: str = "e4m3",
                              eps: float = GROUP_EPS, ue8m0: bool = False) -> Quantized:
  """``group_cast_transpose`` of the norm of x (``jax_fp8.norms``), computed in f32 inside the
  kernel from one read of x and its row statistics: a block-scaled layer's input norm written
  straight into its GEMMs' FP8 inputs, never stored in x's dtype.

  Args:
    x: [R, C] float32 / bfloat16 / float16, C a positive multiple of 128.
    row_stats, gamma, beta, norm: as in ``jax_fp8.norm_cast_transpose``.
    fmt, eps, ue8m0: as in ``group_quantize``.
  Returns:
    ``Quantized`` of the [R, C] norm, as ``group_cast_transpose``.
  Raises:
    TypeError / ValueError at trace time: as ``group_cast_transpose`` and
    ``norm_cast_transpose``.

  Byte-identical to ``jax_fp8.reference.norm_group_cast_transpose`` on every platform
  (csrc/norm.h rounds each product and sum on its own).
  """
  return _group_cast_transpose("norm_group_cast_transpose",
                               sources.norm(x, row_stats, gamma, beta, norm, BLOCK), fmt, eps,
                               ue8m0)


def activation_group_cast_transpose(y: jax.Array, *, activation: str, fmt: str = "e4m3",
                                    eps: float = GROUP_EPS, ue8m0: bool = False) -> Quantized:
  """``group_cast_transpose`` of ``activation(y)`` (``jax_fp8.activations``), computed in f32
  inside the kernel from one read of the pre-activation: a block-scaled MLP's hidden activation
  written straight into the down projection's FP8 inputs.

  Args:
    y: [R, C] float32 / bfloat16 / float16 ([R, 2C] = [gate | up] for "swiglu" / "geglu"), C
      a positive multiple of 128.
    activation: "silu", "gelu", "swiglu" or "geglu".
    fmt, eps, ue8m0: as in ``group_quantize``.
  Returns:
    ``Quantized`` of the [R, C] activation, as ``group_cast_transpose``.
  Raises:
    TypeError / ValueError at trace time: as ``group_cast_transpose``, unknown activation.

  The activation's exp and tanh differ between the CPU (libm) and the GPU (hardware
  approximations): outputs match ``jax_fp8.reference.activation_group_cast_transpose`` within
  the bound of docs/design.md ("The fused MLP"), as ``activation_cast_transpose``'s do.
  """
  return _group_cast_transpose("activation_group_cast_transpose",
                               sources.activation(y, activation, BLOCK), fmt, eps, ue8m0)


def activation_grad_group_cast_transpose(dh: jax.Array, y: jax.Array, *, activation: str,
                                         fmt: str = "e4m3", eps: float = GROUP_EPS,
                                         ue8m0: bool = False) -> Quantized:
  """``group_cast_transpose`` of the gradient through ``activation``
  (``jax_fp8.activations.grad``), computed in f32 inside the kernel from ``dh`` and the
  pre-activation ``y``: the up projection's block-scaled output gradient in both directions
  from one read of each.

  Args:
    dh: [R, C] float32 / bfloat16 / float16, the activation output's gradient; C a positive
      multiple of 128.
    y: the pre-activation, dh's dtype: [R, C], or [R, 2C] ([gate | up]) for a gated
      activation.
    activation: "silu", "gelu", "swiglu" or "geglu".
    fmt, eps, ue8m0: as in ``group_quantize``.
  Returns:
    ``Quantized`` of the gradient, y's shape ([R, 2C] = [dgate | dup] when gated; each
    128-column group lies in one half), as ``group_cast_transpose``.
  Raises:
    TypeError / ValueError at trace time: as ``group_cast_transpose`` and
    ``activation_grad_cast_transpose``.

  Matches ``jax_fp8.reference.activation_grad_group_cast_transpose`` within the bound of
  docs/design.md ("The fused MLP").
  """
  return _group_cast_transpose("activation_grad_group_cast_transpose",
                               sources.activation_grad(dh, y, activation, BLOCK), fmt, eps,
                               ue8m0)


def _group_cast_transpose(op, source: sources.Source, fmt, eps, ue8m0) -> Quantized:
  """The group cast-transposes' kernel call on a checked source (``jax_fp8.ops.sources``)."""
  rows, cols = source.shape(*source.inputs)
  check_rows("dh" if source.grad else "y" if source.activation else "x", rows)
  qdt, eps = fp8_dtype(fmt), checks.group_eps(eps, fmt)
  ue8m0 = checks.boolean(ue8m0, "ue8m0")

  def impl(*ins):
    r, c = source.shape(*ins)
    r128 = -(-r // BLOCK) * BLOCK
    return jax.ffi.ffi_call(
        "jax_fp8_group_cast_transpose",
        (jax.ShapeDtypeStruct((r, c), qdt), jax.ShapeDtypeStruct((c // BLOCK, r), jnp.float32),
         jax.ShapeDtypeStruct((c, r128), qdt),
         jax.ShapeDtypeStruct((r128 // BLOCK, c), jnp.float32)),
        vmap_method="sequential",
    )(*source.kernel_args(*ins), eps=eps, ue8m0=bool(ue8m0), **source.attrs())

  def plan(mesh, shapes):
    # Rows split in multiples of 128 (qt's zero padding is then the global one), columns in
    # multiples of 128 (whole groups) where the source allows it; the transposed outputs split
    # accordingly.
    r, c = sharding.spec(shapes[0].sharding, 2)
    r = sharding.even(mesh, r, rows, BLOCK)
    c = sharding.even(mesh, c, cols, BLOCK) if source.splits_columns() else None
    return impl, source.shardings(mesh, r, c), (
        sharding.named(mesh, r, c), sharding.named(mesh, c, r), sharding.named(mesh, c, r),
        sharding.named(mesh, r, c))

  padded = rows % BLOCK != 0  # then qt's columns share no factor with x's rows
  rf, rb = ("r", "pb") if padded else sharding.grouped("r", rows)
  qt_cols = "p" if padded else rf
  sizes = {"c1": BLOCK, **({} if padded else {"r1": BLOCK})}
  rule = (f"{source.rule(rf, '(cb c1)')} -> {rf} (cb c1), cb {rf}, (cb c1) {qt_cols}, "
          f"{rb} (cb c1)")
  q, s_col, qt, st_col = sharding.call(op, impl, plan, rule, *source.inputs, **sizes)
  q, s_col, qt, st_col = sharding.vary_like((q, s_col, qt, st_col), *source.inputs)
  return Quantized(data=q, scale=s_col.T, data_t=qt, scale_t=st_col.T)
