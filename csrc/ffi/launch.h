// What the CUDA handlers share: kernel launch with Programmatic Dependent Launch on sm_90+
// (programmatic stream serialization; kernels wait with cudaGridDependencySynchronize before
// reading upstream data), the pick of a kernel instantiation by input dtype, and the start and
// the callable of every CUDA handler (the stream, then the op's one decoder).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdlib>
#include <mutex>

#include "common.h"
#include "xla/ffi/api/ffi.h"

namespace jax_fp8 {

struct DeviceInfo {
  int sm_count = 0;
  int major = 0;
};

// Queried once per device (no stream work, so safe inside command-buffer capture).
inline DeviceInfo device_info() {
  static std::mutex mu;
  static DeviceInfo cache[64];
  int dev = 0;
  cudaGetDevice(&dev);
  std::lock_guard<std::mutex> lock(mu);
  DeviceInfo& d = cache[dev % 64];
  if (d.sm_count == 0) {
    cudaDeviceGetAttribute(&d.sm_count, cudaDevAttrMultiProcessorCount, dev);
    cudaDeviceGetAttribute(&d.major, cudaDevAttrComputeCapabilityMajor, dev);
  }
  return d;
}

// How many blocks of `threads` threads of `kernel` fit on one SM at once (its registers and
// shared memory decide): a host-side query, no stream work. Callers keep it per kernel, so a
// process is assumed to drive one GPU architecture. 8 (2048 threads of 256) if the query fails.
template <typename... KArgs>
int resident_blocks_per_sm(void (*kernel)(KArgs...), int threads) {
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, 0) != cudaSuccess) {
    cudaGetLastError();  // not the launch's error
    return 8;
  }
  return std::max(1, blocks);
}

// Blocks for a grid-stride kernel: enough to cover n in units of per_block, at most
// blocks_per_sm resident blocks on every SM, at least one.
inline int grid_size(size_t n, size_t per_block, int blocks_per_sm) {
  const size_t want = (n + per_block - 1) / per_block;
  const size_t cap = size_t(device_info().sm_count) * blocks_per_sm;
  return static_cast<int>(std::max<size_t>(1, std::min(want, cap)));
}

// PDL is on for sm_90+ unless the environment sets JAX_FP8_PDL=0 (read at every launch, so a
// test or benchmark can compare both; a captured command buffer keeps what it saw).
inline bool pdl_enabled() {
  const char* v = std::getenv("JAX_FP8_PDL");
  return device_info().major >= 9 && !(v && v[0] == '0');
}

// A launch with `smem_bytes` of dynamic shared memory, in clusters of `cluster` blocks along x
// (no cluster attribute for 1), with PDL where enabled.
template <typename... KArgs, typename... Args>
void launch_pdl_cluster(void (*kernel)(KArgs...), dim3 blocks, int threads, int smem_bytes,
                        int cluster, cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = blocks;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem_bytes;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  cfg.attrs = attr;
  if (pdl_enabled()) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[cfg.numAttrs++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[cfg.numAttrs].id = cudaLaunchAttributeClusterDimension;
    attr[cfg.numAttrs++].val.clusterDim = {static_cast<unsigned>(cluster), 1, 1};
  }
  cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}

template <typename... KArgs, typename... Args>
void launch_pdl(void (*kernel)(KArgs...), dim3 blocks, int threads, cudaStream_t stream,
                Args&&... args) {
  launch_pdl_cluster(kernel, blocks, threads, 0, 1, stream, std::forward<Args>(args)...);
}

inline ffi::Error last_error() {
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return ffi::Error::Internal(cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Calls launch(InputType<T>{}) with T the device type of the quantizers' input dtype t (float,
// __nv_bfloat16, __half): how a handler picks its kernels' instantiation.
template <typename T>
struct InputType {
  using type = T;
};

template <typename F>
ffi::Error dispatch_input(ffi::DataType t, F&& launch) {
  switch (t) {
    case ffi::DataType::F32: return launch(InputType<float>{});
    case ffi::DataType::BF16: return launch(InputType<__nv_bfloat16>{});
    case ffi::DataType::F16: return launch(InputType<__half>{});
    default: return invalid("x must be float32, bfloat16 or float16");
  }
}

// The start of every CUDA handler's Bind chain: the stream. The op's chain (<op>_args.h)
// follows, and the handler is marked kCmdBufferCompatible (only launches and memsets on this
// stream, the same for the same attributes).
inline auto BindCuda() { return ffi::Ffi::Bind().Ctx<ffi::PlatformStream<cudaStream_t>>(); }

// CpuCall's twin (common.h): the stream, then the bound values to the op's decoder, then impl.
template <typename Args, typename... Bound>
struct CudaCall {
  ffi::Error (*decode)(Platform, Args&, Bound...);
  ffi::Error (*impl)(cudaStream_t, const Args&);

  ffi::Error operator()(cudaStream_t stream, Bound... bound) const {
    Args a{};
    if (ffi::Error e = decode(Platform::kCuda, a, bound...); e.failure()) return e;
    return impl(stream, a);
  }
};

template <typename Args, typename... Bound>
CudaCall<Args, Bound...> DecodeThen(ffi::Error (*decode)(Platform, Args&, Bound...),
                                    ffi::Error (*impl)(cudaStream_t, const Args&)) {
  return {decode, impl};
}

}  // namespace jax_fp8
