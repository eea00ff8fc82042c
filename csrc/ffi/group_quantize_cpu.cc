// CPU FFI handler for jax_fp8_group_quantize: the same numerics as the CUDA kernel, one thread.
// Arguments: group_quantize_args.h.
#include "cpu_io.h"
#include "group_quantize_args.h"

namespace jax_fp8 {
namespace {

ffi::Error GroupQuantizeImpl(const GroupQuantizeArgs& a) {
  const int64_t cols = a.cols, groups = cols / a.group_size;
  const ScaleLayout& sl = a.layout;
  for (int64_t r = 0; r < a.rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * a.group_size, c1 = c0 + a.group_size;
      const float s =
          group_scale(amax_region(a.x, a.x_type, cols, r, r + 1, c0, c1), a.eps, a.fmt, a.ue8m0);
      const float inv = 1.0f / s;
      for (int64_t c = c0; c < c1; ++c) {
        const float v = load_f32(a.x, a.x_type, r * cols + c);
        a.q[r * cols + c] = float_to_fp8((a.ue8m0 ? top_scale_saturate(v, a.fmt) : v) * inv, a.fmt);
      }
      a.scales[r * sl.row_stride + g * sl.group_stride] = s;
    }
  }
  for (int64_t g = 0; g < groups; ++g)  // col_tma's padding rows: zero scales
    for (int64_t r = a.rows; r < sl.padded_rows; ++r)
      a.scales[r * sl.row_stride + g * sl.group_stride] = 0.0f;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupQuantizeCpuHandler,
                              DecodeThen(DecodeGroupQuantize, GroupQuantizeImpl),
                              BindGroupQuantize(ffi::Ffi::Bind()));

}  // namespace jax_fp8
