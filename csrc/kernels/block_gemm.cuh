// jax_fp8's block-scaled FP8 GEMM for sm_90a (the DeepSeek-V3 recipe):
//   d[M, N] = sum over K blocks kb of (a[:, kb] . b[:, kb]^T) * a_scale[m, kb] * b_scale[n, kb]
//             (+ bias[N]),
// a [M, K] e4m3 in 1 x 128 groups along K, b [N, K] e4m3 in 128 x 128 blocks (fprop, dgrad) or
// in 1 x 128 groups along K (wgrad), K a multiple of 128, N of 16, any M.
//
// The method is DeepSeek-V3's (technical report, section 3.3.2) as DeepGEMM runs it: the FP8
// tensor cores accumulate each 128-wide K block into registers of their own (about 14 bits of
// accumulation, so never for longer than one block), and that partial sum is multiplied by the
// block's scales and added into an f32 main accumulator, so every block's product is promoted
// exactly once at full f32 precision.
//
// One persistent CTA per SM (or per cluster of 2) walks 128 x kBlockN output tiles
// (BlockGemmTiles), three warpgroups each:
// - warpgroup 0, one thread: the producer. Per K block it waits for a free stage of the
//   kStages-deep shared-memory ring (its "empty" mbarrier) and issues four TMA copies onto the
//   stage's "full" mbarrier: a's 128 x 128 tile, b's kBlockN x 128 tile (with a cluster of 2,
//   each CTA copies half of b's rows to both CTAs: the two CTAs hold tiles of the same columns),
//   the 128 a scales of the tile's rows and b's scales of the block (kBlockN column scales, or
//   the 128 x 128 block scales of the tile's columns).
// - warpgroups 1 and 2: the consumers, 64 rows of the tile each. A K block's MMAs run in
//   kSplits column slices (one slice, of the whole tile, where registers allow), four wgmma
//   m64nNk32 (e4m3 x e4m3 -> f32) each (a from registers, loaded once a block, where a block
//   has several slices and b block scales), into two partial accumulators in turn: a slice's
//   promotion into the main accumulator waits for its own MMAs only and runs on the CUDA cores
//   while the next slice's MMAs keep the tensor cores busy, as do the other consumer's. Per K
//   block: wait for the stage, read the scales of the thread's rows and of the tile's 128 x 128
//   blocks of b into registers, issue the slices; after the block's last MMAs release the stage
//   (one arrival per warp on the empty mbarrier of each CTA of the cluster; with b's column
//   scales, which the promotion reads from the stage, after the promotion). After the last
//   block: the epilogue adds the bias and stores the tile from registers (lanes of a quad trade
//   values so that each stores 16 contiguous bytes; rows and columns past M and N skipped),
//   then the next tile starts.
// No atomics and a fixed order of sums: the output is the same bit for bit on every run.
//
// Shared memory: kStages stages of [a tile 16 KiB | b tile kBlockN x 128 B | 128 a scales |
// b scales], the tiles 1024-byte aligned and 128-byte swizzled (TMA's SWIZZLE_128B, which
// wgmma's descriptors read as K-major 128-byte swizzled rows), then the 2 x kStages mbarriers.
// Launched by csrc/ffi/block_gemm_launch.cuh (tensor maps, cluster, Programmatic Dependent
// Launch); device code only.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>
#include <utility>

#include "../constants.h"
#include "block_gemm_params.h"
#include "cute/arch/cluster_sm90.hpp"
#include "cute/arch/copy_sm90_desc.hpp"
#include "cute/arch/copy_sm90_tma.hpp"
#include "cute/arch/mma_sm90.hpp"
#include "cute/arch/mma_sm90_desc.hpp"
#include "cutlass/arch/barrier.h"
#include "cutlass/arch/reg_reconfig.h"

// CuTe's wgmma selectors offer the 72-, 80- and 112-column MMAs only with this definition
// (CMakeLists.txt sets it for the block GEMM's target).
#ifndef CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED
#error "block_gemm.cuh needs CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED"
#endif

