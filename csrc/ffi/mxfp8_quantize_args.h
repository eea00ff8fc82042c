// jax_fp8_mxfp8_quantize: its Bind chain and argument decoder, shared by the CPU handler
// (mxfp8_quantize_cpu.cc) and the CUDA one (mxfp8_quantize_cuda.cu).
#pragma once

#include "common.h"

namespace jax_fp8 {

struct Mxfp8QuantizeArgs {
  const void* x;
  ffi::DataType x_type;
  int64_t rows, cols;  // x [rows, cols]
  bool rowwise, columnwise;
  Fp8Format fmt;
  uint8_t* data;      // [rows, cols] (rowwise)
  uint8_t* scales;    // [rows, cols / kMxBlock] E8M0 (rowwise)
  uint8_t* data_t;    // [cols, rows] (columnwise)
  uint8_t* scales_t;  // [cols, rows / kMxBlock] E8M0 (columnwise)
};

// A direction that is off has empty outputs.
inline ffi::Error DecodeMxfp8Quantize(Platform platform, Mxfp8QuantizeArgs& a, ffi::AnyBuffer x,
                                      ffi::Result<ffi::AnyBuffer> data,
                                      ffi::Result<ffi::Buffer<ffi::U8>> scales,
                                      ffi::Result<ffi::AnyBuffer> data_t,
                                      ffi::Result<ffi::Buffer<ffi::U8>> scales_t, bool rowwise,
                                      bool columnwise) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (!is_fp8(data->element_type()) || data_t->element_type() != data->element_type())
    return invalid("data and data_t must be one of float8_e4m3fn, float8_e5m2");
  const auto dims = x.dimensions();
  if (dims.size() != 2) return invalid("x must be [R, C]");
  const int64_t rows = dims[0], cols = dims[1];
  if (cols % kMxBlock) return invalid("C must be a multiple of 32");
  if (columnwise && rows % kMxBlock) return invalid("R must be a multiple of 32 (columnwise)");
  const int64_t n = rows * cols;
  if (int64_t(data->element_count()) != (rowwise ? n : 0) ||
      int64_t(scales->element_count()) != (rowwise ? n / kMxBlock : 0) ||
      int64_t(data_t->element_count()) != (columnwise ? n : 0) ||
      int64_t(scales_t->element_count()) != (columnwise ? n / kMxBlock : 0))
    return invalid("an output has the wrong size for x and the directions");
  a.x = x.untyped_data();
  a.x_type = x.element_type();
  a.rows = rows, a.cols = cols;
  a.rowwise = rowwise, a.columnwise = columnwise;
  a.fmt = fp8_format(data->element_type());
  a.data = static_cast<uint8_t*>(data->untyped_data());
  a.scales = scales->typed_data();
  a.data_t = static_cast<uint8_t*>(data_t->untyped_data());
  a.scales_t = scales_t->typed_data();
  return check_aligned16(platform, {a.x, rowwise ? a.data : nullptr, columnwise ? a.data_t : nullptr},
                         "x, data and data_t");
}

template <typename B>
auto BindMxfp8Quantize(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()         // x [R, C]
      .template Ret<ffi::AnyBuffer>()         // data [R, C] FP8
      .template Ret<ffi::Buffer<ffi::U8>>()   // scales [R, C/32]
      .template Ret<ffi::AnyBuffer>()         // data_t [C, R] FP8
      .template Ret<ffi::Buffer<ffi::U8>>()   // scales_t [C, R/32]
      .template Attr<bool>("rowwise")
      .template Attr<bool>("columnwise");
}

}  // namespace jax_fp8
