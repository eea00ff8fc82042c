// The block-scaled kernels of jax_fp8_grouped_gemm (the handler: grouped_gemm_cuda.cu; how a call
// runs: grouped_gemm_cutlass.cuh): e4m3 operands with DeepSeek-V3's scales, CUTLASS's
// ptr-array grouped GEMM with its FP8 blockwise-scaling mainloop
// (KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise, as CUTLASS's example 68), into bf16
// or f32. A translation unit of its own: these four kernels compile beside the per-tensor six.
#include <string>

#include "grouped_gemm_cutlass.cuh"

namespace jax_fp8 {
namespace {

template <class D>
std::string run_block(const GroupedArgs& g, cudaStream_t stream) {
  if (g.mode == ScaleMode::kBlock128x128)
    return GroupedGemm<E4m3, E4m3, D, RowsBlockScaling>::run(g, stream);
  return GroupedGemm<E4m3, E4m3, D, WgradBlockScaling>::run(g, stream);
}

}  // namespace

std::string run_grouped_block(ffi::DataType d, const GroupedArgs& g, cudaStream_t stream) {
  return d == ffi::DataType::BF16 ? run_block<Bf16>(g, stream) : run_block<float>(g, stream);
}

}  // namespace jax_fp8
