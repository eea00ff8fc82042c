// NVFP4 (NVIDIA's NVFP4 pretraining report, arXiv 2509.25149): E2M1 elements (+-{0, 0.5, 1,
// 1.5, 2, 3, 4, 6}), one E4M3 scale per kNvfp4Block consecutive elements (or per 16 x 16 tile),
// one f32 global scale. With a block's (or tile's) amax a and the global scale g:
//   scale = e4m3(a * (f32(1/6) / g)), step = scale * g, element = e2m1(x * (1 / step)) (0
//   where step <= 0),
// each operation rounded on its own and flushed as XLA's CPU runtime does (numerics.h), the
// E2M1 value rounded to nearest even (e2m1_magnitude_biased) or stochastically
// (e2m1_magnitude_stochastic_biased, 16 Philox bits per element: sr_bits_of_block). Optionally
// each 16-element group first goes through the random Hadamard transform (hadamard16). Shared
// by the CPU handler and the CUDA kernel; the jnp twins: jax_fp8.formats.nvfp4_global_scale,
// jax_fp8.stochastic_rounding (sr_bits, e2m1_round_stochastic), jax_fp8.hadamard
// (hadamard_transform) and jax_fp8.reference.nvfp4_quantize.
#pragma once

#include "philox.h"

namespace jax_fp8 {

constexpr float kE2M1Max = 6.0f;
constexpr float kInvE2M1Max = 1.0f / kE2M1Max;  // formats.INV_E2M1_MAX

// E4M3 byte -> f32 (exact; 0x7F / 0xFF are NaN); on the device the conversion instructions
// to f16 and on to f32.
JF8_HD float e4m3_to_float(uint8_t b) {
#if defined(__CUDA_ARCH__)
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(b, __NV_E4M3)));
#else
  const uint32_t sign = uint32_t(b & 0x80u) << 24, e = (b >> 3) & 0xFu, m = b & 0x7u;
  if (e == 0xFu && m == 0x7u) return bits_float(0x7FC00000u);
  const float mag = e ? bits_float(((e + 120u) << 23) | (m << 20)) : float(m) * (1.0f / 512.0f);
  return bits_float(float_bits(mag) | sign);
#endif
}

// The magnitude functions below return a code plus kE2M1CodeBias (2^22's exponent field, 149,
// times two), which nvfp4_block_codes takes off once per 8 codes.
constexpr uint32_t kE2M1CodeBias = 298;

// The 3-bit E2M1 magnitude code of a in [0, 6], rounded to nearest, ties to the even code.
// E2M1's spacing is 0.5 below 2, 1 below 4 and 2 above, f32's ulp at 2^22, 2^23 and 2^24 (2^22
// times a's power of two, at least 1: integer operations on a's exponent field): adding that
// power of two rounds a to a multiple k of its spacing (ties to even k, the even code), and the
// sum's bits hold k in the mantissa and 2^22+e in the exponent; the code is k + 2e.
JF8_HD uint32_t e2m1_magnitude_biased(float a) {
  const uint32_t e = float_bits(a) & 0x7F800000u, one = 0x3F800000u;
  const uint32_t t = float_bits(a + bits_float((e < one ? one : e) + (22u << 23)));
  return (t & 0xFu) + (t >> 22);
}

// The 3-bit E2M1 magnitude code of a in [0, 6] (zero or normal: a flushed product) rounded
// stochastically, stochastic_rounding.e2m1_round_stochastic's rule: with q = a / gap and
// k = floor(q), up from the code of k * gap exactly when bits16 < (q - k) * 2^16, i.e. when
// a > (k + bits16 * 2^-16) * gap. Every value below is exact in f32 (bits16 as an f32 through
// its bits, without a conversion instruction).
// On the host: q by a power of two, k by floorf, the code k + up + 2e for the spacing 2^(e-1),
// k read from the bits of k + 2^23.
// On the device, fewer instructions (the add's rounding mode is an instruction's modifier
// there): as in e2m1_magnitude_biased with p = gap * 2^23, t = a + p rounded toward zero is p +
// k * gap, whose bits give the code as there, and the threshold is one fma: (2^23 + bits16) *
// (gap * 2^-16) + (t - p * (1 + 2^-16)), the last term gap * (k - 128) by Sterbenz's lemma.
JF8_HD uint32_t e2m1_magnitude_stochastic_biased(float a, uint32_t bits16) {
  const float bits_2p23 = bits_float(0x4B000000u | bits16);  // 2^23 + bits16
#if defined(__CUDA_ARCH__)
  const uint32_t e = float_bits(a) & 0x7F800000u, one = 0x3F800000u;
  const uint32_t p = (e < one ? one : e) + (22u << 23);
  const float t = __fadd_rz(a, bits_float(p));
  const float threshold =
      fmaf(bits_2p23, bits_float(p - (39u << 23)), t - bits_float(p + (1u << 7)));
  return (float_bits(t) & 0xFu) + (float_bits(t) >> 22) + (a > threshold);
#else
  const uint32_t e = a < 2.0f ? 0u : a < 4.0f ? 1u : 2u;
  const float q = a * (a < 2.0f ? 2.0f : a < 4.0f ? 1.0f : 0.5f), k = floorf(q);
  const bool up = bits_2p23 - 0x1p23f < (q - k) * 65536.0f;
  return (float_bits(k + 0x1p23f) & 0xFu) + up + (2u * e + kE2M1CodeBias);
#endif
}

