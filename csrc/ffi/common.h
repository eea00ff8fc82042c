// Helpers shared by the FFI handlers: dtype decoding and attribute parsing.
#pragma once

#include <cstdint>
#include <string>

#include "../numerics.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;

inline bool is_fp8(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
}

inline Fp8Format fp8_format(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
}

// The CUDA kernels use 16-byte vector loads and stores.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument(what); }

// The ring's algo attribute arrives as int64 (0 max, 1 most_recent).
inline ffi::Error check_ring_attrs(int64_t algo, size_t len, size_t max_len) {
  if (algo != 0 && algo != 1) return invalid("algo must be 0 (max) or 1 (most_recent)");
  if (len < 1 || len > max_len) return invalid("amax history length out of range");
  return ffi::Error::Success();
}

}  // namespace jax_fp8
