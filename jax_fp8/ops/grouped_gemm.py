"""Grouped FP8 GEMMs with the group sizes on the device (``jax.lax.ragged_dot``'s semantics), with
per-tensor or block scales: CUTLASS's Hopper ptr-array grouped kernels on CUDA, XLA's f32
``ragged_dot`` on CPU.

FFI handler: ``csrc/ffi/grouped_gemm_cuda.cu`` (its per-group plan and fills:
``csrc/kernels/grouped_gemm_setup.cuh``); jnp twins: ``jax_fp8.reference.grouped_gemm`` and
``grouped_gemm_wgrad``; tests: ``tests/test_grouped_gemm.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, checks, sharding
from ..formats import BLOCK, BLOCK_ROW_ALIGN, DIM_MULTIPLE, ROW_ALIGN, apply_scales
from .gemm import BLOCK_128X128, GROUP_1X128, PER_TENSOR, expand_scales

MAX_GROUPS = _ffi.CONSTANTS["max_groups"]
_ROWS, _WGRAD = 0, 1  # the handler's `form` attribute (csrc GroupedForm)
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# XLA's ragged dots as jax.lax held them when jax_fp8 was imported: jax_fp8.convert replaces
# jax.lax's while a converted linen model runs, and jax_fp8's own calls are never the model's.
XLA_RAGGED_DOT, XLA_RAGGED_DOT_GENERAL = jax.lax.ragged_dot, jax.lax.ragged_dot_general


@dataclasses.dataclass(frozen=True)
class Problem:
  """A checked grouped GEMM: its form, group count, scale mode (``gemm``'s: per-tensor; a in
  1 x 128 groups with b in 128 x 128 blocks, the rows form; both in 1 x 128 groups along the
  grouped rows, wgrad), b_scale per group or not (per-tensor), output dtype."""
  form: int
  groups: int
  mode: int
  per_group_scale: bool
  out_dtype: jnp.dtype

  @property
  def row_align(self) -> int:
    """The multiple of rows at which a non-empty wgrad group must start."""
    return BLOCK_ROW_ALIGN if self.mode != PER_TENSOR else ROW_ALIGN


def group_bounds(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """(start [G], end [G]) int32 of each group's rows: consecutive from row 0, a negative size
  counted as 0, every bound clipped to ``rows`` (so rows past ``rows`` are dropped). The
  running sum saturates at ``rows`` (a plain int32 cumsum of large sizes would wrap)."""
  sizes = jnp.clip(group_sizes, 0, rows).astype(jnp.int32)
  end = jax.lax.associative_scan(lambda a, b: jnp.minimum(a, rows - b) + b, sizes)
  start = jnp.concatenate([jnp.zeros((1,), jnp.int32), end[:-1]])
  return start, end


def misaligned(start: jax.Array, end: jax.Array, align: int = ROW_ALIGN) -> jax.Array:
  """[G] bool: the non-empty groups whose first row is not a multiple of ``align``
  (``ROW_ALIGN``, or ``BLOCK_ROW_ALIGN`` under block scales), whose wgrad
  ``grouped_gemm_wgrad`` writes as NaN."""
  return (start % align != 0) & (end > start)


def _check(a, b, a_scale, b_scale, group_sizes, out_dtype, form):
  """The checked arguments and the Problem; TypeError / ValueError naming the argument."""
  _ffi.check_backend()
  names = ("a", "b") if form == _ROWS else ("a_t", "b_t")
  a, b = checks.fp8_array(a, names[0]), checks.fp8_array(b, names[1])
  if a.dtype == b.dtype == jnp.float8_e5m2:
    raise TypeError(f"e5m2 x e5m2 grouped GEMMs are not supported; use e4m3 for {names[0]} or "
                    f"{names[1]}")
  group_sizes = checks.array(group_sizes, "group_sizes")
  if group_sizes.dtype != jnp.int32 or group_sizes.ndim != 1:
    raise TypeError(f"group_sizes must be int32 [G], got {checks.describe(group_sizes)}")
  groups = group_sizes.shape[0]
  if not 1 <= groups <= MAX_GROUPS:
    raise ValueError(f"group_sizes must have 1 to {MAX_GROUPS} groups, got {groups}")
  if form == _ROWS:
    if a.ndim != 2 or b.ndim != 3:
      raise ValueError(f"a must be [M, K] and b [G, N, K], got a {list(a.shape)} and b "
                       f"{list(b.shape)}")
    (m, k), n = a.shape, b.shape[1]
    if b.shape[0] != groups or b.shape[2] != k:
      raise ValueError(f"b must be [G, N, K] = [{groups}, N, {k}] (G from group_sizes, K from "
                       f"a), got {list(b.shape)}")
    dims = {"K": k, "N": n}
  else:
    if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
      raise ValueError(f"a_t must be [K, M] and b_t [N, M] (M shared, the grouped rows), got "
                       f"a_t {list(a.shape)} and b_t {list(b.shape)}")
    (k, m), n = a.shape, b.shape[0]
    dims = {"K": k, "N": n, "M": m}
  for dim, size in dims.items():
    if size % DIM_MULTIPLE:
      raise ValueError(f"{dim} must be a multiple of {DIM_MULTIPLE} (FP8 GEMM alignment), got "
                       f"{dim}={size}; pad the operands")
  if not checks.python_number(a_scale) and np.ndim(a_scale) == 2:
    a_scale, b_scale, mode = _block_scales(a, b, a_scale, b_scale, form, groups, m, n, k)
    per_group = False
  else:
    a_scale = checks.scale_f32(a_scale, "a_scale")
    b_host = b_scale
    if checks.python_number(b_scale):
      b_scale = checks.scale_f32(b_scale, "b_scale")
    b_scale = checks.array(b_scale, "b_scale")
    per_group = form == _ROWS and b_scale.shape == (groups,)
    if b_scale.dtype != jnp.float32 or not (b_scale.shape == () or per_group):
      want = f"a float32 scalar or [G] = [{groups}]" if form == _ROWS else "a float32 scalar"
      raise TypeError(f"b_scale must be {want} with a per-tensor a_scale, got "
                      f"{checks.describe(b_scale)}")
    checks.host_scales(b_host, "b_scale")
    mode = PER_TENSOR
  out_dtype = checks.dtype(out_dtype, "out_dtype", _OUT_DTYPES)
  return (a, b, a_scale, b_scale, group_sizes), Problem(form, groups, mode, per_group, out_dtype)


def _block_scales(a, b, a_scale, b_scale, form, groups, m, n, k):
  """(a_scale, b_scale, mode) checked as block scales (a_scale 2-D): the rows form's 1 x 128
  groups of a with 128 x 128 blocks of each b[g], or wgrad's 1 x 128 groups of both along the
  grouped rows M; e4m3 operands. TypeError / ValueError naming the argument and the shape it
  must have."""
  names = ("a", "b") if form == _ROWS else ("a_t", "b_t")
  if not a.dtype == b.dtype == jnp.float8_e4m3fn:
    raise TypeError(f"block-scaled grouped GEMMs take e4m3 operands (the DeepSeek-V3 recipe), "
                    f"got {names[0]} {a.dtype} and {names[1]} {b.dtype}")
  a_scale, b_scale = checks.array(a_scale, "a_scale"), checks.array(b_scale, "b_scale")
  for name, v in (("a_scale", a_scale), ("b_scale", b_scale)):
    if v.dtype != jnp.float32:
      raise TypeError(f"{name} must be float32, got {checks.describe(v)}")
  if form == _ROWS:
    if k % BLOCK:
      raise ValueError(f"block scales need K a multiple of {BLOCK} (1 x 128 groups along K), "
                       f"got K={k}")
    kb, nb = k // BLOCK, -(-n // BLOCK)
    want = {"a_scale": ((m, kb), f"[M, K/128] = [{m}, {kb}] (1 x 128 groups of a's rows)"),
            "b_scale": ((groups, nb, kb), f"[G, ceil(N/128), K/128] = [{groups}, {nb}, {kb}] "
                                          f"(128 x 128 blocks of each b[g])")}
    mode = BLOCK_128X128
  else:
    if m % BLOCK_ROW_ALIGN:
      raise ValueError(f"block scales need M a multiple of {BLOCK_ROW_ALIGN} (1 x 128 groups "
                       f"along the grouped rows; group_cast_transpose pads its transposed copy "
                       f"so), got M={m}")
    mb = m // BLOCK
    want = {"a_scale": ((k, mb), f"[K, M/128] = [{k}, {mb}] (1 x 128 groups of a_t's rows)"),
            "b_scale": ((n, mb), f"[N, M/128] = [{n}, {mb}] (1 x 128 groups of b_t's rows)")}
    mode = GROUP_1X128
  for name, v in (("a_scale", a_scale), ("b_scale", b_scale)):
    shape, words = want[name]
    if v.shape != shape:
      raise ValueError(f"{name} must be {words} with block scales, got {list(v.shape)}")
  return a_scale, b_scale, mode


def _on_cuda(p: Problem, a, b, a_scale, b_scale, group_sizes):
  """The CUTLASS grouped GEMM; its plan and CUTLASS's own space in one workspace result. Block
  scales go in the layouts the kernel reads each group's from: the rows form's row-major (K
  contiguous, a group's rows of a_scale one slice), wgrad's transposed ([M/128, K] and
  [M/128, N]: a group's 128-row blocks one slice; ``group_cast_transpose`` stores its
  transposed copy's scales so, and the transposes cancel)."""
  if p.form == _ROWS:
    out = (a.shape[0], b.shape[1])
  else:
    out = (p.groups, a.shape[0], b.shape[0])
  if p.mode == PER_TENSOR:
    scales = (a_scale, b_scale.reshape(-1))
  else:
    scales = (a_scale, b_scale) if p.form == _ROWS else (a_scale.T, b_scale.T)
  workspace = (_ffi.CONSTANTS["grouped_plan_bytes"] * (p.groups + 1)
               + _ffi.CONSTANTS["grouped_cutlass_bytes"])
  d, _ = jax.ffi.ffi_call(
      "jax_fp8_grouped_gemm",
      (jax.ShapeDtypeStruct(out, p.out_dtype), jax.ShapeDtypeStruct((workspace,), jnp.uint8)),
      vmap_method="sequential",
  )(a, b, *scales, group_sizes, form=np.int64(p.form), scale_mode=np.int64(p.mode))
  return sharding.vary_like(d, a, b, a_scale, b_scale, group_sizes)


def _on_cpu(p: Problem, a, b, a_scale, b_scale, group_sizes):
  """XLA's f32 ragged_dot of the upcast operands (block scales: dequantized first) over the
  clipped groups, then the per-tensor scales."""
  rows = a.shape[0] if p.form == _ROWS else a.shape[1]
  start, end = group_bounds(group_sizes, rows)
  sizes = end - start
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  if p.mode == BLOCK_128X128:  # a [M, K] in 1 x 128 groups, each b[g] [N, K] in 128 x 128 blocks
    a = a * expand_scales(a_scale, *a.shape, 1)
    b = b * jax.vmap(lambda s: expand_scales(s, *b.shape[1:], BLOCK))(b_scale)
  elif p.mode == GROUP_1X128:  # a_t [K, M], b_t [N, M], both in 1 x 128 groups along M
    a, b = a * expand_scales(a_scale, *a.shape, 1), b * expand_scales(b_scale, *b.shape, 1)
  if p.mode != PER_TENSOR:
    a_scale = b_scale = jnp.float32(1)
  hi = jax.lax.Precision.HIGHEST
  if p.form == _ROWS:
    acc = XLA_RAGGED_DOT(a, jnp.swapaxes(b, 1, 2), sizes, precision=hi,
                         preferred_element_type=jnp.float32)  # [M, N]
    row_scale = b_scale if not p.per_group_scale else jnp.concatenate(
        [b_scale, jnp.ones((1,), jnp.float32)])[jnp.searchsorted(end, jnp.arange(rows),
                                                                 side="right")]
    d = apply_scales(acc, a_scale, row_scale if row_scale.ndim == 0 else row_scale[:, None])
  else:
    dn = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((1,), (1,)), ((), ())),
                                           lhs_ragged_dimensions=[1], rhs_group_dimensions=[])
    acc = XLA_RAGGED_DOT_GENERAL(a, b, sizes, dn, precision=hi,
                                 preferred_element_type=jnp.float32)  # [G, K, N]
    d = apply_scales(acc, a_scale, b_scale)
    d = jnp.where(misaligned(start, end, p.row_align)[:, None, None], jnp.nan, d)
  return d.astype(p.out_dtype)


