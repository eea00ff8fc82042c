// CUDA FFI handler for jax_fp8_block_gemm: jax_fp8's own block-scaled FP8 GEMM for sm_90a
// (csrc/kernels/block_gemm.cuh), one of the kernels of kBlockGemmKernels named by the `kernel`
// attribute: the one jax_fp8.ops.gemm_algorithms timed fastest for the problem, or the one
// `gemm(..., algorithm=)` names. One launch on the stream, no allocation, no synchronization,
// the same work for the same attributes: safe in XLA's command buffers. Arguments:
// block_gemm_args.h; layouts: block_gemm.h.
#include <string>

#include "block_gemm_args.h"
#include "launch.h"

namespace jax_fp8 {

// The tile widths instantiated (block_gemm_n<N>.cu); every kernel of the table uses one.
constexpr bool instantiated(int block_n) {
  return block_n == 112 || block_n == 128 || block_n == 144 || block_n == 160 || block_n == 192 ||
         block_n == 256;
}
constexpr bool all_instantiated() {
  for (const BlockGemmKernel& k : kBlockGemmKernels)
    if (!instantiated(k.block_n) || (k.cluster != 1 && k.cluster != 2)) return false;
  return true;
}
static_assert(all_instantiated(), "csrc/constants.h kBlockGemmKernels: a tile width or cluster "
                                  "without an instantiation");

std::string run_block_gemm(const BlockGemmArgs& g, int kernel, cudaStream_t stream) {
  if (g.m == 0) return {};
  const BlockGemmKernel& k = kBlockGemmKernels[kernel];
  const bool columns = g.mode == ScaleMode::kGroup1x128;
  switch (k.block_n) {
    case 112: return columns ? launch_block_gemm<112, true>(g, k.cluster, stream)
                             : launch_block_gemm<112, false>(g, k.cluster, stream);
    case 128: return columns ? launch_block_gemm<128, true>(g, k.cluster, stream)
                             : launch_block_gemm<128, false>(g, k.cluster, stream);
    case 144: return columns ? launch_block_gemm<144, true>(g, k.cluster, stream)
                             : launch_block_gemm<144, false>(g, k.cluster, stream);
    case 160: return columns ? launch_block_gemm<160, true>(g, k.cluster, stream)
                             : launch_block_gemm<160, false>(g, k.cluster, stream);
    case 192: return columns ? launch_block_gemm<192, true>(g, k.cluster, stream)
                             : launch_block_gemm<192, false>(g, k.cluster, stream);
    case 256: return columns ? launch_block_gemm<256, true>(g, k.cluster, stream)
                             : launch_block_gemm<256, false>(g, k.cluster, stream);
    default: return "no instantiation of the block-scaled GEMM for " + std::string(k.name);
  }
}

namespace {

ffi::Error BlockGemmImpl(cudaStream_t stream, const BlockGemmCall& c) {
  const DeviceInfo dev = device_info();
  if (dev.major != 9) return invalid("jax_fp8's block-scaled GEMM kernels run on sm_90 (Hopper)");
  if (std::string e = run_block_gemm(c.g, c.kernel, stream); !e.empty())
    return ffi::Error::Internal(e);
  return last_error();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockGemmCudaHandler, DecodeThen(DecodeBlockGemm, BlockGemmImpl),
                              BindBlockGemm(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
