// CPU handlers' element access: f32 / bf16 / f16 inputs read as f32, the same values the CUDA
// kernels see.
#pragma once

#include <algorithm>

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

}  // namespace jax_fp8
