// CPU FFI handler for jax_fp8_cast_transpose_ring: the same numerics as the CUDA kernel.
#include <cstring>

#include "cpu_io.h"

namespace jax_fp8 {
namespace {

constexpr int64_t kDbiasTile = 64;  // rows per dbias partial, as the CUDA kernel's tile

ffi::Error CastTransposeRingImpl(
    ffi::AnyBuffer x, ffi::Buffer<ffi::F32> history, ffi::Buffer<ffi::F32> scale,
    ffi::Buffer<ffi::F32> steps, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
    ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::F32>> history_out,
    ffi::Result<ffi::Buffer<ffi::F32>> scale_out, ffi::Result<ffi::Buffer<ffi::F32>> steps_out,
    ffi::Result<ffi::Buffer<ffi::F32>> dbias_partial, ffi::Result<ffi::Buffer<ffi::F32>> dbias,
    ffi::Result<ffi::AnyBuffer>, int64_t margin, int64_t algo, bool with_dbias) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (x.dimensions().size() != 2) return invalid("x must be 2-D");
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1], rows16 = (rows + 15) / 16 * 16;
  if (!is_fp8(q->element_type()) || qt->element_type() != q->element_type())
    return invalid("q and qt must share an FP8 dtype");
  if (cols <= 0 || cols % 16) return invalid("x's columns must be a positive multiple of 16");
  if (q->element_count() != size_t(rows * cols) || qt->element_count() != size_t(cols * rows16))
    return invalid("q must be [R, C] and qt [C, ceil16(R)]");
  const int64_t tiles = (rows + kDbiasTile - 1) / kDbiasTile;
  if (with_dbias && (dbias_partial->element_count() != size_t(tiles * cols) ||
                     dbias->element_count() != size_t(cols)))
    return invalid("dbias_partial must be [ceil(R / 64), C] and dbias [C]");
  const size_t len = history.element_count();
  if (auto e = check_ring_attrs(algo, len, kMaxHistory); e.failure()) return e;

  const Fp8Format fmt = fp8_format(q->element_type());
  const float a = amax_of(x);
  const float s = ring_scale_for_step(scale.typed_data()[0], steps.typed_data()[0], a, fmt,
                                      static_cast<int>(margin));
  const float inv = 1.0f / flush_subnormal(s);
  auto* qp = static_cast<uint8_t*>(q->untyped_data());
  auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
  std::memset(qtp, 0, qt->size_bytes());  // the padding columns of qt are zero
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t b = float_to_fp8(load_f32(x.untyped_data(), x.element_type(), r * cols + c) * inv, fmt);
      qp[r * cols + c] = b;
      qtp[c * rows16 + r] = b;
    }
  }
  if (with_dbias) {  // the kernel's order: per 64-row tile, 8 pairwise trees of 8 rows
    float* dp = dbias_partial->typed_data();
    for (int64_t t = 0; t < tiles; ++t) {
      for (int64_t c = 0; c < cols; ++c) {
        float sum = 0.0f;
        for (int64_t r8 = t * kDbiasTile; r8 < (t + 1) * kDbiasTile; r8 += 8) {
          float v[8];  // rows past x are zeros, as the kernel loads them
          for (int i = 0; i < 8; ++i) {
            const int64_t r = r8 + i;
            v[i] = r < rows ? load_f32(x.untyped_data(), x.element_type(), r * cols + c) : 0.0f;
          }
          sum += ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7]));
        }
        dp[t * cols + c] = sum;
      }
    }
    for (int64_t c = 0; c < cols; ++c) {  // dbias_reduce_kernel's order: 8 slices of the tiles
      float s[8];
      for (int w = 0; w < 8; ++w) {
        s[w] = 0.0f;
        for (int64_t t = w; t < tiles; t += 8) s[w] += dp[t * cols + c];
      }
      dbias->typed_data()[c] = ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
    }
  }
  amax->typed_data()[0] = a;
  write_next_ring(a, history, scale, steps, history_out, scale_out, steps_out, fmt, margin, algo);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CastTransposeRingCpuHandler, CastTransposeRingImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x [R, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // history [L]
                                  .Arg<ffi::Buffer<ffi::F32>>()   // scale []
                                  .Arg<ffi::Buffer<ffi::F32>>()   // steps []
                                  .Ret<ffi::AnyBuffer>()          // q [R, C]
                                  .Ret<ffi::AnyBuffer>()          // qt [C, R16]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // amax []
                                  .Ret<ffi::Buffer<ffi::F32>>()   // history' (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scale' (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // steps' (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dbias_partial [R/64, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // dbias [C]
                                  .Ret<ffi::AnyBuffer>()          // scratch (used on CUDA only)
                                  .Attr<int64_t>("margin")
                                  .Attr<int64_t>("algo")
                                  .Attr<bool>("with_dbias"));

}  // namespace jax_fp8
