// The device-side half of the grouped FP8 GEMM (csrc/ffi/grouped_gemm_cuda.cu): from the group
// sizes, which stay on the device, each group's problem shape, operand pointers, leading
// dimensions and scales for CUTLASS's ptr-array grouped kernels, and the fill of the output
// that no group writes.
//
// Groups take consecutive rows: group g covers rows [start_g, end_g) with end_g =
// min(sum of max(size_j, 0) for j <= g, rows) and start_g = end_{g-1} (negative sizes count as
// 0, rows past the last are dropped). Two forms (GroupedForm):
//   kRows:  d[start:end, :] = a[start:end, :] . b[g]^T              (a [M, K], b [G, N, K])
//           the rows after the last group's end are zero.
//   kWgrad: d[g] = a[:, start:end] . b[:, start:end]^T              (a [K, M], b [N, M])
//           the contraction ragged; an empty group's d[g] is zero, and that of a non-empty
//           group whose start is not a multiple of the row alignment is NaN: kGroupedRowAlign
//           per-tensor (its operands' first element 16-byte aligned, which the TMA loads need),
//           kGroupedBlockRowAlign with block scales (its 1 x 128 groups along the rows whole).
// Scales (ScaleMode, the dense GEMM's modes):
//   kPerTensor:    alpha_g = a_scale * b_scale[g] in the epilogue (b_scale one per group, or one
//                  for all).
//   kBlock128x128: the rows form; a_scale [M, K/128] row-major (1 x 128 groups of a's rows),
//                  b_scale [G, ceil(N/128), K/128] row-major (128 x 128 blocks of each b[g]):
//                  group g's scales start at row start_g of a_scale and at b_scale[g], and
//                  CUTLASS reads them K-major.
//   kGroup1x128:   wgrad; a_scale [M/128, K] and b_scale [M/128, N] (1 x 128 groups along the
//                  rows, stored by groups of rows): group g's start at row start_g / 128, and
//                  CUTLASS reads them MN-major.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "cute/layout.hpp"

#include "../constants.h"

