"""FP8 GEMM (TN layout) with per-tensor or block scales: cuBLASLt or, for block scales on sm_90,
jax_fp8's own kernels on CUDA; XLA's f32 dot on CPU.

FFI handlers: ``csrc/ffi/gemm_cuda.cc`` (cuBLASLt calls in ``gemm_lt.cc``) and
``csrc/ffi/block_gemm_cuda.cu`` (the kernels: ``csrc/kernels/block_gemm.cuh``); algorithm
choice: ``jax_fp8.ops.gemm_algorithms``; jnp twins: ``jax_fp8.reference.gemm`` and
``block_gemm``; tests: ``tests/test_gemm.py``, ``tests/test_block_gemm_kernel.py``.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from .. import _ffi, checks, sharding
from ..formats import BLOCK, DIM_MULTIPLE, FLOAT_DTYPES, apply_scales
from . import gemm_algorithms
from .quantize import quantize_kernel

_WORKSPACE = jax.ShapeDtypeStruct((_ffi.CONSTANTS["gemm_workspace_bytes"],), jnp.uint8)
PER_TENSOR = _ffi.CONSTANTS["scale_mode_per_tensor"]
BLOCK_128X128 = _ffi.CONSTANTS["scale_mode_block"]  # b in 128 x 128 blocks (weights)
GROUP_1X128 = _ffi.CONSTANTS["scale_mode_group"]  # b in 1 x 128 groups (wgrad)
# gemm's `algorithm`: the timed choice, cuBLASLt alone, or one of jax_fp8's block-scaled kernels.
ALGORITHMS = ("auto", "cublaslt") + gemm_algorithms.KERNELS


@dataclasses.dataclass(frozen=True)
class Problem:
  """A checked GEMM's static description: sizes, scale mode, output and options."""
  m: int
  n: int
  k: int
  mode: int
  out_dtype: jnp.dtype
  fp8_out: bool
  has_bias: bool
  fast_accum: bool
  algorithm: str

  def split(self, rest):
    """(out_scale, bias) from the arguments after the four operands (each may be None)."""
    out_scale = rest[0] if self.fp8_out else None
    bias = rest[int(self.fp8_out)] if self.has_bias else None
    return out_scale, bias


def _scale_mode(a_scale, b_scale, m, n, k) -> int:
  """The scale mode of the two scales' shapes; ValueError for shapes of no mode."""
  if a_scale.shape == () and b_scale.shape == ():
    return PER_TENSOR
  kb, nb = k // BLOCK, -(-n // BLOCK)
  modes = {(nb, kb): BLOCK_128X128, (n, kb): GROUP_1X128}
  if k % BLOCK or a_scale.shape != (m, kb) or b_scale.shape not in modes:
    want = (f"a_scale [M, K/128] = [{m}, {kb}] and b_scale [ceil(N/128), K/128] = [{nb}, {kb}] "
            f"(128 x 128 blocks) or [N, K/128] = [{n}, {kb}] (1 x 128 groups)"
            if k % BLOCK == 0 else f"K={k} is not")
    raise ValueError(f"scales must be float32 scalars (per-tensor), or block scales with K a "
                     f"multiple of 128: {want}; got a_scale {list(a_scale.shape)} and b_scale "
                     f"{list(b_scale.shape)} with K={k}")
  return modes[b_scale.shape]


