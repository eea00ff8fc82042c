// The block-scaled GEMM kernel with 128 x 192 tiles, b in 128 x 128 blocks and in 1 x 128 groups
// (one file per tile width, so the instantiations compile in parallel).
#include "block_gemm_launch.cuh"

namespace jax_fp8 {

template std::string launch_block_gemm<192, false>(const BlockGemmArgs&, int, cudaStream_t);
template std::string launch_block_gemm<192, true>(const BlockGemmArgs&, int, cudaStream_t);

}  // namespace jax_fp8
