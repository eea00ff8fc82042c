"""Runs jax_fp8's CUDA kernels for a tool that watches them (`scripts/gpu_check.sh`):

    python scripts/run_kernels.py profile    # each kernel a few times at 8192 x 8192 bf16, the
                                             # block-scaled GEMM at 8192^3 (ncu)
    python scripts/run_kernels.py coverage   # every variant of our kernels once on small,
                                             # ragged shapes (compute-sanitizer's four tools)
    python scripts/run_kernels.py mxfp8      # coverage's MXFP8 part alone (nvfp4: NVFP4's,
                                             # block: the group cast-transpose's sources,
                                             # parts: the cast-transpose of x in parts,
                                             # stacked: the cast-transpose under vmap)
    python scripts/run_kernels.py gemm       # our cuBLASLt calls, every scale mode (memcheck)
    python scripts/run_kernels.py grouped    # the grouped GEMMs: setup, fill and CUTLASS kernels
    python scripts/run_kernels.py grouped_block  # the same with block scales (CUTLASS's
                                                 # blockwise-scaling kernels)
    python scripts/run_kernels.py block_gemm # every block-scaled GEMM kernel of ours (sm_90);
                                             # also part of coverage

Inputs are copied from the host: initcheck reports buffers written by XLA's own kernels as
uninitialized (it did for a slice and for jnp.zeros), never those written by a copy.
"""

