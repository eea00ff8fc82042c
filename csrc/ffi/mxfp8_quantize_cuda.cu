// CUDA FFI handler for jax_fp8_mxfp8_quantize: pick the instantiation and launch (with PDL).
// Arguments: mxfp8_quantize_args.h.
#include <cuda_runtime.h>

#include "../kernels/mxfp8_quantize.cuh"
#include "launch.h"
#include "mxfp8_quantize_args.h"

namespace jax_fp8 {
namespace {

template <typename T, bool kRowwise, bool kColumnwise>
ffi::Error Launch(cudaStream_t stream, const Mxfp8QuantizeArgs& a) {
  const dim3 grid((a.cols + kMxTileCols - 1) / kMxTileCols, (a.rows + kMxBlock - 1) / kMxBlock);
  launch_pdl(mxfp8_quantize_kernel<T, kRowwise, kColumnwise>, grid, kMxThreads, stream,
             static_cast<const T*>(a.x), a.rows, a.cols, a.fmt, a.data, a.scales, a.data_t,
             a.scales_t);
  return last_error();
}

ffi::Error Mxfp8QuantizeImpl(cudaStream_t stream, const Mxfp8QuantizeArgs& a) {
  if (a.rows == 0 || a.cols == 0 || !(a.rowwise || a.columnwise)) return ffi::Error::Success();
  return dispatch_input(a.x_type, [&](auto t) {
    using T = typename decltype(t)::type;
    if (!a.columnwise) return Launch<T, true, false>(stream, a);
    if (!a.rowwise) return Launch<T, false, true>(stream, a);
    return Launch<T, true, true>(stream, a);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mxfp8QuantizeCudaHandler,
                              DecodeThen(DecodeMxfp8Quantize, Mxfp8QuantizeImpl),
                              BindMxfp8Quantize(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