namespace jax_fp8 {

// The wgmma m64nNk32 e4m3 x e4m3 -> f32 instruction of an MMA width: CuTe's atom, b K-major in
// shared memory, a from registers (kRegisterA) or from shared memory.
template <int kMmaN, bool kRegisterA>
using BlockGemmMma = std::conditional_t<
    kRegisterA,
    decltype(cute::SM90::GMMA::rs_op_selector<cute::float_e4m3_t, cute::float_e4m3_t, float,
                                              cute::Shape<cute::_64, cute::Int<kMmaN>, cute::_32>>()),
    decltype(cute::SM90::GMMA::ss_op_selector<cute::float_e4m3_t, cute::float_e4m3_t, float,
                                              cute::Shape<cute::_64, cute::Int<kMmaN>, cute::_32>>())>;

constexpr int block_gemm_gcd(int a, int b) { return b == 0 ? a : block_gemm_gcd(b, a % b); }

// Tile sizes, pipeline depth and the shared-memory layout of one instantiation.
template <int kBlockN_, bool kColumnScales_>
struct BlockGemmTraits {
  static constexpr int kBlockN = kBlockN_;
  // b's scales: one per column of each K block (1 x 128 groups, wgrad) or one per 128 x 128
  // block (fprop, dgrad).
  static constexpr bool kColumnScales = kColumnScales_;
  static constexpr int kBlockM = 128;
  static constexpr int kBlockK = kBlockTile;  // one scale block of K per stage
  static constexpr int kMmaK = 32;            // K of one wgmma on FP8
  static constexpr int kMathGroups = 2;       // consumer warpgroups, 64 rows each
  static constexpr int kThreads = 128 * (1 + kMathGroups);
  // setmaxnreg: the producer gives registers back to the consumers' accumulators (kAccum +
  // 2 kPart floats a thread); 128 x 40 + 256 x 232 fits the 64 Ki registers of an SM.
  static constexpr int kProducerRegisters = 40;
  static constexpr int kMathRegisters = 232;
  static constexpr int kAccum = kBlockN / 2;  // f32 main accumulator registers of a thread
  // The MMAs of a K block run in kSplits column slices, each into one of two partial
  // accumulators in turn, so that one slice's promotion overlaps the next one's MMAs: the
  // fewest slices whose two partial accumulators and the main one (kAccum + 2 kPart floats)
  // leave a thread's kMathRegisters some 40 registers for the rest.
  static constexpr int kSplits = kBlockN * 3 / 2 <= 192 ? 1 : kBlockN <= 192 ? 2 : 4;
  static constexpr int kMmaN = kBlockN / kSplits;
  static constexpr int kPart = kMmaN / 2;  // f32 partial accumulator registers (m64nN)
  // K blocks a round of the consumers' loop takes: an even number of slices, so that each
  // slice's partial accumulator is known at compile time.
  static constexpr int kRound = kSplits == 1 ? 2 : 1;
  // a from registers where a K block's slices would each read a's tile from shared memory again
  // (four times at 64 columns): a block's 16 registers a thread, loaded when its round starts,
  // after the last round's MMAs are done. With column scales, those 16 spilled (ptxas).
  static constexpr bool kRegisterA = kSplits > 1 && !kColumnScales;

  static constexpr int kABytes = kBlockM * kBlockK;
  static constexpr int kBBytes = kBlockN * kBlockK;
  static constexpr int kAScaleBytes = kBlockM * 4;
  // 128 x 128 block scales: eight f32 from the 16-byte-aligned group of four holding the tile's
  // first block (a TMA box starts on a 16-byte boundary of the row; the tile's columns lie in
  // at most two blocks, asserted below, so the second is inside the eight too).
  static constexpr int kBScaleFloats = kColumnScales ? kBlockN : 8;
  // TMA: 128-byte aligned
  static constexpr int kBScaleSlot = (kBScaleFloats * 4 + 127) / 128 * 128;
  // Bytes the TMA copies of one stage bring to this CTA (a box counts whole, out-of-bounds
  // elements included: TMA fills them with zeros).
  static constexpr uint32_t kTxBytes = kABytes + kBBytes + kAScaleBytes + kBScaleFloats * 4;
  static constexpr int kStageBytes = kABytes + kBBytes + kAScaleBytes + kBScaleSlot;
  // sm_90's largest dynamic shared memory per block (227 KiB), less the 1024 bytes that align
  // the swizzled tiles.
  static constexpr int kSmemLimit = 232448;
  static constexpr int kAlign = 1024;
  static constexpr int kStages = (kSmemLimit - kAlign) / (kStageBytes + 16) < 8
                                     ? (kSmemLimit - kAlign) / (kStageBytes + 16)
                                     : 8;
  static constexpr int kBOffset = kStages * kABytes;
  static constexpr int kAScaleOffset = kBOffset + kStages * kBBytes;
  static constexpr int kBScaleOffset = kAScaleOffset + kStages * kAScaleBytes;
  static constexpr int kBarrierOffset = kBScaleOffset + kStages * kBScaleSlot;
  static constexpr int kSmemBytes = kAlign + kBarrierOffset + kStages * 16;