def _kernel(p: Problem):
  # Under vmap each item runs on its own, on the CPU as the CUDA kernel does (XLA's ragged dot
  # batches only where every operand is batched).
  return lambda *v: jax.lax.platform_dependent(
      *v, cuda=functools.partial(_on_cuda, p),
      default=jax.custom_batching.sequential_vmap(functools.partial(_on_cpu, p)))


def _plan(p: Problem):
  """The partition callback of a sharded jit: the grouped rows M gathered on every device (the
  group offsets count from the first row); N kept as b splits it (its N rows; block scales:
  whole 128-row blocks, the scales split with them), and for wgrad K as a_t splits it, on
  distinct axes (block scales: a_scale's and b_scale's rows with a_t's and b_t's); the rest
  replicated."""
  block = p.mode != PER_TENSOR

  def plan(mesh, shapes):
    rep = sharding.named(mesh)
    if p.form == _ROWS:
      bn = sharding.even(mesh, sharding.spec(shapes[1].sharding, 3)[1], shapes[1].shape[1],
                         BLOCK if block else DIM_MULTIPLE)
      b_sharding = sharding.named(mesh, None, bn, None)
      ins = (rep, b_sharding) + ((rep, b_sharding) if block else (rep, rep))
      out = sharding.named(mesh, None, bn)
    else:
      ak = sharding.even(mesh, sharding.spec(shapes[0].sharding, 2)[0], shapes[0].shape[0],
                         DIM_MULTIPLE)
      bn = sharding.even(mesh, sharding.spec(shapes[1].sharding, 2)[0], shapes[1].shape[0],
                         DIM_MULTIPLE)
      if set(sharding.axes(bn)) & set(sharding.axes(ak)):
        bn = None
      ins = (sharding.named(mesh, ak, None), sharding.named(mesh, bn, None))
      ins += ins if block else (rep, rep)
      out = sharding.named(mesh, None, ak, bn)
    return _kernel(p), ins + (rep,), out
  return plan


