// jax_fp8_cast_transpose_ring: its Bind chain and argument decoder, shared by the CPU handler
// (cast_transpose_cpu.cc) and the CUDA one (cast_transpose_cuda.cu).
#pragma once

#include "ring_args.h"

namespace jax_fp8 {

struct CastTransposeArgs {
  const void* x;
  ffi::DataType x_type;
  int64_t rows, cols, rows16;  // rows16: rows rounded up to kQtRowMultiple, qt's row length
  Fp8Format fmt;
  uint8_t *q, *qt;
  float* amax;
  bool with_dbias;
  float* dbias_partial;  // [ceil(rows / kDbiasTileRows), cols] with dbias, else empty
  float* dbias;          // [cols] with dbias, else empty
  void* scratch;         // kQuantizeScratchWords words, used on CUDA only
  RingArgs ring;
};

inline ffi::Error DecodeCastTransposeRing(
    Platform platform, CastTransposeArgs& a, ffi::AnyBuffer x, F32Buffer history,
    F32Buffer scale, F32Buffer steps, ffi::Result<ffi::AnyBuffer> q,
    ffi::Result<ffi::AnyBuffer> qt, F32Result scale_used, F32Result amax, F32Result history_out,
    F32Result scale_out, F32Result steps_out, F32Result dbias_partial, F32Result dbias,
    ffi::Result<ffi::AnyBuffer> scratch, int64_t margin, int64_t algo, bool observe,
    bool with_dbias) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (!is_fp8(q->element_type()) || qt->element_type() != q->element_type())
    return invalid("q and qt must share an FP8 dtype");
  if (x.dimensions().size() != 2) return invalid("x must be 2-D");
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  const int64_t rows16 = (rows + kQtRowMultiple - 1) / kQtRowMultiple * kQtRowMultiple;
  if (cols <= 0 || cols % kColMultiple)
    return invalid("x's columns must be a positive multiple of 16");
  if (q->element_count() != size_t(rows * cols) || qt->element_count() != size_t(cols * rows16))
    return invalid("q must be [R, C] and qt [C, ceil16(R)]");
  if (amax->element_count() != 1) return invalid("amax must be f32[]");
  const int64_t tiles = (rows + kDbiasTileRows - 1) / kDbiasTileRows;
  if (dbias_partial->element_count() != size_t(with_dbias ? tiles * cols : 0) ||
      dbias->element_count() != size_t(with_dbias ? cols : 0))
    return invalid("dbias_partial must be [ceil(R / 64), C] and dbias [C] (both empty without "
                   "with_dbias)");
  if (scratch->size_bytes() < kQuantizeScratchWords * sizeof(uint32_t))
    return invalid("scratch too small");
  if (ffi::Error e = DecodeRing(a.ring, history, scale, steps, scale_used, history_out,
                                scale_out, steps_out, margin, algo, observe);
      e.failure())
    return e;
  a.x = x.untyped_data();
  a.x_type = x.element_type();
  a.rows = rows, a.cols = cols, a.rows16 = rows16;
  a.fmt = fp8_format(q->element_type());
  a.q = static_cast<uint8_t*>(q->untyped_data());
  a.qt = static_cast<uint8_t*>(qt->untyped_data());
  a.amax = amax->typed_data();
  a.with_dbias = with_dbias;
  a.dbias_partial = dbias_partial->typed_data();
  a.dbias = dbias->typed_data();
  a.scratch = scratch->untyped_data();
  return check_aligned16(platform, {a.x, a.q, a.qt}, "x, q and qt");
}

template <typename B>
auto BindCastTransposeRing(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x [R, C]
      .template Arg<F32Buffer>()       // history [L]
      .template Arg<F32Buffer>()       // scale []
      .template Arg<F32Buffer>()       // steps []
      .template Ret<ffi::AnyBuffer>()  // q [R, C]
      .template Ret<ffi::AnyBuffer>()  // qt [C, ceil16(R)]
      .template Ret<F32Buffer>()       // scale_used []
      .template Ret<F32Buffer>()       // amax []
      .template Ret<F32Buffer>()       // history_out [L]
      .template Ret<F32Buffer>()       // scale_out []
      .template Ret<F32Buffer>()       // steps_out []
      .template Ret<F32Buffer>()       // dbias_partial [ceil(R/64), C] or [0, 0]
      .template Ret<F32Buffer>()       // dbias [C] or [0]
      .template Ret<ffi::AnyBuffer>()  // scratch u32[kQuantizeScratchWords]
      .template Attr<int64_t>("margin")
      .template Attr<int64_t>("algo")
      .template Attr<bool>("observe")
      .template Attr<bool>("with_dbias");
}

}  // namespace jax_fp8
