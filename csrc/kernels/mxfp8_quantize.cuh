// MXFP8 quantization (OCP MX v1.0, RCEIL scales: csrc/mx.h) with a columnwise copy: 32 x 1
// blocks along the columns of x [R, C], written transposed (data_t [C, R], scales_t
// [C, R/32]) and, from the same read, 1 x 32 blocks along its rows (data [R, C], scales
// [R, C/32]): each direction quantized from x itself, as the MX spec asks. (The rowwise
// direction alone is group_quantize.cuh's kernel with E8M0 scales.)
//
// A persistent grid walks 64 x 64 tiles (tiles.cuh). Thread t first holds row t / 4 of a tile,
// columns 16 (t % 4) .. 16 (t % 4) + 15: half a row block, whose other half its neighbouring
// lane holds (their amaxes meet by one shuffle), and stores its 16 bytes (a warp: 8 rows of 64
// contiguous bytes). The tile goes to shared memory as f32, where thread t then reads column t
// / 4 over the rows 16 (t % 4) .. 16 (t % 4) + 15: half a column block, the other half again its
// neighbouring lane's, and its 16 bytes are a run of data_t's row (a warp: 8 rows of 64
// contiguous bytes). x is read without flushing its subnormals (unpack16<T, false>): a block
// whose largest magnitude is subnormal gets byte 0 (e8m0_rceil), as an all-zero one, and the
// products flush the rest (quantize16), so the bytes are those of flushed inputs. Launched with
// PDL; device code only; launched by csrc/ffi/mxfp8_quantize_cuda.cu.
#pragma once

#include "group_quantize.cuh"
#include "tiles.cuh"

namespace jax_fp8 {

static_assert(kMxBlock == 2 * kElemsPerThread, "a block is two neighbouring lanes' halves");

// 16-bit inputs are held to 6 blocks an SM (40 registers; ptxas spills 4 bytes a thread), as many
// as the shared memory allows; f32 inputs would spill about 100 bytes so, and keep theirs.
template <typename T, bool kRowwise>
__global__ void __launch_bounds__(kTileThreads, sizeof(T) == 2 ? 6 : 1)
    mxfp8_cast_transpose_kernel(const T* x, int64_t rows, int64_t cols, Fp8Format fmt,
                                uint8_t* __restrict__ data, uint8_t* __restrict__ scales,
                                uint8_t* __restrict__ data_t, uint8_t* __restrict__ scales_t) {
  // Element (r, c) of a tile lives at column at(r, c) of row r: rows of 72 floats, and the
  // column's 8-float groups XORed with r's 16-row group, its 4-float chunks with c's half of the
  // tile. So a row pass's 16-byte stores (a quarter warp: 2 rows, 4 lanes a row, their chunks 16
  // floats apart) and a column pass's loads (8 columns of 4 row groups) meet no bank twice. Two
  // buffers, alternate tiles: a warp writes a buffer again only after the next tile's barrier,
  // which every warp passes after its reads of it, so one barrier a tile suffices.
  constexpr int kRow = kTile + 8;
  __shared__ __align__(16) float tiles[2][kTile][kRow];
  auto at = [](int r, int c) { return c ^ (r / 16 * 8) ^ (c / 32 * 4); };
  int parity = 0;
  pdl_wait();
  const int tr = threadIdx.x / kTileBlocks, tc = threadIdx.x % kTileBlocks * kElemsPerThread;
  // C is a multiple of 32 (R too, with a columnwise copy): a block is all in or all out.
  auto load = [&](int64_t r0, int64_t c0) {
    const int64_t r = r0 + tr, c = c0 + tc;
    return r < rows && c < cols ? load_raw16(x + r * cols + c) : Raw16<T>{};
  };
  // The E8M0 scale of the block whose halves this lane and its neighbour hold, and the bytes of
  // this lane's half.
  auto quantize_half = [&](const float (&f)[kElemsPerThread], uint8_t& s) {
    unsigned m = 0;
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) m = max(m, abs_bits(f[k]));
    s = e8m0_rceil(bits_float(max(m, __shfl_xor_sync(0xffffffffu, m, 1))), fmt);
    if (s == e8m0_top(fmt)) {  // rare: saturate a copy (f also feeds the other direction)
      float g[kElemsPerThread];
#pragma unroll
      for (int k = 0; k < kElemsPerThread; ++k) g[k] = e8m0_saturate(f[k], s, fmt);
      return quantize16(g, e8m0_inverse(s), fmt);
    }
    return quantize16(f, e8m0_inverse(s), fmt);
  };
  for_each_tile<Raw16<T>>(rows, cols, load, [&](const Raw16<T>& raw, int64_t r0, int64_t c0) {
    float(&tile)[kTile][kRow] = tiles[parity];
    parity ^= 1;
    float f[kElemsPerThread];
    unpack16<T, false>(raw, f);
    if constexpr (kRowwise) {
      uint8_t s;
      const uint4 bytes = quantize_half(f, s);
      const int64_t r = r0 + tr, c = c0 + tc;
      if (r < rows && c < cols) {
        *reinterpret_cast<uint4*>(data + r * cols + c) = bytes;
        if (tc % kMxBlock == 0) scales[r * (cols / kMxBlock) + c / kMxBlock] = s;
      }
    }
#pragma unroll
    for (int k = 0; k < kElemsPerThread; k += 4)
      *reinterpret_cast<float4*>(&tile[tr][at(tr, tc + k)]) =
          make_float4(f[k], f[k + 1], f[k + 2], f[k + 3]);
    __syncthreads();

    // data_t's row c0 + tr, its columns r0 + tc ..
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) f[k] = tile[tc + k][at(tc + k, tr)];
    uint8_t s;
    const uint4 bytes = quantize_half(f, s);
    const int64_t ct = c0 + tr, rt = r0 + tc;
    if (ct < cols && rt < rows) {
      *reinterpret_cast<uint4*>(data_t + ct * rows + rt) = bytes;
      if (tc % kMxBlock == 0) scales_t[ct * (rows / kMxBlock) + rt / kMxBlock] = s;
    }
  });
  pdl_trigger();
}

}  // namespace jax_fp8
