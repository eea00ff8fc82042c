// jax_fp8_nvfp4_quantize: its Bind chain and argument decoder, shared by the CPU handler
// (nvfp4_quantize_cpu.cc) and the CUDA one (nvfp4_quantize_cuda.cu).
#pragma once

#include "common.h"

namespace jax_fp8 {

struct Nvfp4QuantizeArgs {
  const void* x;
  ffi::DataType x_type;
  int64_t rows, cols;  // x [rows, cols]
  const float* global_scales;  // [2]: the rowwise copy's, the columnwise copy's
  const uint32_t* key;         // [2]: the stochastic-rounding key words
  const float* rht_signs;      // [16]: the Hadamard transform's signs
  bool rowwise, columnwise, block_2d, stochastic, rht;
  // The CUDA handler's kernel: the specialised register-resident one (rowwise 1D blocks only)
  // or the general tile kernel. The CPU handler has one loop for every case.
  bool specialised;
  uint8_t* data;      // [rows, cols / 2] (rowwise)
  uint8_t* scales;    // [rows, cols / 16] E4M3 (rowwise)
  uint8_t* data_t;    // [cols, rows / 2] (columnwise)
  uint8_t* scales_t;  // [cols, rows / 16] E4M3 (columnwise)
};

// A direction that is off has empty outputs.
inline ffi::Error DecodeNvfp4Quantize(
    Platform platform, Nvfp4QuantizeArgs& a, ffi::AnyBuffer x,
    ffi::Buffer<ffi::F32> global_scales, ffi::Buffer<ffi::U32> key,
    ffi::Buffer<ffi::F32> rht_signs, ffi::Result<ffi::Buffer<ffi::U8>> data,
    ffi::Result<ffi::AnyBuffer> scales, ffi::Result<ffi::Buffer<ffi::U8>> data_t,
    ffi::Result<ffi::AnyBuffer> scales_t, bool rowwise, bool columnwise, bool block_2d,
    bool stochastic, bool rht, bool specialised) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (scales->element_type() != ffi::DataType::F8E4M3FN ||
      scales_t->element_type() != ffi::DataType::F8E4M3FN)
    return invalid("scales and scales_t must be float8_e4m3fn");
  const auto dims = x.dimensions();
  if (dims.size() != 2) return invalid("x must be [R, C]");
  const int64_t rows = dims[0], cols = dims[1];
  if (cols % kNvfp4Block) return invalid("C must be a multiple of 16");
  if ((columnwise || block_2d) && rows % kNvfp4Block)
    return invalid("R must be a multiple of 16 (columnwise or 2D blocks)");
  if ((stochastic && block_2d) || (rht && (!columnwise || block_2d)))
    return invalid("stochastic rounding takes 1D blocks; rht the columnwise copy of 1D blocks");
  if (specialised && (columnwise || block_2d || !rowwise))
    return invalid("the specialised kernel takes rowwise 1D blocks only");
  if (global_scales.element_count() != 2 || key.element_count() != 2 ||
      rht_signs.element_count() != kNvfp4Block)
    return invalid("global_scales, key and rht_signs must have 2, 2 and 16 elements");
  const int64_t n = rows * cols;
  if (int64_t(data->element_count()) != (rowwise ? n / 2 : 0) ||
      int64_t(scales->element_count()) != (rowwise ? n / kNvfp4Block : 0) ||
      int64_t(data_t->element_count()) != (columnwise ? n / 2 : 0) ||
      int64_t(scales_t->element_count()) != (columnwise ? n / kNvfp4Block : 0))
    return invalid("an output has the wrong size for x and the directions");
  a.x = x.untyped_data();
  a.x_type = x.element_type();
  a.rows = rows, a.cols = cols;
  a.global_scales = global_scales.typed_data();
  a.key = key.typed_data();
  a.rht_signs = rht_signs.typed_data();
  a.rowwise = rowwise, a.columnwise = columnwise, a.block_2d = block_2d;
  a.stochastic = stochastic, a.rht = rht, a.specialised = specialised;
  a.data = data->typed_data();
  a.scales = static_cast<uint8_t*>(scales->untyped_data());
  a.data_t = data_t->typed_data();
  a.scales_t = static_cast<uint8_t*>(scales_t->untyped_data());
  return check_aligned16(platform, {a.x, rowwise ? a.data : nullptr, columnwise ? a.data_t : nullptr},
                         "x, data and data_t");
}

template <typename B>
auto BindNvfp4Quantize(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()          // x [R, C]
      .template Arg<ffi::Buffer<ffi::F32>>()   // global_scales [2]
      .template Arg<ffi::Buffer<ffi::U32>>()   // key [2]
      .template Arg<ffi::Buffer<ffi::F32>>()   // rht_signs [16]
      .template Ret<ffi::Buffer<ffi::U8>>()    // data [R, C/2]
      .template Ret<ffi::AnyBuffer>()          // scales [R, C/16] E4M3
      .template Ret<ffi::Buffer<ffi::U8>>()    // data_t [C, R/2]
      .template Ret<ffi::AnyBuffer>()          // scales_t [C, R/16] E4M3
      .template Attr<bool>("rowwise")
      .template Attr<bool>("columnwise")
      .template Attr<bool>("block_2d")
      .template Attr<bool>("stochastic_rounding")
      .template Attr<bool>("rht")
      .template Attr<bool>("specialised");
}

}  // namespace jax_fp8
