// CPU FFI handlers for jax_fp8_block_quantize and jax_fp8_group_cast_transpose: the same
// numerics and layouts as the CUDA tile kernel (csrc/kernels/block_quantize.cuh), one thread,
// the elements from the source (cpu_io.h source_values).
// Arguments: block_quantize_args.h.
#include <algorithm>

#include "block_quantize_args.h"
#include "cpu_io.h"

namespace jax_fp8 {
namespace {

constexpr int64_t kTile = kBlockTile;

// What is quantized, each element evaluated once (cpu_io.h source_values), and the group_scale
// and FP8 bytes taken from it.
struct Values {
  const BlockQuantizeArgs& a;
  std::vector<float> v;
  explicit Values(const BlockQuantizeArgs& args) : a(args), v(source_values(args.src)) {}
  float at(int64_t r, int64_t c) const { return v[size_t(r * a.src.cols + c)]; }
  // group_scale of the region [r0, r1) x [c0, c1).
  float scale(int64_t r0, int64_t r1, int64_t c0, int64_t c1) const {
    const float amax = amax_over([&](int64_t r, int64_t c) { return at(r, c); }, r0, r1, c0, c1);
    return group_scale(amax, a.eps, a.fmt, a.ue8m0);
  }
  uint8_t quantized(int64_t r, int64_t c, float inv) const {
    const float v = a.ue8m0 ? top_scale_saturate(at(r, c), a.fmt) : at(r, c);
    return float_to_fp8(v * inv, a.fmt);
  }
};

ffi::Error BlockQuantizeImpl(const BlockQuantizeArgs& a) {
  const Values x(a);
  const int64_t rows = a.src.rows, cols = a.src.cols;
  const int64_t br = (rows + kTile - 1) / kTile, bc = (cols + kTile - 1) / kTile;
  for (int64_t i = 0; i < br; ++i) {
    for (int64_t j = 0; j < bc; ++j) {
      const int64_t r1 = std::min(rows, (i + 1) * kTile), c1 = std::min(cols, (j + 1) * kTile);
      const float s = x.scale(i * kTile, r1, j * kTile, c1);
      const float inv = 1.0f / s;
      a.scales[i * bc + j] = s;
      for (int64_t r = i * kTile; r < r1; ++r)
        for (int64_t c = j * kTile; c < c1; ++c) a.q[r * cols + c] = x.quantized(r, c, inv);
    }
  }
  return ffi::Error::Success();
}

ffi::Error GroupCastTransposeImpl(const BlockQuantizeArgs& a) {
  const Values x(a);
  const int64_t rows = a.src.rows, cols = a.src.cols;
  const int64_t rows128 = (rows + kTile - 1) / kTile * kTile;
  for (int64_t r = 0; r < rows; ++r) {  // 1 x 128 groups along rows; scales [C/128, R]
    for (int64_t g = 0; g < cols / kTile; ++g) {
      const float s = x.scale(r, r + 1, g * kTile, (g + 1) * kTile);
      const float inv = 1.0f / s;
      a.scales[g * rows + r] = s;
      for (int64_t c = g * kTile; c < (g + 1) * kTile; ++c)
        a.q[r * cols + c] = x.quantized(r, c, inv);
    }
  }
  for (int64_t c = 0; c < cols; ++c) {  // 128 x 1 groups along columns, transposed, zero-padded
    for (int64_t t = 0; t < rows128 / kTile; ++t) {
      const int64_t r0 = t * kTile, r1 = std::min(rows, r0 + kTile);
      const float s = x.scale(r0, r1, c, c + 1);
      const float inv = 1.0f / s;
      a.scales_t[t * cols + c] = s;
      for (int64_t r = r0; r < r0 + kTile; ++r)  // zero padding past R
        a.qt[c * rows128 + r] = r < rows ? x.quantized(r, c, inv) : 0;
    }
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(BlockQuantizeCpuHandler,
                              DecodeThen(DecodeBlockQuantize, BlockQuantizeImpl),
                              BindBlockQuantize(ffi::Ffi::Bind()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupCastTransposeCpuHandler,
                              DecodeThen(DecodeGroupCastTranspose, GroupCastTransposeImpl),
                              BindGroupCastTranspose(ffi::Ffi::Bind()));

}  // namespace jax_fp8
