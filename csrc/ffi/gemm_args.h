// jax_fp8_gemm: its Bind chain and argument decoder (CUDA only: on CPU, jax_fp8.gemm is XLA's
// dot), kept apart from the cuBLASLt calls in gemm_cuda.cc.
#pragma once

#include <tuple>
#include <utility>

#include "common.h"

namespace jax_fp8 {

// An e4m3 d comes with d_scale and amax_d; the bias (and cuBLASLt's C) is then bf16, else in
// d's dtype.
inline bool fp8_output(ffi::DataType d) { return d == ffi::DataType::F8E4M3FN; }
inline ffi::DataType epilogue_type(ffi::DataType d) {
  return fp8_output(d) ? ffi::DataType::BF16 : d;
}

// What fixes a GEMM's algorithm choice: sizes, dtypes and options, no pointers.
struct GemmProblem {
  int64_t M, N, K;
  ffi::DataType a_type, b_type, d_type;
  bool has_bias, fast_accum;
  ScaleMode scale_mode;

  bool fp8_out() const { return fp8_output(d_type); }
  auto tie() const {
    return std::tie(M, N, K, a_type, b_type, d_type, has_bias, fast_accum, scale_mode);
  }
  bool operator<(const GemmProblem& o) const { return tie() < o.tie(); }
};

struct GemmArgs {
  GemmProblem p;
  const void *a, *b, *bias;  // bias null when absent
  const float *a_scale, *b_scale, *d_scale;
  void* d;
  float* amax_d;
  void* workspace;  // kGemmWorkspaceBytes
};

// Element counts of a_scale and b_scale for a scale mode (block scaling: the layouts cuBLASLt
// reads, gemm_lt.cc, for K a multiple of kBlockTile and M of 4).
inline std::pair<int64_t, int64_t> scale_sizes(ScaleMode mode, int64_t M, int64_t N, int64_t K) {
  if (mode == ScaleMode::kPerTensor) return {1, 1};
  const int64_t kb = K / kBlockTile;
  return {M * kb, mode == ScaleMode::kBlock128x128
                      ? (N + kBlockTile - 1) / kBlockTile * ((kb + 3) / 4 * 4)
                      : N * kb};
}

inline bool scale_sizes_ok(ScaleMode mode, int64_t M, int64_t N, int64_t K, size_t na, size_t nb) {
  if (mode != ScaleMode::kPerTensor && (K % kBlockTile || M % 4)) return false;
  return scale_sizes(mode, M, N, K) == std::make_pair(int64_t(na), int64_t(nb));
}

// dtype -> rank -> attributes -> shape relations, as validated first in jax_fp8/ops/gemm.py. The
// alignment cuBLASLt needs is K and N multiples of kGemmDimMultiple (a shape relation); the
// pointers' own alignment decides which algorithms may run (gemm_cuda.cc).
inline ffi::Error DecodeGemm(Platform, GemmArgs& g, ffi::AnyBuffer a, ffi::AnyBuffer b,
                             ffi::Buffer<ffi::F32> a_scale, ffi::Buffer<ffi::F32> b_scale,
                             ffi::AnyBuffer bias, ffi::Buffer<ffi::F32> d_scale,
                             ffi::Result<ffi::AnyBuffer> d,
                             ffi::Result<ffi::Buffer<ffi::F32>> amax_d,
                             ffi::Result<ffi::AnyBuffer> workspace, bool has_bias, bool fast_accum,
                             int64_t scale_mode) {
  if (!is_fp8(a.element_type()) || !is_fp8(b.element_type()))
    return invalid("a and b must be float8_e4m3fn or float8_e5m2");
  if (a.element_type() == ffi::DataType::F8E5M2 && b.element_type() == ffi::DataType::F8E5M2)
    return invalid("e5m2 x e5m2 is not supported by cuBLASLt");
  const auto dt = d->element_type();
  const bool fp8_out = fp8_output(dt);
  if (dt != ffi::DataType::BF16 && dt != ffi::DataType::F16 && dt != ffi::DataType::F32 && !fp8_out)
    return invalid("out must be bfloat16, float16, float32 or float8_e4m3fn");
  if (has_bias && bias.element_type() != epilogue_type(dt))
    return invalid("bias must be in the output dtype (bfloat16 for an e4m3 output)");
  if (a.dimensions().size() != 2 || b.dimensions().size() != 2) return invalid("a, b must be 2-D");
  if (scale_mode < int64_t(ScaleMode::kPerTensor) || scale_mode > int64_t(ScaleMode::kGroup1x128))
    return invalid("scale_mode must be 0, 1 or 2");
  const ScaleMode mode = static_cast<ScaleMode>(scale_mode);
  if (fp8_out && mode != ScaleMode::kPerTensor)
    return invalid("an e4m3 output takes per-tensor scales only");
  const int64_t M = a.dimensions()[0], K = a.dimensions()[1], N = b.dimensions()[0];
  if (b.dimensions()[1] != K) return invalid("a [M, K] and b [N, K] must share K");
  if (K % kGemmDimMultiple || N % kGemmDimMultiple)
    return invalid("K and N must be multiples of " + std::to_string(kGemmDimMultiple));
  if (d->element_count() != size_t(M * N)) return invalid("d must be [M, N]");
  const size_t n_fp8 = fp8_out ? 1 : 0;  // d_scale and amax_d exist for an e4m3 output only
  if (d_scale.element_count() != n_fp8 || amax_d->element_count() != n_fp8)
    return invalid("d_scale and amax_d must hold one f32 for an e4m3 output, none otherwise");
  if (has_bias && int64_t(bias.element_count()) != N) return invalid("bias must be [N]");
  if (workspace->size_bytes() < kGemmWorkspaceBytes) return invalid("workspace too small");
  if (!scale_sizes_ok(mode, M, N, K, a_scale.element_count(), b_scale.element_count()))
    return invalid("scales do not match the scale mode (block scaling also needs K % 128 == 0 "
                   "and M % 4 == 0)");
  g = GemmArgs{{M, N, K, a.element_type(), b.element_type(), dt, has_bias, fast_accum, mode},
               a.untyped_data(), b.untyped_data(), has_bias ? bias.untyped_data() : nullptr,
               a_scale.typed_data(), b_scale.typed_data(), d_scale.typed_data(),
               d->untyped_data(), amax_d->typed_data(), workspace->untyped_data()};
  return ffi::Error::Success();
}

template <typename B>
auto BindGemm(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()         // a [M, K] fp8
      .template Arg<ffi::AnyBuffer>()         // b [N, K] fp8
      .template Arg<ffi::Buffer<ffi::F32>>()  // a_scale [] or [K/128, M]
      .template Arg<ffi::Buffer<ffi::F32>>()  // b_scale [], [ceil(N/128), ceil4(K/128)], [K/128, N]
      .template Arg<ffi::AnyBuffer>()         // bias [N] (or [0] when absent)
      .template Arg<ffi::Buffer<ffi::F32>>()  // d_scale [1] (e4m3 out) or [0]
      .template Ret<ffi::AnyBuffer>()         // d [M, N]
      .template Ret<ffi::Buffer<ffi::F32>>()  // amax_d [1] (e4m3 out) or [0]
      .template Ret<ffi::AnyBuffer>()         // workspace u8[kGemmWorkspaceBytes]
      .template Attr<bool>("has_bias")
      .template Attr<bool>("fast_accum")
      .template Attr<int64_t>("scale_mode");
}

}  // namespace jax_fp8
