// Sources: what a cast-transpose quantizes (cast_transpose.cuh per tensor, block_quantize.cuh
// in 128-element groups): x itself (in one array or several side by side), an activation of x,
// the gradient through an activation (csrc/activation.h), so an MLP's activation and its
// gradient cost no pass of their own, or a norm of x (csrc/norm.h), so a layer's input norm
// costs none either. Device code only: the CUDA handlers build the one their arguments name
// with csrc/ffi/sources_cuda.h.
#pragma once

#include "../activation.h"
#include "../norm.h"
#include "quantize.cuh"

namespace jax_fp8 {

// Sources: element (r, c) of the [R, C] tensor to quantize, 16 consecutive columns at a time
// (C % 16 == 0), loaded as raw vectors first (`load`, so the next tile's loads can be in
// flight) and turned into f32 values later (`values`). Every value of an all-zero Raw is 0.
// A source of kOutputs = 2 gives two tensors [R, C] from one read, quantized side by side as
// [R, 2C]. kDbias: whether the source is a gradient whose column sums can be a bias gradient.
// blocks_per_sm(dbias): the cast-transpose's launch bound for 16-bit inputs (with or without
// the dbias sums), the resident blocks an SM that ptxas fits a thread's registers to (1: no
// bound); each is the most at which sm_90a's ptxas spills nothing for bf16 inputs, except
// where said (register counts and spills below are sm_90a's).

// x [R, C] itself; with kParts > 1, x in parts side by side (csrc/ffi/source_args.h), part i
// [R, cols[i]] holding the columns from start[i] on, each a multiple of 16 columns wide so that
// no load straddles two; a part not given starts past C.
template <typename T, int kParts = 1>
struct PlainSource {
  using Input = T;
  static constexpr int kOutputs = 1;
  static constexpr bool kDbias = true;
  // 40 registers with the dbias sums; without them any bound spills (54 registers: 4 blocks;
  // in kMaxParts parts 40 and 64, no spills).
  static constexpr int blocks_per_sm(bool dbias) { return dbias ? 6 : 1; }
  const T* x[kParts];
  int64_t cols[kParts];
  int64_t start[kParts];  // start[0] = 0, unread
  struct Raw {
    Raw16<T> x;
  };
  __device__ __forceinline__ Raw load(int64_t r, int64_t c) const {
    const T* p = x[0];
    int64_t w = cols[0], c0 = 0;
#pragma unroll
    for (int i = 1; i < kParts; ++i)
      if (c >= start[i]) p = x[i], w = cols[i], c0 = start[i];
    return {load_raw16(p + r * w + (c - c0))};
  }
  __device__ __forceinline__ void values(const Raw& raw, float (&f)[1][kElemsPerThread]) const {
    unpack16(raw.x, f[0]);
  }
};

// act(y), y [R, C]; kGated: act(gate) * up, y = [gate | up] [R, 2C].
template <typename T, bool kGated>
struct ActivationSource {
  using Input = T;
  static constexpr int kOutputs = 1;
  static constexpr bool kDbias = false;
  static constexpr int blocks_per_sm(bool) { return kGated ? 4 : 6; }  // 64 / 40 registers
  const T* y;
  int64_t cols;  // C
  ActivationId act;
  struct Raw {
    Raw16<T> a, b;  // b: up, when gated
  };
  __device__ __forceinline__ Raw load(int64_t r, int64_t c) const {
    Raw raw = {};
    const T* row = y + r * (kGated ? 2 * cols : cols);
    raw.a = load_raw16(row + c);
    if constexpr (kGated) raw.b = load_raw16(row + cols + c);
    return raw;
  }
  __device__ __forceinline__ void values(const Raw& raw, float (&f)[1][kElemsPerThread]) const {
    unpack16(raw.a, f[0]);
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) f[0][k] = activation(act, f[0][k]);
    if constexpr (kGated) {
      float b[kElemsPerThread];
      unpack16(raw.b, b);
#pragma unroll
      for (int k = 0; k < kElemsPerThread; ++k) f[0][k] *= b[k];
    }
  }
};

