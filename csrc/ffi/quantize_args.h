// jax_fp8_quantize and jax_fp8_quantize_ring: their Bind chains and argument decoders, shared
// by the CPU handlers (quantize_cpu.cc) and the CUDA ones (quantize_cuda.cu).
#pragma once

#include "ring_args.h"

namespace jax_fp8 {

struct QuantizeArgs {
  const void* x;
  ffi::DataType x_type;
  size_t n;
  Fp8Format fmt;
  uint8_t* q;
  const float* scale;  // jax_fp8_quantize: the scale; with a ring: ring.scale
  float* amax;
  void* scratch;  // kQuantizeScratchWords words, used on CUDA only
  RingArgs ring;  // jax_fp8_quantize_ring only
};

// The checks of x, q, amax and scratch, with or without a ring (alignment comes last).
inline ffi::Error DecodeQuantizeBuffers(QuantizeArgs& a, ffi::AnyBuffer x,
                                        ffi::Result<ffi::AnyBuffer> q, F32Result amax,
                                        ffi::Result<ffi::AnyBuffer> scratch) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (!is_fp8(q->element_type())) return invalid("q must be float8_e4m3fn or float8_e5m2");
  if (q->element_count() != x.element_count()) return invalid("q must have x's size");
  if (amax->element_count() != 1) return invalid("amax must be f32[]");
  if (scratch->size_bytes() < kQuantizeScratchWords * sizeof(uint32_t))
    return invalid("scratch too small");
  a.x = x.untyped_data();
  a.x_type = x.element_type();
  a.n = x.element_count();
  a.fmt = fp8_format(q->element_type());
  a.q = static_cast<uint8_t*>(q->untyped_data());
  a.amax = amax->typed_data();
  a.scratch = scratch->untyped_data();
  return ffi::Error::Success();
}

inline ffi::Error DecodeQuantize(Platform platform, QuantizeArgs& a, ffi::AnyBuffer x,
                                 F32Buffer scale, ffi::Result<ffi::AnyBuffer> q, F32Result amax,
                                 ffi::Result<ffi::AnyBuffer> scratch) {
  if (ffi::Error e = DecodeQuantizeBuffers(a, x, q, amax, scratch); e.failure()) return e;
  if (scale.element_count() != 1) return invalid("scale must be f32[]");
  a.scale = scale.typed_data();
  return check_aligned16(platform, {a.x, a.q}, "x and q");
}

template <typename B>
auto BindQuantize(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()   // x
      .template Arg<F32Buffer>()        // scale []
      .template Ret<ffi::AnyBuffer>()   // q, x's shape, FP8
      .template Ret<F32Buffer>()        // amax []
      .template Ret<ffi::AnyBuffer>();  // scratch u32[kQuantizeScratchWords]
}

inline ffi::Error DecodeQuantizeRing(Platform platform, QuantizeArgs& a, ffi::AnyBuffer x,
                                     F32Buffer history, F32Buffer scale, F32Buffer steps,
                                     ffi::Result<ffi::AnyBuffer> q, F32Result scale_used,
                                     F32Result amax, F32Result history_out, F32Result scale_out,
                                     F32Result steps_out, ffi::Result<ffi::AnyBuffer> scratch,
                                     int64_t margin, int64_t algo, bool observe) {
  if (ffi::Error e = DecodeQuantizeBuffers(a, x, q, amax, scratch); e.failure()) return e;
  if (ffi::Error e = DecodeRing(a.ring, history, scale, steps, scale_used, history_out,
                                scale_out, steps_out, margin, algo, observe);
      e.failure())
    return e;
  a.scale = a.ring.scale;
  return check_aligned16(platform, {a.x, a.q}, "x and q");
}

template <typename B>
auto BindQuantizeRing(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x
      .template Arg<F32Buffer>()       // history [L]
      .template Arg<F32Buffer>()       // scale []
      .template Arg<F32Buffer>()       // steps []
      .template Ret<ffi::AnyBuffer>()  // q, x's shape, FP8
      .template Ret<F32Buffer>()       // scale_used []
      .template Ret<F32Buffer>()       // amax []
      .template Ret<F32Buffer>()       // history_out [L]
      .template Ret<F32Buffer>()       // scale_out []
      .template Ret<F32Buffer>()       // steps_out []
      .template Ret<ffi::AnyBuffer>()  // scratch u32[kQuantizeScratchWords]
      .template Attr<int64_t>("margin")
      .template Attr<int64_t>("algo")
      .template Attr<bool>("observe");
}

}  // namespace jax_fp8
