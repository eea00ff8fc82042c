// Philox4x32-10 (Salmon, Moraes, Dror and Shaw, "Parallel random numbers: as easy as 1, 2, 3",
// SC 2011), for the CPU handlers and the CUDA kernels alike: four random words from a counter
// of four words and a key of two, so an element's random bits follow from its coordinates.
// The jnp twin: jax_fp8/philox.py (its known-answer tests pin both).
#pragma once

#include <cstdint>

#include "numerics.h"

namespace jax_fp8 {

JF8_HD void mulhilo32(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
#if defined(__CUDA_ARCH__)
  hi = __umulhi(a, b);
  lo = a * b;
#else
  const uint64_t p = uint64_t(a) * b;
  hi = uint32_t(p >> 32);
  lo = uint32_t(p);
#endif
}

// out = Philox4x32-10(counter c, key (k0, k1)).
JF8_HD void philox4x32_10(const uint32_t (&c_in)[4], uint32_t k0, uint32_t k1, uint32_t (&out)[4]) {
  uint32_t c0 = c_in[0], c1 = c_in[1], c2 = c_in[2], c3 = c_in[3];
  JF8_UNROLL
  for (int r = 0; r < 10; ++r) {
    if (r) {
      k0 += 0x9E3779B9u;
      k1 += 0xBB67AE85u;
    }
    uint32_t hi0, lo0, hi1, lo1;
    mulhilo32(c0, 0xD2511F53u, hi0, lo0);
    mulhilo32(c2, 0xCD9E8D57u, hi1, lo1);
    const uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0, c1 = lo1, c2 = n2, c3 = lo0;
  }
  out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
}

}  // namespace jax_fp8
