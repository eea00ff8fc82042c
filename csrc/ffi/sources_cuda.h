// The CUDA handlers' dispatch on what a cast-transpose quantizes: the source of
// csrc/kernels/sources.cuh that decoded arguments (source_args.h) name.
#pragma once

#include <cstdint>

#include "../kernels/sources.cuh"
#include "source_args.h"

namespace jax_fp8 {

// x itself, in one array.
template <typename T>
PlainSource<T> plain_source(const SourceArgs& s) {
  return {{static_cast<const T*>(s.x)}, {s.cols}, {0}};
}

// x in parts as PlainSource<T, kMaxParts> reads it: the parts not given start past C.
template <typename T>
PlainSource<T, kMaxParts> parts_source(const SourceArgs& s) {
  PlainSource<T, kMaxParts> src;
  int64_t start = 0;
  for (int i = 0; i < kMaxParts; ++i) {
    const int p = i < s.num_parts ? i : 0;
    src.x[i] = static_cast<const T*>(s.part_data[p]);
    src.cols[i] = s.part_cols[p];
    src.start[i] = i < s.num_parts ? start : INT64_MAX;
    if (i < s.num_parts) start += s.part_cols[i];
  }
  return src;
}

// f(src) with the source `s` names, of input type T (the CUDA handlers' dispatch); x in parts
// only where kTakesParts (an op whose decoder takes them: DecodeParts).
template <typename T, bool kTakesParts = false, typename F>
auto with_source(const SourceArgs& s, F&& f) {
  const T* x = static_cast<const T*>(s.x);
  const T* y = static_cast<const T*>(s.y);
  if (s.norm != NormId::kNone)
    return f(NormSource<T>{x, s.stats, s.affine, s.cols, s.norm == NormId::kLayer});
  if constexpr (kTakesParts)
    if (s.num_parts > 1) return f(parts_source<T>(s));
  if (s.activation == ActivationId::kNone) return f(plain_source<T>(s));
  if (!s.grad)
    return s.gated ? f(ActivationSource<T, true>{x, s.cols, s.activation})
                   : f(ActivationSource<T, false>{x, s.cols, s.activation});
  if (s.gated) return f(GatedActivationGradSource<T>{x, y, s.x_cols, s.activation});
  return f(ActivationGradSource<T>{x, y, s.x_cols, s.activation});
}

}  // namespace jax_fp8
