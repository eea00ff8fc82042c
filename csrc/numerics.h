// Numerics shared by the CPU handlers and the CUDA kernels, so both produce the same bits.
//
// Conventions (see jax_fp8/formats.py and jax_fp8/state.py): `scale` is the dequantization step, x ~= q * scale,
// q = saturate(round_nearest_even(x * (1 / scale))). Casts saturate to the format's largest
// finite value (+-inf -> +-max); NaN maps to the canonical NaN 0x7F of either format.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "constants.h"

#if defined(__CUDACC__)
#define JF8_HD __host__ __device__ __forceinline__
#define JF8_UNROLL _Pragma("unroll")  // fixed-trip loops over register arrays, unrolled on the device
#include <cuda_fp8.h>
#else
#define JF8_HD inline
#define JF8_UNROLL
#endif

namespace jax_fp8 {

enum class Fp8Format : int { kE4M3 = 0, kE5M2 = 1 };

// Largest finite value: e4m3fn 448 (no inf), e5m2 57344.
JF8_HD float fp8_max(Fp8Format f) { return f == Fp8Format::kE4M3 ? 448.0f : 57344.0f; }

JF8_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
#endif
}

JF8_HD float bits_float(uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(b);
#else
  float x;
  std::memcpy(&x, &b, 4);
  return x;
#endif
}

// f32 subnormals count as zero on every backend (XLA's CPU runtime flushes them; the GPU does
// not), for inputs and scales alike, so all backends see the same values. Sign and NaN kept.
JF8_HD float flush_subnormal(float x) { return fabsf(x) < FLT_MIN ? copysignf(0.0f, x) : x; }

// f32 arithmetic as XLA's CPU runtime does it: each operation rounded to nearest on its own
// (never contracted into a fused multiply-add), subnormal operands and results flushed to
// sign-preserving zero. On the device each is one PTX instruction (mul / add / div .rn.ftz);
// the CPU module is built with -ffp-contract=off.
JF8_HD float mul_flushed(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return flush_subnormal(flush_subnormal(a) * flush_subnormal(b));
#endif
}

JF8_HD float add_flushed(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return flush_subnormal(flush_subnormal(a) + flush_subnormal(b));
#endif
}

JF8_HD float div_flushed(float a, float b) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("div.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return flush_subnormal(flush_subnormal(a) / flush_subnormal(b));
#endif
}

// |x| as ordered bits: unsigned comparison of these orders finite values, then +inf, then NaN,
// so a max over them is a NaN-propagating amax (as jnp.max(jnp.abs(x)) is).
JF8_HD uint32_t abs_bits(float x) { return float_bits(x) & 0x7FFFFFFFu; }

// IEEE half -> f32, exact (host side; device code uses __half2float).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (man << 13));  // inf / NaN
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (man << 13));
  const float mag = std::ldexp(static_cast<float>(man), -24);  // zero or subnormal
  return sign ? -mag : mag;
}

// Host conversion f32 -> fp8 with round-to-nearest-even and saturation, written out bit by bit
// so it matches the hardware's cvt.rn.satfinite (checked byte for byte by the tests).
inline uint8_t float_to_fp8_host(float x, Fp8Format f) {
  const int mbits = f == Fp8Format::kE4M3 ? 3 : 2;
  const int bias = f == Fp8Format::kE4M3 ? 7 : 15;
  const uint8_t max_bits = f == Fp8Format::kE4M3 ? 0x7E : 0x7B;
  const uint32_t b = float_bits(x);
  const uint8_t sign = static_cast<uint8_t>((b >> 24) & 0x80u);
  if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7F;  // canonical NaN
  const float a = bits_float(b & 0x7FFFFFFFu);
  if (a >= fp8_max(f)) return sign | max_bits;  // saturate, inf included
  const float min_normal = std::ldexp(1.0f, 1 - bias);
  if (a < min_normal) {
    // Subnormal (or zero): count steps of 2^(1 - bias - mbits); the scaling by a power of
    // two is exact and nearbyint rounds half to even. A count of 2^mbits is the smallest
    // normal, whose encoding is that same integer.
    const float steps = std::nearbyint(std::ldexp(a, bias - 1 + mbits));
    return sign | static_cast<uint8_t>(steps);
  }
  // Normal: round the f32 mantissa to mbits, half to even; a carry moves into the exponent.
  const int shift = 23 - mbits;
  uint32_t ab = b & 0x7FFFFFFFu;
  ab += ((1u << (shift - 1)) - 1u) + ((ab >> shift) & 1u);
  const uint32_t r = (ab >> shift) - (static_cast<uint32_t>(127 - bias) << mbits);
  return sign | static_cast<uint8_t>(r > max_bits ? max_bits : r);
}

