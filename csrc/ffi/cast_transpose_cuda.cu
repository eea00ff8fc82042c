// CUDA FFI handler for jax_fp8_cast_transpose_ring: decode, validate, launch.
#include <cuda_runtime.h>

#include "../kernels/cast_transpose.cuh"
#include "common.h"
#include "launch.h"

namespace jax_fp8 {
namespace {

struct CastTransposeArgs {
  const void* x;
  int64_t rows, cols, rows16;
  const float* scale;
  Fp8Format fmt;
  uint8_t *q, *qt;
  float *amax, *dbias_partial, *dbias;
  QuantizeScratch* scratch;
  RingArgs ring;
};

template <typename T, bool kDbias>
ffi::Error Launch(cudaStream_t stream, const CastTransposeArgs& a) {
  if (cudaMemsetAsync(a.scratch, 0, sizeof(QuantizeScratch), stream) != cudaSuccess)
    return ffi::Error::Internal("cudaMemsetAsync failed");
  const size_t n = size_t(a.rows) * a.cols;
  launch_pdl(first_step_amax_kernel<T>, grid_size(n, kQuantizeThreads * kElemsPerThread, 8),
             kQuantizeThreads, stream, static_cast<const T*>(a.x), n,
             static_cast<const float*>(a.ring.steps), a.scratch);
  // At least one row of tiles, so an empty x still records its (zero) amax; a persistent grid
  // over them of as many blocks as fit on the SMs at once (one wave: the registers decide, on
  // sm_90 with 16-bit inputs 5 blocks an SM at 48 registers a thread, 6 at 40 with the dbias
  // sums; a grid sized for 8 blocks an SM ran the dbias kernel in 1.33 waves).
  const size_t tiles = size_t((a.cols + kTile - 1) / kTile) *
                       size_t(std::max<int64_t>(1, (a.rows + kTile - 1) / kTile));
  static const int per_sm = resident_blocks_per_sm(cast_transpose_kernel<T, true, kDbias>, kTileThreads);
  launch_pdl(cast_transpose_kernel<T, true, kDbias>, grid_size(tiles, 1, per_sm), kTileThreads, stream,
             static_cast<const T*>(a.x), a.rows, a.cols, a.rows16, a.scale, a.fmt, a.q, a.qt,
             a.amax, a.dbias_partial, a.scratch, a.ring);
  if constexpr (kDbias) {
    const int64_t row_tiles = (a.rows + kTile - 1) / kTile;
    launch_pdl(dbias_reduce_kernel, int((a.cols + kDbiasCols - 1) / kDbiasCols), kTileThreads,
               stream, static_cast<const float*>(a.dbias_partial), row_tiles, a.cols, a.dbias);
  }
  return last_error();
}

template <bool kDbias>
ffi::Error Dispatch(cudaStream_t stream, ffi::DataType t, const CastTransposeArgs& a) {
  switch (t) {
    case ffi::DataType::F32: return Launch<float, kDbias>(stream, a);
    case ffi::DataType::BF16: return Launch<__nv_bfloat16, kDbias>(stream, a);
    case ffi::DataType::F16: return Launch<__half, kDbias>(stream, a);
    default: return invalid("x must be float32, bfloat16 or float16");
  }
}

ffi::Error CastTransposeRingImpl(
    cudaStream_t stream, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> history, ffi::Buffer<ffi::F32> scale,
    ffi::Buffer<ffi::F32> steps, ffi::Result<ffi::AnyBuffer> q, ffi::Result<ffi::AnyBuffer> qt,
    ffi::Result<ffi::Buffer<ffi::F32>> amax, ffi::Result<ffi::Buffer<ffi::F32>> history_out,
    ffi::Result<ffi::Buffer<ffi::F32>> scale_out, ffi::Result<ffi::Buffer<ffi::F32>> steps_out,
    ffi::Result<ffi::Buffer<ffi::F32>> dbias_partial, ffi::Result<ffi::Buffer<ffi::F32>> dbias,
    ffi::Result<ffi::AnyBuffer> scratch, int64_t margin, int64_t algo, bool with_dbias) {
  if (x.dimensions().size() != 2) return invalid("x must be 2-D");
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1], rows16 = (rows + 15) / 16 * 16;
  if (!is_fp8(q->element_type()) || qt->element_type() != q->element_type())
    return invalid("q and qt must share an FP8 dtype");
  if (cols <= 0 || cols % 16) return invalid("x's columns must be a positive multiple of 16");
  if (q->element_count() != size_t(rows * cols) || qt->element_count() != size_t(cols * rows16))
    return invalid("q must be [R, C] and qt [C, ceil16(R)]");
  if (with_dbias && (dbias_partial->element_count() != size_t((rows + kTile - 1) / kTile * cols) ||
                     dbias->element_count() != size_t(cols)))
    return invalid("dbias_partial must be [ceil(R / 64), C] and dbias [C]");
  if (auto e = check_ring_attrs(algo, history.element_count(), kMaxHistory); e.failure()) return e;
  if (history_out->typed_data() != history.typed_data() ||
      scale_out->typed_data() != scale.typed_data() || steps_out->typed_data() != steps.typed_data())
    return invalid("ring outputs must alias the ring inputs");
  if (scratch->size_bytes() < sizeof(QuantizeScratch)) return invalid("scratch too small");
  if (!aligned16(x.untyped_data()) || !aligned16(q->untyped_data()) ||
      !aligned16(qt->untyped_data()))
    return invalid("x, q and qt must be 16-byte aligned");
  CastTransposeArgs a{x.untyped_data(), rows, cols, rows16, scale_out->typed_data(),
                      fp8_format(q->element_type()), static_cast<uint8_t*>(q->untyped_data()),
                      static_cast<uint8_t*>(qt->untyped_data()), amax->typed_data(),
                      dbias_partial->typed_data(), dbias->typed_data(),
                      static_cast<QuantizeScratch*>(scratch->untyped_data()),
                      RingArgs{history_out->typed_data(), scale_out->typed_data(),
                               steps_out->typed_data(), static_cast<int>(history.element_count()),
                               static_cast<int>(margin), static_cast<AmaxAlgo>(algo)}};
  return with_dbias ? Dispatch<true>(stream, x.element_type(), a)
                    : Dispatch<false>(stream, x.element_type(), a);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(CastTransposeRingCudaHandler, CastTransposeRingImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()            // x [R, C]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // history [L]
                                  .Arg<ffi::Buffer<ffi::F32>>()     // scale []
                                  .Arg<ffi::Buffer<ffi::F32>>()     // steps []
                                  .Ret<ffi::AnyBuffer>()            // q [R, C]
                                  .Ret<ffi::AnyBuffer>()            // qt [C, R16]
                                  .Ret<ffi::Buffer<ffi::F32>>()     // amax []
                                  .Ret<ffi::Buffer<ffi::F32>>()     // history' (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()     // scale' (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()     // steps' (aliased)
                                  .Ret<ffi::Buffer<ffi::F32>>()     // dbias_partial [R/64, C]
                                  .Ret<ffi::Buffer<ffi::F32>>()     // dbias [C]
                                  .Ret<ffi::AnyBuffer>()            // scratch
                                  .Attr<int64_t>("margin")
                                  .Attr<int64_t>("algo")
                                  .Attr<bool>("with_dbias"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
