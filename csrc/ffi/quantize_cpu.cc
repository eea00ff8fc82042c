// CPU FFI handlers for jax_fp8_quantize and jax_fp8_quantize_ring: the same numerics as the
// CUDA kernels (csrc/numerics.h), one thread, written for clarity.
#include <algorithm>
#include <cstring>

#include "cpu_io.h"

namespace jax_fp8 {
namespace {

void quantize_with(const ffi::AnyBuffer& x, float scale, Fp8Format fmt, uint8_t* q) {
  const float inv = 1.0f / flush_subnormal(scale);
  for (size_t i = 0; i < x.element_count(); ++i)
    q[i] = float_to_fp8(load_f32(x.untyped_data(), x.element_type(), i) * inv, fmt);
}

ffi::Error QuantizeImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> scale, ffi::Result<ffi::AnyBuffer> q,
                        ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::AnyBuffer>) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (!is_fp8(q->element_type())) return invalid("q must be float8_e4m3fn or float8_e5m2");
  if (q->element_count() != x.element_count()) return invalid("q must have x's size");
  quantize_with(x, scale.typed_data()[0], fp8_format(q->element_type()),
                static_cast<uint8_t*>(q->untyped_data()));
  amax->typed_data()[0] = amax_of(x);
  return ffi::Error::Success();
}

ffi::Error QuantizeRingImpl(ffi::AnyBuffer x, ffi::Buffer<ffi::F32> history,
                            ffi::Buffer<ffi::F32> scale, ffi::Buffer<ffi::F32> steps,
                            ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::Buffer<ffi::F32>> amax,
                            ffi::Result<ffi::Buffer<ffi::F32>> history_out,
                            ffi::Result<ffi::Buffer<ffi::F32>> scale_out,
                            ffi::Result<ffi::Buffer<ffi::F32>> steps_out,
                            ffi::Result<ffi::AnyBuffer>, int64_t margin,
                            int64_t algo) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (!is_fp8(q->element_type())) return invalid("q must be float8_e4m3fn or float8_e5m2");
  if (q->element_count() != x.element_count()) return invalid("q must have x's size");
  const size_t len = history.element_count();
  if (auto e = check_ring_attrs(algo, len, kMaxHistory); e.failure()) return e;
  const Fp8Format fmt = fp8_format(q->element_type());
  const float a = amax_of(x);
  const float s = ring_scale_for_step(scale.typed_data()[0], steps.typed_data()[0], a, fmt,
                                      static_cast<int>(margin));
  quantize_with(x, s, fmt, static_cast<uint8_t*>(q->untyped_data()));
  amax->typed_data()[0] = a;
  write_next_ring(a, history, scale, steps, history_out, scale_out, steps_out, fmt, margin, algo);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeCpuHandler, QuantizeImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()          // x
                           .Arg<ffi::Buffer<ffi::F32>>()   // scale []
                           .Ret<ffi::AnyBuffer>()          // q
                           .Ret<ffi::Buffer<ffi::F32>>()   // amax []
                           .Ret<ffi::AnyBuffer>());        // scratch (used on CUDA only)

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeRingCpuHandler, QuantizeRingImpl,
                       ffi::Ffi::Bind()
                           .Arg<ffi::AnyBuffer>()          // x
                           .Arg<ffi::Buffer<ffi::F32>>()   // history [L]
                           .Arg<ffi::Buffer<ffi::F32>>()   // scale []
                           .Arg<ffi::Buffer<ffi::F32>>()   // steps []
                           .Ret<ffi::AnyBuffer>()          // q
                           .Ret<ffi::Buffer<ffi::F32>>()   // amax []
                           .Ret<ffi::Buffer<ffi::F32>>()   // history' (aliased)
                           .Ret<ffi::Buffer<ffi::F32>>()   // scale' (aliased)
                           .Ret<ffi::Buffer<ffi::F32>>()   // steps' (aliased)
                           .Ret<ffi::AnyBuffer>()          // scratch (used on CUDA only)
                           .Attr<int64_t>("margin")
                           .Attr<int64_t>("algo"));

}  // namespace jax_fp8
