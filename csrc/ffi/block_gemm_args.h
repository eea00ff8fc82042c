// jax_fp8_block_gemm: its Bind chain and argument decoder (CUDA only: on CPU jax_fp8.gemm is
// XLA's dot). The layouts: block_gemm.h.
#pragma once

#include <limits>
#include <string>
#include <string_view>
#include <utility>

#include "block_gemm.h"
#include "common.h"

namespace jax_fp8 {

struct BlockGemmCall {
  BlockGemmArgs g;
  int kernel;  // index into kBlockGemmKernels
};

// dtype -> rank -> attributes -> shape relations -> alignment, as validated first in
// jax_fp8/ops/gemm.py.
inline ffi::Error DecodeBlockGemm(Platform platform, BlockGemmCall& c, ffi::AnyBuffer a,
                                  ffi::AnyBuffer b, ffi::Buffer<ffi::F32> a_scale,
                                  ffi::Buffer<ffi::F32> b_scale, ffi::AnyBuffer bias,
                                  ffi::Result<ffi::AnyBuffer> d, bool has_bias, int64_t scale_mode,
                                  std::string_view kernel) {
  if (a.element_type() != ffi::DataType::F8E4M3FN || b.element_type() != ffi::DataType::F8E4M3FN)
    return invalid("a and b must be float8_e4m3fn");
  const ffi::DataType dt = d->element_type();
  BlockGemmOut out;
  switch (dt) {
    case ffi::DataType::BF16: out = BlockGemmOut::kBf16; break;
    case ffi::DataType::F16: out = BlockGemmOut::kF16; break;
    case ffi::DataType::F32: out = BlockGemmOut::kF32; break;
    default: return invalid("d must be bfloat16, float16 or float32");
  }
  if (has_bias && (dt == ffi::DataType::F32 || bias.element_type() != dt))
    return invalid("bias must be in d's dtype, bfloat16 or float16");
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2 || d->dimensions().size() != 2)
    return invalid("a, b and d must be 2-D");
  if (scale_mode != int64_t(ScaleMode::kBlock128x128) &&
      scale_mode != int64_t(ScaleMode::kGroup1x128))
    return invalid("scale_mode must be 1 (b in 128 x 128 blocks) or 2 (b in 1 x 128 groups)");
  const int index = block_gemm_kernel(kernel);
  if (index < 0) return invalid("no block-scaled GEMM kernel " + std::string(kernel));
  const int64_t M = a.dimensions()[0], K = a.dimensions()[1], N = b.dimensions()[0];
  if (b.dimensions()[1] != K) return invalid("a [M, K] and b [N, K] must share K");
  if (K % kBlockTile || K == 0 || N % kGemmDimMultiple || N == 0)
    return invalid("K must be a positive multiple of 128 and N of 16");
  // The kernel's row and column arithmetic is in int: M rounded up to a tile must fit.
  constexpr int64_t kMax = std::numeric_limits<int>::max() - 256;
  if (M > kMax || N > kMax || K > kMax) return invalid("M, N and K must be below 2^31 - 256");
  if (d->dimensions()[0] != M || d->dimensions()[1] != N) return invalid("d must be [M, N]");
  const ScaleMode mode = static_cast<ScaleMode>(scale_mode);
  const auto [na, nb] = block_gemm_scale_sizes(mode, M, N, K);
  if (int64_t(a_scale.element_count()) != na || int64_t(b_scale.element_count()) != nb)
    return invalid("scales must be a_scale [K/128, ceil4(M)] and b_scale [K/128, N] (1 x 128 "
                   "groups) or [K/128, ceil4(ceil(N/128))] (128 x 128 blocks)");
  if (has_bias && int64_t(bias.element_count()) != N) return invalid("bias must be [N]");
  if (ffi::Error e = check_aligned16(platform,
                                     {a.untyped_data(), b.untyped_data(), a_scale.typed_data(),
                                      b_scale.typed_data(), d->untyped_data(),
                                      has_bias ? bias.untyped_data() : nullptr},
                                     "a, b, the scales, bias and d");
      e.failure())
    return e;
  c.g = BlockGemmArgs{M,
                      N,
                      K,
                      mode,
                      out,
                      a.untyped_data(),
                      b.untyped_data(),
                      a_scale.typed_data(),
                      b_scale.typed_data(),
                      has_bias ? bias.untyped_data() : nullptr,
                      d->untyped_data()};
  c.kernel = index;
  return ffi::Error::Success();
}

template <typename B>
auto BindBlockGemm(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()         // a [M, K] e4m3
      .template Arg<ffi::AnyBuffer>()         // b [N, K] e4m3
      .template Arg<ffi::Buffer<ffi::F32>>()  // a_scale [K/128, ceil4(M)]
      .template Arg<ffi::Buffer<ffi::F32>>()  // b_scale [K/128, N] or [K/128, ceil4(ceil(N/128))]
      .template Arg<ffi::AnyBuffer>()         // bias [N] (or [0] when absent)
      .template Ret<ffi::AnyBuffer>()         // d [M, N]
      .template Attr<bool>("has_bias")
      .template Attr<int64_t>("scale_mode")
      .template Attr<std::string_view>("kernel");
}

}  // namespace jax_fp8
