// CPU FFI handler for jax_fp8_group_quantize: the same numerics as the CUDA kernel, one thread.
#include "cpu_io.h"

namespace jax_fp8 {
namespace {

ffi::Error GroupQuantizeImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                             ffi::Result<ffi::Buffer<ffi::F32>> scales, int64_t group_size,
                             float eps, bool ue8m0, int64_t layout) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  const auto dims = x.dimensions();
  if (dims.size() < 1) return invalid("x must have at least one axis");
  const int64_t cols = dims.back(), rows = cols ? int64_t(x.element_count()) / cols : 0;
  if (group_size <= 0 || cols % group_size) return invalid("K must be a multiple of group_size");
  if (!is_fp8(q->element_type()) || q->element_count() != x.element_count())
    return invalid("q must be FP8 with x's size");
  if (layout < 0 || layout > 2) return invalid("layout must be 0 (row), 1 (col) or 2 (col_tma)");
  const int64_t groups = cols / group_size;
  const int64_t padded = layout == 2 ? (rows + 3) / 4 * 4 : rows;
  if (int64_t(scales->element_count()) != groups * padded)
    return invalid("scales has the wrong size for this layout");
  const Fp8Format fmt = fp8_format(q->element_type());
  auto* qp = static_cast<uint8_t*>(q->untyped_data());
  float* sp = scales->typed_data();
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t c0 = g * group_size;
      const float s = group_scale(amax_region(x, cols, r, r + 1, c0, c0 + group_size), eps, fmt, ue8m0);
      const float inv = 1.0f / s;
      for (int64_t c = c0; c < c0 + group_size; ++c)
        qp[r * cols + c] = float_to_fp8(load_f32(x.untyped_data(), x.element_type(), r * cols + c) * inv, fmt);
      sp[layout == 0 ? r * groups + g : g * padded + r] = s;
    }
  }
  for (int64_t g = 0; g < groups; ++g)  // col_tma padding
    for (int64_t r = rows; r < padded; ++r) sp[g * padded + r] = 0.0f;
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupQuantizeCpuHandler, GroupQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x [..., K]
                                  .Ret<ffi::AnyBuffer>()          // q [..., K]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scales
                                  .Attr<int64_t>("group_size")
                                  .Attr<float>("eps")
                                  .Attr<bool>("ue8m0")
                                  .Attr<int64_t>("layout"));

}  // namespace jax_fp8
