// CUDA FFI handler for jax_fp8_group_quantize: pick the instantiation and launch (with PDL).
// Arguments: group_quantize_args.h.
#include <cuda_runtime.h>

#include "../kernels/group_quantize.cuh"
#include "group_quantize_args.h"
#include "launch.h"

namespace jax_fp8 {
namespace {

template <typename T, int G>
ffi::Error Launch(cudaStream_t stream, const GroupQuantizeArgs& a) {
  const size_t n = size_t(a.rows) * a.cols;
  // One wave: as many blocks as fit at once (the kernel's launch bound and registers decide).
  constexpr auto kernel = group_quantize_kernel<T, G, F32GroupScale>;
  static const int per_sm = resident_blocks_per_sm(kernel, kQuantizeThreads);
  launch_pdl(kernel, grid_size(n, kQuantizeThreads * kElemsPerThread, per_sm), kQuantizeThreads,
             stream, static_cast<const T*>(a.x), a.rows, a.cols, F32GroupScale{a.eps, a.ue8m0},
             a.fmt, a.q, a.scales, a.layout);
  return last_error();
}

template <typename T>
ffi::Error ForGroup(cudaStream_t stream, const GroupQuantizeArgs& a) {
  static_assert(sizeof(kGroupSizes) / sizeof(kGroupSizes[0]) == 4, "one case per group size");
  switch (a.group_size) {
    case kGroupSizes[0]: return Launch<T, kGroupSizes[0]>(stream, a);
    case kGroupSizes[1]: return Launch<T, kGroupSizes[1]>(stream, a);
    case kGroupSizes[2]: return Launch<T, kGroupSizes[2]>(stream, a);
    case kGroupSizes[3]: return Launch<T, kGroupSizes[3]>(stream, a);
    default: return invalid("group_size must be 16, 32, 64 or 128");
  }
}

ffi::Error GroupQuantizeImpl(cudaStream_t stream, const GroupQuantizeArgs& a) {
  if (a.rows == 0 || a.cols == 0) return ffi::Error::Success();
  return dispatch_input(a.x_type,
                        [&](auto t) { return ForGroup<typename decltype(t)::type>(stream, a); });
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupQuantizeCudaHandler,
                              DecodeThen(DecodeGroupQuantize, GroupQuantizeImpl),
                              BindGroupQuantize(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