// The 16 stochastic-rounding bits of element i (< 16) of block b of row r in direction d
// (stochastic_rounding.sr_bits): words w0..w7 of Philox under the key with counters
// (b, r, d, 0) and (b, r, d, 1); element i takes (w[i / 2] >> 16 (i % 2)) & 0xFFFF.
struct SrBlockBits {
  uint32_t w[8];
  JF8_HD uint32_t bits(int i) const { return (w[i / 2] >> (16 * (i % 2))) & 0xFFFFu; }
};

JF8_HD SrBlockBits sr_bits_of_block(uint32_t k0, uint32_t k1, uint32_t b, uint32_t r, uint32_t d) {
  SrBlockBits s;
  uint32_t lo[4], hi[4];
  philox4x32_10({b, r, d, 0u}, k0, k1, lo);
  philox4x32_10({b, r, d, 1u}, k0, k1, hi);
  JF8_UNROLL
  for (int i = 0; i < 4; ++i) s.w[i] = lo[i], s.w[4 + i] = hi[i];
  return s;
}

// The Walsh-Hadamard butterfly's stages from distance kH on: each pair (a, b) at distance kH
// becomes (a + b, a - b). The distance is a template argument, so that every index is a
// constant and v stays in registers.
template <int kH>
JF8_HD void hadamard16_stages(float (&v)[kNvfp4Block]) {
  JF8_UNROLL
  for (int j = 0; j < kNvfp4Block; j += 2 * kH)
    JF8_UNROLL
    for (int t = j; t < j + kH; ++t) {
      const float a = v[t], b = v[t + kH];
      v[t] = add_flushed(a, b);
      v[t + kH] = add_flushed(a, -b);
    }
  if constexpr (2 * kH < kNvfp4Block) hadamard16_stages<2 * kH>(v);
}

// The random Hadamard transform of one 16-element group in place (hadamard.hadamard_transform):
// v_i * (signs_i / 4), then the butterfly, distances 1, 2, 4, 8.
JF8_HD void hadamard16(float (&v)[kNvfp4Block], const float* signs) {
  JF8_UNROLL
  for (int i = 0; i < kNvfp4Block; ++i) v[i] = mul_flushed(v[i], signs[i] * 0.25f);
  hadamard16_stages<1>(v);
}

// The factor from a block's amax to its scale, f32(1/6) / global_scale: once per tensor.
JF8_HD float nvfp4_scale_encode(float global_scale) {
  return div_flushed(kInvE2M1Max, global_scale);
}

// A block's E4M3 scale byte from its amax (or its tile's) and nvfp4_scale_encode's factor.
JF8_HD uint8_t nvfp4_scale(float block_amax, float encode) {
  return float_to_fp8(mul_flushed(block_amax, encode), Fp8Format::kE4M3);
}

// The 16 E2M1 codes of a block as 8 bytes (element 2i in the low nibble of byte i), with the
// block's scale byte and the global scale, rounded stochastically with `sr`'s bits or (not
// `stochastic`) to nearest even. Each element is v * (1 / step) clamped to [-6, 6] with its
// sign kept; where the step is NaN or 0 (a block holding a NaN, or an all-zero one) that product
// is +-0, or NaN for an inf or NaN element, which gives the code of +0. Each word of 8 codes is
// built by Horner's rule from its last element, word * 16 + code (element 8j + i in nibble i;
// the biases summed in it come off at the end, modulo 2^32).
JF8_HD uint64_t nvfp4_block_codes(const float (&v)[kNvfp4Block], uint8_t scale,
                                  float global_scale, bool stochastic, const SrBlockBits& sr) {
  const float step = mul_flushed(e4m3_to_float(scale), global_scale);
  uint32_t word[2] = {0, 0};  // elements 0-7 and 8-15
  if (!(step > 0.0f)) {
    JF8_UNROLL
    for (int i = 0; i < kNvfp4Block; ++i)
      if (float_bits(v[i]) >= 0x80000000u && float_bits(v[i]) < 0xFF800000u)  // negative, finite
        word[i / 8] |= 8u << (4 * (i % 8));
  } else {  // no NaN here: a NaN element makes its block's amax, hence its scale, NaN
    const float inv = div_flushed(1.0f, step);
    JF8_UNROLL
    for (int i = kNvfp4Block - 1; i >= 0; --i) {
      const float y = mul_flushed(v[i], inv), a = fminf(fabsf(y), kE2M1Max);
      const uint32_t sign = (float_bits(y) >> 31) * 8u;
      word[i / 8] = word[i / 8] * 16u + sign +
                    (stochastic ? e2m1_magnitude_stochastic_biased(a, sr.bits(i))
                                : e2m1_magnitude_biased(a));
    }
    word[0] -= kE2M1CodeBias * 0x11111111u;
    word[1] -= kE2M1CodeBias * 0x11111111u;
  }
  return uint64_t(word[1]) << 32 | word[0];
}

}  // namespace jax_fp8