  static_assert(kBlockN % 16 == 0 && kMmaN % 8 == 0 && kBlockN <= 256,
                "the epilogue's column pairs; wgmma's N and the 8-row swizzle atoms of b's slices");
  static_assert(kColumnScales || 128 - block_gemm_gcd(kBlockN, 128) + kBlockN <= 256,
                "a tile's columns must lie in at most two 128 x 128 blocks");
  static_assert(kStages >= 3, "too few stages to hide the copies");
  static_assert(kABytes % 1024 == 0 && kBBytes % 1024 == 0 && (kBBytes / kSplits) % 1024 == 0,
                "128-byte swizzled tiles (and b's slices) start 1024-byte aligned");
};

struct BlockGemmTile {
  int m0, n0;  // the tile's first row (of a and d) and column (b's row, d's column)
};

// The dense tile order of the persistent grid: the tiles of an output [m, n] go in units of
// `cluster` tiles stacked along M (the CTAs of a cluster take one tile each, of the same
// columns), unit u to cluster u % clusters. Units run down bands of kBandRows tile rows, then
// along N, so the clusters running at once share rows of a and columns of b in L2.
// The kernel walks whatever a scheduler gives: a grouped GEMM's scheduler (tiles of several
// problems) plugs in as the kernel's Tiles parameter with this interface.
struct BlockGemmTiles {
  static constexpr int kBandRows = 16;
  int n_tiles, cluster, rank, band_units, unit_rows, units, unit, stride, block_n;

  __device__ BlockGemmTiles(const BlockGemmParams& p, int block_n_)
      : n_tiles((p.n + block_n_ - 1) / block_n_),
        cluster(p.cluster),
        rank(static_cast<int>(cute::block_rank_in_cluster())),
        band_units(kBandRows / p.cluster),
        unit_rows(((p.m + 127) / 128 + p.cluster - 1) / p.cluster),
        units(unit_rows * n_tiles),
        unit(static_cast<int>(blockIdx.x) / p.cluster),
        stride(static_cast<int>(gridDim.x) / p.cluster),
        block_n(block_n_) {}

  __device__ bool next(BlockGemmTile& t) {
    if (unit >= units) return false;
    const int band = unit / (band_units * n_tiles);
    const int rows = min(band_units, unit_rows - band * band_units);
    const int in_band = unit - band * band_units * n_tiles;
    t.m0 = ((band * band_units + in_band % rows) * cluster + rank) * 128;
    t.n0 = in_band / rows * block_n;
    unit += stride;
    return true;
  }
};

// wgmma's shared-memory matrix descriptor of a K-major tile of 128-byte swizzled rows: 8-row
// groups 1024 bytes apart (the leading offset is unused by swizzled K-major layouts).
__device__ __forceinline__ uint64_t block_gemm_desc(const void* smem) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>(cute::cast_smem_ptr_to_uint(smem) >> 4);
  d.bitfield.leading_byte_offset_ = 1;
  d.bitfield.stride_byte_offset_ = 1024 >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = static_cast<uint8_t>(cute::SM90::GMMA::LayoutType::B128);
  return d.desc_;
}

template <class Op, size_t... I>
__device__ __forceinline__ void block_gemm_mma(uint64_t a, uint64_t b, float* d,
                                               cute::SM90::GMMA::ScaleOut scale_d,
                                               std::index_sequence<I...>) {
  Op::fma(a, b, d[I]..., scale_d);
}
template <class Op, size_t... I>
__device__ __forceinline__ void block_gemm_mma(const uint32_t (&a)[4], uint64_t b, float* d,
                                               cute::SM90::GMMA::ScaleOut scale_d,
                                               std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], b, d[I]..., scale_d);
}

