// CPU FFI handler for jax_fp8_cast_transpose_ring: the same numerics as the CUDA kernel, one
// thread. Arguments: cast_transpose_args.h.
#include <cstring>

#include "cast_transpose_args.h"
#include "cpu_io.h"
#include "items.h"

namespace jax_fp8 {
namespace {

ffi::Error CastTransposeRingImpl(const CastTransposeArgs& a) {
  const int64_t rows = a.src.rows, cols = a.src.cols, rows16 = a.rows16;
  const std::vector<float> v = source_values(a.src);
  auto x = [&](int64_t r, int64_t c) { return v[size_t(r * cols + c)]; };
  const float amax = amax_over(x, 0, rows, 0, cols);
  const float s = ring_scale_for_step(*a.ring.scale, *a.ring.steps, amax, a.fmt, a.ring.margin);
  const float inv = 1.0f / flush_subnormal(s);
  std::memset(a.qt, 0, size_t(cols * rows16));  // the padding columns of qt are zero
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t b = float_to_fp8(x(r, c) * inv, a.fmt);
      a.q[r * cols + c] = b;
      a.qt[c * rows16 + r] = b;
    }
  }
  if (a.with_dbias) {  // the kernel's order: per 64-row tile, 8 pairwise trees of 8 rows
    const int64_t tiles = (rows + kDbiasTileRows - 1) / kDbiasTileRows;
    for (int64_t t = 0; t < tiles; ++t) {
      for (int64_t c = 0; c < cols; ++c) {
        float sum = 0.0f;
        for (int64_t r8 = t * kDbiasTileRows; r8 < (t + 1) * kDbiasTileRows; r8 += 8) {
          float v[8];  // rows past x are zeros, as the kernel loads them
          for (int i = 0; i < 8; ++i) v[i] = r8 + i < rows ? x(r8 + i, c) : 0.0f;
          sum += ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
        }
        a.dbias_partial[t * cols + c] = sum;
      }
    }
    for (int64_t c = 0; c < cols; ++c) {  // dbias_reduce_kernel's order: 8 slices of the tiles
      float p[8];
      for (int w = 0; w < 8; ++w) {
        p[w] = 0.0f;
        for (int64_t t = w; t < tiles; t += 8) p[w] += a.dbias_partial[t * cols + c];
      }
      a.dbias[c] = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
    }
  }
  *a.amax = amax;
  *a.ring.scale_used = s;
  ring_write_serial(a.ring, amax, a.fmt);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CastTransposeRingCpuHandler,
                              each_item<2>(DecodeThen(DecodeCastTransposeRing,
                                                      CastTransposeRingImpl)),
                              BindCastTransposeRing(ffi::Ffi::Bind()));

}  // namespace jax_fp8
