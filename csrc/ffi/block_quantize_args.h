// jax_fp8_block_quantize (128 x 128 blocks) and jax_fp8_group_cast_transpose (1 x 128 and
// 128 x 1 groups): their Bind chains and argument decoders, shared by the CPU handlers
// (block_quantize_cpu.cc) and the CUDA ones (block_quantize_cuda.cu).
#pragma once

#include "common.h"

namespace jax_fp8 {

struct BlockQuantizeArgs {
  const void* x;
  ffi::DataType x_type;
  int64_t rows, cols;
  float eps;
  bool ue8m0;
  Fp8Format fmt;
  uint8_t* q;
  float* scales;    // block_quantize: [ceil(R/128), ceil(C/128)]; group: [C/128, R]
  uint8_t* qt;      // group_cast_transpose only: [C, ceil128(R)]
  float* scales_t;  // group_cast_transpose only: [ceil128(R)/128, C]
};

// x [R, C] with C a positive multiple of col_multiple, at most kMaxTileRows tiles of rows;
// q FP8 of x's shape, and qt (if any) of q's dtype.
inline ffi::Error Decode2D(BlockQuantizeArgs& a, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                           ffi::DataType qt_type, int64_t col_multiple, float eps, bool ue8m0) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (!is_fp8(q->element_type())) return invalid("q must be float8_e4m3fn or float8_e5m2");
  if (qt_type != q->element_type()) return invalid("qt must be in q's dtype");
  if (x.dimensions().size() != 2) return invalid("x must be 2-D");
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  if (cols % col_multiple || cols == 0)
    return invalid("x's columns are not a positive multiple of the required size");
  if ((rows + kBlockTile - 1) / kBlockTile > kMaxTileRows)
    return invalid("x has more than 65535 * 128 rows");
  if (q->element_count() != x.element_count()) return invalid("q must have x's shape");
  a.x = x.untyped_data();
  a.x_type = x.element_type();
  a.rows = rows, a.cols = cols;
  a.eps = eps;
  a.ue8m0 = ue8m0;
  a.fmt = fp8_format(q->element_type());
  a.q = static_cast<uint8_t*>(q->untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error DecodeBlockQuantize(Platform platform, BlockQuantizeArgs& a, ffi::AnyBuffer x,
                                      ffi::Result<ffi::AnyBuffer> q,
                                      ffi::Result<ffi::Buffer<ffi::F32>> scales, float eps,
                                      bool ue8m0) {
  if (ffi::Error e = Decode2D(a, x, q, q->element_type(), kColMultiple, eps, ue8m0); e.failure())
    return e;
  const int64_t blocks =
      (a.rows + kBlockTile - 1) / kBlockTile * ((a.cols + kBlockTile - 1) / kBlockTile);
  if (int64_t(scales->element_count()) != blocks)
    return invalid("scales must be [ceil(R/128), ceil(C/128)]");
  a.scales = scales->typed_data();
  return check_aligned16(platform, {a.x, a.q}, "x and q");
}

template <typename B>
auto BindBlockQuantize(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()         // x [R, C]
      .template Ret<ffi::AnyBuffer>()         // q [R, C]
      .template Ret<ffi::Buffer<ffi::F32>>()  // scales [ceil(R/128), ceil(C/128)]
      .template Attr<float>("eps")
      .template Attr<bool>("ue8m0");
}

inline ffi::Error DecodeGroupCastTranspose(Platform platform, BlockQuantizeArgs& a,
                                           ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                                           ffi::Result<ffi::Buffer<ffi::F32>> scales,
                                           ffi::Result<ffi::AnyBuffer> qt,
                                           ffi::Result<ffi::Buffer<ffi::F32>> scales_t, float eps,
                                           bool ue8m0) {
  if (ffi::Error e = Decode2D(a, x, q, qt->element_type(), kBlockTile, eps, ue8m0); e.failure())
    return e;
  const int64_t rows128 = (a.rows + kBlockTile - 1) / kBlockTile * kBlockTile;
  if (int64_t(qt->element_count()) != a.cols * rows128)
    return invalid("qt must be [C, ceil128(R)]");
  if (int64_t(scales->element_count()) != a.rows * (a.cols / kBlockTile) ||
      int64_t(scales_t->element_count()) != rows128 / kBlockTile * a.cols)
    return invalid("scales must be [C/128, R] and scales_t [ceil128(R)/128, C]");
  a.scales = scales->typed_data();
  a.qt = static_cast<uint8_t*>(qt->untyped_data());
  a.scales_t = scales_t->typed_data();
  return check_aligned16(platform, {a.x, a.q, a.qt}, "x, q and qt");
}

template <typename B>
auto BindGroupCastTranspose(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()         // x [R, C]
      .template Ret<ffi::AnyBuffer>()         // q [R, C]
      .template Ret<ffi::Buffer<ffi::F32>>()  // scales [C/128, R]
      .template Ret<ffi::AnyBuffer>()         // qt [C, R128]
      .template Ret<ffi::Buffer<ffi::F32>>()  // scales_t [R128/128, C]
      .template Attr<float>("eps")
      .template Attr<bool>("ue8m0");
}

}  // namespace jax_fp8
