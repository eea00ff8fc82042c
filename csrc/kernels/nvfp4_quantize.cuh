// NVFP4 quantization (csrc/nvfp4.h) of x [R, C]: two kernels, one launched per call
// (jax_fp8.ops.nvfp4.nvfp4_kernel decides; the FFI attribute `specialised` says which).
//
// nvfp4_rowwise_kernel, the specialised one: rowwise 1 x 16 blocks only (data [R, C/2], scales
// [R, C/16]). Register-resident: thread v of a grid-stride loop quantizes block v of x (its 16
// consecutive elements) and stores its 8 code bytes and its scale byte, so a warp's loads and
// stores are contiguous; no shared memory, no barrier. Each thread loads its next block before
// it quantizes the current one, so two blocks' loads are in flight a thread.
//
// nvfp4_quantize_kernel, the general one: any direction, 1 x 16 blocks along the rows (data [R,
// C/2], scales [R, C/16]) and, from the same read, 16 x 1 blocks along the columns, written
// transposed (data_t [C, R/2], scales_t [C, R/16]); 16 x 16 tiles, stochastic rounding and the
// random Hadamard transform of the columnwise copy as the attributes say. One thread block
// takes a 16 x 128 tile: thread t holds row t / 8 of it and columns 16 (t % 8) .. 16 (t % 8) +
// 15, its rowwise block. The tile goes to shared memory as f32, where thread t then reads
// column t, its columnwise block. A 16 x 16 tile's amax is reduced over the 16 threads that
// share its columns (shuffles, then the warps through shared memory).
//
// Both read x without flushing its subnormals (load16<T, false>): every use of a value flushes
// it, the products through nvfp4.h's .ftz arithmetic and the block maxima through the scale's
// product, so the bytes are those of flushed inputs (the CPU handler's).
//
// Both launched with PDL; device code only; launched by csrc/ffi/nvfp4_quantize_cuda.cu.
#pragma once

#include "../nvfp4.h"
#include "quantize.cuh"