JF8_HD uint8_t float_to_fp8(float x, Fp8Format f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, f == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2);
#elif defined(__CUDA_ARCH__)
  static_assert(__CUDA_ARCH__ >= 890, "jax_fp8 kernels need sm_89 or newer");
  return 0;
#else
  return float_to_fp8_host(x, f);
#endif
}

// Scale (dequantization step) that maps `amax` onto the format's largest value with 2^margin
// of headroom: amax * f32(2^margin / fmt_max) (one rounding), clamped to [FLT_MIN, FLT_MAX] so
// that it and its reciprocal stay finite and positive. An amax that is 0, below FLT_MIN (an f32
// subnormal: XLA's CPU runtime flushes those to zero, so they count as zero everywhere) or not
// finite carries no information: the previous scale is kept. Mirrors
// jax_fp8.state.scale_from_amax.
JF8_HD bool informative(float amax) { return amax >= FLT_MIN && amax <= FLT_MAX; }

JF8_HD float scale_from_amax(float amax, float prev_scale, Fp8Format f, int margin) {
  if (!informative(amax)) return prev_scale;
  const float factor = static_cast<float>(ldexp(1.0, margin) / static_cast<double>(fp8_max(f)));
  return fminf(fmaxf(amax * factor, FLT_MIN), FLT_MAX);
}

// Scale used by a delayed-scaling quantize this step: the ring's scale, except on the ring's
// first step (no history yet), where the current amax gives it (current scaling).
JF8_HD float ring_scale_for_step(float ring_scale, float steps, float current_amax, Fp8Format f,
                                 int margin) {
  return steps == 0.0f ? scale_from_amax(current_amax, ring_scale, f, margin) : ring_scale;
}

// Block scaling (DeepSeek-V3 recipe; jax_fp8.reference.group_scale): the scale of one group
// or block is max(amax, eps) * f32(1 / fmt_max). With ue8m0 it is rounded up to a power of two
// straight from the f32 bits (a nonzero mantissa carries into the exponent). A NaN amax gives
// a NaN scale and an infinite one an infinite scale, so a group holding NaN or inf
// dequantizes to NaN: visible, never silently finite. eps >= fmt_max * FLT_MIN (checked at
// trace time) keeps every finite scale normal, so its reciprocal is finite.
JF8_HD float group_scale(float amax, float eps, Fp8Format f, bool ue8m0) {
  const float a = (amax >= eps || amax != amax) ? amax : eps;
  const float s = a * (1.0f / fp8_max(f));
  if (!ue8m0 || !(s <= FLT_MAX)) return s;
  const uint32_t b = float_bits(s);
  return bits_float((b + 0x007FFFFFu) & 0xFF800000u);
}

// The top power-of-two scale a finite amax gets, 2^(128 - emax) (e4m3 2^120, e5m2 2^113: MXFP8's
// E8M0 byte mx.h e8m0_top, block scaling's ue8m0 group_scale of an amax above 1.75 * 2^127),
// would dequantize an element rounded up to 2^emax to 2^128, an f32 infinity. Its elements
// saturate at the largest FP8 value below 2^emax times that scale (e4m3 240 * 2^120 = 1.875 *
// 2^127, e5m2 28672 * 2^113 = 1.75 * 2^127), as the MX spec saturates values beyond the element
// format's range, so every finite input stays finite once dequantized. Only a finite element
// beyond the limit changes, and such an element puts every group holding it at the top scale:
// applied to every element of power-of-two-scaled groups, the rule needs no look at the scale.
// NaN and infinities are kept (their groups' scales are NaN or infinite).
JF8_HD float top_scale_saturate(float x, Fp8Format f) {
  const float limit = bits_float(f == Fp8Format::kE4M3 ? 0x7F700000u : 0x7F600000u);
  return (x > limit && x <= FLT_MAX) ? limit : (x < -limit && x >= -FLT_MAX) ? -limit : x;
}