// One warp's 16 rows of a's 128 x 128 tile (`rows`: the first, 128-byte swizzled as TMA wrote
// them) in wgmma's register layout for a (m64k32, 8-bit; the layout of mma.m16n8k32's a): per
// 32-byte step k of K, register i holds the four bytes 4 (lane % 4) + 16 (i / 2) of row lane / 4
// + 8 (i % 2). ldmatrix .x4 loads them as four 8 x 8 b16 matrices, matrix i from the addresses
// of lanes 8 i .. 8 i + 7, one row each; the swizzle moves 16-byte chunk c of row r to c ^ r % 8.
__device__ __forceinline__ void block_gemm_load_a(const uint8_t* rows, int lane,
                                                  uint32_t (&a)[kBlockTile / 32][4]) {
  const int r = lane % 8 + 8 * (lane / 8 % 2);
#pragma unroll
  for (int k = 0; k < kBlockTile / 32; ++k) {
    const int chunk = 2 * k + lane / 16;
    const uint32_t at = cute::cast_smem_ptr_to_uint(rows + r * kBlockTile + 16 * (chunk ^ r % 8));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a[k][0]), "=r"(a[k][1]), "=r"(a[k][2]), "=r"(a[k][3])
                 : "r"(at));
  }
}

// Two adjacent outputs rounded once to Out, as the words a shuffle moves: one 32-bit word for a
// 16-bit type, two for f32.
__device__ __forceinline__ uint32_t round_pair(float x, float y, const __nv_bfloat16*) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint32_t round_pair(float x, float y, const __half*) {
  const __half2 v = __floats2half2_rn(x, y);
  return *reinterpret_cast<const uint32_t*>(&v);
}
__device__ __forceinline__ uint2 round_pair(float x, float y, const float*) {
  return make_uint2(__float_as_uint(x), __float_as_uint(y));
}
__device__ __forceinline__ uint32_t shfl_xor(uint32_t v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
__device__ __forceinline__ uint2 shfl_xor(uint2 v, int mask) {
  return make_uint2(__shfl_xor_sync(0xffffffffu, v.x, mask),
                    __shfl_xor_sync(0xffffffffu, v.y, mask));
}
// kW words, 8 or 16 bytes, in one store.
template <class Word, int kW>
__device__ __forceinline__ void store_words(void* at, const Word (&v)[kW]) {
  static_assert(sizeof(v) == 8 || sizeof(v) == 16, "8- or 16-byte stores");
  const uint32_t* w = reinterpret_cast<const uint32_t*>(v);
  if constexpr (sizeof(v) == 16)
    *static_cast<uint4*>(at) = make_uint4(w[0], w[1], w[2], w[3]);
  else
    *static_cast<uint2*>(at) = make_uint2(w[0], w[1]);
}
__device__ __forceinline__ float2 load_pair(const __nv_bfloat16* b) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(b));
}
__device__ __forceinline__ float2 load_pair(const __half* b) {
  return __half22float2(*reinterpret_cast<const __half2*>(b));
}
__device__ __forceinline__ float2 load_pair(const float* b) {
  return *reinterpret_cast<const float2*>(b);
}

