// The scale-ring part of jax_fp8_quantize_ring and jax_fp8_cast_transpose_ring: decoded and
// checked once for both ops and both platforms. The ring arrives as three inputs (history
// f32[L], scale f32[], steps f32[]) and leaves as separate outputs, never aliased (the kernels
// read the inputs while they write the outputs): scale_used f32[], history_out f32[L],
// scale_out f32[], steps_out f32[]. Attributes: margin, algo (csrc/constants.h AmaxAlgo),
// observe (write the step's observation of the ring instead of the next ring; numerics.h).
#pragma once

#include <climits>

#include "common.h"

namespace jax_fp8 {

inline ffi::Error DecodeRing(RingArgs& ring, F32Buffer history, F32Buffer scale, F32Buffer steps,
                             F32Result scale_used, F32Result history_out, F32Result scale_out,
                             F32Result steps_out, int64_t margin, int64_t algo, bool observe) {
  if (history.dimensions().size() != 1) return invalid("history must be 1-D");
  if (algo != int64_t(AmaxAlgo::kMax) && algo != int64_t(AmaxAlgo::kMostRecent))
    return invalid("algo must be 0 (max) or 1 (most_recent)");
  if (margin < INT_MIN || margin > INT_MAX) return invalid("margin out of range");
  const size_t len = history.element_count();
  if (len < 1 || len > size_t(kMaxHistory)) return invalid("amax history length out of range");
  if (history_out->element_count() != len) return invalid("history_out must have history's size");
  for (size_t n : {scale.element_count(), steps.element_count(), scale_used->element_count(),
                   scale_out->element_count(), steps_out->element_count()})
    if (n != 1) return invalid("scale, steps, scale_used, scale_out and steps_out must be f32[]");
  ring = RingArgs{history.typed_data(),      scale.typed_data(),
                  steps.typed_data(),        scale_used->typed_data(),
                  history_out->typed_data(), scale_out->typed_data(),
                  steps_out->typed_data(),   static_cast<int>(len),
                  static_cast<int>(margin),  static_cast<AmaxAlgo>(algo),
                  observe};
  for (const float* in : {ring.history, ring.scale, ring.steps})
    for (const float* out : {ring.history_out, ring.scale_out, ring.steps_out, ring.scale_used})
      if (in == out) return invalid("the ring outputs must not alias the ring inputs");
  return ffi::Error::Success();
}

}  // namespace jax_fp8
