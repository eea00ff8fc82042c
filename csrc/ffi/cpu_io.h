// CPU handlers' element access: f32 / bf16 / f16 inputs read as f32, the same values the CUDA
// kernels see.
#pragma once

#include <algorithm>
#include <vector>

#include "../activation.h"
#include "../norm.h"
#include "common.h"
#include "source_args.h"

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

// NaN-propagating max |value(r, c)| over rows [r0, r1) and columns [c0, c1).
template <typename F>
float amax_over(F&& value, int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
  uint32_t m = 0;
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t c = c0; c < c1; ++c) m = std::max(m, abs_bits(value(r, c)));
  return bits_float(m);
}

// NaN-propagating max |x| over rows [r0, r1) and columns [c0, c1) of x viewed as [*, cols].
inline float amax_region(const void* x, ffi::DataType t, int64_t cols, int64_t r0, int64_t r1,
                         int64_t c0, int64_t c1) {
  return amax_over([&](int64_t r, int64_t c) { return load_f32(x, t, r * cols + c); }, r0, r1,
                   c0, c1);
}

// NaN-propagating max |x| over all n elements.
inline float amax_of(const void* x, ffi::DataType t, size_t n) {
  return amax_region(x, t, 1, 0, 1, 0, int64_t(n));
}

// Element (r, c) of what a source quantizes (source_args.h), in the order of operations of
// csrc/kernels/sources.cuh.
inline float source_value(const SourceArgs& s, int64_t r, int64_t c) {
  auto in = [&](const void* p, int64_t i) { return load_f32(p, s.x_type, i); };
  const int64_t cols = s.cols, xc = s.x_cols;
  const ActivationId act = s.activation;
  if (s.norm != NormId::kNone) {
    const bool centered = s.norm == NormId::kLayer;
    const float* st = s.stats + r * (centered ? 2 : 1);
    return norm_value(in(s.x, r * cols + c), centered ? st[0] : 0.0f, st[centered ? 1 : 0],
                      s.affine[c], centered ? s.affine[cols + c] : 0.0f, centered);
  }
  if (act == ActivationId::kNone) {  // x, or the part that holds column c
    int i = 0;
    int64_t c0 = c;
    while (c0 >= s.part_cols[i]) c0 -= s.part_cols[i++];
    return in(s.part_data[i], r * s.part_cols[i] + c0);
  }
  if (!s.grad) {
    const float g = in(s.x, r * xc + c);
    return s.gated ? activation(act, g) * in(s.x, r * xc + cols + c) : activation(act, g);
  }
  const int64_t ch = c % xc, y_cols = s.gated ? 2 * xc : xc;
  const float d = in(s.x, r * xc + ch), g = in(s.y, r * y_cols + ch);
  if (!s.gated) return d * activation_grad(act, g);
  if (c >= xc) return d * activation(act, g);
  return d * in(s.y, r * y_cols + xc + ch) * activation_grad(act, g);
}

// What a source quantizes, [rows, cols] row-major: each element evaluated once.
inline std::vector<float> source_values(const SourceArgs& s) {
  std::vector<float> v(size_t(s.rows * s.cols));
  for (int64_t r = 0; r < s.rows; ++r)
    for (int64_t c = 0; c < s.cols; ++c) v[size_t(r * s.cols + c)] = source_value(s, r, c);
  return v;
}

}  // namespace jax_fp8
