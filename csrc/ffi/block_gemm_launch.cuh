// The host half of the block-scaled GEMM kernel (csrc/kernels/block_gemm.cuh): its four TMA
// tensor maps, the persistent grid and the launch (clusters of 1 or 2 CTAs, Programmatic
// Dependent Launch). Included by the instantiation files block_gemm_n<N>.cu only, so the
// kernel's templates are compiled there and nowhere else.
//
// Host work per call: four tensor-map encodings (host functions of the driver) and a launch;
// per instantiation and device once: the shared-memory limit raised and the number of clusters
// that fit at once queried. Neither touches a stream, so a call may be captured in a CUDA graph.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "../kernels/block_gemm.cuh"
#include "block_gemm.h"
#include "launch.h"

namespace jax_fp8 {

// The driver's cuTensorMapEncodeTiled through the runtime (the extension links the static
// cudart and not libcuda), looked up once; null where the driver lacks it.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    const cudaError_t e = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000,
                                                           cudaEnableDefault, &found);
#else
    const cudaError_t e = cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &fn,
                                                  cudaEnableDefault, &found);
#endif
    if (e != cudaSuccess || found != cudaDriverEntryPointSuccess) {
      cudaGetLastError();  // not a launch's error
      return PFN_cuTensorMapEncodeTiled_v12000(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return encode;
}

// A row-major [rows, cols] tensor of `type` whose rows are `row_bytes` apart, copied in boxes of
// box_rows x box_cols; out-of-bounds elements read as zeros.
inline bool encode_tensor_map(CUtensorMap* map, CUtensorMapDataType type, const void* base,
                              uint64_t rows, uint64_t cols, uint64_t row_bytes, uint32_t box_rows,
                              uint32_t box_cols, CUtensorMapSwizzle swizzle) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  const cuuint64_t dims[2] = {cols, rows};
  const cuuint64_t strides[1] = {row_bytes};
  const cuuint32_t box[2] = {box_cols, box_rows};
  const cuuint32_t element_strides[2] = {1, 1};
  return encode && encode(map, type, 2, const_cast<void*>(base), dims, strides, box,
                          element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                          CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                          CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

template <int kBlockN, bool kColumnScales>
std::string launch_block_gemm(const BlockGemmArgs& g, int cluster, cudaStream_t stream) {
  using T = BlockGemmTraits<kBlockN, kColumnScales>;
  const auto kernel = sm90_fp8_block_gemm_kernel<T, BlockGemmTiles>;
  int dev = 0;
  cudaGetDevice(&dev);
  // Per device: the shared-memory limit raised, and how many clusters fit at once (1 per SM or
  // per pair of SMs: the kernel takes an SM's whole shared memory).
  int clusters = 0;
  {
    static std::mutex mu;
    static auto* fitting = new std::map<std::pair<int, int>, int>;
    std::lock_guard<std::mutex> lock(mu);
    auto it = fitting->find({dev, cluster});
    if (it == fitting->end()) {
      if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               T::kSmemBytes) != cudaSuccess) {
        cudaGetLastError();
        return "the block-scaled GEMM kernel cannot have " + std::to_string(T::kSmemBytes) +
               " bytes of shared memory on this device";
      }
      cudaLaunchConfig_t cfg = {};
      cfg.gridDim = dim3(cluster);
      cfg.blockDim = dim3(T::kThreads);
      cfg.dynamicSmemBytes = T::kSmemBytes;
      cudaLaunchAttribute attr;
      attr.id = cudaLaunchAttributeClusterDimension;
      attr.val.clusterDim = {static_cast<unsigned>(cluster), 1, 1};
      cfg.attrs = &attr;
      cfg.numAttrs = 1;
      if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) != cudaSuccess || clusters < 1) {
        cudaGetLastError();
        return "no cluster of " + std::to_string(cluster) +
               " block-scaled GEMM CTAs fits this device";
      }
      it = fitting->emplace(std::make_pair(dev, cluster), clusters).first;
    }
    clusters = it->second;
  }

  const int64_t kb = g.k / kBlockTile;
  const auto [a_scales, b_scales] = block_gemm_scale_sizes(g.mode, g.m, g.n, g.k);
  const uint64_t m4 = a_scales / kb, b_scale_cols = b_scales / kb;
  CUtensorMap a_map, b_map, a_scale_map, b_scale_map;
  if (!encode_tensor_map(&a_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, g.a, g.m, g.k, g.k, T::kBlockM,
                         T::kBlockK, CU_TENSOR_MAP_SWIZZLE_128B) ||
      !encode_tensor_map(&b_map, CU_TENSOR_MAP_DATA_TYPE_UINT8, g.b, g.n, g.k, g.k,
                         kBlockN / cluster, T::kBlockK, CU_TENSOR_MAP_SWIZZLE_128B) ||
      !encode_tensor_map(&a_scale_map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, g.a_scale, kb, m4,
                         m4 * 4, 1, T::kBlockM, CU_TENSOR_MAP_SWIZZLE_NONE) ||
      !encode_tensor_map(&b_scale_map, CU_TENSOR_MAP_DATA_TYPE_FLOAT32, g.b_scale, kb,
                         b_scale_cols, b_scale_cols * 4, 1, T::kBScaleFloats,
                         CU_TENSOR_MAP_SWIZZLE_NONE))
    return "could not encode the block-scaled GEMM's TMA tensor maps";

  const BlockGemmParams p{static_cast<int>(g.m), static_cast<int>(g.n), static_cast<int>(kb),
                          cluster, g.bias, g.d, g.out};
  const int64_t units = ((g.m + T::kBlockM - 1) / T::kBlockM + cluster - 1) / cluster *
                        ((g.n + kBlockN - 1) / kBlockN);
  const int grid = cluster * static_cast<int>(std::min<int64_t>(units, clusters));
  launch_pdl_cluster(kernel, dim3(grid), T::kThreads, T::kSmemBytes, cluster, stream, a_map,
                     b_map, a_scale_map, b_scale_map, p);
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cudaGetErrorString(e);
  return {};
}

}  // namespace jax_fp8
