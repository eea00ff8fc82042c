// jax_fp8_cast_transpose_ring: its Bind chain and argument decoder, shared by the CPU handler
// (cast_transpose_cpu.cc) and the CUDA one (cast_transpose_cuda.cu).
#pragma once

#include "ring_args.h"
#include "source_args.h"

namespace jax_fp8 {

struct CastTransposeArgs {
  SourceArgs src;   // what is quantized, [R, C]
  int64_t rows16;   // R rounded up to kQtRowMultiple: qt's row length
  Fp8Format fmt;
  uint8_t *q, *qt;
  float* amax;
  bool with_dbias;
  float* dbias_partial;  // [ceil(rows / kDbiasTileRows), cols] with dbias, else empty
  float* dbias;          // [cols] with dbias, else empty
  void* scratch;         // kQuantizeScratchWords words, used on CUDA only
  RingArgs ring;
};

// x, y, stats, affine and the source's attributes: source_args.h; x's further parts, if any,
// are the remaining arguments (DecodeParts). with_dbias: the column sums
// of what is quantized, which must be x itself or the gradient through an activation.
inline ffi::Error DecodeCastTransposeRing(
    Platform platform, CastTransposeArgs& a, ffi::AnyBuffer x, ffi::AnyBuffer y,
    F32Buffer stats, F32Buffer affine, F32Buffer history,
    F32Buffer scale, F32Buffer steps, ffi::RemainingArgs parts, ffi::Result<ffi::AnyBuffer> q,
    ffi::Result<ffi::AnyBuffer> qt, F32Result scale_used, F32Result amax, F32Result history_out,
    F32Result scale_out, F32Result steps_out, F32Result dbias_partial, F32Result dbias,
    ffi::Result<ffi::AnyBuffer> scratch, int64_t margin, int64_t algo, bool observe,
    bool with_dbias, int64_t activation, bool gated, bool grad, int64_t norm) {
  if (ffi::Error e = DecodeSource(a.src, x, y, stats, affine, activation, gated, grad, norm,
                                  kColMultiple);
      e.failure())
    return e;
  if (ffi::Error e = DecodeParts(a.src, parts, kColMultiple); e.failure()) return e;
  if (!is_fp8(q->element_type()) || qt->element_type() != q->element_type())
    return invalid("q and qt must share an FP8 dtype");
  const SourceArgs& s = a.src;
  if (with_dbias && (s.norm != NormId::kNone || (s.activation != ActivationId::kNone && !grad)))
    return invalid("with_dbias needs x itself or grad under an activation");
  const int64_t rows = s.rows, cols = s.cols;
  const int64_t rows16 = (rows + kQtRowMultiple - 1) / kQtRowMultiple * kQtRowMultiple;
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
  a.rows16 = rows16;
  a.fmt = fp8_format(q->element_type());
  a.q = static_cast<uint8_t*>(q->untyped_data());
  a.qt = static_cast<uint8_t*>(qt->untyped_data());
  a.amax = amax->typed_data();
  a.with_dbias = with_dbias;
  a.dbias_partial = dbias_partial->typed_data();
  a.dbias = dbias->typed_data();
  a.scratch = scratch->untyped_data();
  if (ffi::Error e = CheckSourceAligned(platform, s); e.failure()) return e;
  return check_aligned16(platform, {a.q, a.qt}, "q and qt");
}

template <typename B>
auto BindCastTransposeRing(B binding) {
  return BindSource(std::move(binding))  // x, y, stats, affine
      .template Arg<F32Buffer>()       // history [L]
      .template Arg<F32Buffer>()       // scale []
      .template Arg<F32Buffer>()       // steps []
      .RemainingArgs()                 // x's further parts [R, C_i], if any
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
      .template Attr<bool>("with_dbias")
      .template Attr<int64_t>("activation")
      .template Attr<bool>("gated")
      .template Attr<bool>("grad")
      .template Attr<int64_t>("norm");
}

}  // namespace jax_fp8
