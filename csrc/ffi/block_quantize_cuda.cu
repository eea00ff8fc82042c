// CUDA FFI handlers for jax_fp8_block_quantize (128 x 128 blocks) and
// jax_fp8_group_cast_transpose (1 x 128 and 128 x 1 groups): pick the instantiation and launch
// (PDL). Arguments: block_quantize_args.h.
#include <cuda_runtime.h>

#include "../kernels/block_quantize.cuh"
#include "block_quantize_args.h"
#include "launch.h"

namespace jax_fp8 {
namespace {

template <typename T, bool kBlock2D>
ffi::Error Launch(cudaStream_t stream, const BlockQuantizeArgs& a) {
  // One block per 128 x 128 tile; the decoder checked the rows' tiles fit gridDim.y.
  const dim3 grid(unsigned((a.cols + kBlockTile - 1) / kBlockTile),
                  unsigned((a.rows + kBlockTile - 1) / kBlockTile));
  launch_pdl(block_quantize_kernel<T, kBlock2D>, grid, kBlockThreads, stream,
             static_cast<const T*>(a.x), a.rows, a.cols, a.eps, a.fmt, a.ue8m0, a.q, a.scales,
             a.qt, a.scales_t);
  return last_error();
}

template <bool kBlock2D>
ffi::Error Dispatch(cudaStream_t stream, const BlockQuantizeArgs& a) {
  if (a.rows == 0) return ffi::Error::Success();
  return dispatch_input(a.x_type, [&](auto t) {
    return Launch<typename decltype(t)::type, kBlock2D>(stream, a);
  });
}

ffi::Error BlockQuantizeImpl(cudaStream_t stream, const BlockQuantizeArgs& a) {
  return Dispatch<true>(stream, a);
}

ffi::Error GroupCastTransposeImpl(cudaStream_t stream, const BlockQuantizeArgs& a) {
  return Dispatch<false>(stream, a);
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
