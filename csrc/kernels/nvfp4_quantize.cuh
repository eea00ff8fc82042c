// NVFP4 quantization (csrc/nvfp4.h) of x [R, C]: two kernels, one launched per call
// (jax_fp8.nvfp4_quantize_cuda_kernel decides; the FFI attribute `specialised` says which).
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
// random Hadamard transform of the columnwise copy as the attributes say. A persistent grid walks
// 64 x 64 tiles (tiles.cuh). Thread t first holds row t / 4 of a tile and its columns 16 (t % 4)
// .. 16 (t % 4) + 15, its rowwise block, whose 8 code bytes it stores (a warp: 8 rows of 32
// contiguous bytes). The tile goes to shared memory as f32, where thread t then reads column t %
// 64 over the rows 16 (t / 64) .. 16 (t / 64) + 15, its columnwise block. Those codes go back
// through shared memory, so that a warp stores 8 data_t rows of 32 contiguous bytes, whole
// sectors. A 16 x 16 tile's amax is reduced over the 16 threads that share its columns (shuffles
// over a warp's 8 rows, then the two warps through shared memory).
//
// Both read x without flushing its subnormals (unpack16<T, false>): every use of a value flushes
// it, the products through nvfp4.h's .ftz arithmetic and the block maxima through the scale's
// product, so the bytes are those of flushed inputs (the CPU handler's).
//
// Both launched with PDL; device code only; launched by csrc/ffi/nvfp4_quantize_cuda.cu.
#pragma once

#include "../nvfp4.h"
#include "tiles.cuh"

