// jax_fp8_block_quantize (128 x 128 blocks) and jax_fp8_group_cast_transpose (1 x 128 and
// 128 x 1 groups): their Bind chains and argument decoders, shared by the CPU handlers
// (block_quantize_cpu.cc) and the CUDA ones (block_quantize_cuda.cu).
#pragma once

#include "source_args.h"

namespace jax_fp8 {

struct BlockQuantizeArgs {
  SourceArgs src;  // what is quantized, [R, C]: x itself for block_quantize
  float eps;
  bool ue8m0;
  Fp8Format fmt;
  uint8_t* q;
  float* scales;    // block_quantize: [ceil(R/128), ceil(C/128)]; group: [C/128, R]
  uint8_t* qt;      // group_cast_transpose only: [C, ceil128(R)]
  float* scales_t;  // group_cast_transpose only: [ceil128(R)/128, C]
};

// After the source's checks: at most kMaxTileRows tiles of rows; q FP8 of the source's shape
// [R, C], and qt (if any) of q's dtype.
inline ffi::Error DecodeOutputs(BlockQuantizeArgs& a, ffi::Result<ffi::AnyBuffer> q,
                                ffi::DataType qt_type, float eps, bool ue8m0) {
  if (!is_fp8(q->element_type())) return invalid("q must be float8_e4m3fn or float8_e5m2");
  if (qt_type != q->element_type()) return invalid("qt must be in q's dtype");
  const int64_t rows = a.src.rows, cols = a.src.cols;
  if ((rows + kBlockTile - 1) / kBlockTile > kMaxTileRows)
    return invalid("what is quantized has more than " +
                   std::to_string(kMaxTileRows * kBlockTile) + " rows");
  if (int64_t(q->element_count()) != rows * cols) return invalid("q must be [R, C]");
  a.eps = eps;
  a.ue8m0 = ue8m0;
  a.fmt = fp8_format(q->element_type());
  a.q = static_cast<uint8_t*>(q->untyped_data());
  return ffi::Error::Success();
}

inline ffi::Error DecodeBlockQuantize(Platform platform, BlockQuantizeArgs& a, ffi::AnyBuffer x,
                                      ffi::Result<ffi::AnyBuffer> q, F32Result scales, float eps,
                                      bool ue8m0) {
  if (ffi::Error e = DecodePlainSource(a.src, x, kColMultiple); e.failure()) return e;
  if (ffi::Error e = DecodeOutputs(a, q, q->element_type(), eps, ue8m0); e.failure()) return e;
  const int64_t blocks = (a.src.rows + kBlockTile - 1) / kBlockTile *
                         ((a.src.cols + kBlockTile - 1) / kBlockTile);
  if (int64_t(scales->element_count()) != blocks)
    return invalid("scales must be [ceil(R/128), ceil(C/128)]");
  a.scales = scales->typed_data();
  return check_aligned16(platform, {a.src.x, a.q}, "x and q");
}

template <typename B>
auto BindBlockQuantize(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x [R, C]
      .template Ret<ffi::AnyBuffer>()  // q [R, C]
      .template Ret<F32Buffer>()       // scales [ceil(R/128), ceil(C/128)]
      .template Attr<float>("eps")
      .template Attr<bool>("ue8m0");
}

// x, y, stats, affine and the source's attributes: source_args.h, the columns of each output
// a multiple of 128.
inline ffi::Error DecodeGroupCastTranspose(Platform platform, BlockQuantizeArgs& a,
                                           ffi::AnyBuffer x, ffi::AnyBuffer y, F32Buffer stats,
                                           F32Buffer affine, ffi::Result<ffi::AnyBuffer> q,
                                           F32Result scales, ffi::Result<ffi::AnyBuffer> qt,
                                           F32Result scales_t, float eps, bool ue8m0,
                                           int64_t activation, bool gated, bool grad,
                                           int64_t norm) {
  if (ffi::Error e = DecodeSource(a.src, x, y, stats, affine, activation, gated, grad, norm,
                                  kBlockTile);
      e.failure())
    return e;
  if (ffi::Error e = DecodeOutputs(a, q, qt->element_type(), eps, ue8m0); e.failure()) return e;
  const int64_t rows = a.src.rows, cols = a.src.cols;
  const int64_t rows128 = (rows + kBlockTile - 1) / kBlockTile * kBlockTile;
  if (int64_t(qt->element_count()) != cols * rows128)
    return invalid("qt must be [C, ceil128(R)]");
  if (int64_t(scales->element_count()) != rows * (cols / kBlockTile) ||
      int64_t(scales_t->element_count()) != rows128 / kBlockTile * cols)
    return invalid("scales must be [C/128, R] and scales_t [ceil128(R)/128, C]");
  a.scales = scales->typed_data();
  a.qt = static_cast<uint8_t*>(qt->untyped_data());
  a.scales_t = scales_t->typed_data();
  if (ffi::Error e = CheckSourceAligned(platform, a.src); e.failure()) return e;
  return check_aligned16(platform, {a.q, a.qt}, "q and qt");
}

template <typename B>
auto BindGroupCastTranspose(B binding) {
  return BindSource(std::move(binding))  // x, y, stats, affine
      .template Ret<ffi::AnyBuffer>()    // q [R, C]
      .template Ret<F32Buffer>()         // scales [C/128, R]
      .template Ret<ffi::AnyBuffer>()    // qt [C, R128]
      .template Ret<F32Buffer>()         // scales_t [R128/128, C]
      .template Attr<float>("eps")
      .template Attr<bool>("ue8m0")
      .template Attr<int64_t>("activation")
      .template Attr<bool>("gated")
      .template Attr<bool>("grad")
      .template Attr<int64_t>("norm");
}

}  // namespace jax_fp8
