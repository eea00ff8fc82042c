// MXFP8 (OCP Microscaling Formats v1.0): one E8M0 scale per kMxBlock consecutive elements, a
// power of two 2^k stored as the byte k + 127 (0xFF: NaN; there is no zero), rounded up
// ("RCEIL", as cuBLAS and TransformerEngine do): the smallest 2^k with block_amax / 2^k <=
// fmt_max, so a block never saturates. Shared by the CPU handler and the CUDA kernel; the jnp
// twins: jax_fp8.formats.e8m0_rceil and jax_fp8.reference.mxfp8_quantize.
#pragma once

#include "numerics.h"

namespace jax_fp8 {

constexpr uint8_t kE8M0Nan = 0xFF;
constexpr int kE8M0Bias = 127;

// The scale byte of a block whose NaN-propagating amax is `amax` (>= 0; a subnormal one counts
// as zero): byte 0 (the smallest scale) for an all-zero block, kE8M0Nan where the block holds
// a NaN or an infinity. fmt_max = 1.75 * 2^emax (e4m3 448: emax 8; e5m2 57344: emax 15), so
// with amax = m * 2^e (m in [1, 2)), k = e - emax, plus 1 where m > 1.75; clamped to
// [-127, 127] (a finite f32 amax gives k <= 120).
JF8_HD uint8_t e8m0_rceil(float amax, Fp8Format f) {
  const uint32_t b = float_bits(amax);
  if (b >= 0x7F800000u) return kE8M0Nan;
  if (b < 0x00800000u) return 0;
  const int emax = f == Fp8Format::kE4M3 ? 8 : 15;
  int k = int(b >> 23) - 127 - emax + ((b & 0x007FFFFFu) > 0x00600000u ? 1 : 0);
  k = k < -kE8M0Bias ? -kE8M0Bias : k > kE8M0Bias ? kE8M0Bias : k;
  return static_cast<uint8_t>(k + kE8M0Bias);
}

// The top scale RCEIL gives a finite amax, 2^(128 - emax) (byte e8m0_top: e4m3 247, e5m2 240;
// blocks with amax above 1.75 * 2^127): its blocks' elements saturate below 2^emax times the
// scale (numerics.h top_scale_saturate) before they are scaled; other blocks are left alone.
JF8_HD uint8_t e8m0_top(Fp8Format f) { return f == Fp8Format::kE4M3 ? 247 : 240; }

JF8_HD float e8m0_saturate(float x, uint8_t s, Fp8Format f) {
  return s == e8m0_top(f) ? top_scale_saturate(x, f) : x;
}

// 2^-k of scale byte s = k + 127: the exact factor that quantizes an element (x * 2^-k, then
// the saturating FP8 cast); NaN for kE8M0Nan, so a block holding a NaN or an infinity
// quantizes to NaN. Exact for every byte e8m0_rceil returns for a finite amax (s <= 247).
JF8_HD float e8m0_inverse(uint8_t s) {
  return s == kE8M0Nan ? bits_float(0x7FC00000u) : bits_float(uint32_t(254 - s) << 23);
}

}  // namespace jax_fp8