namespace jax_fp8 {

static_assert(kElemsPerThread == kNvfp4Block, "a thread's 16 elements are one block");

struct Nvfp4Options {
  bool rowwise, columnwise, block_2d, stochastic, rht;
};

template <typename T>
__global__ void __launch_bounds__(kTileThreads)
    nvfp4_quantize_kernel(const T* x, int64_t rows, int64_t cols, Nvfp4Options opt,
                          const float* global_scales, const uint32_t* key,
                          const float* rht_signs, uint8_t* __restrict__ data,
                          uint8_t* __restrict__ scales, uint8_t* __restrict__ data_t,
                          uint8_t* __restrict__ scales_t) {
  constexpr int kWarps = kTileThreads / 32;
  // Rows of 68 floats: 16-byte aligned for the row pass's vector stores; the column pass's warp
  // reads 32 consecutive columns of a row, 32 banks.
  __shared__ __align__(16) float tile[kTile][kTile + 4];
  // Column c's columnwise codes, 8 bytes a row block; 9 words a column, so the column pass's
  // 32 columns store to 32 banks.
  __shared__ uint32_t codes_t[kTile][2 * kTileBlocks + 1];
  __shared__ uint8_t scales_tile_t[kTile][kTileBlocks];
  __shared__ unsigned rows_amax[kWarps][kTileBlocks];  // 16 x 16 tiles: each warp's 8 rows
  __shared__ float signs[kNvfp4Block];
  pdl_wait();
  // Row pass: row tr, columns tc.. (block tq). Column pass: column cc, rows 16 cb.. (block cb).
  // Stores of the columnwise copy: column oc, rows 16 ob.. (block ob).
  const int tq = threadIdx.x % kTileBlocks, tr = threadIdx.x / kTileBlocks;
  const int tc = tq * kNvfp4Block, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cc = threadIdx.x % kTile, cb = threadIdx.x / kTile;
  const int oc = threadIdx.x / kTileBlocks, ob = threadIdx.x % kTileBlocks;
  const uint32_t k0 = key[0], k1 = key[1];
  const float gs = global_scales[0], gs_t = global_scales[1];
  const float enc = nvfp4_scale_encode(gs), enc_t = nvfp4_scale_encode(gs_t);
  if (threadIdx.x < kNvfp4Block) signs[threadIdx.x] = rht_signs[threadIdx.x];
  // The 16 x 16 tile of row block b and column block q: its two warps' maxima.
  auto tile_amax = [&](int b, int q) { return max(rows_amax[2 * b][q], rows_amax[2 * b + 1][q]); };

  auto load = [&](int64_t r0, int64_t c0) {
    const int64_t r = r0 + tr, c = c0 + tc;  // C is a multiple of 16: a block is all in or out
    return r < rows && c < cols ? load_raw16(x + r * cols + c) : Raw16<T>{};
  };
  for_each_tile<Raw16<T>>(rows, cols, load, [&](const Raw16<T>& raw, int64_t r0, int64_t c0) {
    const int64_t r = r0 + tr, c = c0 + tc;
    float v[kNvfp4Block];
    unpack16<T, false>(raw, v);
    unsigned m = 0;
#pragma unroll
    for (int k = 0; k < kNvfp4Block; ++k) m = max(m, abs_bits(v[k]));
    if (opt.block_2d) {
      unsigned t = max(m, __shfl_xor_sync(0xffffffffu, m, kTileBlocks));
      t = max(t, __shfl_xor_sync(0xffffffffu, t, 2 * kTileBlocks));
      t = max(t, __shfl_xor_sync(0xffffffffu, t, 4 * kTileBlocks));
      if (lane < kTileBlocks) rows_amax[warp][lane] = t;
    }
    if (opt.columnwise) {
#pragma unroll
      for (int k = 0; k < kNvfp4Block; k += 4)
        *reinterpret_cast<float4*>(&tile[tr][tc + k]) =
            make_float4(v[k], v[k + 1], v[k + 2], v[k + 3]);
    }
    __syncthreads();

    if (opt.rowwise && r < rows && c < cols) {
      const unsigned a = opt.block_2d ? tile_amax(tr / kNvfp4Block, tq) : m;
      const uint8_t s = nvfp4_scale(bits_float(a), enc);
      const SrBlockBits sr = opt.stochastic ? sr_bits_of_block(k0, k1, uint32_t(c / kNvfp4Block),
                                                               uint32_t(r), 0u)
                                            : SrBlockBits{};
      const uint64_t codes = nvfp4_block_codes(v, s, gs, opt.stochastic, sr);
      *reinterpret_cast<uint2*>(data + r * (cols / 2) + c / 2) =
          make_uint2(uint32_t(codes), uint32_t(codes >> 32));
      scales[r * (cols / kNvfp4Block) + c / kNvfp4Block] = s;
    }

    if (opt.columnwise) {
      const int64_t ct = c0 + cc, rt = r0 + cb * kNvfp4Block;  // R is a multiple of 16
      if (ct < cols && rt < rows) {
        float w[kNvfp4Block];
#pragma unroll
        for (int k = 0; k < kNvfp4Block; ++k) w[k] = tile[cb * kNvfp4Block + k][cc];
        if (opt.rht) hadamard16(w, signs);
        unsigned mt = 0;
#pragma unroll
        for (int k = 0; k < kNvfp4Block; ++k) mt = max(mt, abs_bits(w[k]));
        if (opt.block_2d) mt = tile_amax(cb, cc / kNvfp4Block);
        const uint8_t s = nvfp4_scale(bits_float(mt), enc_t);
        const SrBlockBits sr = opt.stochastic
                                   ? sr_bits_of_block(k0, k1, uint32_t(rt / kNvfp4Block),
                                                      uint32_t(ct), 1u)
                                   : SrBlockBits{};
        const uint64_t codes = nvfp4_block_codes(w, s, gs_t, opt.stochastic, sr);
        codes_t[cc][2 * cb] = uint32_t(codes);
        codes_t[cc][2 * cb + 1] = uint32_t(codes >> 32);
        scales_tile_t[cc][cb] = s;
      }
      __syncthreads();
      const int64_t co = c0 + oc, ro = r0 + ob * kNvfp4Block;
      if (co < cols && ro < rows) {
        *reinterpret_cast<uint2*>(data_t + co * (rows / 2) + ro / 2) =
            make_uint2(codes_t[oc][2 * ob], codes_t[oc][2 * ob + 1]);
        scales_t[co * (rows / kNvfp4Block) + ro / kNvfp4Block] = scales_tile_t[oc][ob];
      }
    }
    // With a columnwise copy, the barrier before its stores already orders this tile's reads of
    // tile and rows_amax before the next tile's writes (and the next tile's first barrier its
    // writes of codes_t after these reads); without one, the next tile's rows_amax waits here.
    if (!opt.columnwise) __syncthreads();
  });
  pdl_trigger();
}

template <typename T>
__global__ void __launch_bounds__(kQuantizeThreads)
    nvfp4_rowwise_kernel(const T* x, int64_t rows, int64_t cols, bool stochastic,
                         const float* global_scales, const uint32_t* key,
                         uint2* __restrict__ data, uint8_t* __restrict__ scales) {
  pdl_wait();
  const float gs = global_scales[0], enc = nvfp4_scale_encode(gs);
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
    const uint8_t s = nvfp4_scale(bits_float(m), enc);
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
