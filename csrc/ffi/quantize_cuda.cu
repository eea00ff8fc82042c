// CUDA FFI handlers for jax_fp8_quantize and jax_fp8_quantize_ring: decode, validate, launch.
#include <cuda_runtime.h>

#include "../kernels/quantize.cuh"
#include "common.h"
#include "launch.h"

namespace jax_fp8 {
namespace {

template <typename T, bool kRing>
ffi::Error Launch(cudaStream_t stream, const void* x, size_t n, const float* scale, Fp8Format fmt,
                  uint8_t* q, float* amax, QuantizeScratch* scratch, RingArgs ring) {
  if (cudaMemsetAsync(scratch, 0, sizeof(QuantizeScratch), stream) != cudaSuccess)
    return ffi::Error::Internal("cudaMemsetAsync failed");
  const int blocks = grid_size(n, kQuantizeThreads * kElemsPerThread, 8);
  if constexpr (kRing) {
    launch_pdl(first_step_amax_kernel<T>, blocks, kQuantizeThreads, stream,
               static_cast<const T*>(x), n, static_cast<const float*>(ring.steps), scratch);
  }
  launch_pdl(quantize_kernel<T, kRing>, blocks, kQuantizeThreads, stream,
             static_cast<const T*>(x), n, scale, fmt, q, amax, scratch, ring);
  return last_error();
}

template <bool kRing>
ffi::Error Dispatch(cudaStream_t stream, ffi::AnyBuffer x, const float* scale, Fp8Format fmt,
                    ffi::Result<ffi::AnyBuffer> q, float* amax, ffi::Result<ffi::AnyBuffer> scratch,
                    RingArgs ring) {
  const size_t n = x.element_count();
  auto* q_ptr = static_cast<uint8_t*>(q->untyped_data());
  auto* s_ptr = static_cast<QuantizeScratch*>(scratch->untyped_data());
  if (scratch->size_bytes() < sizeof(QuantizeScratch)) return invalid("scratch too small");
  if (!aligned16(x.untyped_data()) || !aligned16(q_ptr))
    return invalid("x and q must be 16-byte aligned");
  switch (x.element_type()) {
    case ffi::DataType::F32:
      return Launch<float, kRing>(stream, x.untyped_data(), n, scale, fmt, q_ptr, amax, s_ptr, ring);
    case ffi::DataType::BF16:
      return Launch<__nv_bfloat16, kRing>(stream, x.untyped_data(), n, scale, fmt, q_ptr, amax,
                                          s_ptr, ring);
    case ffi::DataType::F16:
      return Launch<__half, kRing>(stream, x.untyped_data(), n, scale, fmt, q_ptr, amax, s_ptr, ring);
    default:
      return invalid("x must be float32, bfloat16 or float16");
  }
}

ffi::Error QuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale,
                        ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                        ffi::Result<ffi::AnyBuffer> scratch) {
  if (!is_fp8(q->element_type())) return invalid("q must be float8_e4m3fn or float8_e5m2");
  if (q->element_count() != x.element_count()) return invalid("q must have x's size");
  return Dispatch<false>(stream, x, scale.typed_data(), fp8_format(q->element_type()), q,
                         amax->typed_data(), scratch, RingArgs{});
}

ffi::Error QuantizeRingImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> history,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> steps,
                            ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                            ffi::Result<ffi::Buffer<ffi::F32>> history_out,
                            ffi::Result<ffi::Buffer<ffi::F32>> scale_out,
                            ffi::Result<ffi::Buffer<ffi::F32>> steps_out,
                            ffi::Result<ffi::AnyBuffer> scratch, int64_t margin, int64_t algo) {
  if (!is_fp8(q->element_type())) return invalid("q must be float8_e4m3fn or float8_e5m2");
  if (q->element_count() != x.element_count()) return invalid("q must have x's size");
  const Fp8Format fmt = fp8_format(q->element_type());
  if (auto e = check_ring_attrs(algo, history.element_count(), kMaxHistory); e.failure())
    return e;
  // The ring outputs alias their inputs (input_output_aliases in jax_fp8/_ffi.py).
  if (history_out->typed_data() != history.typed_data() ||
      scale_out->typed_data() != scale.typed_data() || steps_out->typed_data() != steps.typed_data())
    return invalid("ring outputs must alias the ring inputs");
  RingArgs ring{history_out->typed_data(), scale_out->typed_data(), steps_out->typed_data(),
                static_cast<int>(history.element_count()), static_cast<int>(margin),
                static_cast<AmaxAlgo>(algo)};
  return Dispatch<true>(stream, x, ring.scale, fmt, q, amax->typed_data(), scratch, ring);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeCudaHandler, QuantizeImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()             // x
                           .Arg<ffi::Buffer<ffi::F32>>()      // scale []
                           .Ret<ffi::AnyBuffer>()             // q
                           .Ret<ffi::Buffer<ffi::F32>>()      // amax []
                           .Ret<ffi::AnyBuffer>(),            // scratch
                       {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeRingCudaHandler, QuantizeRingImpl,
                       ffi::Ffi::Bind()
                           .Ctx<ffi::PlatformStream<cudaStream_t>>()
                           .Arg<ffi::AnyBuffer>()             // x
                           .Arg<ffi::Buffer<ffi::F32>>()      // history [L]
                           .Arg<ffi::Buffer<ffi::F32>>()      // scale []
                           .Arg<ffi::Buffer<ffi::F32>>()      // steps []
                           .Ret<ffi::AnyBuffer>()             // q
                           .Ret<ffi::Buffer<ffi::F32>>()      // amax []
                           .Ret<ffi::Buffer<ffi::F32>>()      // history' (aliased)
                           .Ret<ffi::Buffer<ffi::F32>>()      // scale' (aliased)
                           .Ret<ffi::Buffer<ffi::F32>>()      // steps' (aliased)
                           .Ret<ffi::AnyBuffer>()             // scratch
                           .Attr<int64_t>("margin")
                           .Attr<int64_t>("algo"),
                       {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
