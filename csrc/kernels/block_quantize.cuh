// 128 x 128 tile kernels of block scaling (DeepSeek-V3 technical report, section 3.3): one
// thread block reads one 128 x 128 tile of x [R, C] once and quantizes it with
//  - kBlock2D: one scale for the whole tile (weights: block_quantize), writing q [R, C] and
//    scales [ceil(R/128), ceil(C/128)] row-major; or
//  - group cast-transpose: 1 x 128 groups along rows (q [R, C], the forward / dgrad operand)
//    and 128 x 1 groups along columns, written transposed (qt [C, R128], the wgrad operand,
//    zero-padded to R128 = R rounded up to 128). Every group lies inside one tile, so both
//    directions come from the same read. Scales are stored the way cuBLASLt's VEC128 mode
//    reads them: row-direction ones [C/128, R] (R contiguous), column-direction ones
//    [R128/128, C] (C contiguous). What is quantized comes from a source (sources.cuh): x, an
//    activation of x, the gradient through one (two outputs side by side, [R, 2C], under a
//    gated activation), or a norm of x, so none of them costs a pass of its own.
// Scales: numerics.h group_scale (UE8M0: top_scale_saturate). Launched with PDL; device code
// only; launched by csrc/ffi/block_quantize_cuda.cu.
#pragma once

#include "sources.cuh"

namespace jax_fp8 {

// kBlockTile (128): csrc/constants.h.
constexpr int kBlockThreads = 256;  // 8 threads a row of 16 elements each; 32 row quads a tile
constexpr int kBlockPasses = kBlockTile / (kBlockThreads / 8);  // rows per thread: 4
static_assert(kBlockThreads == kQuantizeThreads, "block_max assumes kQuantizeThreads");

// Output kJ of src over the rows a thread holds (below): 0 past the edges.
template <int kJ, typename Src>
__device__ __forceinline__ void load_output(const Src& src, int64_t r0, int64_t c, int64_t rows,
                                            int64_t cols,
                                            float (&f)[kBlockPasses][kElemsPerThread]) {
#pragma unroll
  for (int p = 0; p < kBlockPasses; ++p) {
    const int64_t r = r0 + (threadIdx.x / 8) * kBlockPasses + p;
    float v[Src::kOutputs][kElemsPerThread] = {};
    if (r < rows && c < cols) src.values(src.load(r, c), v);
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) f[p][k] = v[kJ][k];
  }
}

