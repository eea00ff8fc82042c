// CPU FFI handler for jax_fp8_nvfp4_quantize: the same numerics as the CUDA kernel (csrc/nvfp4.h),
// one thread. Arguments: nvfp4_quantize_args.h.
#include "../nvfp4.h"
#include "cpu_io.h"
#include "nvfp4_quantize_args.h"

namespace jax_fp8 {
namespace {

// One direction: 1 x 16 blocks along the rows of x (transposed: along its columns), written to
// out [outer, inner / 2] with scales [outer, inner / 16]; element (o, i) of the quantized
// matrix is x[o, i], or x[i, o] when transposed.
void quantize_direction(const Nvfp4QuantizeArgs& a, bool transposed, uint8_t* out,
                        uint8_t* scales) {
  const int64_t outer = transposed ? a.cols : a.rows, inner = transposed ? a.rows : a.cols;
  const int64_t blocks = inner / kNvfp4Block;
  const float global_scale = a.global_scales[transposed ? 1 : 0];
  const float encode = nvfp4_scale_encode(global_scale);
  const bool rht = transposed && a.rht;
  auto load = [&](int64_t o, int64_t i) {
    return load_f32(a.x, a.x_type, transposed ? i * a.cols + o : o * a.cols + i);
  };
  for (int64_t o = 0; o < outer; ++o) {
    for (int64_t b = 0; b < blocks; ++b) {
      float v[kNvfp4Block];
      for (int i = 0; i < kNvfp4Block; ++i) v[i] = load(o, b * kNvfp4Block + i);
      if (rht) hadamard16(v, a.rht_signs);
      uint32_t m = 0;
      if (a.block_2d) {  // the tile's 16 x 16 amax: x's rows o0 .. o0 + 15 of these columns
        const int64_t o0 = o / kNvfp4Block * kNvfp4Block;
        for (int64_t p = o0; p < o0 + kNvfp4Block; ++p)
          for (int i = 0; i < kNvfp4Block; ++i)
            m = std::max(m, abs_bits(load(p, b * kNvfp4Block + i)));
      } else {
        for (int i = 0; i < kNvfp4Block; ++i) m = std::max(m, abs_bits(v[i]));
      }
      const uint8_t s = nvfp4_scale(bits_float(m), encode);
      const SrBlockBits sr = a.stochastic ? sr_bits_of_block(a.key[0], a.key[1], uint32_t(b),
                                                             uint32_t(o), transposed ? 1u : 0u)
                                          : SrBlockBits{};
      const uint64_t codes = nvfp4_block_codes(v, s, global_scale, a.stochastic, sr);
      for (int j = 0; j < kNvfp4Block / 2; ++j)
        out[o * (inner / 2) + b * (kNvfp4Block / 2) + j] = uint8_t(codes >> (8 * j));
      scales[o * blocks + b] = s;
    }
  }
}

ffi::Error Nvfp4QuantizeImpl(const Nvfp4QuantizeArgs& a) {
  if (a.rowwise) quantize_direction(a, false, a.data, a.scales);
  if (a.columnwise) quantize_direction(a, true, a.data_t, a.scales_t);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Nvfp4QuantizeCpuHandler,
                              DecodeThen(DecodeNvfp4Quantize, Nvfp4QuantizeImpl),
                              BindNvfp4Quantize(ffi::Ffi::Bind()));

}  // namespace jax_fp8