// The epilogue of the kW column blocks j0 .. j0 + kW - 1 of one thread's rows r0 and r0 + 8.
// Its accumulator holds, for each j, the columns c0 + 8 j and c0 + 8 j + 1 with c0 = n0 + 2 quad
// (wgmma's m64nN f32 layout); the bias is added in f32 and each value rounded once to Out. The
// kW lanes of a quad that share quad / kW trade their pairs (a kW x kW transpose in log2(kW)
// rounds of shuffles): lane quad then holds block j0 + quad % kW's 2 kW adjacent columns from
// 2 kW (quad / kW) on, and stores them at once. N is a multiple of 16, so a run of 2 kW columns
// (kW = 16 / sizeof(Word) or 2) is wholly inside or outside the output.
template <int kW, class Out, int kAccum>
__device__ __forceinline__ void block_gemm_store_run(const float (&acc)[kAccum],
                                                     const BlockGemmParams& p, int r0, int n0,
                                                     int quad, int j0) {
  Out* d = static_cast<Out*>(p.d);
  const Out* bias = static_cast<const Out*>(p.bias);
  using Word = decltype(round_pair(0.0f, 0.0f, d));
  const int c_run = n0 + 8 * (j0 + quad % kW) + 2 * kW * (quad / kW);
  float2 b[kW];
#pragma unroll
  for (int i = 0; i < kW; ++i) {
    const int c = n0 + 2 * quad + 8 * (j0 + i);
    b[i] = bias && c < p.n ? load_pair(bias + c) : make_float2(0.0f, 0.0f);
  }
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    Word v[kW];
#pragma unroll
    for (int i = 0; i < kW; ++i) {
      const int j = j0 + i;
      v[i] = round_pair(acc[4 * j + 2 * h] + b[i].x, acc[4 * j + 2 * h + 1] + b[i].y, d);
    }
    // Round m: the lanes whose quad differs in bit m swap the pairs whose index differs from
    // their own position in that bit (every lane shuffles: none may skip).
#pragma unroll
    for (int m = 1; m < kW; m *= 2) {
      const bool upper = quad & m;
#pragma unroll
      for (int i = 0; i < kW; ++i) {
        if (i & m) continue;
        const Word got = shfl_xor(upper ? v[i] : v[i | m], m);
        if (upper)
          v[i] = got;
        else
          v[i | m] = got;
      }
    }
    const int r = r0 + 8 * h;
    if (r < p.m && c_run < p.n) store_words(d + int64_t(r) * p.n + c_run, v);
  }
}

// The epilogue of one thread: 16-byte stores (a quad writes 64 contiguous bytes of a row, a
// quarter of the stores of pairs), and 8-byte ones for the last two column blocks of a tile
// whose blocks do not come in fours (112 and 144 columns, 16-bit outputs).
template <class Out, int kAccum>
__device__ __forceinline__ void block_gemm_store(const float (&acc)[kAccum],
                                                 const BlockGemmParams& p, int r0, int n0,
                                                 int quad) {
  constexpr int kW = 16 / sizeof(round_pair(0.0f, 0.0f, static_cast<const Out*>(nullptr)));
  constexpr int kBlocks = kAccum / 4, kWhole = kBlocks / kW * kW;
  static_assert(kBlocks % 2 == 0, "column blocks in pairs");
#pragma unroll
  for (int j0 = 0; j0 < kWhole; j0 += kW) block_gemm_store_run<kW, Out>(acc, p, r0, n0, quad, j0);
  if constexpr (kWhole < kBlocks) block_gemm_store_run<2, Out>(acc, p, r0, n0, quad, kWhole);
}

// One K block's scales as a thread's promotion takes them: its two rows' a scales and, with
// block scales, b's scales of the (at most two) 128 x 128 blocks of the tile's columns, read
// into registers before the block's MMAs, so that the stage can be released before the
// promotion; b's column scales (kColumnScales) are read from the stage during the promotion.
struct BlockGemmScales {
  float a0, a1;       // rows row and row + 8
  float b0, b1;       // block scales: the tile's first and second 128 x 128 block of b
  const float* b_columns;  // column scales: the tile's kBlockN, in shared memory
};

// A stage's scales for the consumer thread of rows row and row + 8 of the tile at column n0.
template <class T>
__device__ __forceinline__ BlockGemmScales block_gemm_scales(const uint8_t* smem, int stage,
                                                             int row, int n0) {
  const float* a =
      reinterpret_cast<const float*>(smem + T::kAScaleOffset + stage * T::kAScaleBytes);
  const float* b =
      reinterpret_cast<const float*>(smem + T::kBScaleOffset + stage * T::kBScaleSlot);
  if constexpr (T::kColumnScales) {
    return {a[row], a[row + 8], 0.0f, 0.0f, b};
  } else {  // the tile's first 128 x 128 block of b and the next, within the eight copied
    const float* block = b + n0 / 128 % 4;
    return {a[row], a[row + 8], block[0], block[1], nullptr};
  }
}

