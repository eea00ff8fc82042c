// The activations a cast-transpose can apply before it quantizes (an MLP's hidden activation
// written straight into the down projection's FP8 input) and their derivatives (the backward's
// gradient written straight into the up projection's FP8 gradient), in f32, for the CPU
// handlers and the CUDA kernels. Their jnp twins: jax_fp8.activations.
//
//   silu(x) = x * sigmoid(x)                    (Elfwing et al. 2017; jax.nn.silu)
//   gelu(x) = x * (1 + tanh(k0 (x + k1 x^3))) / 2  (tanh approximation, Hendrycks & Gimpel
//             2016; jax.nn.gelu's default)
// Gated forms (Shazeer 2020, "GLU Variants Improve Transformer"): swiglu / geglu take the
// pre-activation [gate | up] and give act(gate) * up.
//
// expf and tanhf are the platform's (libm on the host, CUDA's on the device, within 2 ulp of
// each other): outputs agree with the reference within the bound docs/design.md states, not
// byte for byte.
#pragma once

#include "numerics.h"

namespace jax_fp8 {

constexpr float kGeluK0 = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluK1 = 0.044715f;

JF8_HD float activation(ActivationId a, float x) {
  if (a == ActivationId::kSilu) return x / (1.0f + expf(-x));
  const float t = tanhf(kGeluK0 * (x + kGeluK1 * x * x * x));
  return 0.5f * x * (1.0f + t);
}

// d activation / dx.
JF8_HD float activation_grad(ActivationId a, float x) {
  if (a == ActivationId::kSilu) {
    const float s = 1.0f / (1.0f + expf(-x));
    return s * (1.0f + x * (1.0f - s));
  }
  const float t = tanhf(kGeluK0 * (x + kGeluK1 * x * x * x));
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * kGeluK0 * (1.0f + 3.0f * kGeluK1 * x * x);
}

}  // namespace jax_fp8
