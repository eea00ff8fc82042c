// What the block-scaled GEMM kernel (block_gemm.cuh) reads besides its four tensor maps: plain
// C++, shared with the host code that launches it (csrc/ffi/block_gemm.h).
#pragma once

#include <cstdint>

namespace jax_fp8 {

// The output's element type, chosen at run time: one instantiation writes all three.
enum class BlockGemmOut : int { kBf16 = 0, kF16 = 1, kF32 = 2 };

struct BlockGemmParams {
  int m, n;          // d is [m, n]
  int k_blocks;      // K / 128
  int cluster;       // CTAs of a cluster (1 or 2, along M), as launched
  const void* bias;  // [n] in the output's dtype, or null
  void* d;           // [m, n] row-major
  BlockGemmOut out;
};

}  // namespace jax_fp8
