// CPU handlers' element access: f32 / bf16 / f16 inputs read as f32, the same values the CUDA
// kernels see.
#pragma once

#include <algorithm>
#include <cstring>

#include "common.h"

namespace jax_fp8 {

// Element i as f32, subnormals flushed (numerics.h).
inline float load_f32(const void* x, ffi::DataType t, size_t i) {
  switch (t) {
    case ffi::DataType::F32:
      return flush_subnormal(static_cast<const float*>(x)[i]);
    case ffi::DataType::BF16:
      return flush_subnormal(bits_float(uint32_t(static_cast<const uint16_t*>(x)[i]) << 16));
    default:
      return half_to_float(static_cast<const uint16_t*>(x)[i]);
  }
}

inline bool supported_input(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

inline float amax_of(const ffi::AnyBuffer& x) {
  uint32_t m = 0;
  for (size_t i = 0; i < x.element_count(); ++i)
    m = std::max(m, abs_bits(load_f32(x.untyped_data(), x.element_type(), i)));
  return bits_float(m);
}

// NaN-propagating max |x| over rows [r0, r1) and columns [c0, c1) of x viewed as [*, cols].
inline float amax_region(const ffi::AnyBuffer& x, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                         int64_t c1) {
  uint32_t m = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c)
      m = std::max(m, abs_bits(load_f32(x.untyped_data(), x.element_type(), r * cols + c)));
  return bits_float(m);
}

// Writes the ring outputs: the inputs advanced by this step's amax (copied first, in case XLA
// did not alias them; the result is the same either way).
inline void write_next_ring(float amax, const ffi::Buffer<ffi::F32>& history,
                            const ffi::Buffer<ffi::F32>& scale, const ffi::Buffer<ffi::F32>& steps,
                            ffi::Result<ffi::Buffer<ffi::F32>>& history_out,
                            ffi::Result<ffi::Buffer<ffi::F32>>& scale_out,
                            ffi::Result<ffi::Buffer<ffi::F32>>& steps_out, Fp8Format fmt,
                            int64_t margin, int64_t algo) {
  const size_t len = history.element_count();
  std::memmove(history_out->typed_data(), history.typed_data(), len * sizeof(float));
  scale_out->typed_data()[0] = scale.typed_data()[0];
  steps_out->typed_data()[0] = steps.typed_data()[0];
  ring_finalize_serial(amax, history_out->typed_data(), static_cast<int>(len),
                       scale_out->typed_data(), steps_out->typed_data(), fmt,
                       static_cast<int>(margin), static_cast<AmaxAlgo>(algo));
}

}  // namespace jax_fp8
