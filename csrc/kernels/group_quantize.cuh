// Per-token-group FP8 quantization: groups of G consecutive elements along the last axis, one
// scale per group. Block scaling's groups (DeepSeek-V3 / vLLM): f32 scales (numerics.h
// group_scale), q = x * (1 / scale); MXFP8's rowwise blocks: E8M0 bytes (mx.h), q = x * 2^-k.
// Launched with Programmatic Dependent Launch (launch.h): the kernel waits on the upstream
// grid before its first load and lets the downstream grid launch once its stores are issued.
// Device code only; launched by csrc/ffi/group_quantize_cuda.cu.
#pragma once

#include "../mx.h"
#include "quantize.cuh"

namespace jax_fp8 {

// How a group's amax becomes the scale it stores and the factor its elements are multiplied by.
struct F32GroupScale {
  using Stored = float;
  float eps;
  bool ue8m0;
  __device__ float stored(float amax, Fp8Format fmt) const {
    return group_scale(amax, eps, fmt, ue8m0);
  }
  // = 1.0f / scale, correctly rounded, as on the CPU
  __device__ float factor(float scale) const { return __frcp_rn(scale); }
  // UE8M0 scales: the top scale's elements saturate (numerics.h top_scale_saturate).
  __device__ void saturate(float (&f)[kElemsPerThread], float, Fp8Format fmt) const {
    if (!ue8m0) return;
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) f[k] = top_scale_saturate(f[k], fmt);
  }
};

struct E8M0GroupScale {
  using Stored = uint8_t;
  __device__ uint8_t stored(float amax, Fp8Format fmt) const { return e8m0_rceil(amax, fmt); }
  __device__ float factor(uint8_t scale) const { return e8m0_inverse(scale); }
  // The top scale's elements saturate below 2^emax (mx.h e8m0_saturate); a rare branch.
  __device__ void saturate(float (&f)[kElemsPerThread], uint8_t scale, Fp8Format fmt) const {
    if (scale != e8m0_top(fmt)) return;
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) f[k] = e8m0_saturate(f[k], scale, fmt);
  }
};

// One thread quantizes 16 consecutive elements; G / 16 adjacent lanes hold one group and
// reduce its amax with shuffles. Loops run per warp so every lane reaches the shuffles.
template <typename T, int G, typename Scale>
__global__ void __launch_bounds__(kQuantizeThreads, 5)
    group_quantize_kernel(const T* x, int64_t rows, int64_t cols, Scale rule, Fp8Format fmt,
                          uint8_t* __restrict__ q, typename Scale::Stored* __restrict__ scales,
                          ScaleLayout layout) {
  static_assert(G % kElemsPerThread == 0 && G / kElemsPerThread <= 32, "G in [16, 512]");
  constexpr int kLanes = G / kElemsPerThread;
  pdl_wait();
  const int64_t n_vec = rows * cols / kElemsPerThread;
  const int64_t groups = cols / G;
  const int lane = threadIdx.x & 31;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t v0 = int64_t(blockIdx.x) * blockDim.x + (threadIdx.x & ~31); v0 < n_vec;
       v0 += stride) {
    const int64_t v = v0 + lane;
    const bool in = v < n_vec;
    float f[kElemsPerThread];
    unsigned m = 0;
    if (in) {
      load16(x + v * kElemsPerThread, f);
#pragma unroll
      for (int k = 0; k < kElemsPerThread; ++k) m = max(m, abs_bits(f[k]));
    }
#pragma unroll
    for (int o = kLanes / 2; o; o >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (!in) continue;
    // abs_bits order puts NaN above inf above finite values, so this is a NaN-propagating amax.
    const typename Scale::Stored scale = rule.stored(bits_float(m), fmt);
    rule.saturate(f, scale, fmt);
    reinterpret_cast<uint4*>(q)[v] = quantize16(f, rule.factor(scale), fmt);
    if (lane % kLanes == 0) {
      const int64_t e = v * kElemsPerThread, row = e / cols, g = (e % cols) / G;
      scales[row * layout.row_stride + g * layout.group_stride] = scale;
    }
  }
  // col_tma: zero the padding rows of the stored grid, so no element is left unwritten.
  const int64_t pad = layout.padded_rows - rows;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < pad * groups; i += stride)
    scales[(i / pad) * layout.group_stride + rows + i % pad] = typename Scale::Stored(0);
  pdl_trigger();
}

}  // namespace jax_fp8
