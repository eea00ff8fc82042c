// CUDA FFI handlers for jax_fp8_quantize and jax_fp8_quantize_ring: pick the instantiation and
// launch. Arguments: quantize_args.h.
#include <cuda_runtime.h>

#include "../kernels/quantize.cuh"
#include "launch.h"
#include "quantize_args.h"

namespace jax_fp8 {
namespace {

template <typename T, bool kRing>
ffi::Error Launch(cudaStream_t stream, const QuantizeArgs& a) {
  auto* scratch = static_cast<QuantizeScratch*>(a.scratch);
  if (cudaMemsetAsync(scratch, 0, sizeof(QuantizeScratch), stream) != cudaSuccess)
    return ffi::Error::Internal("cudaMemsetAsync failed");
  const int blocks = grid_size(a.n, kQuantizeThreads * kElemsPerThread, 8);
  const T* x = static_cast<const T*>(a.x);
  if constexpr (kRing) {
    launch_pdl(first_step_amax_kernel<T>, blocks, kQuantizeThreads, stream, x, a.n, a.ring.steps,
               scratch);
  }
  launch_pdl(quantize_kernel<T, kRing>, blocks, kQuantizeThreads, stream, x, a.n, a.scale, a.fmt,
             a.q, a.amax, scratch, a.ring);
  return last_error();
}

template <bool kRing>
ffi::Error Dispatch(cudaStream_t stream, const QuantizeArgs& a) {
  return dispatch_input(a.x_type, [&](auto t) {
    return Launch<typename decltype(t)::type, kRing>(stream, a);
  });
}

ffi::Error QuantizeImpl(cudaStream_t stream, const QuantizeArgs& a) {
  return Dispatch<false>(stream, a);
}

ffi::Error QuantizeRingImpl(cudaStream_t stream, const QuantizeArgs& a) {
  return Dispatch<true>(stream, a);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeCudaHandler, DecodeThen(DecodeQuantize, QuantizeImpl),
                              BindQuantize(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeRingCudaHandler,
                              DecodeThen(DecodeQuantizeRing, QuantizeRingImpl),
                              BindQuantizeRing(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
