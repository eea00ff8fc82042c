// CUDA FFI handler for jax_fp8_group_quantize: decode, validate, launch (with PDL).
#include <cuda_runtime.h>

#include "../kernels/group_quantize.cuh"
#include "common.h"
#include "launch.h"

namespace jax_fp8 {
namespace {

struct GroupArgs {
  const void* x;
  int64_t rows, cols;
  float eps;
  Fp8Format fmt;
  bool ue8m0;
  uint8_t* q;
  float* scales;
  ScaleLayout layout;
};

template <typename T, int G>
ffi::Error Launch(cudaStream_t stream, const GroupArgs& a) {
  const size_t n = size_t(a.rows) * a.cols;
  // One wave: as many blocks as fit at once (5 an SM for bf16 128-groups on sm_90, not 8).
  static const int per_sm = resident_blocks_per_sm(group_quantize_kernel<T, G>, kQuantizeThreads);
  launch_pdl(group_quantize_kernel<T, G>, grid_size(n, kQuantizeThreads * kElemsPerThread, per_sm),
             kQuantizeThreads, stream, static_cast<const T*>(a.x), a.rows, a.cols, a.eps, a.fmt,
             a.ue8m0, a.q, a.scales, a.layout);
  return last_error();
}

template <typename T>
ffi::Error ForGroup(cudaStream_t stream, int64_t group_size, const GroupArgs& a) {
  switch (group_size) {
    case 16: return Launch<T, 16>(stream, a);
    case 32: return Launch<T, 32>(stream, a);
    case 64: return Launch<T, 64>(stream, a);
    case 128: return Launch<T, 128>(stream, a);
    default: return invalid("group_size must be 16, 32, 64 or 128");
  }
}

ffi::Error GroupQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                             ffi::Result<ffi::Buffer<ffi::F32>> scales, int64_t group_size,
                             float eps, bool ue8m0, int64_t layout) {
  const auto dims = x.dimensions();
  if (dims.size() < 1) return invalid("x must have at least one axis");
  const int64_t cols = dims.back(), rows = cols ? int64_t(x.element_count()) / cols : 0;
  if (group_size <= 0 || cols % group_size) return invalid("K must be a multiple of group_size");
  if (!is_fp8(q->element_type()) || q->element_count() != x.element_count())
    return invalid("q must be FP8 with x's size");
  const int64_t groups = cols / group_size, rows4 = (rows + 3) / 4 * 4;
  ScaleLayout sl;
  switch (layout) {
    case 0: sl = {groups, 1, rows}; break;
    case 1: sl = {1, rows, rows}; break;
    case 2: sl = {1, rows4, rows4}; break;
    default: return invalid("layout must be 0 (row), 1 (col) or 2 (col_tma)");
  }
  if (int64_t(scales->element_count()) != groups * sl.padded_rows)
    return invalid("scales has the wrong size for this layout");
  if (!aligned16(x.untyped_data()) || !aligned16(q->untyped_data()))
    return invalid("x and q must be 16-byte aligned");
  if (rows == 0 || cols == 0) return ffi::Error::Success();
  const GroupArgs a{x.untyped_data(), rows, cols, eps, fp8_format(q->element_type()), ue8m0,
                    static_cast<uint8_t*>(q->untyped_data()), scales->typed_data(), sl};
  switch (x.element_type()) {
    case ffi::DataType::F32: return ForGroup<float>(stream, group_size, a);
    case ffi::DataType::BF16: return ForGroup<__nv_bfloat16>(stream, group_size, a);
    case ffi::DataType::F16: return ForGroup<__half>(stream, group_size, a);
    default: return invalid("x must be float32, bfloat16 or float16");
  }
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupQuantizeCudaHandler, GroupQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [..., K]
                                  .Ret<ffi::AnyBuffer>()          // q [..., K]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scales
                                  .Attr<int64_t>("group_size")
                                  .Attr<float>("eps")
                                  .Attr<bool>("ue8m0")
                                  .Attr<int64_t>("layout"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
