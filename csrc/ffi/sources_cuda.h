// The CUDA handlers' dispatch on what a cast-transpose quantizes: the source of
// csrc/kernels/sources.cuh that decoded arguments (source_args.h) name.
#pragma once

#include "../kernels/sources.cuh"
#include "source_args.h"

namespace jax_fp8 {

// f(src) with the source `s` names, of input type T (the CUDA handlers' dispatch).
template <typename T, typename F>
auto with_source(const SourceArgs& s, F&& f) {
  const T* x = static_cast<const T*>(s.x);
  const T* y = static_cast<const T*>(s.y);
  if (s.norm != NormId::kNone)
    return f(NormSource<T>{x, s.stats, s.affine, s.cols, s.norm == NormId::kLayer});
  if (s.activation == ActivationId::kNone) return f(PlainSource<T>{x, s.cols});
  if (!s.grad)
    return s.gated ? f(ActivationSource<T, true>{x, s.cols, s.activation})
                   : f(ActivationSource<T, false>{x, s.cols, s.activation});
  if (s.gated) return f(GatedActivationGradSource<T>{x, y, s.x_cols, s.activation});
  return f(ActivationGradSource<T>{x, y, s.x_cols, s.activation});
}

}  // namespace jax_fp8
