"""NVFP4 quantization (NVIDIA's NVFP4 pretraining report, arXiv 2509.25149; TransformerEngine's
NVFP4 recipe): E2M1 elements (+-{0, 0.5, 1, 1.5, 2, 3, 4, 6}) packed two a byte, one E4M3 scale
per 16 consecutive elements (or per 16 x 16 tile) and one f32 global scale:
``x ~= e2m1 * scale * global_scale``, ``global_scale = amax / (448 * 6)``. Options as the report
trains: 16 x 16 weight tiles (both directions then hold the same numbers), stochastic rounding
of gradients (Philox4x32-10 bits drawn from each block's coordinates and a key), and the random
Hadamard transform of the wgrad operands' columnwise copy. On Hopper no tensor core reads these
operands; the bytes are the ones a Blackwell block-scaled GEMM reads.

The global amaxes are XLA reductions (under a sharded ``jit`` over the whole tensor, so every
device quantizes with one global scale; inside ``shard_map`` pass ``global_amax`` reduced over
the axes that split x); then one kernel writes both directions from one read of x: the
specialised register-resident kernel where only 1 x 16 rowwise blocks are asked for, the
general tile kernel otherwise (``nvfp4_quantize_cuda_kernel`` says which, and why).

CUDA kernel: ``csrc/kernels/nvfp4_quantize.cuh``; numerics ``csrc/nvfp4.h`` (with
``csrc/philox.h``), shared with the CPU handler ``csrc/ffi/nvfp4_quantize_cpu.cc``; jnp twins
``jax_fp8.reference.nvfp4_quantize`` / ``nvfp4_dequantize``; tests: ``tests/test_nvfp4.py``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .. import checks, sharding
from ..formats import FLOAT_DTYPES, NVFP4_BLOCK, amax, apply_scales, as_f32, nvfp4_global_scale
from ..hadamard import hadamard_amax, rht_signs
from ..philox import key_words
from ..quantized import Quantized


def _check_options(stochastic_rounding, key, block_2d, columnwise, rht, global_amax_t) -> None:
  """The combinations of ``nvfp4_quantize``'s options that it refuses, each a ValueError saying
  what the option needs."""
  if stochastic_rounding and key is None:
    raise ValueError("stochastic_rounding=True needs a key (a jax.random key), got key=None")
  if key is not None and not stochastic_rounding:
    raise ValueError("key is stochastic rounding's: it needs stochastic_rounding=True")
  if stochastic_rounding and block_2d:
    raise ValueError("stochastic rounding takes 1 x 16 blocks (gradients): block_2d=True "
                     "(weights) rounds to nearest, so both directions hold the same numbers")
  if rht and (not columnwise or block_2d):
    raise ValueError("rht transforms the columnwise copy of 1 x 16 blocks: it needs "
                     "columnwise=True and block_2d=False")
  if global_amax_t is not None and not rht:
    raise ValueError("global_amax_t is the amax of the Hadamard-transformed columnwise copy: "
                     "it needs rht=True")


def _global_amax(v, name):
  """A float scalar (the tensor's amax) as f32; a Python int or float is taken as one."""
  rule = f"{name} must be a float scalar (the tensor's amax), got {checks.describe(v)}"
  v = checks.array(np.float32(v) if checks.python_number(v) else v, name)
  if not jnp.issubdtype(v.dtype, jnp.floating):
    raise TypeError(rule)
  if v.shape != ():
    raise ValueError(rule)
  return v.astype(jnp.float32)


_OUTPUTS = ("data", "scale", "data_t", "scale_t")  # the kernel's results, in order
_SPECIALISED, _GENERAL = "nvfp4_rowwise_kernel", "nvfp4_quantize_kernel"


def nvfp4_quantize_cuda_kernel(*, rowwise: bool = True, columnwise: bool = False,
                               block_2d: bool = False) -> tuple[str, str]:
  """Which CUDA kernel ``nvfp4_quantize`` launches for these options (one per call), and why
  the specialised one was refused.

  The specialised kernel, ``nvfp4_rowwise_kernel``, keeps each thread's 16-element block in
  registers: no shared memory, no barrier, contiguous loads and stores, any number of rows. It
  takes rowwise 1 x 16 blocks only (any input dtype, stochastic rounding included). The general
  kernel, ``nvfp4_quantize_kernel``, serves every case through 64 x 64 shared-memory tiles.
  Both write the same bytes. (The CPU handler is one loop for every case.)

  Returns:
    ``(kernel_name, reason)``: ``reason`` is ``""`` for the specialised kernel, else why it
    was refused.
  Raises:
    TypeError: a flag that is not a bool. ValueError: neither direction asked for.
  """
  rowwise = checks.boolean(rowwise, "rowwise")
  columnwise = checks.boolean(columnwise, "columnwise")
  block_2d = checks.boolean(block_2d, "block_2d")
  if not (rowwise or columnwise):
    raise ValueError("NVFP4 quantization needs rowwise=True or columnwise=True (or both)")
  if columnwise:
    return _GENERAL, ("columnwise=True: the columnwise copy is transposed through the general "
                      "kernel's shared-memory tile")
  if block_2d:
    return _GENERAL, ("block_2d=True: a 16 x 16 tile's amax is reduced across 16 rows in the "
                      "general kernel's tile")
  return _SPECIALISED, ""


def quantize_call(x, global_scales, words, signs, *, rowwise, columnwise, block_2d,
                  stochastic_rounding, rht, specialised):
  """The kernel's call on one device, inputs as the kernel reads them (global_scales f32 [2]:
  rowwise, columnwise; words uint32 [2]; signs f32 [16]; ``specialised``: the CUDA handler
  launches the specialised kernel, which ``nvfp4_quantize_cuda_kernel`` must allow): the
  outputs data, scale, data_t, scale_t, a direction not asked for shaped (0,)."""
  r, c = x.shape
  shapes = {"data": ((r, c // 2), jnp.uint8),
            "scale": ((r, c // NVFP4_BLOCK), jnp.float8_e4m3fn),
            "data_t": ((c, r // 2), jnp.uint8),
            "scale_t": ((c, r // NVFP4_BLOCK), jnp.float8_e4m3fn)}
  wanted = ("data", "scale") * rowwise + ("data_t", "scale_t") * columnwise
  return jax.ffi.ffi_call(
      "jax_fp8_nvfp4_quantize",
      tuple(jax.ShapeDtypeStruct(shapes[n][0] if n in wanted else (0,), shapes[n][1])
            for n in _OUTPUTS),
      vmap_method="sequential",
  )(x, global_scales, words, signs, rowwise=rowwise, columnwise=columnwise, block_2d=block_2d,
    stochastic_rounding=stochastic_rounding, rht=rht, specialised=specialised)


def nvfp4_quantize(x: jax.Array, *, rowwise: bool = True, columnwise: bool = False,
                   block_2d: bool = False, stochastic_rounding: bool = False, key=None,
                   rht: bool = False, rht_seed: int | None = None, global_amax=None,
                   global_amax_t=None) -> Quantized:
  """NVFP4 quantization of ``x`` along its rows and / or its columns, both from one read.

  Each block's scale is ``e4m3(block_amax * (f32(1 / 6) / global_scale))`` and each element
  ``e2m1(x * (1 / (scale * global_scale)))``, saturating at +-6; an all-zero block gets scale 0 and
  zero elements; a NaN or infinity in x makes the global scale NaN (and a NaN in a block its
  scale NaN). Every operation is rounded and flushed as ``jax_fp8.reference.nvfp4_quantize``
  computes it on the CPU: the bytes are identical.

  Args:
    x: [R, C] float32 / bfloat16 / float16; C a positive multiple of 16, R a multiple of 16 with
      ``columnwise`` or ``block_2d``; f32 subnormals count as zero.
    rowwise: quantize 1 x 16 blocks along the rows (the operand of a GEMM contracting over C).
    columnwise: quantize 16 x 1 blocks along the columns, written transposed (x.T's rowwise
      quantization, from x itself).
    block_2d: one scale per 16 x 16 tile (weights), repeated on the tile's 16 rows in
      ``scale``; the two directions then hold the same numbers. Round to nearest only.
    stochastic_rounding: round each element up or down at random with the probabilities that
      make it unbiased (gradients), 16 Philox4x32-10 bits an element: block b of row r in
      direction d (0 rowwise, 1 columnwise, rows then x's columns) draws counters (b, r, d, 0)
      and (b, r, d, 1) under ``key`` (``jax_fp8.stochastic_rounding.sr_bits``). Needs ``key``.
    key: a JAX PRNG key (``jax.random.key(seed)``, threefry) or raw uint32 [2]; give a fresh
      one each step and tensor (``jax.random.fold_in``).
    rht: the columnwise copy quantizes each 16-element group of x.T's rows after the random
      Hadamard transform ``jax_fp8.hadamard.hadamard_transform(., rht_seed)`` (the report's
      wgrad operands), under its own global scale ``global_scale_t``. Needs ``columnwise``, 1D
      blocks.
    rht_seed: the transform's sign seed, a Python int in [0, 2^64); None (default): 0. Only
      with ``rht``.
    global_amax, global_amax_t: f32 scalars to take the global scales from instead of this x's
      amax (and its transformed copy's, with ``rht``): e.g. the max over the devices holding
      parts of the tensor. A value below the true amax saturates scales at 448 and elements
      at +-6; a value <= 0 is an all-zero tensor's (global scale 1); inf or NaN make every
      scale NaN.
  Returns:
    ``Quantized``: ``global_scale`` f32 []; with ``rowwise`` ``data`` uint8 [R, C/2] (element
    2i in the low nibble of byte i) and ``scale`` float8_e4m3fn [R, C/16]; with ``columnwise``
    ``data_t`` uint8 [C, R/2] and ``scale_t`` [C, R/16]; with ``rht`` ``global_scale_t`` (else
    None: ``data_t`` shares ``global_scale``); a direction not asked for None.
  Raises:
    TypeError at trace time: x's dtype, a flag that is not a bool. ValueError: shapes the
    rules above exclude, no direction asked for, an option without what it needs (or with
    what it excludes), a global amax that is not a float scalar.
  """
  x = checks.float_input(x)
  cuda_kernel, _ = nvfp4_quantize_cuda_kernel(rowwise=rowwise, columnwise=columnwise,
                                              block_2d=block_2d)
  specialised = cuda_kernel == _SPECIALISED
  stochastic_rounding = checks.boolean(stochastic_rounding, "stochastic_rounding")
  rht = checks.boolean(rht, "rht")
  _check_options(stochastic_rounding, key, block_2d, columnwise, rht, global_amax_t)
  if rht_seed is not None and not rht:
    raise ValueError("rht_seed is the Hadamard transform's seed: it needs rht=True")
  rht_seed = 0 if rht_seed is None else rht_seed
  signs = rht_signs(rht_seed)  # checks the seed
  if x.ndim != 2 or x.shape[1] == 0 or x.shape[1] % NVFP4_BLOCK:
    raise ValueError(f"x must be [R, C] with C a positive multiple of {NVFP4_BLOCK} (whole "
                     f"NVFP4 blocks along the rows), got shape {x.shape}")
  r, c = x.shape
  if (columnwise or block_2d) and r % NVFP4_BLOCK:
    raise ValueError(f"columnwise=True and block_2d=True need x's rows R a multiple of "
                     f"{NVFP4_BLOCK}, got shape {x.shape}")
  words = key_words(key) if stochastic_rounding else jnp.zeros(2, jnp.uint32)

  x32 = as_f32(x)
  gs = nvfp4_global_scale(amax(x32) if global_amax is None else
                          _global_amax(global_amax, "global_amax"))
  gs_t = gs  # the columnwise copy's: its own with the transform
  if rht:
    gs_t = nvfp4_global_scale(
        hadamard_amax(x32, rht_seed, axis=0) if global_amax_t is None else
        _global_amax(global_amax_t, "global_amax_t"))
  names = ["data", "scale"] * rowwise + ["data_t", "scale_t"] * columnwise

  def impl(x, global_scales, words, signs):
    outs = quantize_call(x, global_scales, words, signs, rowwise=rowwise, columnwise=columnwise,
                         block_2d=block_2d, stochastic_rounding=stochastic_rounding, rht=rht,
                         specialised=specialised)
    return tuple(o for o, n in zip(outs, _OUTPUTS) if n in names)

  # The random bits and the 2D tiles follow global coordinates: with stochastic rounding or
  # 2D blocks the kernel sees the whole of x (a split dimension is gathered first).
  whole = stochastic_rounding or block_2d

  def plan(mesh, shapes):
    rs, cs = sharding.spec(shapes[0].sharding, 2)
    rs = None if whole else sharding.even(mesh, rs, r, NVFP4_BLOCK if columnwise else 1)
    cs = None if whole else sharding.even(mesh, cs, c, NVFP4_BLOCK)
    xs, ts, rep = (sharding.named(mesh, rs, cs), sharding.named(mesh, cs, rs),
                   sharding.named(mesh))
    return impl, (xs, rep, rep, rep), (xs, xs) * rowwise + (ts, ts) * columnwise

  # Shardy factors: a blocked dimension is tied to its scales' dimension and to the packed
  # bytes' (two elements a byte: 8 bytes a block).
  xr, dr, dtc, str_ = ("(rb r1)", "(rb r1)", "(rb r8)", "rb") if columnwise else ("r",) * 4
  xc, dc, sc, dtr = ("(cb c1)", "(cb c8)", "cb", "(cb c1)") if rowwise else ("c",) * 4
  outs = [f"{dr} {dc}", f"{dr} {sc}"] * rowwise + [f"{dtr} {dtc}", f"{dtr} {str_}"] * columnwise
  sizes = {**({"r1": NVFP4_BLOCK, "r8": NVFP4_BLOCK // 2} if columnwise else {}),
           **({"c1": NVFP4_BLOCK, "c8": NVFP4_BLOCK // 2} if rowwise else {})}
  rule = f"{xr} {xc}, g, k, s -> " + ", ".join(outs)
  results = sharding.call("nvfp4_quantize", impl, plan, rule, x, jnp.stack([gs, gs_t]), words,
                          jnp.asarray(signs), **sizes)
  return Quantized(global_scale=gs, global_scale_t=gs_t if rht else None,
                   **dict(zip(names, sharding.vary_like(results, x))))


def nvfp4_dequantize(data: jax.Array, scales: jax.Array, global_scale, dtype=jnp.float32
                     ) -> jax.Array:
  """``e2m1 * scale * global_scale`` in ``dtype`` (each product in f32). Plain XLA, so it fuses
  into its consumer. ``e2m1 * scale`` alone (``global_scale`` 1) is exact in bfloat16: at most
  6 significant bits, within bfloat16's normals (``nvfp4_gemm`` emulates the GEMM so).

  Args:
    data: uint8 [..., C/2] (element 2i in the low nibble of byte i), ``data`` or ``data_t`` of
      ``nvfp4_quantize``'s ``Quantized``.
    scales: float8_e4m3fn [..., C/16].
    global_scale: f32 [] (``global_scale``, or ``global_scale_t`` for an RHT copy).
    dtype: float32 / bfloat16 / float16.
  Raises:
    TypeError at trace time: dtypes. ValueError: shapes that do not match.
  """
  data = checks.array(data, "data")
  if data.dtype != jnp.uint8:
    raise TypeError(f"data must be uint8 (two E2M1 codes a byte), got {data.dtype}")
  scales = checks.array(scales, "scales")
  if scales.dtype != jnp.float8_e4m3fn:
    raise TypeError(f"scales must be float8_e4m3fn, got {scales.dtype}")
  global_scale = checks.scalar_f32(global_scale, "global_scale")
  dtype = checks.dtype(dtype, "dtype", FLOAT_DTYPES)
  if (data.ndim < 1 or scales.shape != (*data.shape[:-1], 2 * data.shape[-1] // NVFP4_BLOCK)
      or 2 * data.shape[-1] % NVFP4_BLOCK):
    raise ValueError(f"scales must be [..., C/16] for data [..., C/2] (two elements a byte), got "
                     f"data {data.shape} and scales {scales.shape}")
  codes = jnp.stack([data & 0xF, data >> 4], axis=-1).reshape(*data.shape[:-1],
                                                              2 * data.shape[-1])
  values = jax.lax.bitcast_convert_type(codes.astype(jnp.uint4), jnp.float4_e2m1fn)
  step = jnp.repeat(scales.astype(jnp.float32), NVFP4_BLOCK, axis=-1) * global_scale
  return (values.astype(jnp.float32) * step).astype(dtype)


def nvfp4_gemm(a: jax.Array, b: jax.Array, a_scales: jax.Array, b_scales: jax.Array,
               a_global_scale, b_global_scale, *, out_dtype=jnp.bfloat16) -> jax.Array:
  """``a @ b.T`` of two NVFP4 operands (TN, as block-scaled GEMMs take them: both contract over
  their last axis), each element times its 16-element block's E4M3 scale and its tensor's
  global scale, summed in f32. Emulated on Hopper, which has no FP4 tensor cores: each
  operand's ``e2m1 * scale`` in bfloat16 (exact, see ``nvfp4_dequantize``), XLA's BF16 GEMM with
  f32 accumulation, then the two global scales (``formats.apply_scales``: no intermediate
  underflow or overflow). The result is the NVFP4 GEMM's up to the order of the f32 sums and
  the global scales' rounding; a Blackwell GEMM with 16-element E4M3 scales (cuBLASLt's
  VEC16_UE4M3 mode, the global scales in alpha) would take the same operands. Arguments in
  ``gemm``'s order.

  Args:
    a: uint8 [M, K/2] (two E2M1 codes a byte): ``nvfp4_quantize``'s ``data`` (or ``data_t``).
    b: uint8 [N, K/2] likewise.
    a_scales, b_scales: float8_e4m3fn [M, K/16] and [N, K/16], their block scales.
    a_global_scale, b_global_scale: f32 [], their global scales.
    out_dtype: float32 / bfloat16 / float16.
  Returns:
    [M, N] in out_dtype.
  Raises:
    TypeError at trace time: out_dtype, a global scale that is not an f32 scalar. ValueError:
    the operands' dtypes and shapes (2-D, one K, scales not K/16 wide), naming the argument.
  """
  out_dtype = checks.dtype(out_dtype, "out_dtype", FLOAT_DTYPES)
  operands, global_scales = [], []
  for name, data, scales, global_scale in (("a", a, a_scales, a_global_scale),
                                           ("b", b, b_scales, b_global_scale)):
    data, scales = checks.array(data, name), checks.array(scales, f"{name}_scales")
    global_scale = checks.scalar_f32(global_scale, f"{name}_global_scale")
    if (data.dtype != jnp.uint8 or scales.dtype != jnp.float8_e4m3fn or data.ndim != 2
        or scales.shape != (data.shape[0], 2 * data.shape[1] // NVFP4_BLOCK)
        or 2 * data.shape[1] % NVFP4_BLOCK):
      raise ValueError(f"{name} must be uint8 [rows, K/2] with K a multiple of {NVFP4_BLOCK} "
                       f"and {name}_scales float8_e4m3fn [rows, K/{NVFP4_BLOCK}], got {name} "
                       f"{data.dtype}{list(data.shape)} and {name}_scales "
                       f"{scales.dtype}{list(scales.shape)}")
    operands.append(nvfp4_dequantize(data, scales, jnp.float32(1), jnp.bfloat16))
    global_scales.append(global_scale)
  if operands[0].shape[1] != operands[1].shape[1]:
    raise ValueError(f"a [M, K/2] and b [N, K/2] must share K, got a {list(jnp.shape(a))} and b "
                     f"{list(jnp.shape(b))}")
  acc = jax.lax.dot_general(*operands, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32)
  return apply_scales(acc, *global_scales).astype(out_dtype)
