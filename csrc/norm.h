// The normalizations a cast-transpose can apply before it quantizes (a layer's input norm
// written straight into its GEMM's FP8 input), in f32, for the CPU handler and the CUDA
// kernel. Their jnp twins: jax_fp8.norms. The row statistics come in computed by XLA: rsigma =
// 1 / sqrt(mean square + epsilon) for RMSNorm, and the mean mu with rsigma = 1 / sqrt(variance
// + epsilon) for LayerNorm.
//
//   RMSNorm   (Zhang & Sennrich 2019):  x * (rsigma * gamma)
//   LayerNorm (Ba et al. 2016):         (x - mu) * (rsigma * gamma) + beta
//
// Each product and sum is rounded on its own (the device compiler would otherwise contract a
// product and a sum into one fused multiply-add), so the CUDA kernel, the CPU handler and the
// reference agree bit for bit.
#pragma once

#include "numerics.h"

namespace jax_fp8 {

JF8_HD float norm_value(float x, float mu, float rsigma, float gamma, float beta, bool centered) {
#if defined(__CUDA_ARCH__)
  const float m = __fmul_rn(rsigma, gamma);
  return centered ? __fadd_rn(__fmul_rn(__fsub_rn(x, mu), m), beta) : __fmul_rn(x, m);
#else
  const float m = rsigma * gamma;
  return centered ? (x - mu) * m + beta : x * m;
#endif
}

}  // namespace jax_fp8
