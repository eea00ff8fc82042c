// Helpers shared by the FFI handlers: dtypes, errors, and how a handler runs an op's one
// argument decoder (csrc/ffi/<op>_args.h) before its CPU or CUDA implementation.
//
// Each op's decoder checks, in this order: dtypes -> ranks -> attribute values -> shape
// relations -> alignment (only where the CUDA kernels need it), and returns
// ffi::Error::InvalidArgument for the first rule broken. jax_fp8's Python wrappers check the
// same rules first, with messages that name the argument; these checks guard the handlers.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <string>

#include "../numerics.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {
namespace ffi = xla::ffi;
using F32Buffer = ffi::Buffer<ffi::F32>;
using F32Result = ffi::Result<ffi::Buffer<ffi::F32>>;

inline bool is_fp8(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN || t == ffi::DataType::F8E5M2;
}

inline Fp8Format fp8_format(ffi::DataType t) {
  return t == ffi::DataType::F8E4M3FN ? Fp8Format::kE4M3 : Fp8Format::kE5M2;
}

// The quantizers' inputs.
inline bool supported_input(ffi::DataType t) {
  return t == ffi::DataType::F32 || t == ffi::DataType::BF16 || t == ffi::DataType::F16;
}

// The CUDA kernels use 16-byte vector loads and stores.
inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

inline ffi::Error invalid(const std::string& what) { return ffi::Error::InvalidArgument(what); }

// The platform a decoder checks for: CUDA adds the alignment its kernels need.
enum class Platform { kCpu, kCuda };

// A decoder's last check: on CUDA, every pointer 16-byte aligned.
inline ffi::Error check_aligned16(Platform platform, std::initializer_list<const void*> ptrs,
                                  const char* what) {
  if (platform == Platform::kCuda)
    for (const void* p : ptrs)
      if (!aligned16(p)) return invalid(std::string(what) + " must be 16-byte aligned");
  return ffi::Error::Success();
}

// What a CPU handler calls: the bound values, in the order of the op's Bind chain, go to the
// op's decoder, which checks them and fills Args; then impl runs on Args. (CUDA's twin, with
// the stream, is in launch.h.)
template <typename Args, typename... Bound>
struct CpuCall {
  ffi::Error (*decode)(Platform, Args&, Bound...);
  ffi::Error (*impl)(const Args&);

  ffi::Error operator()(Bound... bound) const {
    Args a{};
    if (ffi::Error e = decode(Platform::kCpu, a, bound...); e.failure()) return e;
    return impl(a);
  }
};

template <typename Args, typename... Bound>
CpuCall<Args, Bound...> DecodeThen(ffi::Error (*decode)(Platform, Args&, Bound...),
                                   ffi::Error (*impl)(const Args&)) {
  return {decode, impl};
}

}  // namespace jax_fp8
