"""Grouped FP8 GEMMs with the group sizes on the device (``jax.lax.ragged_dot``'s semantics):
CUTLASS's Hopper ptr-array grouped kernel on CUDA, XLA's f32 ``ragged_dot`` on CPU.

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
from ..formats import DIM_MULTIPLE, apply_scales

ROW_ALIGN = _ffi.CONSTANTS["grouped_row_align"]  # 16: wgrad groups start at multiples of it
MAX_GROUPS = _ffi.CONSTANTS["max_groups"]
_ROWS, _WGRAD = 0, 1  # the handler's `form` attribute (csrc GroupedForm)
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
# XLA's ragged dots as jax.lax held them when jax_fp8 was imported: jax_fp8.convert replaces
# jax.lax's while a converted linen model runs, and jax_fp8's own calls are never the model's.
XLA_RAGGED_DOT, XLA_RAGGED_DOT_GENERAL = jax.lax.ragged_dot, jax.lax.ragged_dot_general


@dataclasses.dataclass(frozen=True)
class Problem:
  """A checked grouped GEMM: its form, group count, b_scale per group or not, output dtype."""
  form: int
  groups: int
  per_group_scale: bool
  out_dtype: jnp.dtype


def group_bounds(group_sizes: jax.Array, rows: int) -> tuple[jax.Array, jax.Array]:
  """(start [G], end [G]) int32 of each group's rows: consecutive from row 0, a negative size
  counted as 0, every bound clipped to ``rows`` (so rows past ``rows`` are dropped)."""
  end = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows).astype(jnp.int32)
  start = jnp.concatenate([jnp.zeros((1,), jnp.int32), end[:-1]])
  return start, end


def misaligned(start: jax.Array, end: jax.Array) -> jax.Array:
  """[G] bool: the non-empty groups whose first row is not a multiple of ``ROW_ALIGN``, whose
  wgrad ``grouped_gemm_wgrad`` writes as NaN."""
  return (start % ROW_ALIGN != 0) & (end > start)


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
  a_scale = checks.scale_f32(a_scale, "a_scale")
  if checks.python_number(b_scale):
    b_scale = checks.scale_f32(b_scale, "b_scale")
  b_scale = checks.array(b_scale, "b_scale")
  per_group = form == _ROWS and b_scale.shape == (groups,)
  if b_scale.dtype != jnp.float32 or not (b_scale.shape == () or per_group):
    want = f"a float32 scalar or [G] = [{groups}]" if form == _ROWS else "a float32 scalar"
    raise TypeError(f"b_scale must be {want}, got {checks.describe(b_scale)}")
  out_dtype = checks.dtype(out_dtype, "out_dtype", _OUT_DTYPES)
  return (a, b, a_scale, b_scale, group_sizes), Problem(form, groups, per_group, out_dtype)


def _on_cuda(p: Problem, a, b, a_scale, b_scale, group_sizes):
  """The CUTLASS grouped GEMM; its plan and CUTLASS's own space in one workspace result."""
  if p.form == _ROWS:
    out = (a.shape[0], b.shape[1])
  else:
    out = (p.groups, a.shape[0], b.shape[0])
  workspace = (_ffi.CONSTANTS["grouped_plan_bytes"] * (p.groups + 1)
               + _ffi.CONSTANTS["grouped_cutlass_bytes"])
  d, _ = jax.ffi.ffi_call(
      "jax_fp8_grouped_gemm",
      (jax.ShapeDtypeStruct(out, p.out_dtype), jax.ShapeDtypeStruct((workspace,), jnp.uint8)),
      vmap_method="sequential",
  )(a, b, a_scale, b_scale.reshape(-1), group_sizes, form=np.int64(p.form))
  return sharding.vary_like(d, a, b, a_scale, b_scale, group_sizes)


def _on_cpu(p: Problem, a, b, a_scale, b_scale, group_sizes):
  """XLA's f32 ragged_dot of the upcast operands over the clipped groups, then the scales."""
  rows = a.shape[0] if p.form == _ROWS else a.shape[1]
  start, end = group_bounds(group_sizes, rows)
  sizes = end - start
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
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
    d = jnp.where(misaligned(start, end)[:, None, None], jnp.nan, d)
  return d.astype(p.out_dtype)


def _kernel(p: Problem):
  return lambda *v: jax.lax.platform_dependent(
      *v, cuda=functools.partial(_on_cuda, p), default=functools.partial(_on_cpu, p))


def _plan(p: Problem):
  """The partition callback of a sharded jit: the grouped rows M gathered on every device (the
  group offsets count from the first row); N kept as b splits it (its N rows), and for wgrad K
  as a_t splits it, on distinct axes; the rest replicated."""
  def plan(mesh, shapes):
    rep = sharding.named(mesh)
    if p.form == _ROWS:
      bn = sharding.even(mesh, sharding.spec(shapes[1].sharding, 3)[1], shapes[1].shape[1],
                         DIM_MULTIPLE)
      ins = (rep, sharding.named(mesh, None, bn, None))
      out = sharding.named(mesh, None, bn)
    else:
      ak = sharding.even(mesh, sharding.spec(shapes[0].sharding, 2)[0], shapes[0].shape[0],
                         DIM_MULTIPLE)
      bn = sharding.even(mesh, sharding.spec(shapes[1].sharding, 2)[0], shapes[1].shape[0],
                         DIM_MULTIPLE)
      if set(sharding.axes(bn)) & set(sharding.axes(ak)):
        bn = None
      ins = (sharding.named(mesh, ak, None), sharding.named(mesh, bn, None))
      out = sharding.named(mesh, None, ak, bn)
    return _kernel(p), ins + (rep, rep, rep), out
  return plan


