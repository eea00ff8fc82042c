// What a cast-transpose quantizes (csrc/kernels/sources.cuh), decoded and checked once for the
// per-tensor cast-transpose (cast_transpose_args.h) and block scaling's group cast-transpose
// (block_quantize_args.h), on both platforms.
#pragma once

#include "common.h"

namespace jax_fp8 {

struct SourceArgs {
  const void* x;
  const void* y;        // the pre-activation with grad, else unused
  const float* stats;   // a norm's row statistics [R, S], else unused
  const float* affine;  // a norm's gamma (and beta) [S, C], else unused
  ffi::DataType x_type;
  ActivationId activation;  // kNone: x itself, or its norm
  NormId norm;
  bool gated, grad;
  int64_t rows, cols;  // of what is quantized, [R, C]
  int64_t x_cols;
  // x in parts (x itself quantized): part i [R, part_cols[i]] holds columns from
  // sum_{j<i} part_cols[j] on; one part, x, unless DecodeParts found more.
  int num_parts;
  const void* part_data[kMaxParts];
  int64_t part_cols[kMaxParts];
};

// x as the one part of what is quantized.
inline void SetOnePart(SourceArgs& s) {
  s.num_parts = 1;
  s.part_data[0] = s.x;
  s.part_cols[0] = s.x_cols;
}

// x: a 2-D float32 / bfloat16 / float16 array.
inline ffi::Error CheckInput(ffi::AnyBuffer x) {
  if (!supported_input(x.element_type())) return invalid("x must be float32, bfloat16 or float16");
  if (x.dimensions().size() != 2) return invalid("x must be 2-D");
  return ffi::Error::Success();
}

// What is quantized, [R, C] (csrc/activation.h): with activation kNone, x [R, C] itself; else
// without grad, act(x) with x [R, C] (gated: act(gate) * up, x = [gate | up] [R, 2C]); with
// grad, the gradient through the activation from x = dh [R, Ch] and y = the pre-activation
// ([R, Ch]; gated [R, 2Ch], and C = 2Ch). y is empty unless grad. With a norm (csrc/norm.h;
// no activation), the norm of x [R, C] from stats [R, S] (S = 1: rsigma; LayerNorm, S = 2:
// mu, rsigma) and affine [S, C] (gamma; LayerNorm, S = 2: gamma, beta); both empty otherwise.
// `multiple`: what the columns of each output must be a positive multiple of (C, or Ch under a
// gated activation's gradient).
inline ffi::Error DecodeSource(SourceArgs& s, ffi::AnyBuffer x, ffi::AnyBuffer y,
                               F32Buffer stats, F32Buffer affine, int64_t activation,
                               bool gated, bool grad, int64_t norm, int64_t multiple) {
  if (ffi::Error e = CheckInput(x); e.failure()) return e;
  if (grad && y.element_type() != x.element_type()) return invalid("y must have x's dtype");
  if (grad && y.dimensions().size() != 2) return invalid("y must be 2-D");
  if (activation != int64_t(ActivationId::kNone) && activation != int64_t(ActivationId::kSilu) &&
      activation != int64_t(ActivationId::kGelu))
    return invalid("activation must be 0 (none), 1 (silu) or 2 (gelu)");
  const bool act = activation != int64_t(ActivationId::kNone);
  if (norm != int64_t(NormId::kNone) && norm != int64_t(NormId::kRms) &&
      norm != int64_t(NormId::kLayer))
    return invalid("norm must be 0 (none), 1 (rmsnorm) or 2 (layernorm)");
  const bool normed = norm != int64_t(NormId::kNone);
  if (normed && act) return invalid("a norm takes no activation");
  if (!act && (gated || grad)) return invalid("gated and grad need an activation");
  if (!grad && y.element_count() != 0) return invalid("y must be empty without grad");
  const int64_t rows = x.dimensions()[0], x_cols = x.dimensions()[1];
  const bool halved = act && gated && !grad;  // x = [gate | up]
  if (x_cols <= 0 || x_cols % (halved ? 2 * multiple : multiple))
    return invalid("x's columns must be a positive multiple of " + std::to_string(multiple) +
                   (halved ? " times 2 ([gate | up])" : ""));
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
  s.x = x.untyped_data();
  s.y = y.untyped_data();
  s.stats = stats.typed_data();
  s.affine = affine.typed_data();
  s.x_type = x.element_type();
  s.activation = static_cast<ActivationId>(activation);
  s.norm = static_cast<NormId>(norm);
  s.gated = gated, s.grad = grad;
  s.rows = rows, s.cols = cols, s.x_cols = x_cols;
  SetOnePart(s);
  return ffi::Error::Success();
}

// x's further parts (the op's remaining arguments), quantized as the columns after x's: each
// [R, C_i] in x's dtype, C_i a positive multiple of `multiple`, at most kMaxParts parts in all,
// and only where x itself is quantized (no activation, no norm).
inline ffi::Error DecodeParts(SourceArgs& s, ffi::RemainingArgs more, int64_t multiple) {
  if (more.empty()) return ffi::Error::Success();
  if (s.activation != ActivationId::kNone || s.norm != NormId::kNone)
    return invalid("x in parts takes no activation and no norm");
  if (more.size() >= size_t(kMaxParts))
    return invalid("x comes in at most " + std::to_string(kMaxParts) + " parts");
  for (size_t i = 0; i < more.size(); ++i) {
    ffi::ErrorOr<ffi::AnyBuffer> b = more.get<ffi::AnyBuffer>(i);
    if (!b.has_value()) return b.error();
    const auto dims = b->dimensions();
    if (b->element_type() != s.x_type || dims.size() != 2 || dims[0] != s.rows || dims[1] <= 0 ||
        dims[1] % multiple)
      return invalid("x's parts must be [R, C_i] in x's dtype, C_i a positive multiple of " +
                     std::to_string(multiple));
    s.part_data[s.num_parts] = b->untyped_data();
    s.part_cols[s.num_parts++] = dims[1];
    s.cols += dims[1];
  }
  return ffi::Error::Success();
}

// x [R, C] itself (an op that takes no other source), C a positive multiple of `multiple`.
inline ffi::Error DecodePlainSource(SourceArgs& s, ffi::AnyBuffer x, int64_t multiple) {
  if (ffi::Error e = CheckInput(x); e.failure()) return e;
  const int64_t rows = x.dimensions()[0], cols = x.dimensions()[1];
  if (cols <= 0 || cols % multiple)
    return invalid("x's columns must be a positive multiple of " + std::to_string(multiple));
  s = SourceArgs{};
  s.x = x.untyped_data();
  s.x_type = x.element_type();
  s.activation = ActivationId::kNone;
  s.norm = NormId::kNone;
  s.rows = rows, s.cols = s.x_cols = cols;
  SetOnePart(s);
  return ffi::Error::Success();
}

// On CUDA, the inputs the kernels read with 16-byte loads aligned: x and its parts, and y or
// affine where used.
inline ffi::Error CheckSourceAligned(Platform platform, const SourceArgs& s) {
  for (int i = 1; i < s.num_parts; ++i)
    if (ffi::Error e = check_aligned16(platform, {s.part_data[i]}, "x's parts"); e.failure())
      return e;
  return check_aligned16(platform,
                         {s.x, s.grad ? s.y : s.x, s.norm != NormId::kNone ? s.affine : s.x},
                         "x, y and affine");
}

template <typename B>
auto BindSource(B&& binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()  // x [R, C] (see DecodeSource)
      .template Arg<ffi::AnyBuffer>()  // y: the pre-activation with grad, else [0]
      .template Arg<F32Buffer>()       // stats [R, S] with a norm, else [0, 0]
      .template Arg<F32Buffer>();      // affine [S, C] with a norm, else [0, 0]
}

}  // namespace jax_fp8
