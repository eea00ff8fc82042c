// The activations a cast-transpose can apply before it quantizes (an MLP's hidden activation
// written straight into the down projection's FP8 input) and their derivatives (the backward's
// gradient written straight into the up projection's FP8 gradient), in f32, for the CPU
// handlers and the CUDA kernels. Their jnp twins: jax_fp8.activations.
//
//   silu(x) = x * sigmoid(x)                       (Elfwing et al. 2017; jax.nn.silu)
//   gelu(x) = x * (1 + tanh(k0 (x + k1 x^3))) / 2  (tanh approximation, Hendrycks & Gimpel
//             2016; jax.nn.gelu's default)
// Gated forms (Shazeer 2020, "GLU Variants Improve Transformer"): swiglu / geglu take the
// pre-activation [gate | up] and give act(gate) * up.
//
// The host uses libm's expf and tanhf, the device its hardware approximations (below): outputs
// agree with the reference within the bound docs/design.md states, not byte for byte.
#pragma once

#include "numerics.h"

namespace jax_fp8 {

constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;

// The transcendental pieces: libm's on the host; on the device built on the special-function
// unit's exp and reciprocal (__expf, __fdividef: a few instructions each, where the IEEE-exact
// expf, tanhf and division take dozens and made the kernels applying them bound by their
// instructions rather than by memory). tanh as 1 - 2 / (1 + e^2z) keeps its absolute error near
// an ulp of 1 (the hardware's tanh.approx errs by 2^-11 there, which gelu's derivative, where
// 1 + tanh cancels, would carry into the gradient).
JF8_HD float sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  return __fdividef(1.0f, 1.0f + __expf(-x));
#else
  return 1.0f / (1.0f + expf(-x));
#endif
}

JF8_HD float tanh_f32(float x) {
#if defined(__CUDA_ARCH__)
  return 1.0f - __fdividef(2.0f, 1.0f + __expf(2.0f * x));
#else
  return tanhf(x);
#endif
}

JF8_HD float activation(ActivationId a, float x) {
  if (a == ActivationId::kSilu) return x * sigmoid(x);
  return 0.5f * x * (1.0f + tanh_f32(kGeluK0 * (x + kGeluK1 * x * x * x)));
}

// d activation / dx.
JF8_HD float activation_grad(ActivationId a, float x) {
  if (a == ActivationId::kSilu) {
    const float s = sigmoid(x);
    return s * (1.0f + x * (1.0f - s));
  }
  const float t = tanh_f32(kGeluK0 * (x + kGeluK1 * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluK0 * (1.0f + 3.0f * kGeluK1 * x * x);
}

}  // namespace jax_fp8
