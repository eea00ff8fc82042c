// MXFP8 quantization (OCP MX v1.0, RCEIL scales: csrc/mx.h) with a columnwise copy: 32 x 1
// blocks along the columns of x [R, C], written transposed (data_t [C, R], scales_t
// [C, R/32]) and, from the same read, 1 x 32 blocks along its rows (data [R, C], scales
// [R, C/32]): each direction quantized from x itself, as the MX spec asks. (The rowwise
// direction alone is group_quantize.cuh's kernel with E8M0 scales.)
//
// One thread block takes a 32 x 128 tile, read row by row into shared memory; warp w then
// holds its columns 16w .. 16w + 15 and lane l its row l, 16 elements a thread. A row block of 32 spans two warps (their amaxes meet in
// shared memory); a column block is one warp's 32 lanes (a reduce-scatter of shuffles), and
// its bytes are transposed through shared memory into 32-byte runs of data_t. Launched with PDL; device
// code only; launched by csrc/ffi/mxfp8_quantize_cuda.cu.
#pragma once

#include "group_quantize.cuh"

namespace jax_fp8 {

constexpr int kMxTileCols = 128;
constexpr int kMxThreads = kMxTileCols / kElemsPerThread * 32;  // 8 warps
static_assert(kMxBlock == 32, "a column block is one warp's lanes");

template <typename T, bool kRowwise>
__global__ void __launch_bounds__(kMxThreads)
    mxfp8_cast_transpose_kernel(const T* x, int64_t rows, int64_t cols, Fp8Format fmt,
                                uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
                                uint8_t* __restrict__ data_t, uint8_t* __restrict__ scales_t) {
  __shared__ unsigned row_part[kRowwise ? kMxThreads / 32 : 1][32];
  __shared__ alignas(16) uint8_t tile_t[kMxTileCols][kMxBlock];
  pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r = int64_t(blockIdx.y) * kMxBlock + lane;
  const int64_t c = int64_t(blockIdx.x) * kMxTileCols + warp * kElemsPerThread;
  // C is a multiple of 32, so a warp's 16 columns are all in or all out; R is a multiple of 32,
  // so every lane's row is in.
  const bool in = c < cols;
  // The tile goes through shared memory: each warp load instruction reads 512 contiguous bytes
  // of x (two tile rows), then lane l takes its 16 elements of row l. (Loading a row a lane
  // straight from x touched 32 rows' cache lines per instruction and bound the kernel on L1.)
  constexpr int kRowVecs = kMxTileCols * sizeof(T) / 16;  // 16-byte vectors in a tile row
  __shared__ uint4 staged[kMxBlock][kRowVecs + 1];  // padded: lanes' rows 16 bytes apart mod 128
  for (int i = threadIdx.x; i < kMxBlock * kRowVecs; i += kMxThreads) {
    const int row = i / kRowVecs, vec = i % kRowVecs;
    const int64_t col = int64_t(blockIdx.x) * kMxTileCols + vec * (16 / int(sizeof(T)));
    if (col < cols)
      staged[row][vec] = *reinterpret_cast<const uint4*>(
          x + (int64_t(blockIdx.y) * kMxBlock + row) * cols + col);
  }
  __syncthreads();
  float f[kElemsPerThread];
  if (in) {
    load16(reinterpret_cast<const T*>(staged[lane]) + warp * kElemsPerThread, f);
  } else {
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) f[k] = 0.0f;
  }

  if constexpr (kRowwise) {
    unsigned m = 0;
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) m = max(m, abs_bits(f[k]));
    row_part[warp][lane] = m;
    __syncthreads();
    m = max(m, row_part[warp ^ 1][lane]);
    const uint8_t s = e8m0_rceil(bits_float(m), fmt);
    if (in) {
      *reinterpret_cast<uint4*>(data + r * cols + c) = quantize16(f, e8m0_inverse(s), fmt);
      if (warp % 2 == 0) scales[r * (cols / kMxBlock) + c / kMxBlock] = s;
    }
  }

  // Column blocks: a reduce-scatter over the lanes. Each step halves the columns a lane holds
  // (the lanes whose bit o is set keep the upper half, their partners the lower) and takes the
  // max with what the partner sends, 8 + 4 + 2 + 1 shuffles; then lanes 2j and 2j + 1 both hold
  // column j's max over all 32 rows after one more. The factors come back by 16 broadcasts.
  unsigned m[kElemsPerThread];
#pragma unroll
  for (int k = 0; k < kElemsPerThread; ++k) m[k] = abs_bits(f[k]);
#pragma unroll
  for (int o = 16, half = kElemsPerThread / 2; o > 1; o >>= 1, half >>= 1) {
    const bool upper = lane & o;
#pragma unroll
    for (int i = 0; i < half; ++i) {
      const unsigned got = __shfl_xor_sync(0xffffffffu, upper ? m[i] : m[i + half], o);
      m[i] = max(upper ? m[i + half] : m[i], got);
    }
  }
  m[0] = max(m[0], __shfl_xor_sync(0xffffffffu, m[0], 1));
  const uint8_t col_scale = e8m0_rceil(bits_float(m[0]), fmt);  // column lane / 2's
  const float col_factor = e8m0_inverse(col_scale);
  if (lane % 2 == 0 && in) scales_t[(c + lane / 2) * (rows / kMxBlock) + blockIdx.y] = col_scale;
#pragma unroll
  for (int k = 0; k < kElemsPerThread; ++k)
    tile_t[warp * kElemsPerThread + k][lane] =
        float_to_fp8(f[k] * __shfl_sync(0xffffffffu, col_factor, 2 * k), fmt);
  __syncthreads();
  // The tile's 128 columns as rows of data_t, 32 bytes each: two 16-byte stores.
  const int row = threadIdx.x / 2, half = threadIdx.x % 2;
  const int64_t ct = int64_t(blockIdx.x) * kMxTileCols + row;
  if (ct < cols)
    *reinterpret_cast<uint4*>(data_t + ct * rows + int64_t(blockIdx.y) * kMxBlock + 16 * half) =
        *reinterpret_cast<const uint4*>(&tile_t[row][16 * half]);
  pdl_trigger();
}

}  // namespace jax_fp8
