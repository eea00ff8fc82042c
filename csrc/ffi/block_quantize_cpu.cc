// CPU FFI handlers for jax_fp8_block_quantize and jax_fp8_group_cast_transpose: the same
// numerics and layouts as the CUDA tile kernel (csrc/kernels/block_quantize.cuh), one thread.
#include <algorithm>

#include "cpu_io.h"

namespace jax_fp8 {
namespace {

constexpr int64_t kTile = 128;

ffi::Error Check2D(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& q, int64_t col_multiple) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (x.dimensions().size() != 2) return invalid("x must be 2-D");
  if (x.dimensions()[1] % col_multiple || x.dimensions()[1] == 0)
    return invalid("x's columns are not a positive multiple of the required size");
  if (!is_fp8(q->element_type()) || q->element_count() != x.element_count())
    return invalid("q must be FP8 with x's shape");
  return ffi::Error::Success();
}

float at(const ffi::AnyBuffer& x, int64_t i) { return load_f32(x.untyped_data(), x.element_type(), i); }

ffi::Error BlockQuantizeImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                             ffi::Result<ffi::Buffer<ffi::F32>> scales, float eps, bool ue8m0) {
  if (auto e = Check2D(x, q, 16); e.failure()) return e;
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t br = (rows + kTile - 1) / kTile, bc = (cols + kTile - 1) / kTile;
  if (int64_t(scales->element_count()) != br * bc)
    return invalid("scales must be [ceil(R/128), ceil(C/128)]");
  const Fp8Format fmt = fp8_format(q->element_type());
  auto* qp = static_cast<uint8_t*>(q->untyped_data());
  for (int64_t i = 0; i < br; ++i) {
    for (int64_t j = 0; j < bc; ++j) {
      const int64_t r1 = std::min(rows, (i + 1) * kTile), c1 = std::min(cols, (j + 1) * kTile);
      const float s = group_scale(amax_region(x, cols, i * kTile, r1, j * kTile, c1), eps, fmt, ue8m0);
      const float inv = 1.0f / s;
      scales->typed_data()[i * bc + j] = s;
      for (int64_t r = i * kTile; r < r1; ++r)
        for (int64_t c = j * kTile; c < c1; ++c) qp[r * cols + c] = float_to_fp8(at(x, r * cols + c) * inv, fmt);
    }
  }
  return ffi::Error::Success();
}

ffi::Error GroupCastTransposeImpl(ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                                  ffi::Result<ffi::Buffer<ffi::F32>> scales,
                                  ffi::Result<ffi::AnyBuffer> qt,
                                  ffi::Result<ffi::Buffer<ffi::F32>> scales_t, float eps, bool ue8m0) {
  if (auto e = Check2D(x, q, kTile); e.failure()) return e;
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t rows128 = (rows + kTile - 1) / kTile * kTile;
  if (qt->element_type() != q->element_type() || int64_t(qt->element_count()) != cols * rows128)
    return invalid("qt must be [C, ceil128(R)] in q's dtype");
  if (int64_t(scales->element_count()) != rows * (cols / kTile) ||
      int64_t(scales_t->element_count()) != rows128 / kTile * cols)
    return invalid("scales must be [C/128, R] and scales_t [ceil128(R)/128, C]");
  const Fp8Format fmt = fp8_format(q->element_type());
  auto* qp = static_cast<uint8_t*>(q->untyped_data());
  auto* qtp = static_cast<uint8_t*>(qt->untyped_data());
  for (int64_t r = 0; r < rows; ++r) {  // 1 x 128 groups along rows; scales [C/128, R]
    for (int64_t g = 0; g < cols / kTile; ++g) {
      const float s = group_scale(amax_region(x, cols, r, r + 1, g * kTile, (g + 1) * kTile), eps, fmt, ue8m0);
      const float inv = 1.0f / s;
      scales->typed_data()[g * rows + r] = s;
      for (int64_t c = g * kTile; c < (g + 1) * kTile; ++c)
        qp[r * cols + c] = float_to_fp8(at(x, r * cols + c) * inv, fmt);
    }
  }
  for (int64_t c = 0; c < cols; ++c) {  // 128 x 1 groups along columns, transposed, zero-padded
    for (int64_t t = 0; t < rows128 / kTile; ++t) {
      const int64_t r0 = t * kTile, r1 = std::min(rows, r0 + kTile);
      const float s = group_scale(amax_region(x, cols, r0, r1, c, c + 1), eps, fmt, ue8m0);
      const float inv = 1.0f / s;
      scales_t->typed_data()[t * cols + c] = s;
      for (int64_t r = r0; r < r0 + kTile; ++r)  // zero padding past R
        qtp[c * rows128 + r] = r < rows ? float_to_fp8(at(x, r * cols + c) * inv, fmt) : 0;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockQuantizeCpuHandler, BlockQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x [R, C]
                                  .Ret<ffi::AnyBuffer>()          // q [R, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scales [ceil(R/128), ceil(C/128)]
                                  .Attr<float>("eps")
                                  .Attr<bool>("ue8m0"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupCastTransposeCpuHandler, GroupCastTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()          // x [R, C]
                                  .Ret<ffi::AnyBuffer>()          // q [R, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scales [C/128, R]
                                  .Ret<ffi::AnyBuffer>()          // qt [C, R128]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scales_t [R128/128, C]
                                  .Attr<float>("eps")
                                  .Attr<bool>("ue8m0"));

}  // namespace jax_fp8
