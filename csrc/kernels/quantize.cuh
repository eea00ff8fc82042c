// CUDA kernels for per-tensor FP8 quantization with a fused amax, and the delayed-scaling
// variant whose last block writes the scale ring's outputs (the next ring, or this step's
// observation of it: numerics.h) with no extra launch. Device code only: no XLA or nanobind
// includes. Launched by csrc/ffi/quantize_cuda.cu.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../numerics.h"

namespace jax_fp8 {

constexpr int kQuantizeThreads = 256;
constexpr int kElemsPerThread = 16;  // 16 fp8 bytes out per thread: one 16-byte store
static_assert(kElemsPerThread == kColMultiple, "csrc/constants.h kColMultiple");

// Scratch words, zeroed by a memset on the stream before the launches.
struct QuantizeScratch {
  unsigned amax_bits;        // amax of this pass, as abs_bits
  unsigned first_amax_bits;  // amax from the pre-pass on a ring's first step
  unsigned blocks_done;      // last-block detection
};
static_assert(sizeof(QuantizeScratch) == kQuantizeScratchWords * sizeof(unsigned),
              "csrc/constants.h kQuantizeScratchWords");

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaGridDependencySynchronize();
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  cudaTriggerProgrammaticLaunchCompletion();
#endif
}

// Inputs as f32, subnormals flushed (numerics.h).
__device__ __forceinline__ float to_float(float v) { return flush_subnormal(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) {
  return flush_subnormal(__bfloat162float(v));
}
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }  // never subnormal

// Block-wide max of ordered bits; the result is valid in thread 0.
__device__ __forceinline__ unsigned block_max(unsigned v) {
  __shared__ unsigned warp_max[kQuantizeThreads / 32];
  for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = v;
  __syncthreads();
  if (threadIdx.x < 32) {
    v = threadIdx.x < kQuantizeThreads / 32 ? warp_max[threadIdx.x] : 0u;
    for (int o = 16; o; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  }
  return v;
}

// 16 consecutive elements of T as raw 16-byte vectors: loaded now, converted later, so a
// kernel can have the next loads in flight while it works on the current ones.
template <typename T>
struct Raw16 {
  static constexpr int kVecs = kElemsPerThread * sizeof(T) / 16;
  uint4 v[kVecs];
};

// The caller guarantees a 16-element-aligned, in-bounds start.
template <typename T>
__device__ __forceinline__ Raw16<T> load_raw16(const T* p) {
  Raw16<T> r;
  const uint4* src = reinterpret_cast<const uint4*>(p);
#pragma unroll
  for (int j = 0; j < Raw16<T>::kVecs; ++j) r.v[j] = src[j];
  return r;
}

// kFlush false: subnormals kept, for a kernel whose every use of a value flushes it anyway
// (the .ftz arithmetic of numerics.h, maxima of abs_bits that end in one). bf16 widens by its
// bits: a word's low element shifted up, its high one masked (one instruction each, where the
// conversion took two for the high one).
template <typename T, bool kFlush = true>
__device__ __forceinline__ void unpack16(const Raw16<T>& r, float (&v)[kElemsPerThread]) {
  constexpr int kPerVec = 16 / sizeof(T);
#pragma unroll
  for (int j = 0; j < Raw16<T>::kVecs; ++j) {
    const T* e = reinterpret_cast<const T*>(&r.v[j]);
    const uint32_t* w = reinterpret_cast<const uint32_t*>(&r.v[j]);
#pragma unroll
    for (int k = 0; k < kPerVec; ++k) {
      float f;
      if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        f = __uint_as_float(k % 2 ? w[k / 2] & 0xFFFF0000u : w[k / 2] << 16);
        if (kFlush) f = flush_subnormal(f);
      } else {
        f = kFlush ? to_float(e[k]) : static_cast<float>(e[k]);
      }
      v[j * kPerVec + k] = f;
    }
  }
}

// 16 values times inv as 16 FP8 bytes (element k in byte k), two a conversion instruction
// (cvt.rn.satfinite.{e4m3,e5m2}x2.f32, as float_to_fp8 one at a time), the format chosen once.
// The products flush subnormals (mul_flushed), as the CPU handlers' do: a subnormal value (it
// may come unflushed) gives +-0, as once flushed; so does a subnormal inv (a scale above 2^126);
// a subnormal product gives +-0 either way, far below either format's smallest subnormal.
template <__nv_fp8_interpretation_t kFmt>
__device__ __forceinline__ uint4 quantize16_as(const float (&f)[kElemsPerThread], float inv) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(
        make_float2(mul_flushed(f[4 * i], inv), mul_flushed(f[4 * i + 1], inv)), __NV_SATFINITE,
        kFmt);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(
        make_float2(mul_flushed(f[4 * i + 2], inv), mul_flushed(f[4 * i + 3], inv)),
        __NV_SATFINITE, kFmt);
    w[i] = lo | hi << 16;
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ uint4 quantize16(const float (&f)[kElemsPerThread], float inv,
                                            Fp8Format fmt) {
  return fmt == Fp8Format::kE4M3 ? quantize16_as<__NV_E4M3>(f, inv)
                                 : quantize16_as<__NV_E5M2>(f, inv);
}