def _rule(p: Problem, n: int) -> tuple[str, dict, tuple]:
  """The Shardy rule, its compound factors' sizes and its reduction factors: M (the grouped
  rows) and G are never split by the plan. Block scales: the contraction and its scales'
  dimension as one factor, and in the rows form b's N with its blocks."""
  if p.mode == PER_TENSOR:
    if p.form == _ROWS:
      return f"m k, g n k, , {'g' if p.per_group_scale else ''}, g -> m n", {}, ("k",)
    return "k m, n m, , , g -> g k n", {}, ("m",)
  if p.form == _ROWS:
    nf, nbf = sharding.grouped("n", n)
    sizes = {"k1": BLOCK, **({"n1": BLOCK} if n % BLOCK == 0 else {})}
    return f"m (kb k1), g {nf} (kb k1), m kb, g {nbf} kb, g -> m {nf}", sizes, ("kb", "k1")
  return "k (mb m1), n (mb m1), k mb, n mb, g -> g k n", {"m1": BLOCK}, ("mb", "m1")


def _call(form, a, b, a_scale, b_scale, group_sizes, out_dtype):
  args, p = _check(a, b, a_scale, b_scale, group_sizes, out_dtype, form)
  a, b = args[0], args[1]
  if 0 in a.shape or 0 in b.shape:  # nothing to multiply: no kernel
    out = (a.shape[0], b.shape[1]) if form == _ROWS else (p.groups, a.shape[0], b.shape[0])
    return sharding.vary_like(jnp.zeros(out, p.out_dtype), *args)
  rule, sizes, reduction = _rule(p, b.shape[1] if form == _ROWS else b.shape[0])
  return sharding.call("grouped_gemm" if form == _ROWS else "grouped_gemm_wgrad", _kernel(p),
                       _plan(p), rule, *args, reduction_factors=reduction, **sizes)


