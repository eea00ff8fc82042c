// jax_fp8's block-scaled FP8 GEMM kernels for sm_90a (csrc/kernels/block_gemm.cuh) as the host
// sees them: the arguments of one GEMM, the kernel table (csrc/constants.h kBlockGemmKernels)
// and the launch, shared by the FFI handler (block_gemm_cuda.cu) and the timing of the GEMM
// candidates (gemm_tuning.cc). Plain C++: no CUDA device code, no XLA.
//
// Layouts (M, N, K the GEMM's; KB = K / 128):
//   a [M, K] e4m3, b [N, K] e4m3 (TN), both row-major with 16-byte aligned rows;
//   a_scale [KB, ceil4(M)] f32, M contiguous (rows past M are never used);
//   b_scale, 1 x 128 groups (ScaleMode::kGroup1x128): [KB, N] f32, N contiguous;
//           128 x 128 blocks (ScaleMode::kBlock128x128): [KB, ceil4(ceil(N / 128))] f32;
//   bias [N] in d's dtype (bf16 / f16) or null; d [M, N] bf16, f16 or f32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "../constants.h"
#include "../kernels/block_gemm_params.h"

namespace jax_fp8 {

struct BlockGemmArgs {
  int64_t m, n, k;
  ScaleMode mode;  // kBlock128x128 or kGroup1x128
  BlockGemmOut out;
  const void *a, *b;
  const float *a_scale, *b_scale;
  const void* bias;  // null when absent
  void* d;
};

// The index of kBlockGemmKernels' entry called `name`, or -1.
inline int block_gemm_kernel(std::string_view name) {
  for (int i = 0; i < kNumBlockGemmKernels; ++i)
    if (name == kBlockGemmKernels[i].name) return i;
  return -1;
}

// Element counts of a_scale and b_scale in the layouts above.
inline std::pair<int64_t, int64_t> block_gemm_scale_sizes(ScaleMode mode, int64_t m, int64_t n,
                                                          int64_t k) {
  const int64_t kb = k / kBlockTile;
  const int64_t nb = (n + kBlockTile - 1) / kBlockTile;
  return {kb * ((m + 3) / 4 * 4), mode == ScaleMode::kGroup1x128 ? kb * n : kb * ((nb + 3) / 4 * 4)};
}

// Runs kernel kBlockGemmKernels[kernel] on `stream`: only launches (no allocation, no
// synchronization), so it may be captured in a CUDA graph. The device must be sm_90 and the
// pointers 16-byte aligned. Empty on success, else what failed.
std::string run_block_gemm(const BlockGemmArgs& g, int kernel, cudaStream_t stream);

// One instantiation's launch (block_gemm_launch.cuh; instantiated in block_gemm_n<N>.cu).
template <int kBlockN, bool kColumnScales>
std::string launch_block_gemm(const BlockGemmArgs& g, int cluster, cudaStream_t stream);

}  // namespace jax_fp8