def _check(a, b, a_scale, b_scale, bias, out_dtype, out_scale, fast_accum, algorithm):
  """The checked arguments (arrays) and the Problem; TypeError / ValueError otherwise."""
  _ffi.check_backend()
  a, b = checks.fp8_array(a, "a"), checks.fp8_array(b, "b")
  for name, v in (("a", a), ("b", b)):
    if v.ndim != 2:
      raise ValueError(f"{name} must be 2-D, got shape {v.shape}")
  if a.dtype == b.dtype == jnp.float8_e5m2:
    raise TypeError("e5m2 x e5m2 GEMMs are not supported (cuBLASLt has none); use e4m3 for "
                    "one operand")
  if a.shape[1] != b.shape[1]:
    raise ValueError(f"a [M, K] and b [N, K] must share K (TN layout), got a {a.shape} and "
                     f"b {b.shape}")
  (m, k), n = a.shape, b.shape[0]
  if k % DIM_MULTIPLE or n % DIM_MULTIPLE:
    raise ValueError(f"K and N must be multiples of {DIM_MULTIPLE} (cuBLASLt FP8 alignment), "
                     f"got K={k}, N={n}; pad the operands")
  # a Python number is a per-tensor scale (float32 with or without x64, checked positive)
  a_scale, b_scale = (checks.scale_f32(v, name) if checks.python_number(v)
                      else checks.array(v, name)
                      for name, v in (("a_scale", a_scale), ("b_scale", b_scale)))
  for name, v in (("a_scale", a_scale), ("b_scale", b_scale)):
    if v.dtype != jnp.float32:
      raise TypeError(f"{name} must be float32, got {v.dtype}")
  mode = _scale_mode(a_scale, b_scale, m, n, k)
  if mode != PER_TENSOR and not a.dtype == b.dtype == jnp.float8_e4m3fn:
    raise TypeError(f"block-scaled GEMMs take e4m3 operands (the DeepSeek-V3 recipe), got "
                    f"{a.dtype} x {b.dtype}")
  out_dtype = checks.dtype(out_dtype, "out_dtype",
                           FLOAT_DTYPES + (jnp.dtype(jnp.float8_e4m3fn),))
  fp8_out = out_dtype == jnp.float8_e4m3fn
  if fp8_out:
    if out_scale is None:
      raise TypeError("out_dtype float8_e4m3fn needs out_scale (the output's dequantization "
                      "step, a float32 scalar)")
    out_scale = checks.scalar_f32(out_scale, "out_scale")
    if mode != PER_TENSOR:
      raise ValueError("out_dtype float8_e4m3fn takes per-tensor scales only, got block scales")
  elif out_scale is not None:
    raise TypeError(f"out_scale applies to out_dtype float8_e4m3fn only, got out_dtype "
                    f"{out_dtype}")
  if bias is not None:
    bias = checks.array(bias, "bias")
    if out_dtype == jnp.float32:
      raise TypeError("a fused bias needs out_dtype bfloat16, float16 or float8_e4m3fn "
                      "(cuBLASLt's FP8 epilogue); add an f32 bias after the GEMM")
    bias_dtype = jnp.dtype(jnp.bfloat16) if fp8_out else out_dtype
    if bias.shape != (n,) or bias.dtype != bias_dtype:
      error = TypeError if bias.dtype != bias_dtype else ValueError
      raise error(f"bias must be [{n}] {bias_dtype}, got {bias.dtype}{list(bias.shape)}")
  fast_accum = checks.boolean(fast_accum, "fast_accum")
  if mode != PER_TENSOR and fast_accum:
    raise ValueError("fast_accum applies to per-tensor scales only: block-scaled GEMMs promote "
                     "to f32 at every 128-element group")
  algorithm = checks.one_of(algorithm, "algorithm", ALGORITHMS)
  if algorithm in gemm_algorithms.KERNELS and mode == PER_TENSOR:
    raise ValueError(f"algorithm {algorithm!r} is a block-scaled kernel; per-tensor scales take "
                     f"'auto' or 'cublaslt'")
  args = (a, b, a_scale, b_scale) + ((out_scale,) if fp8_out else ()) + (
      (bias,) if bias is not None else ())
  return args, Problem(m, n, k, mode, out_dtype, fp8_out, bias is not None, fast_accum,
                       algorithm)


def _finish(p: Problem, d, out_scale, out_dtype):
  """An f32 result in the output dtype: e4m3 with its amax (the quantize kernel), or a cast."""
  return quantize_kernel(d, out_scale, "e4m3") if p.fp8_out else d.astype(out_dtype)


