// Cast-transpose: one read of the input writes the row-major FP8 copy q [R, C] and the
// transposed copy qt [C, R16] (R16 = R rounded up to 16, padding columns zero), with the amax
// fused, optionally the column sums of what was quantized (the bias gradient: per-tile partials
// here, summed by dbias_reduce_kernel), and optionally the scale ring's outputs written by the
// last block (quantize.cuh's finish_amax). These are the layouts Hopper's TN-only FP8 GEMMs
// need: q feeds the forward / dgrad, qt the wgrad (docs/design.md, "Linear layout"). What is
// quantized comes from a source (sources.cuh): x, an activation of x, the gradient through one,
// or a norm of x.
#pragma once

#include "sources.cuh"
#include "tiles.cuh"

namespace jax_fp8 {

static_assert(kQtRowMultiple == kElemsPerThread, "a thread stores 16 bytes of a qt row");
static_assert(kTileBlocks == 4, "the dbias shuffles assume 4 lanes a row");

// The amax of a source's values (all its outputs) when the ring is on its first step (the
// cast-transpose then quantizes with the scale from it); otherwise every block returns at once.
template <typename Src>
__global__ void __launch_bounds__(kQuantizeThreads)
    first_step_source_amax_kernel(Src src, int64_t rows, int64_t cols, const float* steps,
                                  QuantizeScratch* scratch) {
  pdl_wait();
  if (*steps != 0.0f) {
    pdl_trigger();
    return;
  }
  unsigned m = 0;
  const int64_t row_vecs = cols / kElemsPerThread, n = rows * row_vecs;
  for (int64_t v = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; v < n;
       v += int64_t(gridDim.x) * blockDim.x) {
    const int64_t r = v / row_vecs, c = v % row_vecs * kElemsPerThread;
    float f[Src::kOutputs][kElemsPerThread];
    src.values(src.load(r, c), f);
#pragma unroll
    for (int j = 0; j < Src::kOutputs; ++j)
#pragma unroll
      for (int k = 0; k < kElemsPerThread; ++k) m = max(m, abs_bits(f[j][k]));
  }
  add_first_amax(m, scratch);
  pdl_trigger();
}

// A persistent grid (tiles.cuh's for_each_tile): each block keeps its amax in registers over
// its tiles, so the amax atomics and the completion count are paid once per block, not once
// per tile.
//
// cols: the source's columns (of each output); q is [R, kOutputs * cols], its outputs side by
// side, and qt [kOutputs * cols, R16].
// dbias_partial: f32 [ceil(R / 64), kOutputs * cols], the column sums of each row-tile
// (dbias_reduce_kernel sums them). Inside a tile the order is fixed, so the kernel is
// deterministic: a warp holds 8 rows and sums them pairwise by shuffles, ((r0 + r1) + (r2 +
// r3)) + ((r4 + r5) + (r6 + r7)), then the 8 warps' sums are added in warp order onto 0 (the
// CPU handler follows the order).
// 16-bit inputs take their source's launch bound (blocks_per_sm in sources.cuh): enough
// resident blocks for the loads in flight to cover the memory's latency; f32 inputs keep
// their registers.
template <typename Src, bool kRing, bool kDbias>
__global__ void __launch_bounds__(
    kTileThreads, sizeof(typename Src::Input) != 2 ? 1 : Src::blocks_per_sm(kDbias))
    cast_transpose_kernel(Src src, int64_t rows, int64_t cols, int64_t rows16,
                          const float* scale_in, Fp8Format fmt, uint8_t* __restrict__ q,
                          uint8_t* __restrict__ qt, float* amax_out, float* dbias_partial,
                          QuantizeScratch* scratch, RingArgs ring) {
  constexpr int kOut = Src::kOutputs;
  __shared__ __align__(16) uint8_t tile_q[kOut][kTile][kTile + 4];
  constexpr int kWarps = kTileThreads / 32;
  __shared__ __align__(8) float warp_sums[kOut][kDbias ? kWarps : 1][kDbias ? kTile : 1];
  pdl_wait();
  const float scale = kRing ? ring_scale(ring, scratch, fmt) : *scale_in;
  const float inv = 1.0f / flush_subnormal(scale);
  const int64_t q_cols = kOut * cols;  // output j's column c is q's column c + j * cols
  const int tr = threadIdx.x / kTileBlocks, tc = threadIdx.x % kTileBlocks * kElemsPerThread;
  using Raw = typename Src::Raw;
  // This thread's 16 elements of a tile: row r0 + tr, columns c0 + tc.. (C % 16 == 0), zeros
  // outside the tensor.
  auto load = [&](int64_t r0, int64_t c0) {
    Raw raw = {};
    const int64_t r = r0 + tr, c = c0 + tc;
    if (r < rows && c < cols) raw = src.load(r, c);
    return raw;
  };
  unsigned m = 0;

  for_each_tile<Raw>(rows, cols, load, [&](const Raw& cur, int64_t r0, int64_t c0) {
    // Row-major pass: 16 consecutive elements of one row per thread.
    const int64_t r = r0 + tr, c = c0 + tc;
    const bool in = r < rows && c < cols;
    float f[kOut][kElemsPerThread];
    src.values(cur, f);
#pragma unroll
    for (int j = 0; j < kOut; ++j) {
#pragma unroll
      for (int k = 0; k < kElemsPerThread; ++k) m = max(m, abs_bits(f[j][k]));
      const uint4 packed = in ? quantize16(f[j], inv, fmt) : make_uint4(0, 0, 0, 0);
      if constexpr (kDbias) {
        // A reduce-scatter over the 8 lanes of a column group (lanes 4, 8, 16 apart hold the
        // same columns of other rows): at each step a lane keeps half of its columns, sends
        // the other half to its partner and adds the partner's half, so 8 + 4 + 2 shuffles
        // leave it 2 columns summed over the warp's 8 rows (all 16 columns to every lane took
        // 48).
        float* v = f[j];
        int col = tc;
#pragma unroll
        for (int step = 0; step < 3; ++step) {
          const int lanes = 4 << step, half = kElemsPerThread / 2 >> step;
          const bool upper = threadIdx.x & lanes;
#pragma unroll
          for (int k = 0; k < kElemsPerThread / 2; ++k) {  // constant bounds: v stays in registers
            if (k >= half) break;
            const float lo = v[k], hi = v[k + half];
            v[k] = (upper ? hi : lo) + __shfl_xor_sync(~0u, upper ? lo : hi, lanes);
          }
          col += upper ? half : 0;
        }
        *reinterpret_cast<float2*>(&warp_sums[j][threadIdx.x / 32][col]) = make_float2(v[0], v[1]);
      }
      if (in) *reinterpret_cast<uint4*>(q + r * q_cols + j * cols + c) = packed;
      // Rows of tile_q are 68 bytes: 4-byte aligned, so the 16 bytes go in as four words.
      uint32_t* row = reinterpret_cast<uint32_t*>(&tile_q[j][tr][tc]);
      row[0] = packed.x, row[1] = packed.y, row[2] = packed.z, row[3] = packed.w;
    }
    __syncthreads();

    // Transposed pass: qt row (c0 + tr), 16 consecutive r of it per thread (R16 % 16 == 0).
    const int64_t qt_row = c0 + tr, qt_col = r0 + tc;
#pragma unroll
    for (int j = 0; j < kOut; ++j) {
      if (qt_row < cols && qt_col < rows16) {
        alignas(16) uint8_t tq[kElemsPerThread];
#pragma unroll
        for (int k = 0; k < kElemsPerThread; ++k) tq[k] = tile_q[j][tc + k][tr];
        *reinterpret_cast<uint4*>(qt + (j * cols + qt_row) * rows16 + qt_col) =
            *reinterpret_cast<const uint4*>(tq);
      }
      if constexpr (kDbias) {
        if (threadIdx.x < kTile && c0 + threadIdx.x < cols && r0 < rows) {
          float sum = 0.0f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) sum += warp_sums[j][w][threadIdx.x];
          dbias_partial[r0 / kTile * q_cols + j * cols + c0 + threadIdx.x] = sum;
        }
      }
    }
    __syncthreads();  // the next tile reuses tile_q and warp_sums
  });