// The gradient through the activation, from dh [R, C] and the pre-activation y [R, C]:
// dh * act'(y).
template <typename T>
struct ActivationGradSource {
  using Input = T;
  static constexpr int kOutputs = 1;
  static constexpr bool kDbias = true;
  // 48 / 64 registers; with the dbias sums f16 inputs spill 40 bytes a thread (bf16 none),
  // and without them a bound of 5 spills 48.
  static constexpr int blocks_per_sm(bool dbias) { return dbias ? 5 : 4; }
  const T* dh;
  const T* y;
  int64_t cols;
  ActivationId act;
  struct Raw {
    Raw16<T> dh, y;
  };
  __device__ __forceinline__ Raw load(int64_t r, int64_t c) const {
    return {load_raw16(dh + r * cols + c), load_raw16(y + r * cols + c)};
  }
  __device__ __forceinline__ void values(const Raw& raw, float (&f)[1][kElemsPerThread]) const {
    float d[kElemsPerThread], a[kElemsPerThread];
    unpack16(raw.dh, d);
    unpack16(raw.y, a);
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) f[0][k] = d[k] * activation_grad(act, a[k]);
  }
};

// The gradient through a gated activation, from dh [R, C] and y = [gate | up] [R, 2C]: the two
// outputs [dgate | dup] = [dh * up * act'(gate) | dh * act(gate)], from one read of each input.
template <typename T>
struct GatedActivationGradSource {
  using Input = T;
  static constexpr int kOutputs = 2;
  static constexpr bool kDbias = true;
  // 80 registers; ptxas spills up to 40 bytes a thread (about 100 unbounded: two blocks).
  static constexpr int blocks_per_sm(bool) { return 3; }
  const T* dh;
  const T* y;
  int64_t cols;  // C
  ActivationId act;
  struct Raw {
    Raw16<T> dh, gate, up;
  };
  __device__ __forceinline__ Raw load(int64_t r, int64_t c) const {
    const T* row = y + r * 2 * cols;
    return {load_raw16(dh + r * cols + c), load_raw16(row + c), load_raw16(row + cols + c)};
  }
  __device__ __forceinline__ void values(const Raw& raw, float (&f)[2][kElemsPerThread]) const {
    float d[kElemsPerThread], g[kElemsPerThread], u[kElemsPerThread];
    unpack16(raw.dh, d);
    unpack16(raw.gate, g);
    unpack16(raw.up, u);
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) {
      f[0][k] = d[k] * u[k] * activation_grad(act, g[k]);
      f[1][k] = d[k] * activation(act, g[k]);
    }
  }
};

// A norm of x [R, C] (csrc/norm.h) from its row statistics stats [R, S] and affine [S, C]
// (S = 1: rsigma and gamma; centered, LayerNorm, S = 2: mu, rsigma and gamma, beta). gamma and
// beta are read when the values are made (they stay in L1: every row tile reads the same
// ones); an all-zero Raw has no affine row and gives zeros.
template <typename T>
struct NormSource {
  using Input = T;
  static constexpr int kOutputs = 1;
  static constexpr bool kDbias = false;
  static constexpr int blocks_per_sm(bool) { return 3; }  // 80 registers
  const T* x;
  const float* stats;
  const float* affine;
  int64_t cols;
  bool centered;
  struct Raw {
    Raw16<T> x;
    float mu, rsigma;
    const float* gamma;  // affine + c; beta at gamma + cols
  };
  __device__ __forceinline__ Raw load(int64_t r, int64_t c) const {
    const float* s = stats + r * (centered ? 2 : 1);
    return {load_raw16(x + r * cols + c), centered ? s[0] : 0.0f, s[centered ? 1 : 0],
            affine + c};
  }
  __device__ __forceinline__ void values(const Raw& raw, float (&f)[1][kElemsPerThread]) const {
    if (raw.gamma == nullptr) {
#pragma unroll
      for (int k = 0; k < kElemsPerThread; ++k) f[0][k] = 0.0f;
      return;
    }
    float v[kElemsPerThread];
    unpack16(raw.x, v);
#pragma unroll
    for (int k = 0; k < kElemsPerThread; k += 4) {
      // Plain loads: affine comes from the XLA op before this kernel (no __ldg under PDL).
      const float4 g = *reinterpret_cast<const float4*>(raw.gamma + k);
      const float4 b = centered ? *reinterpret_cast<const float4*>(raw.gamma + cols + k)
                                : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      f[0][k] = norm_value(v[k], raw.mu, raw.rsigma, g.x, b.x, centered);
      f[0][k + 1] = norm_value(v[k + 1], raw.mu, raw.rsigma, g.y, b.y, centered);
      f[0][k + 2] = norm_value(v[k + 2], raw.mu, raw.rsigma, g.z, b.z, centered);
      f[0][k + 3] = norm_value(v[k + 3], raw.mu, raw.rsigma, g.w, b.w, centered);
    }
  }
};

}  // namespace jax_fp8