// Loads 16 consecutive elements as f32 with 16-byte vector loads (same guarantee).
template <typename T, bool kFlush = true>
__device__ __forceinline__ void load16(const T* p, float (&v)[kElemsPerThread]) {
  unpack16<T, kFlush>(load_raw16(p), v);
}

// A first-step pre-pass's end: this thread's amax `m` (abs_bits) joins the grid's.
__device__ __forceinline__ void add_first_amax(unsigned m, QuantizeScratch* scratch) {
  m = block_max(m);
  if (threadIdx.x == 0) atomicMax(&scratch->first_amax_bits, m);
}

// Amax over x when the ring is on its first step; otherwise every block returns at once.
template <typename T>
__global__ void __launch_bounds__(kQuantizeThreads)
    first_step_amax_kernel(const T* x, size_t n, const float* steps,
                           QuantizeScratch* scratch) {
  pdl_wait();
  if (*steps != 0.0f) {
    pdl_trigger();
    return;
  }
  unsigned m = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    m = max(m, abs_bits(to_float(x[i])));
  add_first_amax(m, scratch);
  pdl_trigger();
}

// The last block of a ring quantize writes the ring after this step (numerics.h's ring rules,
// the shifted history's max reduced over the block).
__device__ inline void ring_write_block(const RingArgs& ring, float amax, Fp8Format fmt) {
  const float front = ring_front(amax);
  const unsigned m = block_max(ring_write_history(ring, front, threadIdx.x, blockDim.x));
  if (threadIdx.x == 0) ring_write_scalars(ring, front, m, fmt);
}

// A quantize's end: this thread's amax `m` (abs_bits) joins the grid's, and the last block to
// finish writes the amax and, with a ring, the ring's outputs. Every thread of the block calls
// it, once per kernel (its is_last is one byte of the kernel's shared memory).
template <bool kRing>
__device__ __forceinline__ void finish_amax(unsigned m, QuantizeScratch* scratch,
                                            float* amax_out, const RingArgs& ring,
                                            Fp8Format fmt) {
  m = block_max(m);
  __shared__ bool is_last;
  if (threadIdx.x == 0) {
    atomicMax(&scratch->amax_bits, m);
    __threadfence();
    is_last = atomicAdd(&scratch->blocks_done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (is_last) {
    __threadfence();
    const float amax = bits_float(atomicMax(&scratch->amax_bits, 0u));
    if (threadIdx.x == 0) *amax_out = amax;
    if constexpr (kRing) ring_write_block(ring, amax, fmt);
  }
}

// The ring's scale this step (or, on its first step, the scale from the pre-pass amax); one
// thread records it as scale_used.
__device__ __forceinline__ float ring_scale(const RingArgs& ring, const QuantizeScratch* scratch,
                                            Fp8Format fmt) {
  const float scale = ring_scale_for_step(*ring.scale, *ring.steps,
                                          bits_float(scratch->first_amax_bits), fmt, ring.margin);
  if (blockIdx.x == 0 && threadIdx.x == 0) *ring.scale_used = scale;
  return scale;
}

// q = saturate(rne(x / scale)) with amax fused. Without a ring, `scale_in` is the scale. With
// a ring, the scale is ring_scale's, and the last block to finish writes the ring outputs.
template <typename T, bool kRing>
__global__ void __launch_bounds__(kQuantizeThreads)
    quantize_kernel(const T* x, size_t n, const float* scale_in, Fp8Format fmt,
                    uint8_t* __restrict__ q, float* amax_out, QuantizeScratch* scratch,
                    RingArgs ring) {
  pdl_wait();
  const float scale = kRing ? ring_scale(ring, scratch, fmt) : *scale_in;
  const float inv = 1.0f / flush_subnormal(scale);
  unsigned m = 0;
  const size_t n_vec = n / kElemsPerThread;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t v = blockIdx.x * size_t(blockDim.x) + threadIdx.x; v < n_vec; v += stride) {
    float f[kElemsPerThread];
    load16(x + v * kElemsPerThread, f);
#pragma unroll
    for (int k = 0; k < kElemsPerThread; ++k) m = max(m, abs_bits(f[k]));
    reinterpret_cast<uint4*>(q)[v] = quantize16(f, inv, fmt);
  }
  for (size_t i = n_vec * kElemsPerThread + blockIdx.x * size_t(blockDim.x) + threadIdx.x;
       i < n; i += stride) {
    const float f = to_float(x[i]);
    m = max(m, abs_bits(f));
    q[i] = float_to_fp8(mul_flushed(f, inv), fmt);
  }
  finish_amax<kRing>(m, scratch, amax_out, ring, fmt);
  pdl_trigger();
}

}  // namespace jax_fp8
