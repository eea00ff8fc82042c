// CPU FFI handler for jax_fp8_mxfp8_quantize: the same numerics as the CUDA kernel (csrc/mx.h),
// one thread. Arguments: mxfp8_quantize_args.h.
#include "../mx.h"
#include "cpu_io.h"
#include "mxfp8_quantize_args.h"

namespace jax_fp8 {
namespace {

// One direction: blocks of 32 along the rows of x (transposed: along its columns), written to
// out [outer, inner] with scales [outer, inner / 32]; element (o, i) of the quantized matrix is
// x[o, i], or x[i, o] when transposed.
void quantize_direction(const Mxfp8QuantizeArgs& a, bool transposed, uint8_t* out,
                        uint8_t* scales) {
  const int64_t outer = transposed ? a.cols : a.rows, inner = transposed ? a.rows : a.cols;
  auto index = [&](int64_t o, int64_t i) { return transposed ? i * a.cols + o : o * a.cols + i; };
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t i0 = 0; i0 < inner; i0 += kMxBlock) {
      uint32_t m = 0;
      for (int64_t i = i0; i < i0 + kMxBlock; ++i)
        m = std::max(m, abs_bits(load_f32(a.x, a.x_type, index(o, i))));
      const uint8_t s = e8m0_rceil(bits_float(m), a.fmt);
      const float inv = e8m0_inverse(s);
      for (int64_t i = i0; i < i0 + kMxBlock; ++i)
        out[o * inner + i] =
            float_to_fp8(e8m0_saturate(load_f32(a.x, a.x_type, index(o, i)), s, a.fmt) * inv, a.fmt);
      scales[o * (inner / kMxBlock) + i0 / kMxBlock] = s;
    }
  }
}

ffi::Error Mxfp8QuantizeImpl(const Mxfp8QuantizeArgs& a) {
  if (a.rowwise) quantize_direction(a, false, a.data, a.scales);
  if (a.columnwise) quantize_direction(a, true, a.data_t, a.scales_t);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Mxfp8QuantizeCpuHandler,
                              DecodeThen(DecodeMxfp8Quantize, Mxfp8QuantizeImpl),
                              BindMxfp8Quantize(ffi::Ffi::Bind()));

}  // namespace jax_fp8