def _rule(p: Problem) -> str:
  """The Shardy rule: M (the grouped rows) and G are never split by the plan."""
  if p.form == _ROWS:
    return f"m k, g n k, , {'g' if p.per_group_scale else ''}, g -> m n"
  return "k m, n m, , , g -> g k n"


def _call(form, a, b, a_scale, b_scale, group_sizes, out_dtype):
  args, p = _check(a, b, a_scale, b_scale, group_sizes, out_dtype, form)
  if 0 in args[0].shape or 0 in args[1].shape:  # nothing to multiply: no kernel
    a, b = args[0], args[1]
    out = (a.shape[0], b.shape[1]) if form == _ROWS else (p.groups, a.shape[0], b.shape[0])
    return sharding.vary_like(jnp.zeros(out, p.out_dtype), *args)
  reduction = ("k",) if form == _ROWS else ("m",)
  return sharding.call("grouped_gemm" if form == _ROWS else "grouped_gemm_wgrad", _kernel(p),
                       _plan(p), _rule(p), *args, reduction_factors=reduction)


def grouped_gemm(a: jax.Array, b: jax.Array, a_scale: jax.Array, b_scale: jax.Array,
                 group_sizes: jax.Array, *, out_dtype=jnp.bfloat16) -> jax.Array:
  """FP8 grouped GEMM over consecutive row groups, ``jax.lax.ragged_dot`` in FP8 (forward and
  dgrad of a grouped linear, TN as ``gemm``): ``d[rows of g] = (a_scale * b_scale[g]) *
  a[rows of g] @ b[g].T`` with f32 accumulation.

  Group g holds rows ``[start_g, end_g)`` of ``a``: ``end_g`` is the sum of
  ``max(group_sizes[j], 0)`` for ``j <= g``, clipped to M, and ``start_g = end_{g-1}`` (0 for
  the first). The sizes are device values, read by the kernel (no host synchronization, one
  compilation for every value): a negative size counts as 0, rows past M are dropped, and the
  rows after the last group are zero. Any row offsets work (no padding of groups).

  CUDA (sm_90): CUTLASS's Hopper ptr-array grouped GEMM, the problem shapes built on the device
  from ``group_sizes``; FP8 tensor-core products promoted to f32 as in ``gemm``; the scales'
  product ``a_scale * b_scale[g]`` applied in its epilogue (f32). CPU: XLA's f32
  ``ragged_dot`` of the upcast operands, the scales applied as ``gemm`` applies them.

  Args:
    a: [M, K] float8_e4m3fn or float8_e5m2, rows grouped consecutively by ``group_sizes``.
    b: [G, N, K] float8_e4m3fn or float8_e5m2 (not both e5m2): one [N, K] operand per group.
    a_scale: a's dequantization step, float32 scalar.
    b_scale: float32 scalar, or [G] (one step per group, e.g. per expert).
    group_sizes: [G] int32, 1 <= G <= 1024.
    out_dtype: bfloat16 (default) or float32.
  Returns:
    [M, N] in ``out_dtype``.
  Raises:
    TypeError / ValueError at trace time: dtypes, ranks, shapes that do not match, K or N not a
    multiple of 16, G out of range, b_scale neither a scalar nor [G], another out_dtype.
    RuntimeError when traced for a GPU where the CUDA kernels did not load; on a GPU that is
    not sm_90 the call fails when it runs.
  """
  return _call(_ROWS, a, b, a_scale, b_scale, group_sizes, out_dtype)


def grouped_gemm_wgrad(a_t: jax.Array, b_t: jax.Array, a_scale: jax.Array, b_scale: jax.Array,
                       group_sizes: jax.Array, *, out_dtype=jnp.float32) -> jax.Array:
  """FP8 grouped GEMM with the contraction ragged (the wgrad of a grouped linear,
  ``jax.lax.ragged_dot``'s kernel gradient): ``d[g] = (a_scale * b_scale) * a_t[:, rows of g]
  @ b_t[:, rows of g].T``, f32 accumulation, for the groups of ``grouped_gemm``.

  ``a_t`` and ``b_t`` hold the grouped rows along their last axis (the cast-transposed copies
  ``cast_transpose_delayed`` / ``quantize`` make of x and dy). An empty group's ``d[g]`` is
  zero. A non-empty group's first row must be a multiple of 16 (``ROW_ALIGN``), so that its
  first FP8 element is 16-byte aligned for the CUDA kernel's TMA loads: the d[g] of any other
  is NaN, on every platform (pad each group's rows to a multiple of 16, as grouped layers do).

  CUDA (sm_90): CUTLASS's Hopper ptr-array grouped GEMM, as ``grouped_gemm``. CPU: XLA's f32
  ``ragged_dot_general`` with the contraction ragged.

  Args:
    a_t: [K, M] float8_e4m3fn or float8_e5m2.
    b_t: [N, M] float8_e4m3fn or float8_e5m2 (not both e5m2).
    a_scale, b_scale: the operands' dequantization steps, float32 scalars.
    group_sizes: [G] int32, 1 <= G <= 1024; read as in ``grouped_gemm``.
    out_dtype: float32 (default) or bfloat16.
  Returns:
    [G, K, N] in ``out_dtype``.
  Raises:
    TypeError / ValueError at trace time as ``grouped_gemm``, and M not a multiple of 16.
  """
  return _call(_WGRAD, a_t, b_t, a_scale, b_scale, group_sizes, out_dtype)
