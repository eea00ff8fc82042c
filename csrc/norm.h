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
// product and a sum into one fused multiply-add), and every operand and result is flushed to
// zero where it is an f32 subnormal (numerics.h: as XLA's CPU runtime flushes them; x comes in
// flushed), so the CUDA kernel, the CPU handler and the reference agree bit for bit.
#pragma once

#include "numerics.h"

namespace jax_fp8 {

JF8_HD float mul_flushed(float a, float b) {
#if defined(__CUDA_ARCH__)
  return flush_subnormal(__fmul_rn(a, b));
#else
  return flush_subnormal(a * b);
#endif
}

JF8_HD float add_flushed(float a, float b) {
#if defined(__CUDA_ARCH__)
  return flush_subnormal(__fadd_rn(a, b));
#else
  return flush_subnormal(a + b);
#endif
}

// x flushed; the statistics and the affine parameters are flushed here.
JF8_HD float norm_value(float x, float mu, float rsigma, float gamma, float beta, bool centered) {
  const float m = mul_flushed(flush_subnormal(rsigma), flush_subnormal(gamma));
  if (!centered) return mul_flushed(x, m);
  const float d = add_flushed(x, -flush_subnormal(mu));
  return add_flushed(mul_flushed(d, m), flush_subnormal(beta));
}

}  // namespace jax_fp8
