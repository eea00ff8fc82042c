// CUDA FFI handler for jax_fp8_nvfp4_quantize: the kernel the `specialised` attribute names, its
// instantiation, launched with PDL. Arguments: nvfp4_quantize_args.h.
#include <cuda_runtime.h>

#include "../kernels/nvfp4_quantize.cuh"
#include "launch.h"
#include "nvfp4_quantize_args.h"

namespace jax_fp8 {
namespace {

template <typename T>
ffi::Error Launch(cudaStream_t stream, const Nvfp4QuantizeArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  if (a.specialised) {
    // One wave: as many blocks as fit at once.
    constexpr auto kernel = nvfp4_rowwise_kernel<T>;
    static const int per_sm = resident_blocks_per_sm(kernel, kQuantizeThreads);
    launch_pdl(kernel, grid_size(size_t(a.rows) * a.cols, kQuantizeThreads * kNvfp4Block, per_sm),
               kQuantizeThreads, stream, x, a.rows, a.cols, a.stochastic, a.global_scales, a.key,
               reinterpret_cast<uint2*>(a.data), a.scales);
  } else {
    // A persistent grid of 64 x 64 tiles, one wave.
    constexpr auto kernel = nvfp4_quantize_kernel<T>;
    static const int per_sm = resident_blocks_per_sm(kernel, kTileThreads);
    const size_t tiles = size_t((a.rows + kTile - 1) / kTile) * ((a.cols + kTile - 1) / kTile);
    const Nvfp4Options opt = {a.rowwise, a.columnwise, a.block_2d, a.stochastic, a.rht};
    launch_pdl(kernel, grid_size(tiles, 1, per_sm), kTileThreads, stream, x, a.rows, a.cols, opt,
               a.global_scales, a.key, a.rht_signs, a.data, a.scales, a.data_t, a.scales_t);
  }
  return last_error();
}

ffi::Error Nvfp4QuantizeImpl(cudaStream_t stream, const Nvfp4QuantizeArgs& a) {
  if (a.rows == 0 || a.cols == 0 || !(a.rowwise || a.columnwise)) return ffi::Error::Success();
  return dispatch_input(a.x_type,
                        [&](auto t) { return Launch<typename decltype(t)::type>(stream, a); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4QuantizeCudaHandler,
                              DecodeThen(DecodeNvfp4Quantize, Nvfp4QuantizeImpl),
                              BindNvfp4Quantize(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
