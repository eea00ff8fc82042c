"""jax_fp8's block-scaled GEMM kernels for sm_90a (csrc/kernels/block_gemm.cuh), each run through
``gemm(..., algorithm=name)``: against reference.block_gemm in f32 within the FP8 tensor cores'
accumulation bound at every form (b in 128 x 128 blocks or 1 x 128 groups; bf16, f16, f32
output; bias), M not a multiple of the tile, N of no tile width, K = 128 and N = 128, tiles
straddling two 128 x 128 blocks of b, several tiles per CTA; outputs poisoned first; the same
bits run to run; a NaN scale kept visible; bad arguments. On CPU ``gemm`` ignores ``algorithm``
(XLA's dot), so the CPU cases run for the first kernel only."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import poison_allocator
from test_gemm import b_scale_shape, block_scales, check_block_gemm, fp8_operand

import jax_fp8
from jax_fp8.ops import gemm_algorithms

KERNELS = gemm_algorithms.KERNELS
MODES = [pytest.param(1, id="b128x128"), pytest.param(2, id="b1x128")]
# (output dtype, with a bias): a fused bias is bf16 / f16 (in the output's dtype).
FORMS = [pytest.param(jnp.bfloat16, False, id="bfloat16"),
         pytest.param(jnp.bfloat16, True, id="bfloat16-bias"),
         pytest.param(jnp.float16, False, id="float16"),
         pytest.param(jnp.float16, True, id="float16-bias"),
         pytest.param(jnp.float32, False, id="float32")]


def only_first_on_cpu(platform, kernel):
  if platform == "cpu" and kernel != KERNELS[0]:
    pytest.skip("the CPU path ignores the kernel: its cases run for the first kernel")


def run(kernel, m, n, k, mode, out_dtype, with_bias, rng):
  """Operands of a block-scaled GEMM, and the kernel's output (its buffer poisoned first)."""
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (n, k), "e4m3")
  sa, sb = block_scales(rng, (m, k // 128)), block_scales(rng, b_scale_shape(mode, n, k))
  bias = jnp.asarray(rng.standard_normal(n) * 10, out_dtype) if with_bias else None
  poison_allocator(m * n * jnp.dtype(out_dtype).itemsize)
  got = jax.jit(jax_fp8.gemm, static_argnames=("out_dtype", "algorithm"))(
      a, b, sa, sb, bias=bias, out_dtype=out_dtype, algorithm=kernel)
  assert got.shape == (m, n) and got.dtype == out_dtype
  return got, (a, b, sa, sb, bias)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("out_dtype,with_bias", FORMS)
# M off the 128-row tile (one CTA of a pair of tiles past M), N of no tile width (the last tile
# partly past N; 144- and 112-wide tiles straddling two 128 x 128 blocks of b), nine K blocks;
# and one tile's worth: K = 128, N = 128.
@pytest.mark.parametrize("m,n,k", [(300, 400, 1152), (70, 128, 128)])
def test_kernel_matches_f32(platform, rng, kernel, mode, out_dtype, with_bias, m, n, k):
  only_first_on_cpu(platform, kernel)
  got, operands = run(kernel, m, n, k, mode, out_dtype, with_bias, rng)
  check_block_gemm(got, *operands, out_dtype)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_many_tiles_per_cta_and_the_same_bits(platform, rng, kernel, mode):
  """More tiles than the persistent grid has CTAs (33 x 7 to 10 tiles), so each CTA walks
  several tiles and its pipeline's stages wrap around many times; a second run gives the same
  bits."""
  only_first_on_cpu(platform, kernel)
  m, n, k = 4100, 1040, 512
  got, operands = run(kernel, m, n, k, mode, jnp.bfloat16, False, rng)
  check_block_gemm(got, *operands, jnp.bfloat16)
  again = jax.jit(jax_fp8.gemm, static_argnames="algorithm")(*operands[:4], algorithm=kernel)
  np.testing.assert_array_equal(np.asarray(again).view(np.uint16),
                                np.asarray(got).view(np.uint16))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", MODES)
def test_nan_scale_stays_visible(platform, rng, kernel, mode):
  """A NaN scale of a's row 3 in K block 1: row 3 is NaN, every other element finite."""
  only_first_on_cpu(platform, kernel)
  m, n, k = 130, 272, 384
  a, b = fp8_operand(rng, (m, k), "e4m3"), fp8_operand(rng, (n, k), "e4m3")
  sa = block_scales(rng, (m, k // 128)).at[3, 1].set(jnp.nan)
  sb = block_scales(rng, b_scale_shape(mode, n, k))
  d = np.asarray(jax_fp8.gemm(a, b, sa, sb, out_dtype=jnp.float32, algorithm=kernel))
  assert np.all(np.isnan(d[3])) and np.all(np.isfinite(np.delete(d, 3, axis=0)))


def test_cublaslt_named(platform, rng):
  """``algorithm="cublaslt"`` runs cuBLASLt's choice (on CPU: XLA's dot), within the bound."""
  got, operands = run("cublaslt", 300, 400, 1152, 1, jnp.bfloat16, True, rng)
  check_block_gemm(got, *operands, jnp.bfloat16)


def test_bad_algorithm():
  a, b = jnp.ones((32, 256), jnp.float8_e4m3fn), jnp.ones((48, 256), jnp.float8_e4m3fn)
  sa, sb, one = jnp.ones((32, 2)), jnp.ones((1, 2)), jnp.float32(1)
  with pytest.raises(ValueError, match=r"algorithm must be one of \('auto', 'cublaslt', "
                                       r"'sm90_128x112_c1'.*got 'sm90_128x96_c1'"):
    jax_fp8.gemm(a, b, sa, sb, algorithm="sm90_128x96_c1")
  with pytest.raises(TypeError, match="algorithm must be one of"):
    jax_fp8.gemm(a, b, sa, sb, algorithm=None)
  with pytest.raises(ValueError, match="'sm90_128x128_c2' is a block-scaled kernel; per-tensor "
                                       "scales take 'auto' or 'cublaslt'"):
    jax_fp8.gemm(a, b, one, one, algorithm="sm90_128x128_c2")
