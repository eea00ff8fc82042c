// CPU FFI handlers for jax_fp8_quantize and jax_fp8_quantize_ring: the same numerics as the
// CUDA kernels (csrc/numerics.h), one thread, written for clarity. Arguments: quantize_args.h.
#include "cpu_io.h"
#include "quantize_args.h"

namespace jax_fp8 {
namespace {

void quantize_with(const QuantizeArgs& a, float scale) {
  const float inv = 1.0f / flush_subnormal(scale);
  for (size_t i = 0; i < a.n; ++i) a.q[i] = float_to_fp8(load_f32(a.x, a.x_type, i) * inv, a.fmt);
}

ffi::Error QuantizeImpl(const QuantizeArgs& a) {
  quantize_with(a, *a.scale);
  *a.amax = amax_of(a.x, a.x_type, a.n);
  return ffi::Error::Success();
}

ffi::Error QuantizeRingImpl(const QuantizeArgs& a) {
  const float amax = amax_of(a.x, a.x_type, a.n);
  const float scale = ring_scale_for_step(*a.ring.scale, *a.ring.steps, amax, a.fmt, a.ring.margin);
  quantize_with(a, scale);
  *a.amax = amax;
  *a.ring.scale_used = scale;
  ring_write_serial(a.ring, amax, a.fmt);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeCpuHandler, DecodeThen(DecodeQuantize, QuantizeImpl),
                              BindQuantize(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(QuantizeRingCpuHandler,
                              DecodeThen(DecodeQuantizeRing, QuantizeRingImpl),
                              BindQuantizeRing(ffi::Ffi::Bind()));

}  // namespace jax_fp8