// Thread t holds rows 4 * (t / 8) + p (p < 4) and columns (t % 8) * 16 + k (k < 16) of the
// tile. The transposed tile goes through shared memory as 32-bit words, each the 4 rows of one
// column a thread holds; word w of column c sits at (w + 4 * (c / 16 % 8)) % 32, a rotation that
// makes a warp's stores hit 32 distinct banks and keeps each 16-byte run of a row contiguous.
// A source of two outputs gets two blocks a tile, adjacent in the grid (blockIdx.x = 2 * tile
// + output), so each holds one output's values and the second one's reads mostly hit L2.
template <typename Src, bool kBlock2D>
__global__ void __launch_bounds__(kBlockThreads)
    block_quantize_kernel(Src src, int64_t rows, int64_t cols, float eps, Fp8Format fmt,
                          bool ue8m0, uint8_t* __restrict__ q, float* __restrict__ scales,
                          uint8_t* __restrict__ qt, float* __restrict__ scales_t) {
  constexpr int kOut = Src::kOutputs;  // output j's column c is column j * cols + c of q
  static_assert(!kBlock2D || kOut == 1, "a 2D block takes one output");
  static_assert(kOut == 1 || kOut == 2, "one or two outputs");
  __shared__ alignas(16) uint32_t tile_qt[kBlock2D ? 1 : kBlockTile][kBlockTile / 4];
  __shared__ unsigned col_part[kBlock2D ? 1 : kBlockThreads / 32][kBlockTile];
  __shared__ float col_inv[kBlock2D ? 1 : kBlockTile];  // 1 / scale of each column group
  __shared__ float tile_scale;
  pdl_wait();
  const int j = blockIdx.x % kOut;
  const int64_t r0 = int64_t(blockIdx.y) * kBlockTile;
  const int64_t c0 = int64_t(blockIdx.x / kOut) * kBlockTile;
  const int quad = threadIdx.x / 8, tc = (threadIdx.x % 8) * kElemsPerThread;
  const int64_t c = c0 + tc, out_cols = kOut * cols;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;

  float f[kBlockPasses][kElemsPerThread];
  if (j == 0) {
    load_output<0>(src, r0, c, rows, cols, f);
  } else {
    load_output<kOut - 1>(src, r0, c, rows, cols, f);
  }

  const int64_t oc0 = j * cols + c0;  // this tile's first column in the outputs
  unsigned row_m[kBlockPasses];
#pragma unroll
  for (int p = 0; p < kBlockPasses; ++p) {
    row_m[p] = 0;
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) row_m[p] = max(row_m[p], abs_bits(f[p][k]));
  }

  float inv[kBlockPasses];
  if constexpr (kBlock2D) {
    unsigned m = 0;
#pragma unroll
    for (int p = 0; p < kBlockPasses; ++p) m = max(m, row_m[p]);
    m = block_max(m);
    if (threadIdx.x == 0) {
      tile_scale = group_scale(bits_float(m), eps, fmt, ue8m0);
      scales[int64_t(blockIdx.y) * gridDim.x + blockIdx.x] = tile_scale;
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < kBlockPasses; ++p) inv[p] = 1.0f / tile_scale;
  } else {
    // Row groups: the 8 lanes of a row reduce by shuffles.
#pragma unroll
    for (int p = 0; p < kBlockPasses; ++p) {
#pragma unroll
      for (int o = 4; o; o >>= 1)
        row_m[p] = max(row_m[p], __shfl_xor_sync(0xffffffffu, row_m[p], o));
      const float s = group_scale(bits_float(row_m[p]), eps, fmt, ue8m0);
      inv[p] = 1.0f / s;
      const int64_t r = r0 + quad * kBlockPasses + p;
      if (tc == 0 && r < rows) scales[oc0 / kBlockTile * rows + r] = s;
    }
    // Column groups: over this thread's rows, then the 4 lanes of a warp sharing the
    // columns, then the 8 warps through shared memory.
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) {
      unsigned m = 0;
#pragma unroll
      for (int p = 0; p < kBlockPasses; ++p) m = max(m, abs_bits(f[p][k]));
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 8));
      m = max(m, __shfl_xor_sync(0xffffffffu, m, 16));
      if (lane < 8) col_part[warp][tc + k] = m;
    }
    __syncthreads();
    if (threadIdx.x < kBlockTile) {
      unsigned m = 0;
#pragma unroll
      for (int w = 0; w < kBlockThreads / 32; ++w) m = max(m, col_part[w][threadIdx.x]);
      const float s = group_scale(bits_float(m), eps, fmt, ue8m0);
      col_inv[threadIdx.x] = 1.0f / s;
      scales_t[int64_t(blockIdx.y) * out_cols + oc0 + threadIdx.x] = s;
    }
    __syncthreads();
  }

  if (ue8m0)  // after the amaxes: the top scale's elements saturate (numerics.h)
#pragma unroll
    for (int p = 0; p < kBlockPasses; ++p)
#pragma unroll
      for (int k = 0; k < kElemsPerThread; ++k) f[p][k] = top_scale_saturate(f[p][k], fmt);

  // Row-major q.
#pragma unroll
  for (int p = 0; p < kBlockPasses; ++p) {
    const int64_t r = r0 + quad * kBlockPasses + p;
    if (r < rows && c < cols)
      *reinterpret_cast<uint4*>(q + r * out_cols + j * cols + c) =
          quantize16(f[p], inv[p], fmt);
  }

  if constexpr (!kBlock2D) {
    // Column-direction q, transposed through shared memory.
    const int rot = 4 * (threadIdx.x % 8);  // 4 * (column / 16 % 8) for this thread's columns
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) {
      const float inv_c = col_inv[tc + k];
      uint32_t word = 0;
#pragma unroll
      for (int p = 0; p < kBlockPasses; ++p) {
        const bool in = r0 + quad * kBlockPasses + p < rows;  // past R: qt's zero padding
        word |= uint32_t(in ? float_to_fp8(mul_flushed(f[p][k], inv_c), fmt) : 0) << (8 * p);
      }
      tile_qt[tc + k][(quad + rot) & 31] = word;
    }
    __syncthreads();
    const int64_t rows128 = int64_t(gridDim.y) * kBlockTile;
    for (int i = threadIdx.x; i < kBlockTile * kBlockTile / kElemsPerThread;
         i += kBlockThreads) {
      const int row = i / 8, run = i % 8;  // 8 runs of 16 bytes a row
      const int word = (4 * run + 4 * (row / 16 % 8)) & 31;
      *reinterpret_cast<uint4*>(qt + (oc0 + row) * rows128 + r0 + 16 * run) =
          *reinterpret_cast<const uint4*>(&tile_qt[row][word]);
    }
  }
  pdl_trigger();
}

}  // namespace jax_fp8