def _on_cuda(p: Problem, out_dtype, a, b, a_scale, b_scale, *rest):
  """The algorithm ``p.algorithm`` names, or the one timed fastest for the problem: cuBLASLt's
  (``_cublaslt``) or one of jax_fp8's block-scaled kernels (``_block_kernel``)."""
  m, n = a.shape[0], b.shape[0]  # this device's piece under a sharded jit
  # Block-scaled problems are keyed, and cuBLASLt's candidates timed, at M padded to 4 rows.
  # A kernel named by the caller runs as it is, nothing timed; "auto" and "cublaslt" time
  # the problem's candidates once (cuBLASLt's choice is installed for the handler to find).
  rows = m if p.mode == PER_TENSOR else -(-m // 4) * 4
  kernel = p.algorithm
  if p.algorithm in ("auto", "cublaslt"):
    kernel = gemm_algorithms.select((rows, n, a.shape[1], a.dtype.name, b.dtype.name,
                                     jnp.dtype(out_dtype).name, p.has_bias, p.fast_accum,
                                     int(p.mode)))
    if p.algorithm == "cublaslt":
      kernel = None
  out = (functools.partial(_block_kernel, kernel) if kernel else _cublaslt)(
      p, out_dtype, a, b, a_scale, b_scale, *rest)
  return sharding.vary_like(out, a, b, a_scale, b_scale, *rest)


def _block_kernel(kernel: str, p: Problem, out_dtype, a, b, a_scale, b_scale, *rest):
  """jax_fp8's block-scaled kernel ``kernel``, with the scales in the layouts it reads
  (``block_kernel_call``); a needs no padding (TMA reads rows past M as zeros)."""
  _, bias = p.split(rest)
  a_scale_t = jnp.pad(a_scale, ((0, -a.shape[0] % 4), (0, 0))).T
  if p.mode == BLOCK_128X128:
    b_scale = jnp.pad(b_scale, ((0, -b_scale.shape[0] % 4), (0, 0)))
  return block_kernel_call(kernel, p.mode, out_dtype, a, b, a_scale_t, b_scale.T, bias)


def block_kernel_call(kernel: str, mode: int, out_dtype, a, b, a_scale_t, b_scale_t, bias=None):
  """The FFI call of jax_fp8's block-scaled kernel ``kernel`` (one of ``ALGORITHMS[2:]``; CUDA,
  sm_90) on operands already checked by ``gemm``, the scales in the layouts it reads
  (``csrc/ffi/block_gemm.h``), each M or N contiguous for TMA's 16-byte rows: a [M, K] and
  b [N, K] e4m3; a_scale_t [K/128, ceil4(M)]; b_scale_t [K/128, N] (``GROUP_1X128``) or
  [K/128, ceil4(ceil(N/128))] (``BLOCK_128X128``); bias [N] in ``out_dtype`` (bf16 / f16) or
  None. Returns d [M, N] in ``out_dtype``."""
  return jax.ffi.ffi_call("jax_fp8_block_gemm",
                          jax.ShapeDtypeStruct((a.shape[0], b.shape[0]), out_dtype),
                          vmap_method="sequential")(
      a, b, a_scale_t, b_scale_t, bias if bias is not None else jnp.zeros((0,), out_dtype),
      has_bias=bias is not None, scale_mode=np.int64(mode), kernel=kernel)


def _cublaslt(p: Problem, out_dtype, a, b, a_scale, b_scale, *rest):
  """cuBLASLt, with the operands and scales in the layouts it reads (csrc/ffi/gemm_cuda.cc)."""
  out_scale, bias = p.split(rest)
  m, n = a.shape[0], b.shape[0]
  bias_arg = bias if bias is not None else jnp.zeros((0,), jnp.bfloat16 if p.fp8_out
                                                     else out_dtype)
  # cuBLASLt multiplies by its D scale: the reciprocal, computed as quantize computes it.
  d_scale = (1.0 / out_scale).reshape(1) if p.fp8_out else jnp.zeros((0,), jnp.float32)
  rows = m
  if p.mode != PER_TENSOR:
    rows = -(-m // 4) * 4  # cuBLASLt takes block-scaled GEMMs only for M % 4 == 0: zero rows
    a = jnp.pad(a, ((0, rows - m), (0, 0)))
    a_scale = jnp.pad(a_scale, ((0, rows - m), (0, 0))).T  # [K/128, M], M contiguous
    if p.mode == BLOCK_128X128:  # [ceil(N/128), K/128] with rows padded to 16 bytes
      b_scale = jnp.pad(b_scale, ((0, 0), (0, -b_scale.shape[1] % 4)))
    else:  # [K/128, N], N contiguous
      b_scale = b_scale.T
  d, amax_d, _ = jax.ffi.ffi_call(
      "jax_fp8_gemm",
      (jax.ShapeDtypeStruct((rows, n), out_dtype),
       jax.ShapeDtypeStruct((int(p.fp8_out),), jnp.float32), _WORKSPACE),
      vmap_method="sequential",
  )(a, b, a_scale, b_scale, bias_arg, d_scale, has_bias=p.has_bias, fast_accum=p.fast_accum,
    scale_mode=np.int64(p.mode))
  return (d[:m], amax_d[0]) if p.fp8_out else d[:m]


def expand_scales(scale: jax.Array, rows: int, cols: int, block_rows: int) -> jax.Array:
  """Block scales [ceil(rows / block_rows), ceil(cols / 128)] repeated to one per element
  [rows, cols]: block_rows 1 for 1 x 128 groups, 128 for 128 x 128 blocks."""
  s = jnp.repeat(jnp.repeat(scale, block_rows, axis=0), BLOCK, axis=1)
  return s[:rows, :cols]


def _on_cpu(p: Problem, out_dtype, a, b, a_scale, b_scale, *rest):
  """XLA's f32 dot of the upcast operands (block scales: dequantized first)."""
  out_scale, bias = p.split(rest)
  (m, k), n = a.shape, b.shape[0]
  a, b = a.astype(jnp.float32), b.astype(jnp.float32)
  if p.mode != PER_TENSOR:
    a = a * expand_scales(a_scale, m, k, 1)
    b = b * expand_scales(b_scale, n, k, BLOCK if p.mode == BLOCK_128X128 else 1)
    a_scale = b_scale = jnp.float32(1)
  acc = jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
  d = apply_scales(acc, a_scale, b_scale)
  if bias is not None:
    d = d + bias.astype(jnp.float32)
  return _finish(p, d, out_scale, out_dtype)


def _kernel(p: Problem, out_dtype):
  """The per-device GEMM for the platform being lowered, into ``out_dtype``."""
  return lambda *v: jax.lax.platform_dependent(
      *v, cuda=functools.partial(_on_cuda, p, out_dtype),
      default=functools.partial(_on_cpu, p, out_dtype))


def _plan(p: Problem):
  """The partition callback of a sharded jit. M and N keep a's and b's row sharding (on distinct
  axes); a K split alike in a and b is kept for a 16/32-bit output (block scales: whole
  128-groups on each device), the local products summed in f32, then the bias added and the
  result cast once; otherwise K is gathered."""
  def plan(mesh, shapes):
    am, ak = sharding.spec(shapes[0].sharding, 2)
    bn, bk = sharding.spec(shapes[1].sharding, 2)
    am = sharding.even(mesh, am, p.m)
    bn = sharding.even(mesh, bn, p.n, BLOCK if p.mode == BLOCK_128X128 else DIM_MULTIPLE)
    if set(sharding.axes(bn)) & set(sharding.axes(am)):
      bn = None
    same_k = sharding.axes(ak) == sharding.axes(bk)
    kk = (sharding.even(mesh, ak, p.k, BLOCK if p.mode != PER_TENSOR else DIM_MULTIPLE)
          if same_k and not p.fp8_out else None)
    if set(sharding.axes(kk)) & set(sharding.axes(am, bn)):
      kk = None
    rep = sharding.named(mesh)
    ins = (sharding.named(mesh, am, kk), sharding.named(mesh, bn, kk))
    ins += ((rep, rep) if p.mode == PER_TENSOR else
            (sharding.named(mesh, am, kk), sharding.named(mesh, bn, kk)))
    ins += (rep,) * p.fp8_out + ((sharding.named(mesh, bn),) if p.has_bias else ())
    d = sharding.named(mesh, am, bn)
    over_k, over_mn = sharding.axes(kk), sharding.axes(am, bn)

    def lower(*v):
      if not over_k:
        out = _kernel(p, p.out_dtype)(*v)
        return (out[0], sharding.pmax_keep_nan(out[1], over_mn)) if p.fp8_out else out
      d = jax.lax.psum(_kernel(dataclasses.replace(p, has_bias=False), jnp.float32)(*v[:4]),
                       over_k)
      return (d if not p.has_bias else d + v[4].astype(jnp.float32)).astype(p.out_dtype)
    return lower, ins, (d, rep) if p.fp8_out else d
  return plan


def _rule(p: Problem) -> tuple[str, dict, tuple]:
  """The Shardy rule, its compound factors' sizes and its reduction factors. Block scales: K
  and the scales' K/128 as one factor, and N with its blocks (128 x 128 mode)."""
  if p.mode != PER_TENSOR:
    nf, nbf = sharding.grouped("n", p.n) if p.mode == BLOCK_128X128 else ("n", "n")
    rule = f"m (kb k1), {nf} (kb k1), m kb, {nbf} kb"
    sizes = {"k1": BLOCK, **({"n1": BLOCK} if p.mode == BLOCK_128X128 and p.n % BLOCK == 0
                              else {})}
    reduction = ("kb", "k1")
  else:
    nf, rule, sizes, reduction = "n", "m k, n k, , ", {}, ("k",)
  rule += ", " * p.fp8_out + (f", {nf}" if p.has_bias else "") + f" -> m {nf}" + ", " * p.fp8_out
  return rule, sizes, reduction


def gemm(a: jax.Array, b: jax.Array, a_scale: jax.Array, b_scale: jax.Array, *,
         bias: jax.Array | None = None, out_dtype=jnp.bfloat16,
         out_scale: jax.Array | None = None, fast_accum: bool = False,
         algorithm: str = "auto") -> jax.Array | tuple[jax.Array, jax.Array]:
  """FP8 GEMM in TN layout with f32 accumulation: ``(a_scale * b_scale) * a @ b.T + bias``,
  with per-tensor or block scales, into a 16/32-bit output or into e4m3 with its amax.

  CUDA: cuBLASLt (scales read on the device, bias in the epilogue, its candidate algorithms
  timed once per problem while tracing and the choice recorded for later runs:
  ``jax_fp8.ops.gemm_algorithms``; block scales through its VEC128 / BLK128x128 modes, cuBLASLt
  >= 12.9, the DeepSeek-V3 recipe; an e4m3 output through its D scale and amax-D epilogue, as
  TransformerEngine's FP8-output GEMMs). Block-scaled GEMMs on sm_90 also time jax_fp8's own
  kernels (persistent, warp-specialized, TMA and wgmma; every 128-element block of K promoted
  to f32 with its scales: ``csrc/kernels/block_gemm.cuh``) and run one where it is faster.
  CPU: XLA's f32 dot on the upcast (for block scales: dequantized) operands, the per-tensor
  scales applied so that their product cannot underflow (``jax_fp8.formats.apply_scales``).

  Args:
    a: [M, K] float8_e4m3fn or float8_e5m2.
    b: [N, K] float8_e4m3fn or float8_e5m2 (not both e5m2).
    a_scale, b_scale: the operands' dequantization steps, float32. Per-tensor: two scalars.
      Block scaling (K a multiple of 128): a_scale [M, K/128] (1 x 128 groups of a's rows) and
      b_scale [ceil(N/128), K/128] (128 x 128 blocks, weights) or [N, K/128] (1 x 128 groups,
      as in wgrad); ``group_quantize`` / ``block_quantize`` / ``group_cast_transpose`` make
      them. Block scales need e4m3 operands and no ``fast_accum``. On CUDA a block-scaled GEMM
      with M not a multiple of 4 runs on a copy of a padded with zero rows.
    bias: optional [N] in ``out_dtype`` (bfloat16 or float16), or bfloat16 for an e4m3 output.
    out_dtype: bfloat16 (default), float16, float32, or float8_e4m3fn (per-tensor scales
      only) so a layer hands FP8 straight to the next.
    out_scale: the e4m3 output's dequantization step, float32 scalar, required with
      ``out_dtype=float8_e4m3fn`` and rejected otherwise: the output is
      ``saturate(rne(d * (1 / out_scale)))``, like ``quantize(d, out_scale)``. With a bias,
      cuBLASLt adds it in bf16 before the cast (about 2^-7 relative); the CPU path is exact.
    fast_accum: a bool; let Hopper's FP8 tensor cores accumulate without periodic promotion
      to f32 (cuBLASLt ``FAST_ACCUM``): faster, less accurate for large K. CPU ignores it.
    algorithm: ``"auto"`` (default): the candidate timed fastest for the problem;
      ``"cublaslt"``: cuBLASLt's fastest; or, for block scales, one of jax_fp8's kernels by name
      (``jax_fp8.ops.gemm.ALGORITHMS`` after the first two: ``"sm90_128x<BLOCK_N>_c<C>"``,
      128 x BLOCK_N output tiles in clusters of C CTAs that share b's tiles; sm_90 only, the
      handler refuses other GPUs). Every choice keeps within the same accumulation bound. CPU
      ignores it. Under ``JAX_FP8_GEMM_AUTOTUNE=0``, "auto" is cuBLASLt's first heuristic choice.
  Returns:
    [M, N] in ``out_dtype``; for an e4m3 output the pair ``(d [M, N] e4m3, amax f32 [])``
    where amax is max |d| before the cast, in f32 (on CUDA cuBLASLt's amax-D).
  Raises:
    TypeError / ValueError at trace time: wrong dtypes, ranks, K mismatch, K or N not a
    multiple of 16, scales of shapes that match no scale mode, block scales with e5m2 operands,
    fast_accum or an e4m3 output, a bias with f32 output or of the wrong shape or dtype,
    out_scale missing for an e4m3 output or given for another, fast_accum not a bool,
    algorithm not one of ``ALGORITHMS`` or a block-scaled kernel with per-tensor scales.
  """
  args, p = _check(a, b, a_scale, b_scale, bias, out_dtype, out_scale, fast_accum, algorithm)
  if 0 in (p.m, p.n, p.k):  # nothing to multiply: no library call
    out_scale, bias = p.split(args[4:])
    d = jnp.zeros((p.m, p.n), jnp.float32) + (0 if bias is None else bias.astype(jnp.float32))
    return sharding.vary_like(_finish(p, d, out_scale, p.out_dtype), *args)
  rule, sizes, reduction = _rule(p)
  return sharding.call("gemm", _kernel(p, p.out_dtype), _plan(p), rule, *args,
                       reduction_factors=reduction, **sizes)


def gemm_dtype(dtype):
  """cuBLASLt writes bf16 / f16 directly; f32 inputs get an f32 GEMM output."""
  return dtype if dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def gemm_bias(a, b, a_scale, b_scale, bias, dtype, fast_accum=False):
  """``a @ b.T + bias`` in ``dtype``, the bias fused into the GEMM's epilogue where cuBLASLt
  can (bf16 / f16 outputs)."""
  out = gemm_dtype(dtype)
  fused_bias = bias is not None and out != jnp.float32
  y = gemm(a, b, a_scale, b_scale, bias=bias.astype(out) if fused_bias else None,
           out_dtype=out, fast_accum=fast_accum)
  if bias is not None and not fused_bias:
    y = y + bias.astype(out)
  return y.astype(dtype)