def grouped_gemm(a: jax.Array, b: jax.Array, a_scale: jax.Array, b_scale: jax.Array,
                 group_sizes: jax.Array, *, out_dtype=jnp.bfloat16) -> jax.Array:
  """FP8 grouped GEMM over consecutive row groups, ``jax.lax.ragged_dot`` in FP8 (forward and
  dgrad of a grouped linear, TN as ``gemm``): ``d[rows of g] = (a_scale * b_scale[g]) *
  a[rows of g] @ b[g].T`` with f32 accumulation, or with block scales each product of a
  1 x 128 group of a and a 128 x 128 block of b[g] scaled by their two scales.

  Group g holds rows ``[start_g, end_g)`` of ``a``: ``end_g`` is the sum of
  ``max(group_sizes[j], 0)`` for ``j <= g``, clipped to M, and ``start_g = end_{g-1}`` (0 for
  the first). The sizes are device values, read by the kernel (no host synchronization, one
  compilation for every value): a negative size counts as 0, rows past M are dropped, and the
  rows after the last group are zero. Any row offsets work (no padding of groups), with either
  scaling: a 1 x 128 group of a lies within one row.

  CUDA (sm_90): CUTLASS's Hopper ptr-array grouped GEMM, the problem shapes built on the device
  from ``group_sizes``; FP8 tensor-core products promoted to f32 as in ``gemm``; per-tensor:
  the scales' product ``a_scale * b_scale[g]`` applied in its epilogue (f32); block scales:
  CUTLASS's blockwise-scaling mainloop, which multiplies each 128-deep slice of the
  accumulation by its scales as it promotes it to f32 (DeepSeek-V3, section 3.3.2). CPU: XLA's
  f32 ``ragged_dot`` of the upcast operands (block scales: dequantized first), the per-tensor
  scales applied as ``gemm`` applies them. Under ``jax.vmap`` each item runs as a call of its own.

  Args:
    a: [M, K] float8_e4m3fn or float8_e5m2, rows grouped consecutively by ``group_sizes``.
    b: [G, N, K] float8_e4m3fn or float8_e5m2 (not both e5m2): one [N, K] operand per group.
    a_scale, b_scale: float32 dequantization steps. Per-tensor: a_scale a scalar, b_scale a
      scalar or [G] (one step per group, e.g. per expert). Block scales (the DeepSeek-V3
      recipe; e4m3 operands, K a multiple of 128): a_scale [M, K/128] (1 x 128 groups of a's
      rows: ``group_quantize`` / ``group_cast_transpose``'s ``scale``), b_scale
      [G, ceil(N/128), K/128] (128 x 128 blocks of each b[g]: ``block_quantize``'s scale of
      the kernel [K, N], transposed).
    group_sizes: [G] int32, 1 <= G <= 1024.
    out_dtype: bfloat16 (default) or float32.
  Returns:
    [M, N] in ``out_dtype``.
  Raises:
    TypeError / ValueError at trace time: dtypes, ranks, shapes that do not match, K or N not a
    multiple of 16, G out of range, b_scale neither a scalar nor [G] with a per-tensor
    a_scale, block scales of other shapes than the above (naming the argument and its shape),
    with e5m2 operands or K not a multiple of 128, another out_dtype.
    RuntimeError when traced for a GPU where the CUDA kernels did not load; on a GPU that is
    not sm_90 the call fails when it runs.
  """
  return _call(_ROWS, a, b, a_scale, b_scale, group_sizes, out_dtype)


