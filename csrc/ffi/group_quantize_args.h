// jax_fp8_group_quantize: its Bind chain and argument decoder, shared by the CPU handler
// (group_quantize_cpu.cc) and the CUDA one (group_quantize_cuda.cu).
#pragma once

#include "common.h"

namespace jax_fp8 {

struct GroupQuantizeArgs {
  const void* x;
  ffi::DataType x_type;
  int64_t rows, cols;  // x viewed as [rows, cols], cols its last axis
  int64_t group_size;  // one of kGroupSizes
  float eps;
  bool ue8m0;
  Fp8Format fmt;
  uint8_t* q;
  float* scales;
  ScaleLayout layout;
};

inline ffi::Error DecodeGroupQuantize(Platform platform, GroupQuantizeArgs& a, ffi::AnyBuffer x,
                                      ffi::Result<ffi::AnyBuffer> q,
                                      ffi::Result<ffi::Buffer<ffi::F32>> scales,
                                      int64_t group_size, float eps, bool ue8m0, int64_t layout) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (!is_fp8(q->element_type())) return invalid("q must be float8_e4m3fn or float8_e5m2");
  const auto dims = x.dimensions();
  if (dims.size() < 1) return invalid("x must have at least one axis");
  bool known_group = false;
  for (int g : kGroupSizes) known_group |= group_size == g;
  if (!known_group) return invalid("group_size must be 16, 32, 64 or 128");
  const int64_t cols = dims.back(), rows = cols ? int64_t(x.element_count()) / cols : 0;
  const int64_t groups = cols / group_size, rows4 = (rows + 3) / 4 * 4;
  switch (static_cast<ScaleLayoutId>(layout)) {
    case ScaleLayoutId::kRow: a.layout = {groups, 1, rows}; break;
    case ScaleLayoutId::kCol: a.layout = {1, rows, rows}; break;
    case ScaleLayoutId::kColTma: a.layout = {1, rows4, rows4}; break;
    default: return invalid("layout must be 0 (row), 1 (col) or 2 (col_tma)");
  }
  if (cols % group_size) return invalid("K must be a multiple of group_size");
  if (q->element_count() != x.element_count()) return invalid("q must have x's size");
  if (int64_t(scales->element_count()) != groups * a.layout.padded_rows)
    return invalid("scales has the wrong size for this layout");
  a.x = x.untyped_data();
  a.x_type = x.element_type();
  a.rows = rows, a.cols = cols;
  a.group_size = group_size;
  a.eps = eps;
  a.ue8m0 = ue8m0;
  a.fmt = fp8_format(q->element_type());
  a.q = static_cast<uint8_t*>(q->untyped_data());
  a.scales = scales->typed_data();
  return check_aligned16(platform, {a.x, a.q}, "x and q");
}

template <typename B>
auto BindGroupQuantize(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()            // x [..., K]
      .template Ret<ffi::AnyBuffer>()            // q [..., K]
      .template Ret<ffi::Buffer<ffi::F32>>()     // scales, as the layout says
      .template Attr<int64_t>("group_size")
      .template Attr<float>("eps")
      .template Attr<bool>("ue8m0")
      .template Attr<int64_t>("layout");
}

}  // namespace jax_fp8
