// The normalizations a cast-transpose can apply before it quantizes (a layer's input norm
// written straight into its GEMM's FP8 input), in f32, for the CPU handler and the CUDA
// kernel. Their jnp twins: jax_fp8.norms. The row statistics come in computed by XLA: rsigma =
// 1 / sqrt(mean square + epsilon) for RMSNorm, and the mean mu with rsigma = 1 / sqrt(variance
// + epsilon) for LayerNorm.
//
//   RMSNorm   (Zhang & Sennrich 2019):  x * (rsigma * gamma)
//   LayerNorm (Ba et al. 2016):         (x - mu) * (rsigma * gamma) + beta
//
// Each product and sum is rounded on its own and flushed as XLA's CPU runtime flushes
// (numerics.h mul_flushed / add_flushed), so the CUDA kernel, the CPU handler and the
// reference agree bit for bit.
#pragma once

#include "numerics.h"

namespace jax_fp8 {

JF8_HD float norm_value(float x, float mu, float rsigma, float gamma, float beta, bool centered) {
  const float m = mul_flushed(rsigma, gamma);
  if (!centered) return mul_flushed(x, m);
  return add_flushed(mul_flushed(add_flushed(x, -mu), m), beta);
}

}  // namespace jax_fp8
