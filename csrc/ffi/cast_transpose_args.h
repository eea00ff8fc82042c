// jax_fp8_cast_transpose_ring: its Bind chain and argument decoder, shared by the CPU handler
// (cast_transpose_cpu.cc) and the CUDA one (cast_transpose_cuda.cu).
#pragma once

#include "ring_args.h"

namespace jax_fp8 {

struct CastTransposeArgs {
  const void* x;
  const void* y;  // the pre-activation with `grad`, else unused
  const float* stats;   // a norm's row statistics [R, S], else unused
  const float* affine;  // a norm's gamma (and beta) [A, C], else unused
  ffi::DataType x_type;
  ActivationId activation;  // kNone: q is x quantized (or its norm)
  NormId norm;
  bool gated, grad;
  int64_t rows, cols, rows16;  // of q; rows16: rows rounded up to kQtRowMultiple, qt's row length
  int64_t x_cols;
  Fp8Format fmt;
  uint8_t *q, *qt;
  float* amax;
  bool with_dbias;
  float* dbias_partial;  // [ceil(rows / kDbiasTileRows), cols] with dbias, else empty
  float* dbias;          // [cols] with dbias, else empty
  void* scratch;         // kQuantizeScratchWords words, used on CUDA only
  RingArgs ring;
};

// What is quantized, [R, C] (csrc/activation.h): with activation kNone, x [R, C] itself; else
// without grad, act(x) with x [R, C] (gated: act(gate) * up, x = [gate | up] [R, 2C]); with
// grad, the gradient through the activation from x = dh [R, Ch] and y = the pre-activation
// ([R, Ch]; gated [R, 2Ch], and C = 2Ch). y is empty unless grad. With a norm (csrc/norm.h;
// no activation), the norm of x [R, C] from stats [R, S] (S = 1: rsigma; LayerNorm, S = 2:
// mu, rsigma) and affine [A, C] (gamma; LayerNorm, A = 2: gamma, beta); both empty otherwise.
inline ffi::Error DecodeCastTransposeRing(
    Platform platform, CastTransposeArgs& a, ffi::AnyBuffer x, ffi::AnyBuffer y,
    F32Buffer stats, F32Buffer affine, F32Buffer history,
    F32Buffer scale, F32Buffer steps, ffi::Result<ffi::AnyBuffer> q,
    ffi::Result<ffi::AnyBuffer> qt, F32Result scale_used, F32Result amax, F32Result history_out,
    F32Result scale_out, F32Result steps_out, F32Result dbias_partial, F32Result dbias,
    ffi::Result<ffi::AnyBuffer> scratch, int64_t margin, int64_t algo, bool observe,
    bool with_dbias, int64_t activation, bool gated, bool grad, int64_t norm) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (grad && y.element_type() != x.element_type()) return invalid("y must have x's dtype");
  if (!is_fp8(q->element_type()) || qt->element_type() != q->element_type())
    return invalid("q and qt must share an FP8 dtype");
  if (x.dimensions().size() != 2) return invalid("x must be 2-D");
  if (grad && y.dimensions().size() != 2) return invalid("y must be 2-D");
  if (activation != int64_t(ActivationId::kNone) && activation != int64_t(ActivationId::kSilu) &&
      activation != int64_t(ActivationId::kGelu))
    return invalid("activation must be 0 (none), 1 (silu) or 2 (gelu)");
  const bool act = activation != int64_t(ActivationId::kNone);
  if (norm != int64_t(NormId::kNone) && norm != int64_t(NormId::kRms) &&
      norm != int64_t(NormId::kLayer))
    return invalid("norm must be 0 (none), 1 (rmsnorm) or 2 (layernorm)");
  const bool normed = norm != int64_t(NormId::kNone);
  if (normed && (act || with_dbias)) return invalid("a norm takes no activation and no dbias");
  if (!act && (gated || grad)) return invalid("gated and grad need an activation");
  if (act && !grad && with_dbias) return invalid("with_dbias needs grad under an activation");
  if (!grad && y.element_count() != 0) return invalid("y must be empty without grad");
  const int64_t rows = x.dimensions()[0], x_cols = x.dimensions()[1];
  const int64_t rows16 = (rows + kQtRowMultiple - 1) / kQtRowMultiple * kQtRowMultiple;
  if (x_cols <= 0 || x_cols % (act && gated && !grad ? 2 * kColMultiple : kColMultiple))
    return invalid("x's columns must be a positive multiple of 16 (32 for a gated activation's "
                   "forward)");
  const int64_t cols = !act ? x_cols : !grad ? (gated ? x_cols / 2 : x_cols)
                                             : (gated ? 2 * x_cols : x_cols);
  if (grad && (y.dimensions()[0] != rows || y.dimensions()[1] != cols))
    return invalid("y must be [R, Ch] ([R, 2 Ch] gated) for dh = x [R, Ch]");
  const int64_t per_row = norm == int64_t(NormId::kLayer) ? 2 : normed ? 1 : 0;
  if (stats.dimensions().size() != 2 || stats.dimensions()[0] != (normed ? rows : 0) ||
      stats.dimensions()[1] != per_row || affine.dimensions().size() != 2 ||
      affine.dimensions()[0] != per_row || affine.dimensions()[1] != (normed ? cols : 0))
    return invalid("stats must be [R, S] and affine [S, C], S = 1 for rmsnorm and 2 for "
                   "layernorm ([0, 0] both without a norm)");
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
  a.y = y.untyped_data();
  a.stats = stats.typed_data();
  a.affine = affine.typed_data();
  a.x_type = x.element_type();
  a.activation = static_cast<ActivationId>(activation);
  a.norm = static_cast<NormId>(norm);
  a.gated = gated, a.grad = grad;
  a.rows = rows, a.cols = cols, a.rows16 = rows16, a.x_cols = x_cols;
  a.fmt = fp8_format(q->element_type());
  a.q = static_cast<uint8_t*>(q->untyped_data());
  a.qt = static_cast<uint8_t*>(qt->untyped_data());
  a.amax = amax->typed_data();
  a.with_dbias = with_dbias;
  a.dbias_partial = dbias_partial->typed_data();
  a.dbias = dbias->typed_data();
  a.scratch = scratch->untyped_data();
  return check_aligned16(platform, {a.x, grad ? a.y : a.x, normed ? a.affine : a.x, a.q, a.qt},
                         "x, y, affine, q and qt");
}

template <typename B>
auto BindCastTransposeRing(B binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x [R, C] (see DecodeCastTransposeRing)
      .template Arg<ffi::AnyBuffer>()  // y: the pre-activation with grad, else [0]
      .template Arg<F32Buffer>()       // stats [R, S] with a norm, else [0, 0]
      .template Arg<F32Buffer>()       // affine [S, C] with a norm, else [0, 0]
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
      .template Attr<bool>("with_dbias")
      .template Attr<int64_t>("activation")
      .template Attr<bool>("gated")
      .template Attr<bool>("grad")
      .template Attr<int64_t>("norm");
}

}  // namespace jax_fp8
