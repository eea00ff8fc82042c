// MXFP8 quantization (OCP MX v1.0, RCEIL scales: csrc/mx.h): 1 x 32 blocks along the rows of
// x [R, C] (data [R, C], scales [R, C/32]) and, from the same read, 1 x 32 blocks along its
// columns, written transposed (data_t [C, R], scales_t [C, R/32]): each direction quantized
// from x itself, as the MX spec asks.
//
// One thread block takes a 32 x 128 tile; warp w holds its columns 16w .. 16w + 15 and lane l
// its row l, 16 elements a thread. A row block of 32 spans two warps (their amaxes meet in
// shared memory); a column block is one warp's 32 lanes (a shuffle reduction), and its bytes
// are transposed through shared memory into 32-byte runs of data_t. Launched with PDL; device
// code only; launched by csrc/ffi/mxfp8_quantize_cuda.cu.
#pragma once

#include "../mx.h"
#include "quantize.cuh"

namespace jax_fp8 {

constexpr int kMxTileCols = 128;
constexpr int kMxThreads = kMxTileCols / kElemsPerThread * 32;  // 8 warps
static_assert(kMxBlock == 32, "a column block is one warp's lanes");

template <typename T, bool kRowwise, bool kColumnwise>
__global__ void __launch_bounds__(kMxThreads)
    mxfp8_quantize_kernel(const T* x, int64_t rows, int64_t cols, Fp8Format fmt,
                          uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
                          uint8_t* __restrict__ data_t, uint8_t* __restrict__ scales_t) {
  __shared__ unsigned row_part[kRowwise ? kMxThreads / 32 : 1][32];
  __shared__ alignas(16) uint8_t tile_t[kColumnwise ? kMxTileCols : 1][kMxBlock];
  pdl_wait();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t r = int64_t(blockIdx.y) * kMxBlock + lane;
  const int64_t c = int64_t(blockIdx.x) * kMxTileCols + warp * kElemsPerThread;
  // C is a multiple of 32, so a warp's 16 columns are all in or all out; with columnwise R is
  // a multiple of 32, so every lane's row is in.
  const bool in = r < rows && c < cols;
  float f[kElemsPerThread];
  if (in) {
    load16(x + r * cols + c, f);
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

  if constexpr (kColumnwise) {
    uint8_t lane_scale = 0;  // lane k keeps column k's scale
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) {
      unsigned m = abs_bits(f[k]);
#pragma unroll
      for (int o = 16; o; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
      const uint8_t s = e8m0_rceil(bits_float(m), fmt);
      tile_t[warp * kElemsPerThread + k][lane] = float_to_fp8(f[k] * e8m0_inverse(s), fmt);
      if (lane == k) lane_scale = s;
    }
    if (lane < kElemsPerThread && c + lane < cols)
      scales_t[(c + lane) * (rows / kMxBlock) + blockIdx.y] = lane_scale;
    __syncthreads();
    // The tile's 128 columns as rows of data_t, 32 bytes each: two 16-byte stores.
    const int row = threadIdx.x / 2, half = threadIdx.x % 2;
    const int64_t ct = int64_t(blockIdx.x) * kMxTileCols + row;
    if (ct < cols)
      *reinterpret_cast<uint4*>(data_t + ct * rows + int64_t(blockIdx.y) * kMxBlock + 16 * half) =
          *reinterpret_cast<const uint4*>(&tile_t[row][16 * half]);
  }
  pdl_trigger();
}

}  // namespace jax_fp8