// Where the scale of group g of row r lands in a group quantize's scales (csrc/constants.h
// ScaleLayoutId): scales[r * row_stride + g * group_stride], in a grid of padded_rows rows.
struct ScaleLayout {
  int64_t row_stride;    // row: groups; col / col_tma: 1
  int64_t group_stride;  // row: 1; col: rows; col_tma: rows rounded up to 4
  int64_t padded_rows;   // rows of the stored grid (col_tma pads with zero scales)
};

// A delayed-scaling quantize's ring (jax_fp8.state.ScaleRing), read from its inputs, and the
// separate outputs it writes: the ring after this step and the scale it quantized with.
struct RingArgs {
  const float* history;  // [len], newest first
  const float* scale;    // []
  const float* steps;    // []
  float* scale_used;     // []
  float* history_out;    // [len]
  float* scale_out;      // []
  float* steps_out;      // []
  int len;
  int margin;
  AmaxAlgo algo;
  bool observe;  // write this step's observation of the ring instead of the next ring
};

// The ring rules, written once for the CPU handlers and the CUDA epilogues (jnp's twins:
// jax_fp8.state.observe and advance).
//  - observe(ring, amax): the history shifted by one with ring_front(amax) in front, scale 0,
//    steps + 1.
//  - advance(ring, observation with front f): a non-finite f leaves the ring as it was;
//    otherwise the history is shifted with f in front, the window (the shifted history's max,
//    or f for most_recent) gives the next scale, and the step counts if the window was
//    informative (so a ring that has seen only zeros stays on current scaling).
// Without `observe` the ring written is the next ring, advance(ring, observe(ring, amax)): a
// NaN or inf amax leaves it unchanged.

// The front entry an amax is recorded as: NaN and inf become +inf.
JF8_HD float ring_front(float amax) { return amax <= FLT_MAX ? amax : INFINITY; }

// Whether the ring stays as it was this step: advanced by a non-finite front.
JF8_HD bool ring_unchanged(const RingArgs& ring, float front) {
  return !ring.observe && !(front <= FLT_MAX);
}

// Writes entries i = first, first + stride, ... of the history after this step and returns the
// max of the shifted history over them as bits (entries are >= 0, so bits order as values;
// NaN-propagating, as jnp.max). One thread: first 0, stride 1; a CUDA block: its threads.
JF8_HD uint32_t ring_write_history(const RingArgs& ring, float front, int first, int stride) {
  const bool unchanged = ring_unchanged(ring, front);
  uint32_t m = 0;
  for (int i = first; i < ring.len; i += stride) {
    const float shifted = i == 0 ? front : ring.history[i - 1];
    m = float_bits(shifted) > m ? float_bits(shifted) : m;
    ring.history_out[i] = unchanged ? ring.history[i] : shifted;
  }
  return m;
}

// Writes the scale and steps after this step, from the shifted history's max (all threads'
// ring_write_history results combined).
JF8_HD void ring_write_scalars(const RingArgs& ring, float front, uint32_t shifted_max_bits,
                               Fp8Format f) {
  const float scale = *ring.scale, steps = *ring.steps;
  if (ring.observe) {
    *ring.scale_out = 0.0f;
    *ring.steps_out = steps + 1.0f;
  } else if (ring_unchanged(ring, front)) {
    *ring.scale_out = scale;
    *ring.steps_out = steps;
  } else {
    const float window = ring.algo == AmaxAlgo::kMostRecent ? front : bits_float(shifted_max_bits);
    *ring.scale_out = scale_from_amax(window, scale, f, ring.margin);
    *ring.steps_out = informative(window) ? steps + 1.0f : steps;
  }
}

// The whole ring after this step, on one thread (the CPU handlers).
inline void ring_write_serial(const RingArgs& ring, float amax, Fp8Format f) {
  const float front = ring_front(amax);
  ring_write_scalars(ring, front, ring_write_history(ring, front, 0, 1), f);
}

}  // namespace jax_fp8