namespace jax_fp8 {

enum class GroupedForm : int64_t { kRows = 0, kWgrad = 1 };

// The fill a group's output slot gets instead of a GEMM (kWgrad) or the rows after the last
// group (kRows).
enum class GroupFill : int32_t { kNone = 0, kZero = 1, kNan = 2 };

// The multiple of rows at which a non-empty wgrad group must start under a scale mode.
__host__ __device__ constexpr int64_t grouped_row_align(ScaleMode mode) {
  return mode == ScaleMode::kPerTensor ? kGroupedRowAlign : kGroupedBlockRowAlign;
}

// What the setup kernel writes per group for CUTLASS (Shape and Stride are the kernel's
// UnderlyingProblemShape and InternalStride types) and for the fill kernel.
template <class Shape, class Stride, class A, class B, class D>
struct GroupedPlan {
  Shape* shape;
  const A** a;
  const B** b;
  D** d;
  Stride* stride_a;
  Stride* stride_b;
  Stride* stride_d;
  float* alpha;  // kPerTensor: a_scale * b_scale[g]
  const float** alpha_ptr;
  const float** scale_a;  // block scales: the first of group g's
  const float** scale_b;
  GroupFill* fill;  // [G] (kWgrad) or [1] (kRows)
  int64_t* rows_end;  // [1]: the last group's end
};

// One block; thread 0 accumulates the offsets (G is small), then every thread fills groups.
// a_scale and b_scale: the per-tensor scalars (b_scales of them in b_scale: 1 or G), or the
// block scales of kMode in the layouts above.
template <GroupedForm kForm, ScaleMode kMode, class Shape, class Stride, class A, class B,
          class D>
__global__ void grouped_gemm_setup_kernel(GroupedPlan<Shape, Stride, A, B, D> plan,
                                          const int32_t* __restrict__ sizes, int groups,
                                          const A* a, const B* b, D* d, const float* a_scale,
                                          const float* b_scale, int b_scales, int64_t rows,
                                          int64_t n, int64_t k, int64_t* __restrict__ starts) {
  static_assert(kMode == ScaleMode::kPerTensor ||
                    (kMode == ScaleMode::kBlock128x128) == (kForm == GroupedForm::kRows),
                "block scales: kBlock128x128 in the rows form, kGroup1x128 in wgrad");
  cudaGridDependencySynchronize();
  if (threadIdx.x == 0) {
    int64_t end = 0;
    for (int g = 0; g < groups; ++g) {
      starts[g] = end;
      const int64_t next = end + (sizes[g] > 0 ? sizes[g] : 0);
      end = next < rows ? next : rows;
    }
    starts[groups] = end;
    *plan.rows_end = end;
  }
  __syncthreads();
  for (int g = threadIdx.x; g < groups; g += blockDim.x) {
    const int64_t start = starts[g], size = starts[g + 1] - start;
    if constexpr (kMode == ScaleMode::kPerTensor) {
      plan.alpha[g] = *a_scale * b_scale[b_scales == 1 ? 0 : g];
      plan.alpha_ptr[g] = plan.alpha + g;
    } else if constexpr (kMode == ScaleMode::kBlock128x128) {  // group g's rows; b[g]'s blocks
      const int64_t kb = k / kBlockTile, nb = (n + kBlockTile - 1) / kBlockTile;
      plan.scale_a[g] = a_scale + start * kb;
      plan.scale_b[g] = b_scale + g * nb * kb;
    } else {  // kGroup1x128: group g's first 128-row block (start a multiple of 128 if run)
      plan.scale_a[g] = a_scale + start / kBlockTile * k;
      plan.scale_b[g] = b_scale + start / kBlockTile * n;
    }
    if constexpr (kForm == GroupedForm::kRows) {  // (size, N, K) per group
      plan.shape[g] = Shape(int(size), int(n), int(k));
      plan.a[g] = a + start * k;
      plan.b[g] = b + g * n * k;
      plan.d[g] = d + start * n;
      plan.stride_a[g] = cute::make_stride(k, cute::_1{}, cute::_0{});
      plan.stride_b[g] = cute::make_stride(k, cute::_1{}, cute::_0{});
      plan.stride_d[g] = cute::make_stride(n, cute::_1{}, cute::_0{});
    } else {  // (K, N, size) per group; a [K, M] and b [N, M] read from column `start`
      const bool aligned = start % grouped_row_align(kMode) == 0;
      const bool run = size > 0 && aligned;
      plan.fill[g] = run ? GroupFill::kNone : size == 0 ? GroupFill::kZero : GroupFill::kNan;
      plan.shape[g] = Shape(run ? int(k) : 0, int(n), int(size));
      plan.a[g] = a + start;
      plan.b[g] = b + start;
      plan.d[g] = d + g * k * n;
      plan.stride_a[g] = cute::make_stride(rows, cute::_1{}, cute::_0{});
      plan.stride_b[g] = cute::make_stride(rows, cute::_1{}, cute::_0{});
      plan.stride_d[g] = cute::make_stride(n, cute::_1{}, cute::_0{});
    }
  }
  cudaTriggerProgrammaticLaunchCompletion();
}

// Sets d[begin, end) to value, grid-stride.
template <class D>
__device__ void fill_range(D* d, int64_t begin, int64_t end, D value) {
  for (int64_t i = begin + int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < end;
       i += int64_t(gridDim.x) * blockDim.x)
    d[i] = value;
}

// kRows: zero rows [rows_end, rows) of d [rows, n]. kWgrad: fill d[g] ([k, n]) of each group
// whose fill is not kNone (every block reads the G flags; only flagged slots cost stores).
template <GroupedForm kForm, class D>
__global__ void grouped_gemm_fill_kernel(D* __restrict__ d, const GroupFill* __restrict__ fill,
                                         const int64_t* __restrict__ rows_end, int groups,
                                         int64_t rows, int64_t n, int64_t k) {
  cudaGridDependencySynchronize();
  if constexpr (kForm == GroupedForm::kRows) {
    fill_range(d, *rows_end * n, rows * n, D(0.0f));
  } else {
    for (int g = 0; g < groups; ++g)
      if (fill[g] != GroupFill::kNone)
        fill_range(d, int64_t(g) * k * n, int64_t(g + 1) * k * n,
                   fill[g] == GroupFill::kNan ? D(NAN) : D(0.0f));
  }
}

}  // namespace jax_fp8
