// CUDA FFI handlers for jax_fp8_block_quantize (128 x 128 blocks) and
// jax_fp8_group_cast_transpose (1 x 128 and 128 x 1 groups): pick the instantiation and launch
// (PDL). Arguments: block_quantize_args.h.
#include <cuda_runtime.h>

#include "../kernels/block_quantize.cuh"
#include "block_quantize_args.h"
#include "launch.h"
#include "sources_cuda.h"

namespace jax_fp8 {
namespace {

template <bool kBlock2D, typename Src>
ffi::Error Launch(cudaStream_t stream, const BlockQuantizeArgs& a, Src src) {
  // One block per 128 x 128 tile of each output of the source; the decoder checked the rows'
  // tiles fit gridDim.y.
  const int64_t rows = a.src.rows, cols = a.src.cols / Src::kOutputs;
  const dim3 grid(unsigned(Src::kOutputs * ((cols + kBlockTile - 1) / kBlockTile)),
                  unsigned((rows + kBlockTile - 1) / kBlockTile));
  launch_pdl(block_quantize_kernel<Src, kBlock2D>, grid, kBlockThreads, stream, src, rows, cols,
             a.eps, a.fmt, a.ue8m0, a.q, a.scales, a.qt, a.scales_t);
  return last_error();
}

ffi::Error BlockQuantizeImpl(cudaStream_t stream, const BlockQuantizeArgs& a) {
  if (a.src.rows == 0) return ffi::Error::Success();
  return dispatch_input(a.src.x_type, [&](auto t) {
    using T = typename decltype(t)::type;
    return Launch<true>(stream, a, plain_source<T>(a.src));
  });
}

ffi::Error GroupCastTransposeImpl(cudaStream_t stream, const BlockQuantizeArgs& a) {
  if (a.src.rows == 0) return ffi::Error::Success();
  return dispatch_input(a.src.x_type, [&](auto t) {
    return with_source<typename decltype(t)::type>(
        a.src, [&](auto src) { return Launch<false>(stream, a, src); });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockQuantizeCudaHandler,
                              DecodeThen(DecodeBlockQuantize, BlockQuantizeImpl),
                              BindBlockQuantize(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupCastTransposeCudaHandler,
                              DecodeThen(DecodeGroupCastTranspose, GroupCastTransposeImpl),
                              BindGroupCastTranspose(BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