import functools
import itertools
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jax_fp8
from jax_fp8.hadamard import rht_signs
from jax_fp8.ops import nvfp4 as nvfp4_ops
from jax_fp8.ops.gemm import ALGORITHMS, BLOCK_128X128, GROUP_1X128, block_kernel_call

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def profile():
  x = jax.random.normal(jax.random.key(0), (8192, 8192), jnp.bfloat16)
  ring = jax_fp8.quantize_delayed(x, jax_fp8.ScaleRing.create()).ring  # past step 0
  quantize = jax.jit(lambda x: jax_fp8.quantize(x, jnp.float32(0.01)))
  delayed = jax.jit(jax_fp8.quantize_delayed)
  cast_t = jax.jit(jax_fp8.cast_transpose_delayed)
  cast_t_dbias = jax.jit(lambda x, r: jax_fp8.cast_transpose_delayed(x, r, with_dbias=True))
  group = jax.jit(lambda x: jax_fp8.group_quantize(x, scale_layout="col"))
  block = jax.jit(jax_fp8.block_quantize)
  group_t = jax.jit(jax_fp8.group_cast_transpose)
  y = jnp.concatenate([x, x], axis=1)  # a SwiGLU pre-activation [gate | up]
  act = jax.jit(lambda y, r: jax_fp8.activation_cast_transpose(y, r, activation="swiglu"))
  act_grad = jax.jit(lambda dh, y, r: jax_fp8.activation_grad_cast_transpose(
      dh, y, r, activation="swiglu"))
  gamma, beta = jnp.ones(x.shape[1]), jnp.zeros(x.shape[1])
  mxfp8 = jax.jit(lambda x: jax_fp8.mxfp8_quantize(x, columnwise=True))
  amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
  sr = dict(stochastic_rounding=True, key=jax.random.key(0), global_amax=amax)
  nvfp4 = jax.jit(lambda x: (jax_fp8.nvfp4_quantize(x, global_amax=amax),
                             jax_fp8.nvfp4_quantize(x, **sr),
                             jax_fp8.nvfp4_quantize(x, columnwise=True, global_amax=amax),
                             jax_fp8.nvfp4_quantize(x, columnwise=True, rht=True,
                                                    global_amax_t=amax, **sr)))
  layer_norm = jax.jit(lambda x, r: jax_fp8.norm_cast_transpose(
      x, jax_fp8.norms.stats(x, "layernorm", 1e-6), gamma, beta, r, norm="layernorm"))
  for _ in range(3):
    jax.block_until_ready((quantize(x), delayed(x, ring), cast_t(x, ring), cast_t_dbias(x, ring),
                           group(x), block(x), group_t(x), act(y, ring), act_grad(x, y, ring),
                           layer_norm(x, ring), mxfp8(x), nvfp4(x)))
  # jax_fp8's block-scaled GEMM at 8192^3 (the tiles of 256, 192 and 128 columns, the fastest
  # of benchmarks.run's block_gemm group), b in 128 x 128 blocks (fprop, dgrad) and in 1 x 128
  # groups (wgrad); unit scales.
  a = x.astype(jnp.float8_e4m3fn)
  ones = lambda n: jnp.ones((8192 // 128, n), jnp.float32)  # noqa: E731
  for kernel in ("sm90_128x256_c1", "sm90_128x192_c1", "sm90_128x128_c1"):
    gemm = functools.partial(block_kernel_call, kernel)
    block_gemm = jax.jit(lambda a: (
        gemm(BLOCK_128X128, jnp.bfloat16, a, a, ones(8192), ones(64)),
        gemm(GROUP_1X128, jnp.bfloat16, a, a, ones(8192), ones(8192))))
    for _ in range(3):
      jax.block_until_ready(block_gemm(a))


def coverage():
  """Every kernel and template variant: input dtypes, formats, fresh and later ring steps, both
  ring epilogues, dbias, activations and norms, group sizes and scale layouts, MXFP8, ragged
  edges."""
  rng = np.random.default_rng(0)
  normal = lambda shape, dtype: jax.device_put((rng.standard_normal(shape) * 3).astype(dtype))
  for dtype, fmt in itertools.product(DTYPES, ("e4m3", "e5m2")):
    for shape in ((37, 80), (1000, 1040)):  # a vector tail, partial tiles, several blocks
      x = normal(shape, dtype)
      jax.block_until_ready(jax_fp8.quantize(x, jax.device_put(np.float32(0.05)), fmt))
      for observe, dbias in itertools.product((False, True), (False, True)):
        ring = jax_fp8.ScaleRing(*jax.device_put((np.zeros(5, np.float32), np.float32(1),
                                                  np.float32(0))), fmt)
        for _ in range(2):  # the fresh step (amax pre-pass), then a delayed one
          q = jax_fp8.quantize_delayed(x, ring, observe=observe)
          c = jax_fp8.cast_transpose_delayed(x, ring, with_dbias=dbias, observe=observe)
          jax.block_until_ready((q, c))
          for activation in ("silu", "gelu", "swiglu", "geglu") if observe == dbias else ():
            gated = activation.endswith("glu")
            y = normal((shape[0], shape[1] * 2 if gated else shape[1]), dtype)
            a = jax_fp8.activation_cast_transpose(y, ring, activation=activation,
                                                  observe=observe)
            g = jax_fp8.activation_grad_cast_transpose(x, y, ring, activation=activation,
                                                       with_dbias=dbias, observe=observe)
            jax.block_until_ready((a, g))
          for norm in ("rmsnorm", "layernorm") if not dbias else ():
            gamma = normal((shape[1],), np.float32)
            beta = normal((shape[1],), np.float32) if norm == "layernorm" else None
            # On the CPU, then copied: initcheck does not see what XLA's GPU kernels write.
            host_x = jax.device_put(np.asarray(x), jax.devices("cpu")[0])
            row_stats = jax.device_put(np.asarray(jax_fp8.norms.stats(host_x, norm, 1e-6)),
                                       jax.devices()[0])
            jax.block_until_ready(jax_fp8.norm_cast_transpose(x, row_stats, gamma, beta, ring,
                                                              norm=norm, observe=observe))
          ring = jax_fp8.quantize_delayed(x, ring).ring
    for shape in ((3, 128), (257, 384)):
      x = normal(shape, dtype)
      for group_size, layout, ue8m0 in zip((16, 32, 64, 128), ("row", "col", "col_tma", "col"),
                                           (False, True, False, True)):
        jax.block_until_ready(jax_fp8.group_quantize(x, group_size=group_size, fmt=fmt,
                                                     scale_layout=layout, ue8m0=ue8m0))
      jax.block_until_ready((jax_fp8.block_quantize(x, fmt=fmt),
                             jax_fp8.block_quantize(normal((shape[0], 144), dtype), fmt=fmt,
                                                    ue8m0=True),
                             jax_fp8.group_cast_transpose(x, fmt=fmt)))
  parts()
  stacked()
  block()
  mxfp8()
  nvfp4()
  block_gemm()


def parts():
  """The cast-transpose of x in 2 to 4 parts: every input dtype, with and without dbias, the
  fresh step and a delayed one, parts narrower and wider than a tile, ragged rows."""
  rng = np.random.default_rng(4)
  for dtype, cols in itertools.product(DTYPES, ((16, 48), (64, 16, 80), (16, 112, 32, 48))):
    for rows in (37, 1000):
      xs = [jax.device_put((rng.standard_normal((rows, c)) * 3).astype(dtype)) for c in cols]
      for dbias in (False, True):
        ring = jax_fp8.ScaleRing(*jax.device_put((np.zeros(5, np.float32), np.float32(1),
                                                  np.float32(0))), "e5m2")
        for _ in range(2):
          c = jax_fp8.cast_transpose_delayed(xs, ring, with_dbias=dbias)
          jax.block_until_ready(c)
          ring = c.ring


def stacked():
  """The cast-transpose under vmap (one call, the kernels run item by item on views of the
  stacks, csrc/ffi/items.h): a stack of 3 expert kernels with their own rings, ragged tiles,
  the fresh step and a delayed one; a shared x with stacked rings; a gated activation's
  gradient (its y viewed too) with dbias."""
  rng = np.random.default_rng(5)
  ring = jax_fp8.ScaleRing(*jax.device_put((np.zeros((3, 5), np.float32), np.ones(3, np.float32),
                                            np.zeros(3, np.float32))), "e4m3")
  cast = jax.jit(jax.vmap(functools.partial(jax_fp8.cast_transpose_delayed, observe=False)))
  shared_x = jax.jit(jax.vmap(jax_fp8.cast_transpose_delayed, in_axes=(None, 0)))
  act_grad = jax.jit(jax.vmap(lambda dh, y, r: jax_fp8.activation_grad_cast_transpose(
      dh, y, r, activation="swiglu", with_dbias=True)))
  for dtype in DTYPES:
    host = (rng.standard_normal((3, 100, 208)) * 3).astype(dtype)
    x, x0 = jax.device_put(host), jax.device_put(host[0])
    r = ring
    for _ in range(2):
      r = cast(x, r).ring
    y = jax.device_put((rng.standard_normal((3, 100, 416)) * 3).astype(dtype))
    jax.block_until_ready((shared_x(x0, r), act_grad(x, y, r)))


def block():
  """The group cast-transpose of each source (a norm of x, an activation, the gradient through
  one): every input dtype and format, UE8M0 scales, rows that are not a multiple of 128."""
  rng = np.random.default_rng(3)
  cpu, gpu = jax.devices("cpu")[0], jax.devices()[0]
  for dtype, fmt in itertools.product(DTYPES, ("e4m3", "e5m2")):
    for rows, ue8m0 in ((3, False), (257, True)):
      host = lambda cols: (rng.standard_normal((rows, cols)) * 3).astype(dtype)
      x, gamma, beta = host(256), host(256)[0].astype(np.float32), host(256)[1].astype(np.float32)
      for norm, b in (("rmsnorm", None), ("layernorm", beta)):
        # On the CPU, then copied: initcheck does not see what XLA's GPU kernels write.
        row_stats = np.asarray(jax_fp8.norms.stats(jax.device_put(x, cpu), norm, 1e-6))
        jax.block_until_ready(jax_fp8.norm_group_cast_transpose(
            *jax.device_put((x, row_stats, gamma, b), gpu), norm=norm, fmt=fmt, ue8m0=ue8m0))
      for activation in ("silu", "gelu", "swiglu", "geglu"):
        y = jax.device_put(host(512 if activation.endswith("glu") else 256), gpu)
        dh = jax.device_put(x, gpu)
        jax.block_until_ready((
            jax_fp8.activation_group_cast_transpose(y, activation=activation, fmt=fmt,
                                                    ue8m0=ue8m0),
            jax_fp8.activation_grad_group_cast_transpose(dh, y, activation=activation, fmt=fmt,
                                                         ue8m0=ue8m0)))


def mxfp8():
  """MXFP8 quantization: every input dtype and format, ragged rows (rowwise only), a partial
  128-column tile, every direction."""
  rng = np.random.default_rng(1)
  for dtype, fmt in itertools.product(DTYPES, ("e4m3", "e5m2")):
    for shape, rowwise, columnwise in (((37, 96), True, False), ((96, 416), True, False),
                                       ((96, 416), True, True), ((96, 416), False, True)):
      x = jax.device_put((rng.standard_normal(shape) * 3).astype(dtype))
      jax.block_until_ready(jax_fp8.mxfp8_quantize(x, rowwise=rowwise, columnwise=columnwise,
                                                   fmt=fmt))


def gemm():
  """The GEMM's scale modes, bias and output dtypes (cuBLASLt's kernels: under memcheck only,
  which checks the pointers and layouts our handler gives it)."""
  rng = np.random.default_rng(0)
  a32, b32 = rng.standard_normal((130, 256)), rng.standard_normal((272, 256))
  a = jax.device_put(a32.astype(jnp.float8_e4m3fn))
  b = jax.device_put(b32.astype(jnp.float8_e4m3fn))
  one = jax.device_put(np.float32(1))
  bias = jax.device_put(np.ones(272, jnp.bfloat16))
  qa = jax_fp8.group_quantize(jax.device_put(a32.astype(np.float32)))
  qb = jax_fp8.block_quantize(jax.device_put(b32.astype(np.float32)))
  qg = jax_fp8.group_quantize(jax.device_put(b32.astype(np.float32)))
  jax.block_until_ready((
      jax_fp8.gemm(a, b, one, one), jax_fp8.gemm(a, b, one, one, bias=bias, fast_accum=True),
      jax_fp8.gemm(a, b, one, one, out_dtype=jnp.float32),
      jax_fp8.gemm(a, b, one, one, bias=bias, out_dtype=jnp.float8_e4m3fn, out_scale=one),
      jax_fp8.gemm(qa.data, qb.data, qa.scale, qb.scale),
      jax_fp8.gemm(qa.data, qg.data, qa.scale, qg.scale, bias=bias)))

def grouped():
  """The grouped GEMMs, both forms, every operand pair and output, with empty groups, rows in
  no group, clipped and misaligned groups (the setup and fill kernels: all four tools;
  CUTLASS's kernel is not in namespace jax_fp8, so memcheck over every kernel covers it)."""
  rng = np.random.default_rng(3)
  e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
  one = jax.device_put(np.float32(1))
  per_group = jax.device_put(np.float32([1, 2, 0.5, 1]))
  for fa, fb, out in ((e4, e4, jnp.bfloat16), (e5, e4, jnp.float32), (e4, e5, jnp.bfloat16)):
    a = jax.device_put(rng.standard_normal((200, 128)).astype(fa))
    b = jax.device_put(rng.standard_normal((4, 48, 128)).astype(fb))
    a_t = jax.device_put(rng.standard_normal((64, 192)).astype(fa))
    b_t = jax.device_put(rng.standard_normal((48, 192)).astype(fb))
    for sizes in ([50, 50, 50, 50], [0, 120, 0, 30], [90, 90, 90, 90], [10, 6, 64, 5]):
      s = jax.device_put(np.int32(sizes))
      jax.block_until_ready((
          jax_fp8.grouped_gemm(a, b, one, per_group, s, out_dtype=out),
          jax_fp8.grouped_gemm_wgrad(a_t, b_t, one, one, s, out_dtype=out)))


def grouped_block():
  """The block-scaled grouped GEMMs, both forms and both outputs: groups at any row (the rows
  form), K and N not multiples of the tile, empty groups, rows in no group, clipped sizes,
  wgrad groups ending inside a 128-row group and a misaligned one (the setup and fill kernels:
  all four tools; CUTLASS's kernel, outside namespace jax_fp8, under memcheck over every kernel).
  The scales are copied from the host in the layouts the kernel reads: wgrad's given as the
  transposes of [M/128, K] / [M/128, N] arrays, which cancel against the op's own transposes
  inside one jit (XLA writes nothing initcheck would not see)."""
  rng = np.random.default_rng(5)
  e4 = jnp.float8_e4m3fn
  scales = lambda shape: jax.device_put((2.0 ** rng.uniform(-4, 4, shape)).astype(np.float32))
  a = jax.device_put(rng.standard_normal((200, 384)).astype(e4))
  b = jax.device_put(rng.standard_normal((4, 176, 384)).astype(e4))
  a_scale, b_scale = scales((200, 3)), scales((4, 2, 3))
  a_t = jax.device_put(rng.standard_normal((48, 384)).astype(e4))
  b_t = jax.device_put(rng.standard_normal((80, 384)).astype(e4))
  a_scale_t, b_scale_t = scales((3, 48)), scales((3, 80))  # [M/128, K], [M/128, N]
  wgrad = jax.jit(lambda a_t, b_t, sa, sb, s, out: jax_fp8.grouped_gemm_wgrad(
      a_t, b_t, sa.T, sb.T, s, out_dtype=out), static_argnums=5)
  for out in (jnp.bfloat16, jnp.float32):
    for sizes in ([50, 50, 50, 50], [0, 120, 0, 30], [90, 90, 90, 90], [10, 6, 64, 5]):
      s = jax.device_put(np.int32(sizes))
      jax.block_until_ready(jax_fp8.grouped_gemm(a, b, a_scale, b_scale, s, out_dtype=out))
    for sizes in ([128, 128, 128, 0], [0, 256, 0, 37], [100, 0, 28, 128], [384, 0, 0, 0]):
      s = jax.device_put(np.int32(sizes))
      jax.block_until_ready(wgrad(a_t, b_t, a_scale_t, b_scale_t, s, out))


def block_gemm():
  """jax_fp8's block-scaled GEMM kernels: each one, b in 128 x 128 blocks and in 1 x 128
  groups, every output dtype, with a bias where it applies; M off the tile and N of no tile
  width (partial tiles, a cluster's second tile past M, tiles across two blocks of b), and more
  tiles than the grid has CTAs (the stages wrap around). The operands and the scales, in the
  layouts the kernel reads, are made on the host and copied."""
  rng = np.random.default_rng(5)
  e4m3 = jnp.float8_e4m3fn
  for m, n, k in ((300, 400, 1152), (4100, 1040, 256)):
    kb = k // 128
    a, b = (rng.standard_normal(s).astype(e4m3) for s in ((m, k), (n, k)))
    scales = lambda shape: (rng.uniform(0.5, 2, shape)).astype(np.float32)  # noqa: E731
    a_scale_t = np.pad(scales((kb, m)), ((0, 0), (0, -m % 4)))
    nb = -(-n // 128)
    b_scale_t = {GROUP_1X128: scales((kb, n)),
                 BLOCK_128X128: np.pad(scales((kb, nb)), ((0, 0), (0, -nb % 4)))}
    for kernel, mode, out in itertools.product(ALGORITHMS[2:], b_scale_t,
                                               (jnp.bfloat16, jnp.float16, jnp.float32)):
      biases = (None,) if out == jnp.float32 else (None, rng.standard_normal(n).astype(out))
      for bias in biases:
        args = jax.device_put((a, b, a_scale_t, b_scale_t[mode], bias))
        jax.block_until_ready(jax.jit(
            lambda *v: block_kernel_call(kernel, mode, out, *v))(*args))


def nvfp4():
  """NVFP4 quantization: every input dtype, ragged rows (rowwise only), a partial 128-column
  tile, every direction, 2D tiles, stochastic rounding and the Hadamard transform, with the
  specialised kernel and the general one where both take the case. The kernel is
  called with its global scales computed on the CPU and copied (the op computes them with XLA's
  kernels, whose writes initcheck does not see)."""
  rng = np.random.default_rng(2)
  cpu, gpu = jax.devices("cpu")[0], jax.devices()[0]
  words = jax.device_put(np.array([7, 11], np.uint32), gpu)  # the key's words
  signs = jax.device_put(rht_signs(0), gpu)
  options = (dict(), dict(columnwise=True), dict(rowwise=False, columnwise=True),
             dict(columnwise=True, block_2d=True),
             dict(columnwise=True, rht=True, stochastic_rounding=True),
             dict(stochastic_rounding=True))
  for dtype in DTYPES:  # the last shape: several grid-stride rounds of the specialised kernel
    for shape, kws in (((37, 96), (options[0], options[-1])), ((96, 416), options),
                       ((2048, 2048), (options[-1],))):
      host = (rng.standard_normal(shape) * 3).astype(dtype)
      for kw in kws:
        kw = dict(dict(rowwise=True, columnwise=False, block_2d=False, stochastic_rounding=False,
                       rht=False), **kw)
        key = np.array([7, 11], np.uint32) if kw["stochastic_rounding"] else None
        q = jax_fp8.nvfp4_quantize(jax.device_put(host, cpu), key=key, **kw)
        scales = np.array([q.global_scale, q.global_scale if q.global_scale_t is None
                           else q.global_scale_t])
        chosen = jax_fp8.nvfp4_quantize_cuda_kernel(
            rowwise=kw["rowwise"], columnwise=kw["columnwise"],
            block_2d=kw["block_2d"])[0] == "nvfp4_rowwise_kernel"
        for specialised in {chosen, False}:  # the general kernel also on the rowwise case
          jax.block_until_ready(nvfp4_ops.quantize_call(
              jax.device_put(host, gpu), jax.device_put(scales, gpu), words, signs,
              specialised=specialised, **kw))


if __name__ == "__main__":
  {"profile": profile, "coverage": coverage, "parts": parts, "stacked": stacked, "block": block,
   "mxfp8": mxfp8, "nvfp4": nvfp4, "gemm": gemm, "grouped": grouped, "grouped_block": grouped_block,
   "block_gemm": block_gemm}[sys.argv[1]]()