namespace jax_fp8 {

constexpr int kNvfp4TileCols = 128;
constexpr int kNvfp4Threads = kNvfp4TileCols;  // one column of the tile each; 16 x 8 row blocks
static_assert(kNvfp4Threads == kNvfp4Block * (kNvfp4TileCols / kElemsPerThread), "tile shape");
static_assert(kElemsPerThread == kNvfp4Block, "a thread's 16 elements are one block");

struct Nvfp4Options {
  bool rowwise, columnwise, block_2d, stochastic, rht;
};

template <typename T>
__global__ void __launch_bounds__(kNvfp4Threads)
    nvfp4_quantize_kernel(const T* x, int64_t rows, int64_t cols, Nvfp4Options opt,
                          const float* global_scales, const uint32_t* key,
                          const float* rht_signs, uint8_t* __restrict__ data,
                          uint8_t* __restrict__ scales, uint8_t* __restrict__ data_t,
                          uint8_t* __restrict__ scales_t) {
  constexpr int kGroups = kNvfp4TileCols / kNvfp4Block;  // 8 column blocks of the tile
  __shared__ float tile[kNvfp4Block][kNvfp4TileCols + 1];
  __shared__ unsigned tile_part[kNvfp4Threads / 32][kGroups];
  __shared__ float signs[kNvfp4Block];
  pdl_wait();
  const int tr = threadIdx.x / kGroups, tg = threadIdx.x % kGroups;
  const int64_t r0 = int64_t(blockIdx.y) * kNvfp4Block, c0 = int64_t(blockIdx.x) * kNvfp4TileCols;
  const int64_t r = r0 + tr, c = c0 + tg * kNvfp4Block;
  const bool in = r < rows && c < cols;  // C is a multiple of 16: a block is all in or all out
  const uint32_t k0 = key[0], k1 = key[1];
  if (threadIdx.x < kNvfp4Block) signs[threadIdx.x] = rht_signs[threadIdx.x];

  float v[kNvfp4Block];
  if (in) {
    load16<T, false>(x + r * cols + c, v);
  } else {
#pragma unroll
    for (int k = 0; k < kNvfp4Block; ++k) v[k] = 0.0f;
  }
  unsigned m = 0;
#pragma unroll
  for (int k = 0; k < kNvfp4Block; ++k) m = max(m, abs_bits(v[k]));

  // 16 x 16 tiles: the max over the 16 row blocks of each column block (4 rows a warp).
  __shared__ unsigned tile_amax[kGroups];
  if (opt.block_2d) {
    unsigned t = max(m, __shfl_xor_sync(0xffffffffu, m, 8));
    t = max(t, __shfl_xor_sync(0xffffffffu, t, 16));
    if ((threadIdx.x & 31) < kGroups) tile_part[threadIdx.x / 32][tg] = t;
    __syncthreads();
    if (threadIdx.x < kGroups) {
      unsigned all = 0;
#pragma unroll
      for (int w = 0; w < kNvfp4Threads / 32; ++w) all = max(all, tile_part[w][threadIdx.x]);
      tile_amax[threadIdx.x] = all;
    }
  }
  if (opt.columnwise) {
#pragma unroll
    for (int k = 0; k < kNvfp4Block; ++k) tile[tr][tg * kNvfp4Block + k] = v[k];
  }
  __syncthreads();

  if (opt.rowwise && in) {
    const float gs = global_scales[0];
    const uint8_t s = nvfp4_scale(bits_float(opt.block_2d ? tile_amax[tg] : m), gs);
    const SrBlockBits sr = opt.stochastic ? sr_bits_of_block(k0, k1, uint32_t(c / kNvfp4Block),
                                                             uint32_t(r), 0u)
                                          : SrBlockBits{};
    const uint64_t codes = nvfp4_block_codes(v, s, gs, opt.stochastic, sr);
    *reinterpret_cast<uint2*>(data + r * (cols / 2) + c / 2) =
        make_uint2(uint32_t(codes), uint32_t(codes >> 32));
    scales[r * (cols / kNvfp4Block) + c / kNvfp4Block] = s;
  }

  const int64_t ct = c0 + threadIdx.x;  // this thread's column, a row of data_t
  if (opt.columnwise && ct < cols) {  // R is a multiple of 16: all 16 rows are in
    float w[kNvfp4Block];
#pragma unroll
    for (int k = 0; k < kNvfp4Block; ++k) w[k] = tile[k][threadIdx.x];
    if (opt.rht) hadamard16(w, signs);
    unsigned mt = 0;
#pragma unroll
    for (int k = 0; k < kNvfp4Block; ++k) mt = max(mt, abs_bits(w[k]));
    if (opt.block_2d) mt = tile_amax[threadIdx.x / kNvfp4Block];
    const float gs = global_scales[1];
    const uint8_t s = nvfp4_scale(bits_float(mt), gs);
    const SrBlockBits sr = opt.stochastic ? sr_bits_of_block(k0, k1, uint32_t(blockIdx.y),
                                                             uint32_t(ct), 1u)
                                          : SrBlockBits{};
    const uint64_t codes = nvfp4_block_codes(w, s, gs, opt.stochastic, sr);
    *reinterpret_cast<uint2*>(data_t + ct * (rows / 2) + r0 / 2) =
        make_uint2(uint32_t(codes), uint32_t(codes >> 32));
    scales_t[ct * (rows / kNvfp4Block) + blockIdx.y] = s;
  }
  pdl_trigger();
}

template <typename T>
__global__ void __launch_bounds__(kQuantizeThreads)
    nvfp4_rowwise_kernel(const T* x, int64_t rows, int64_t cols, bool stochastic,
                         const float* global_scales, const uint32_t* key,
                         uint2* __restrict__ data, uint8_t* __restrict__ scales) {
  pdl_wait();
  const float gs = global_scales[0];
  const uint32_t k0 = key[0], k1 = key[1];
  const int64_t row_blocks = cols / kNvfp4Block, blocks = rows * row_blocks;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t v = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  Raw16<T> next;  // the following block's loads, in flight while this one is quantized
  if (v < blocks) next = load_raw16(x + v * kNvfp4Block);
  for (; v < blocks; v += stride) {
    const Raw16<T> raw = next;
    if (v + stride < blocks) next = load_raw16(x + (v + stride) * kNvfp4Block);
    float f[kNvfp4Block];
    unpack16<T, false>(raw, f);
    unsigned m = 0;
#pragma unroll
    for (int k = 0; k < kNvfp4Block; ++k) m = max(m, abs_bits(f[k]));
    const uint8_t s = nvfp4_scale(bits_float(m), gs);
    const SrBlockBits sr = stochastic ? sr_bits_of_block(k0, k1, uint32_t(v % row_blocks),
                                                         uint32_t(v / row_blocks), 0u)
                                      : SrBlockBits{};
    const uint64_t codes = nvfp4_block_codes(f, s, gs, stochastic, sr);
    data[v] = make_uint2(uint32_t(codes), uint32_t(codes >> 32));
    scales[v] = s;
  }
  pdl_trigger();
}

}  // namespace jax_fp8