// One K block's partial sums `part` of the tile's columns [kFirst, kFirst + kMmaN) into the
// main accumulator `acc`: each product times its row's a scale and its column's b scale (one f32
// product per scale pair, then one fma). `boundary`: the first column of the tile in the second
// 128 x 128 block of b (block scales).
template <class T, int kFirst>
__device__ __forceinline__ void block_gemm_promote(float (&acc)[T::kAccum],
                                                   const float (&part)[T::kPart],
                                                   const BlockGemmScales& s, int quad,
                                                   int boundary) {
  constexpr int kAt = kFirst / 2;  // acc's register of the first column (m64nN: 8 columns, 4)
  const float a0 = s.a0, a1 = s.a1;
  if constexpr (T::kColumnScales) {
#pragma unroll
    for (int j = 0; j < T::kPart / 4; ++j) {
      const float2 b = *reinterpret_cast<const float2*>(s.b_columns + kFirst + 8 * j + 2 * quad);
      float* d = acc + kAt + 4 * j;
      d[0] = fmaf(part[4 * j], a0 * b.x, d[0]);
      d[1] = fmaf(part[4 * j + 1], a0 * b.y, d[1]);
      d[2] = fmaf(part[4 * j + 2], a1 * b.x, d[2]);
      d[3] = fmaf(part[4 * j + 3], a1 * b.y, d[3]);
    }
  } else {
    const float s00 = a0 * s.b0, s10 = a1 * s.b0, s01 = a0 * s.b1, s11 = a1 * s.b1;
#pragma unroll
    for (int j = 0; j < T::kPart / 4; ++j) {
      // A tile of 128 columns or fewer that divides 128 never reaches a second block.
      const bool second = 128 % T::kBlockN != 0 && kFirst + 8 * j >= boundary;
      const float s0 = second ? s01 : s00, s1 = second ? s11 : s10;
      float* d = acc + kAt + 4 * j;
      d[0] = fmaf(part[4 * j], s0, d[0]);
      d[1] = fmaf(part[4 * j + 1], s0, d[1]);
      d[2] = fmaf(part[4 * j + 2], s1, d[2]);
      d[3] = fmaf(part[4 * j + 3], s1, d[3]);
    }
  }
}

// f(std::integral_constant<int, i>{}) for each i of the sequence, in order.
template <class F, int... I>
__device__ __forceinline__ void block_gemm_for(F& f, std::integer_sequence<int, I...>) {
  (f(std::integral_constant<int, I>{}), ...);
}

