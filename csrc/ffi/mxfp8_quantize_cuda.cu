// CUDA FFI handler for jax_fp8_mxfp8_quantize: pick the instantiation and launch (with PDL).
// Arguments: mxfp8_quantize_args.h.
#include <cuda_runtime.h>

#include "../kernels/mxfp8_quantize.cuh"
#include "launch.h"
#include "mxfp8_quantize_args.h"

namespace jax_fp8 {
namespace {

// Rowwise alone: the group quantize kernel with E8M0 scales (a grid-stride pass, 16 elements a
// thread, a block's amax by one shuffle).
template <typename T>
ffi::Error LaunchRowwise(cudaStream_t stream, const Mxfp8QuantizeArgs& a) {
  constexpr auto kernel = group_quantize_kernel<T, kMxBlock, E8M0GroupScale>;
  static const int per_sm = resident_blocks_per_sm(kernel, kQuantizeThreads);
  const ScaleLayout row_layout = {a.cols / kMxBlock, 1, a.rows};
  launch_pdl(kernel, grid_size(size_t(a.rows) * a.cols, kQuantizeThreads * kElemsPerThread, per_sm),
             kQuantizeThreads, stream, static_cast<const T*>(a.x), a.rows, a.cols,
             E8M0GroupScale{}, a.fmt, a.data, a.scales, row_layout);
  return last_error();
}

// With a columnwise copy: a persistent grid of 64 x 64 tiles, one wave, both directions from
// one read.
template <typename T, bool kRowwise>
ffi::Error LaunchColumnwise(cudaStream_t stream, const Mxfp8QuantizeArgs& a) {
  constexpr auto kernel = mxfp8_cast_transpose_kernel<T, kRowwise>;
  static const int per_sm = resident_blocks_per_sm(kernel, kTileThreads);
  const size_t tiles = size_t((a.rows + kTile - 1) / kTile) * ((a.cols + kTile - 1) / kTile);
  launch_pdl(kernel, grid_size(tiles, 1, per_sm), kTileThreads, stream,
             static_cast<const T*>(a.x), a.rows, a.cols, a.fmt, a.data, a.scales, a.data_t,
             a.scales_t);
  return last_error();
}

ffi::Error Mxfp8QuantizeImpl(cudaStream_t stream, const Mxfp8QuantizeArgs& a) {
  if (a.rows == 0 || a.cols == 0 || !(a.rowwise || a.columnwise)) return ffi::Error::Success();
  return dispatch_input(a.x_type, [&](auto t) {
    using T = typename decltype(t)::type;
    if (!a.columnwise) return LaunchRowwise<T>(stream, a);
    if (!a.rowwise) return LaunchColumnwise<T, false>(stream, a);
    return LaunchColumnwise<T, true>(stream, a);
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mxfp8QuantizeCudaHandler,
                              DecodeThen(DecodeMxfp8Quantize, Mxfp8QuantizeImpl),
                              BindMxfp8Quantize(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
