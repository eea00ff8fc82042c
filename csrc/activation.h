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

// The transcendental pieces: libm's on the host; on the device the special-function unit's
// approximations (ex2.approx through __expf, rcp.approx through __fdividef, tanh.approx), a
// handful of instructions each where the IEEE-accurate expf, tanhf and division take dozens
// (the kernels applying them would be bound by their instructions, not by memory).
JF8_HD float sigmoid(float x) {
#if defined(__CUDA_ARCH__)
  return __fdividef(1.0f, 1.0f + __expf(-x));
#else
  return 1.0f / (1.0f + expf(-x));
#endif
}

JF8_HD float tanh_f32(float x) {
#if defined(__CUDA_ARCH__)
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
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
