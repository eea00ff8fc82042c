// CUDA FFI handler for jax_fp8_nvfp4_quantize: pick the instantiation and launch (with PDL).
// Arguments: nvfp4_quantize_args.h.
#include <cuda_runtime.h>

#include "../kernels/nvfp4_quantize.cuh"
#include "launch.h"
#include "nvfp4_quantize_args.h"

namespace jax_fp8 {
namespace {

ffi::Error Nvfp4QuantizeImpl(cudaStream_t stream, const Nvfp4QuantizeArgs& a) {
  if (a.rows == 0 || a.cols == 0 || !(a.rowwise || a.columnwise)) return ffi::Error::Success();
  const dim3 grid((a.cols + kNvfp4TileCols - 1) / kNvfp4TileCols,
                  (a.rows + kNvfp4Block - 1) / kNvfp4Block);
  const Nvfp4Options opt = {a.rowwise, a.columnwise, a.block_2d, a.stochastic, a.rht};
  return dispatch_input(a.x_type, [&](auto t) {
    using T = typename decltype(t)::type;
    launch_pdl(nvfp4_quantize_kernel<T>, grid, kNvfp4Threads, stream, static_cast<const T*>(a.x),
               a.rows, a.cols, opt, a.global_scales, a.key, a.rht_signs, a.data, a.scales,
               a.data_t, a.scales_t);
    return last_error();
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4QuantizeCudaHandler,
                              DecodeThen(DecodeNvfp4Quantize, Nvfp4QuantizeImpl),
                              BindNvfp4Quantize(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