  finish_amax<kRing>(m, scratch, amax_out, ring, fmt);
  pdl_trigger();
}

// The bias gradient from cast_transpose_kernel's partials: dbias[c] = the sum over p of
// partial[p][c], p < tiles (the row tiles). A block takes 32 columns; its warp w sums the
// rows p = w, w + 8, ... in order onto 0, and the 8 warps' sums are added pairwise,
// ((w0 + w1) + (w2 + w3)) + ((w4 + w5) + (w6 + w7)): a fixed order (the CPU handler's). Launched
// right after the cast-transpose (PDL), it reads the partials from L2.
constexpr int kDbiasCols = 32, kDbiasSlices = kTileThreads / kDbiasCols;

__global__ void __launch_bounds__(kTileThreads)
    dbias_reduce_kernel(const float* partial, int64_t tiles, int64_t cols, float* dbias) {
  __shared__ float sums[kDbiasSlices][kDbiasCols];
  pdl_wait();
  const int lane = threadIdx.x % kDbiasCols, w = threadIdx.x / kDbiasCols;
  const int64_t c = int64_t(blockIdx.x) * kDbiasCols + lane;
  float sum = 0.0f;
  if (c < cols) {
#pragma unroll 4
    for (int64_t p = w; p < tiles; p += kDbiasSlices) sum += partial[p * cols + c];
  }
  sums[w][lane] = sum;
  __syncthreads();
  if (w == 0 && c < cols) {
    const float(*s)[kDbiasCols] = sums;
    dbias[c] = ((s[0][lane] + s[1][lane]) + (s[2][lane] + s[3][lane])) +
               ((s[4][lane] + s[5][lane]) + (s[6][lane] + s[7][lane]));
  }
  pdl_trigger();
}
static_assert(kDbiasSlices == 8, "dbias_reduce_kernel adds 8 warps' sums");

}  // namespace jax_fp8