def grouped_gemm_wgrad(a_t: jax.Array, b_t: jax.Array, a_scale: jax.Array, b_scale: jax.Array,
                       group_sizes: jax.Array, *, out_dtype=jnp.float32) -> jax.Array:
  """FP8 grouped GEMM with the contraction ragged (the wgrad of a grouped linear,
  ``jax.lax.ragged_dot``'s kernel gradient): ``d[g] = (a_scale * b_scale) * a_t[:, rows of g]
  @ b_t[:, rows of g].T``, f32 accumulation, for the groups of ``grouped_gemm``; or with block
  scales each product of two 1 x 128 groups along the rows scaled by their two scales.

  ``a_t`` and ``b_t`` hold the grouped rows along their last axis (the transposed copies
  ``cast_transpose_delayed`` / ``group_cast_transpose`` make of x and dy). An empty group's
  ``d[g]`` is zero. A non-empty group's first row must be a multiple of 16 (``ROW_ALIGN``;
  its first FP8 element is then 16-byte aligned for the CUDA kernel's TMA loads), or of 128
  under block scales (``BLOCK_ROW_ALIGN``: the 128-row groups of the scales must not straddle
  two groups): the d[g] of any other is NaN, on every platform (pad each group's rows to that
  multiple before quantizing, as grouped layers do). The last group's size is free.

  CUDA (sm_90): CUTLASS's Hopper ptr-array grouped GEMM, as ``grouped_gemm``. CPU: XLA's f32
  ``ragged_dot_general`` with the contraction ragged.

  Args:
    a_t: [K, M] float8_e4m3fn or float8_e5m2.
    b_t: [N, M] float8_e4m3fn or float8_e5m2 (not both e5m2).
    a_scale, b_scale: float32 dequantization steps. Per-tensor: two scalars. Block scales
      (e4m3 operands, M a multiple of 128): a_scale [K, M/128] and b_scale [N, M/128], 1 x 128
      groups of a_t's and b_t's rows (``group_cast_transpose``'s ``scale_t``).
    group_sizes: [G] int32, 1 <= G <= 1024; read as in ``grouped_gemm``.
    out_dtype: float32 (default) or bfloat16.
  Returns:
    [G, K, N] in ``out_dtype``.
  Raises:
    TypeError / ValueError at trace time as ``grouped_gemm``, and M not a multiple of 16 (of
    128 under block scales).
  """
  return _call(_WGRAD, a_t, b_t, a_scale, b_scale, group_sizes, out_dtype)
