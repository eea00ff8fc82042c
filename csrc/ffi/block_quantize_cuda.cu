// CUDA FFI handlers for jax_fp8_block_quantize (128 x 128 blocks) and
// jax_fp8_group_cast_transpose (1 x 128 and 128 x 1 groups): decode, validate, launch (PDL).
#include <cuda_runtime.h>

#include "../kernels/block_quantize.cuh"
#include "common.h"
#include "launch.h"

namespace jax_fp8 {
namespace {

struct BlockArgs {
  const void* x;
  int64_t rows, cols;
  float eps;
  Fp8Format fmt;
  bool ue8m0;
  uint8_t *q, *qt;
  float *scales, *scales_t;
};

template <bool kBlock2D>
ffi::Error Launch(cudaStream_t stream, ffi::DataType t, const BlockArgs& a) {
  if (a.rows == 0) return ffi::Error::Success();
  const int64_t tile_rows = (a.rows + kBlockTile - 1) / kBlockTile;
  if (tile_rows > 65535) return invalid("x has more than 65535 * 128 rows");
  const dim3 grid(unsigned((a.cols + kBlockTile - 1) / kBlockTile), unsigned(tile_rows));
  switch (t) {
    case ffi::DataType::F32:
      launch_pdl(block_quantize_kernel<float, kBlock2D>, grid, kBlockThreads, stream,
                 static_cast<const float*>(a.x), a.rows, a.cols, a.eps, a.fmt, a.ue8m0, a.q,
                 a.scales, a.qt, a.scales_t);
      break;
    case ffi::DataType::BF16:
      launch_pdl(block_quantize_kernel<__nv_bfloat16, kBlock2D>, grid, kBlockThreads, stream,
                 static_cast<const __nv_bfloat16*>(a.x), a.rows, a.cols, a.eps, a.fmt, a.ue8m0,
                 a.q, a.scales, a.qt, a.scales_t);
      break;
    case ffi::DataType::F16:
      launch_pdl(block_quantize_kernel<__half, kBlock2D>, grid, kBlockThreads, stream,
                 static_cast<const __half*>(a.x), a.rows, a.cols, a.eps, a.fmt, a.ue8m0, a.q,
                 a.scales, a.qt, a.scales_t);
      break;
    default:
      return invalid("x must be float32, bfloat16 or float16");
  }
  return last_error();
}

ffi::Error Check2D(const ffi::AnyBuffer& x, ffi::Result<ffi::AnyBuffer>& q, int64_t col_multiple) {
  if (x.dimensions().size() != 2) return invalid("x must be 2-D");
  if (x.dimensions()[1] % col_multiple || x.dimensions()[1] == 0)
    return invalid("x's columns are not a positive multiple of the required size");
  if (!is_fp8(q->element_type()) || q->element_count() != x.element_count())
    return invalid("q must be FP8 with x's shape");
  if (!aligned16(x.untyped_data()) || !aligned16(q->untyped_data()))
    return invalid("x and q must be 16-byte aligned");
  return ffi::Error::Success();
}

ffi::Error BlockQuantizeImpl(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> q,
                             ffi::Result<ffi::Buffer<ffi::F32>> scales, float eps, bool ue8m0) {
  if (auto e = Check2D(x, q, 16); e.failure()) return e;
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t blocks = (rows + kBlockTile - 1) / kBlockTile * ((cols + kBlockTile - 1) / kBlockTile);
  if (int64_t(scales->element_count()) != blocks)
    return invalid("scales must be [ceil(R/128), ceil(C/128)]");
  return Launch<true>(stream, x.element_type(),
                      BlockArgs{x.untyped_data(), rows, cols, eps, fp8_format(q->element_type()),
                                ue8m0, static_cast<uint8_t*>(q->untyped_data()), nullptr,
                                scales->typed_data(), nullptr});
}

ffi::Error GroupCastTransposeImpl(cudaStream_t stream, ffi::AnyBuffer x,
                                  ffi::Result<ffi::AnyBuffer> q,
                                  ffi::Result<ffi::Buffer<ffi::F32>> scales,
                                  ffi::Result<ffi::AnyBuffer> qt,
                                  ffi::Result<ffi::Buffer<ffi::F32>> scales_t, float eps,
                                  bool ue8m0) {
  if (auto e = Check2D(x, q, kBlockTile); e.failure()) return e;
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t rows128 = (rows + kBlockTile - 1) / kBlockTile * kBlockTile;
  if (qt->element_type() != q->element_type() || int64_t(qt->element_count()) != cols * rows128)
    return invalid("qt must be [C, ceil128(R)] in q's dtype");
  if (int64_t(scales->element_count()) != rows * (cols / kBlockTile) ||
      int64_t(scales_t->element_count()) != rows128 / kBlockTile * cols)
    return invalid("scales must be [C/128, R] and scales_t [ceil128(R)/128, C]");
  if (!aligned16(qt->untyped_data())) return invalid("qt must be 16-byte aligned");
  return Launch<false>(stream, x.element_type(),
                       BlockArgs{x.untyped_data(), rows, cols, eps, fp8_format(q->element_type()),
                                 ue8m0, static_cast<uint8_t*>(q->untyped_data()),
                                 static_cast<uint8_t*>(qt->untyped_data()), scales->typed_data(),
                                 scales_t->typed_data()});
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockQuantizeCudaHandler, BlockQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [R, C]
                                  .Ret<ffi::AnyBuffer>()          // q [R, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scales [ceil(R/128), ceil(C/128)]
                                  .Attr<float>("eps")
                                  .Attr<bool>("ue8m0"),
                              {ffi::Traits::kCmdBufferCompatible});

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupCastTransposeCudaHandler, GroupCastTransposeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()          // x [R, C]
                                  .Ret<ffi::AnyBuffer>()          // q [R, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scales [C/128, R]
                                  .Ret<ffi::AnyBuffer>()          // qt [C, R128]
                                  .Ret<ffi::Buffer<ffi::F32>>()   // scales_t [R128/128, C]
                                  .Attr<float>("eps")
                                  .Attr<bool>("ue8m0"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
