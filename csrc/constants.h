// The numbers and ids that the Python side and the C++ side must agree on, each written once.
// Python reads them from the extension (`constants()` in both modules, built by
// constants_py.h; `jax_fp8._ffi.CONSTANTS`), so they are never written again there.
// Plain C++: included by the numerics, the CUDA kernels and the FFI handlers alike.
#pragma once

#include <cstddef>
#include <cstdint>

namespace jax_fp8 {

// u32 words of the scratch result of jax_fp8_quantize, jax_fp8_quantize_ring and
// jax_fp8_cast_transpose_ring (the kernels' QuantizeScratch: amax, first-step amax and
// completion count), zeroed on the stream before each launch.
constexpr int kQuantizeScratchWords = 3;

// Bytes of the cuBLASLt workspace, the last result of jax_fp8_gemm.
constexpr size_t kGemmWorkspaceBytes = size_t(32) << 20;
// The bytes of one cuBLASLt algorithm (sizeof(cublasLtMatmulAlgo_t), asserted where cuBLASLt
// is included), as the GEMM algorithm file records it (jax_fp8/ops/gemm_algorithms.py).
constexpr int kGemmAlgorithmBytes = 64;

// The cast-transpose's tile rows: dbias_partial has one row per kDbiasTileRows rows of x.
constexpr int kDbiasTileRows = 64;

// The cast-transpose's qt is [C, R rounded up to kQtRowMultiple] (16-byte rows of FP8).
constexpr int kQtRowMultiple = 16;

// The last axis of x in the cast-transpose and block_quantize is a multiple of this: whole
// 16-element vectors, as the kernels load and store them.
constexpr int kColMultiple = 16;

// The most arrays jax_fp8_cast_transpose_ring reads x from: x and its further parts (its
// remaining arguments), each [R, C_i], quantized as their concatenation [R, sum C_i], which is
// never stored.
constexpr int kMaxParts = 4;

// cuBLASLt's FP8 GEMMs need K and N multiples of this (16 bytes of FP8 per row of a and b).
constexpr int kGemmDimMultiple = 16;

// The grouped GEMM's ragged contraction (wgrad) starts each group at a row that is a multiple of
// this: the group's first FP8 element is then 16-byte aligned, as its TMA loads need.
constexpr int kGroupedRowAlign = 16;
// The most groups jax_fp8_grouped_gemm takes (its setup kernel is one block).
constexpr int kMaxGroups = 1024;
// The grouped GEMM's workspace, its last result: kGroupedPlanBytes * (groups + 1) bytes for the
// per-group plan (problem shapes, pointers, strides, scales), then kGroupedCutlassBytes for
// CUTLASS (its tensor maps per SM and its tile scheduler).
constexpr size_t kGroupedPlanBytes = 256;
constexpr size_t kGroupedCutlassBytes = size_t(1) << 20;

// Longest amax history a ring may have (the CUDA epilogue reduces it in one block).
constexpr int kMaxHistory = 1024;

// How a ring reduces its history window (the `algo` attribute; jax_fp8.state.ALGOS).
enum class AmaxAlgo : int64_t { kMax = 0, kMostRecent = 1 };

// Where jax_fp8_group_quantize stores the scales of rows x groups (the `layout` attribute):
// row [M, K/g]; col [K/g, M]; col_tma [K/g, ceil4(M)] with zero scales in the padding.
enum class ScaleLayoutId : int64_t { kRow = 0, kCol = 1, kColTma = 2 };

// The tile of block scaling: 128 x 128 blocks (block_quantize) and 1 x 128 / 128 x 1 groups
// (group_cast_transpose), as cuBLASLt's BLK128x128 / VEC128 scale modes take them.
constexpr int kBlockTile = 128;
// Under block scales the grouped GEMM's ragged contraction (wgrad) starts each group at a row
// that is a multiple of this, so that the 1 x 128 groups of its operands along the grouped rows
// (each with one scale) never straddle two groups.
constexpr int kGroupedBlockRowAlign = kBlockTile;

// Scale modes of jax_fp8_gemm and jax_fp8_grouped_gemm (the `scale_mode` attribute):
// per-tensor scalars; a 1 x 128 groups with b 128 x 128 blocks; a and b both 1 x 128 groups
// (the grouped GEMM: kBlock128x128 for its rows form, kGroup1x128 for its wgrad).
enum class ScaleMode : int64_t { kPerTensor = 0, kBlock128x128 = 1, kGroup1x128 = 2 };

// Group sizes jax_fp8_group_quantize takes (one instantiation each).
constexpr int kGroupSizes[] = {16, 32, 64, 128};

// What jax_fp8_cast_transpose_ring quantizes (the `activation` attribute; csrc/activation.h):
// x itself, or its image through an activation (or, with `grad`, the gradient through it).
enum class ActivationId : int64_t { kNone = 0, kSilu = 1, kGelu = 2 };

// Which normalization jax_fp8_cast_transpose_ring applies before it quantizes (the `norm`
// attribute; csrc/norm.h): none, RMSNorm, or LayerNorm.
enum class NormId : int64_t { kNone = 0, kRms = 1, kLayer = 2 };

// MXFP8's block: one E8M0 scale per kMxBlock consecutive elements (csrc/mx.h).
constexpr int kMxBlock = 32;

// NVFP4's block: one E4M3 scale per kNvfp4Block consecutive elements, or per kNvfp4Block x
// kNvfp4Block tile (csrc/nvfp4.h).
constexpr int kNvfp4Block = 16;

// Most row tiles of 128 a block-scaling kernel takes: CUDA's limit on gridDim.y.
constexpr int64_t kMaxTileRows = 65535;

// jax_fp8's own block-scaled GEMM kernels for sm_90a (csrc/kernels/block_gemm.cuh), the
// candidates `gemm` times beside cuBLASLt's and the values of its `algorithm` argument: a
// persistent kernel of 128 x block_n output tiles whose `cluster` CTAs (1, or 2 along M) share
// each tile of b through TMA multicast. The name records the configuration; jax_fp8's GEMM
// algorithm file stores it (jax_fp8/ops/gemm_algorithms.py).
struct BlockGemmKernel {
  const char* name;
  int block_n;
  int cluster;
};
constexpr BlockGemmKernel kBlockGemmKernels[] = {
    {"sm90_128x112_c1", 112, 1}, {"sm90_128x112_c2", 112, 2}, {"sm90_128x128_c1", 128, 1},
    {"sm90_128x128_c2", 128, 2}, {"sm90_128x144_c1", 144, 1}, {"sm90_128x144_c2", 144, 2},
    {"sm90_128x160_c1", 160, 1}, {"sm90_128x160_c2", 160, 2}, {"sm90_128x192_c1", 192, 1},
    {"sm90_128x192_c2", 192, 2}, {"sm90_128x256_c1", 256, 1}, {"sm90_128x256_c2", 256, 2}};
constexpr int kNumBlockGemmKernels = sizeof(kBlockGemmKernels) / sizeof(kBlockGemmKernels[0]);
// Part of the identity of a kind of device (csrc/ffi/gemm_lt.h device_identity): raised when
// the candidates or their speed change, so that recorded choices are timed again.
constexpr int kBlockGemmRevision = 4;

}  // namespace jax_fp8