// Tensor maps (csrc/ffi/block_gemm_launch.cuh): a [M, K] u8 with boxes of 128 x 128, b [N, K]
// u8 with boxes of kBlockN / cluster rows x 128, both 128-byte swizzled; a_scale [K/128,
// ceil4(M)] f32 with boxes of 1 x 128; b_scale [K/128, N] (column scales) with boxes of
// 1 x kBlockN, or [K/128, ceil4(ceil(N / 128))] (block scales) with boxes of 1 x 8 starting at
// a multiple of 4.
template <class T, class Tiles>
__global__ void __launch_bounds__(T::kThreads, 1)
    sm90_fp8_block_gemm_kernel(const __grid_constant__ CUtensorMap a_map,
                               const __grid_constant__ CUtensorMap b_map,
                               const __grid_constant__ CUtensorMap a_scale_map,
                               const __grid_constant__ CUtensorMap b_scale_map,
                               const BlockGemmParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = smem_raw + (T::kAlign - cute::cast_smem_ptr_to_uint(smem_raw) % T::kAlign) %
                                 T::kAlign;
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + T::kBarrierOffset);
  uint64_t* empty = full + T::kStages;
  const int group = threadIdx.x / 128;

  if (threadIdx.x == 0) {
    cute::prefetch_tma_descriptor(&a_map);
    cute::prefetch_tma_descriptor(&b_map);
    cute::prefetch_tma_descriptor(&a_scale_map);
    cute::prefetch_tma_descriptor(&b_scale_map);
    for (int s = 0; s < T::kStages; ++s) {
      Barrier::init(&full[s], 1);  // the producer's arrival, plus the copies' bytes
      // every consumer warp of the cluster
      Barrier::init(&empty[s], T::kMathGroups * 4 * p.cluster);
    }
    cutlass::arch::fence_barrier_init();
  }
  // Every CTA's barriers exist before the cluster's copies and arrivals reach them.
  if (p.cluster > 1)
    cute::cluster_sync();
  else
    __syncthreads();
  cudaGridDependencySynchronize();  // PDL: the upstream grid's outputs are ready from here on

  if (group == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegisters>();
    if (threadIdx.x == 0) {
      constexpr uint64_t kHint = static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL);
      const int rank = static_cast<int>(cute::block_rank_in_cluster());
      const int b_rows = T::kBlockN / p.cluster;  // b's rows this CTA copies (to every CTA)
      Tiles tiles(p, T::kBlockN);
      int stage = 0;
      uint32_t phase = 0;
      for (BlockGemmTile t; tiles.next(t);) {
        for (int kb = 0; kb < p.k_blocks; ++kb) {
          Barrier::wait(&empty[stage], phase ^ 1);
          Barrier::arrive_and_expect_tx(&full[stage], T::kTxBytes);
          uint8_t* a_tile = smem + stage * T::kABytes;
          uint8_t* b_tile = smem + T::kBOffset + stage * T::kBBytes;
          const int k0 = kb * T::kBlockK;
          cute::SM90_TMA_LOAD_2D::copy(&a_map, &full[stage], kHint, a_tile, k0, t.m0);
          if (p.cluster == 1) {
            cute::SM90_TMA_LOAD_2D::copy(&b_map, &full[stage], kHint, b_tile, k0, t.n0);
          } else {
            cute::SM90_TMA_LOAD_MULTICAST_2D::copy(
                &b_map, &full[stage], static_cast<uint16_t>((1 << p.cluster) - 1), kHint,
                b_tile + rank * b_rows * T::kBlockK, k0, t.n0 + rank * b_rows);
          }
          cute::SM90_TMA_LOAD_2D::copy(&a_scale_map, &full[stage], kHint,
                                       smem + T::kAScaleOffset + stage * T::kAScaleBytes, t.m0,
                                       kb);
          cute::SM90_TMA_LOAD_2D::copy(&b_scale_map, &full[stage], kHint,
                                       smem + T::kBScaleOffset + stage * T::kBScaleSlot,
                                       T::kColumnScales ? t.n0 : t.n0 / 128 / 4 * 4, kb);
          if (++stage == T::kStages) stage = 0, phase ^= 1;
        }
      }
      // The other CTA of the cluster arrives on this CTA's empty barriers: stay until every
      // stage has been released, so that no arrival reaches a CTA that has exited.
      for (int s = 0; s < T::kStages; ++s) {
        Barrier::wait(&empty[stage], phase ^ 1);
        if (++stage == T::kStages) stage = 0, phase ^= 1;
      }
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<T::kMathRegisters>();
    using Mma = BlockGemmMma<T::kMmaN, T::kRegisterA>;
    static_assert(sizeof(typename Mma::CRegisters) == T::kPart * sizeof(float), "m64nN's f32");
    using cute::SM90::GMMA::ScaleOut;
    const int math = group - 1;
    const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32;
    const int row = 64 * math + 16 * warp + lane / 4;  // this thread's rows: row, row + 8
    float acc[T::kAccum], part[2][T::kPart];
    Tiles tiles(p, T::kBlockN);
    int stage = 0;
    uint32_t phase = 0;
    // Frees stage s in every CTA whose producer copies into it: this warp's MMAs on it are done
    // and its reads of the stage's scales too.
    auto release = [&](int s) {
      __syncwarp();
      if (lane == 0 && p.cluster == 1) Barrier::arrive(&empty[s]);
      if (lane == 0 && p.cluster > 1)
        for (int c = 0; c < p.cluster; ++c) Barrier::arrive(&empty[s], c, 1);
    };
    for (BlockGemmTile t; tiles.next(t);) {
#pragma unroll
      for (int i = 0; i < T::kAccum; ++i) acc[i] = 0.0f;
      const int boundary = 128 - t.n0 % 128;
      // One round: kBlocks K blocks of kSplits slices each, the slices' MMAs into the two
      // partial accumulators in turn. Each slice's promotion waits for its MMAs only, and runs
      // while the next slice's are under way; the round's last waits for all (ptxas keeps
      // wgmma groups in flight across a loop's back edge only by serializing them).
      auto round = [&](auto blocks) {
        constexpr int kBlocks = decltype(blocks)::value, kUnits = kBlocks * T::kSplits;
        int stages[kBlocks] = {};
        // a's operand: each K block's shared-memory descriptor, or (kRegisterA) the round's one
        // K block in registers
        std::conditional_t<T::kRegisterA, uint32_t[T::kBlockK / T::kMmaK][4], uint64_t[kBlocks]>
            a_op;
        BlockGemmScales scales[kBlocks];
        // Slice u's promotion, once its MMAs are done; its block's stage is released after its
        // last slice's MMAs (and before the promotion where that reads no scales from it).
        auto promote = [&](auto unit) {
          constexpr int kU = decltype(unit)::value, kB = kU / T::kSplits;
          constexpr int kS = kU % T::kSplits, kBuf = kU % 2;
          constexpr bool kLast = kS == T::kSplits - 1;
#pragma unroll
          for (int i = 0; i < T::kPart; ++i) cute::warpgroup_fence_operand(part[kBuf][i]);
          if constexpr (kLast && !T::kColumnScales) release(stages[kB]);
          block_gemm_promote<T, kS * T::kMmaN>(acc, part[kBuf], scales[kB], lane % 4, boundary);
          if constexpr (kLast && T::kColumnScales) release(stages[kB]);
        };
        auto slice = [&](auto unit) {
          constexpr int kU = decltype(unit)::value, kB = kU / T::kSplits;
          constexpr int kS = kU % T::kSplits, kBuf = kU % 2;
          if constexpr (kS == 0) {  // a new K block: its stage and scales
            Barrier::wait(&full[stage], phase);
            stages[kB] = stage;
            const uint8_t* a_rows = smem + stage * T::kABytes + math * 64 * T::kBlockK;
            if constexpr (T::kRegisterA)
              block_gemm_load_a(a_rows + warp * 16 * T::kBlockK, lane, a_op);
            else
              a_op[kB] = block_gemm_desc(a_rows);
            scales[kB] = block_gemm_scales<T>(smem, stage, row, t.n0);
            if (++stage == T::kStages) stage = 0, phase ^= 1;
          }
          const uint64_t b_desc = block_gemm_desc(smem + T::kBOffset + stages[kB] * T::kBBytes +
                                                  kS * T::kMmaN * T::kBlockK);
#pragma unroll
          for (int i = 0; i < T::kPart; ++i) cute::warpgroup_fence_operand(part[kBuf][i]);
          if constexpr (T::kRegisterA) {
#pragma unroll
            for (int k = 0; k < T::kBlockK / T::kMmaK; ++k)
#pragma unroll
              for (int i = 0; i < 4; ++i) cute::warpgroup_fence_operand(a_op[k][i]);
          }
          cute::warpgroup_arrive();
#pragma unroll
          for (int k = 0; k < T::kBlockK / T::kMmaK; ++k) {
            // the descriptor's address is in 16-byte units: 32 bytes of K further along the rows
            const ScaleOut scale_d = k == 0 ? ScaleOut::Zero : ScaleOut::One;
            if constexpr (T::kRegisterA)
              block_gemm_mma<Mma>(a_op[k], b_desc + 2 * k, part[kBuf], scale_d,
                                  std::make_index_sequence<T::kPart>{});
            else
              block_gemm_mma<Mma>(a_op[kB] + 2 * k, b_desc + 2 * k, part[kBuf], scale_d,
                                  std::make_index_sequence<T::kPart>{});
          }
          cute::warpgroup_commit_batch();
          if constexpr (kU > 0) {
            cute::warpgroup_wait<1>();
            promote(std::integral_constant<int, kU - 1>{});
          }
        };
        block_gemm_for(slice, std::make_integer_sequence<int, kUnits>{});
        cute::warpgroup_wait<0>();
        promote(std::integral_constant<int, kUnits - 1>{});
      };
      int kb = 0;
      for (; kb + T::kRound <= p.k_blocks; kb += T::kRound)
        round(std::integral_constant<int, T::kRound>{});
      if constexpr (T::kRound == 2)
        if (kb < p.k_blocks) round(std::integral_constant<int, 1>{});
      const int r0 = t.m0 + row;
      switch (p.out) {
        case BlockGemmOut::kBf16:
          block_gemm_store<__nv_bfloat16>(acc, p, r0, t.n0, lane % 4);
          break;
        case BlockGemmOut::kF16: block_gemm_store<__half>(acc, p, r0, t.n0, lane % 4); break;
        case BlockGemmOut::kF32: block_gemm_store<float>(acc, p, r0, t.n0, lane % 4); break;
      }
    }
  }
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

}  // namespace jax_fp8
