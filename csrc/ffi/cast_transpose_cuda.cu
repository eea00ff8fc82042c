// CUDA FFI handler for jax_fp8_cast_transpose_ring: pick the instantiation and launch.
// Arguments: cast_transpose_args.h.
#include <cuda_runtime.h>

#include "../kernels/cast_transpose.cuh"
#include "cast_transpose_args.h"
#include "items.h"
#include "launch.h"
#include "sources_cuda.h"

namespace jax_fp8 {
namespace {

template <bool kDbias, typename Src>
ffi::Error Launch(cudaStream_t stream, const CastTransposeArgs& a, Src src) {
  auto* scratch = static_cast<QuantizeScratch*>(a.scratch);
  if (cudaMemsetAsync(scratch, 0, sizeof(QuantizeScratch), stream) != cudaSuccess)
    return ffi::Error::Internal("cudaMemsetAsync failed");
  const int64_t cols = a.src.cols / Src::kOutputs;  // the source's columns, per output
  const size_t n = size_t(a.src.rows) * cols;
  launch_pdl(first_step_source_amax_kernel<Src>,
             grid_size(n, kQuantizeThreads * kElemsPerThread, 8), kQuantizeThreads, stream, src,
             a.src.rows, cols, a.ring.steps, scratch);
  // A persistent grid over the tiles of as many blocks as fit on the SMs at once (one wave:
  // the kernel's registers decide how many, so the count is queried rather than assumed), at
  // least one, so an empty x still records its (zero) amax.
  const size_t tiles =
      size_t((cols + kTile - 1) / kTile) * size_t((a.src.rows + kTile - 1) / kTile);
  static const int per_sm =
      resident_blocks_per_sm(cast_transpose_kernel<Src, true, kDbias>, kTileThreads);
  launch_pdl(cast_transpose_kernel<Src, true, kDbias>, grid_size(tiles, 1, per_sm), kTileThreads,
             stream, src, a.src.rows, cols, a.rows16, a.ring.scale, a.fmt, a.q, a.qt, a.amax,
             a.dbias_partial, scratch, a.ring);
  if constexpr (kDbias) {
    const int64_t row_tiles = (a.src.rows + kTile - 1) / kTile;
    launch_pdl(dbias_reduce_kernel, int((a.src.cols + kDbiasCols - 1) / kDbiasCols), kTileThreads,
               stream, static_cast<const float*>(a.dbias_partial), row_tiles, a.src.cols, a.dbias);
  }
  return last_error();
}

ffi::Error CastTransposeRingImpl(cudaStream_t stream, const CastTransposeArgs& a) {
  return dispatch_input(a.src.x_type, [&](auto t) {
    return with_source<typename decltype(t)::type, true>(a.src, [&](auto src) {
      if constexpr (decltype(src)::kDbias)
        if (a.with_dbias) return Launch<true>(stream, a, src);
      return Launch<false>(stream, a, src);
    });
  });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CastTransposeRingCudaHandler,
                              each_item<2>(DecodeThen(DecodeCastTransposeRing,
                                                      CastTransposeRingImpl)),
                              BindCastTransposeRing(BindCuda()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
