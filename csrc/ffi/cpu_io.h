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

// NaN-propagating max |x| over rows [r0, r1) and columns [c0, c1) of x viewed as [*, cols].
inline float amax_region(const void* x, ffi::DataType t, int64_t cols, int64_t r0, int64_t r1,
                         int64_t c0, int64_t c1) {
  uint32_t m = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) m = std::max(m, abs_bits(load_f32(x, t, r * cols + c)));
  return bits_float(m);
}

// NaN-propagating max |x| over all n elements.
inline float amax_of(const void* x, ffi::DataType t, size_t n) {
  return amax_region(x, t, 1, 0, 1, 0, int64_t(n));
}

}  // namespace jax_fp8
