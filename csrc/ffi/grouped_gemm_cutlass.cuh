// CUTLASS's Hopper ptr-array grouped GEMMs as jax_fp8_grouped_gemm runs them (the handler and
// the per-tensor kernels: grouped_gemm_cuda.cu; the block-scaled kernels:
// grouped_gemm_block_cuda.cu, a translation unit of their own so that the two sets compile in
// parallel). One call is three launches on the stream, no host synchronization and no
// allocation, so it is safe in XLA's command buffers and never recompiles when the sizes change:
//   1. the setup kernel (csrc/kernels/grouped_gemm_setup.cuh) turns group_sizes into each
//      group's problem shape, pointers, leading dimensions and scales in the workspace;
//   2. the fill kernel zeroes what no group writes (NaN for a misaligned wgrad group);
//   3. CUTLASS's grouped GEMM (TMA loads, warp-specialized cooperative consumers, its tile
//      scheduler walking the problem shapes it reads from device memory) runs every group.
//
// Workspace (the handler's last result, kGroupedPlanBytes * (G + 1) + kGroupedCutlassBytes
// bytes): first the plan, carved in order into 16-byte-aligned arrays of G entries (problem
// shapes; pointers to a, b and d; their strides; alpha and pointers to it; pointers to each
// group's first block scales of a and b; fill flags), the last group's end and the G + 1 row
// offsets; every scale mode carves the same arrays and writes those it uses. Then CUTLASS's
// own space (its tensor maps, one set per SM, and its tile scheduler's).
#pragma once

#include <string>
#include <type_traits>

#include "../kernels/grouped_gemm_setup.cuh"
#include "common.h"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "launch.h"

namespace jax_fp8 {

// Carves the workspace in order, each piece 16-byte aligned; null once it runs out.
struct Carve {
  char* at;
  char* end;
  template <class T>
  T* take(size_t count) {
    char* p = at;
    at += (count * sizeof(T) + 15) / 16 * 16;
    return at <= end ? reinterpret_cast<T*>(p) : nullptr;
  }
};

// A decoded call (the handler checked every shape against form and mode).
struct GroupedArgs {
  GroupedForm form;
  ScaleMode mode;
  int groups;
  int64_t rows, n, k;  // kRows: a [rows, k], b [G, n, k]; kWgrad: a [k, rows], b [n, rows]
  const void *a, *b;
  const float *a_scale, *b_scale;  // the mode's layouts (grouped_gemm_setup.cuh)
  int b_scales;  // kPerTensor: 1 or groups
  const int32_t* sizes;
  void* d;
  char* workspace;
};

// Per-tensor scales: a_scale * b_scale[g] as the epilogue's alpha, one per group; the
// mainloop CUTLASS's plain ptr-array one (f32 accumulators promoted out of the tensor cores).
struct PerTensorScaling {
  static constexpr ScaleMode kMode = ScaleMode::kPerTensor;
  using LayoutA = cutlass::layout::RowMajor*;
  using LayoutB = cutlass::layout::ColumnMajor*;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative;
};

// Block scales (DeepSeek-V3): CUTLASS's blockwise-scaling mainloop multiplies each 128-deep
// slice of the tensor cores' accumulation by its scales as it adds it to the f32 accumulators.
// ScaleConfig: the scales' granularity along CUTLASS's M, N and K and which dimension of each
// scale array is contiguous; the kernel derives each group's scale layout from its problem
// shape, starting at the group's scale pointers.
template <ScaleMode kScaleMode, class ScaleConfig>
struct BlockScaling {
  static constexpr ScaleMode kMode = kScaleMode;
  using LayoutA = cute::tuple<cutlass::layout::RowMajor*,
                              decltype(ScaleConfig::deduce_layoutSFA())*>;
  using LayoutB = cute::tuple<cutlass::layout::ColumnMajor*,
                              decltype(ScaleConfig::deduce_layoutSFB())*>;
  using Schedule = cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperativeFP8Blockwise;
};

// The rows form: CUTLASS's M is a group's rows, one scale per row and 128 of K, read K-major
// from a_scale [M, K/128]; b[g] one scale per 128 x 128 block, K-major from its
// [ceil(N/128), K/128].
using RowsBlockScaling = BlockScaling<
    ScaleMode::kBlock128x128,
    cutlass::detail::Sm90BlockwiseScaleConfig<1, kBlockTile, kBlockTile, cute::GMMA::Major::K,
                                              cute::GMMA::Major::K>>;
// wgrad: CUTLASS's M and N are K and N, its K a group's rows; one scale per element of M (N)
// and 128 rows, read MN-major from a_scale [M/128, K] (b_scale [M/128, N]) from the group's
// first 128-row block on.
using WgradBlockScaling = BlockScaling<
    ScaleMode::kGroup1x128,
    cutlass::detail::Sm90BlockwiseScaleConfig<1, 1, kBlockTile, cute::GMMA::Major::MN,
                                              cute::GMMA::Major::MN>>;

// One CUTLASS grouped kernel for a pair of FP8 operand types, an output type and a scaling.
template <class A, class B, class D, class Scaling>
struct GroupedGemm {
  using Tile = cute::Shape<cute::_128, cute::_128, cute::_128>;
  using Cluster = cute::Shape<cute::_1, cute::_1, cute::_1>;
  using Problem = cutlass::gemm::GroupProblemShape<cute::Shape<int, int, int>>;
  static constexpr int kAlignD = 16 / sizeof(D);
  static constexpr bool kPerTensor = Scaling::kMode == ScaleMode::kPerTensor;
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor*, kAlignD, D, cutlass::layout::RowMajor*, kAlignD,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<D, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, A, typename Scaling::LayoutA, 16, B,
      typename Scaling::LayoutB, 16, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      typename Scaling::Schedule>::CollectiveOp;
  using Kernel = cutlass::gemm::kernel::GemmUniversal<Problem, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
  using Stride = typename Kernel::InternalStrideA;
  static_assert(std::is_same_v<Stride, typename Kernel::InternalStrideB> &&
                std::is_same_v<Stride, typename Kernel::InternalStrideD>);
  using Plan = GroupedPlan<typename Problem::UnderlyingProblemShape, Stride, A, B, D>;

  template <GroupedForm kForm>
  static std::string launch(const GroupedArgs& g, cudaStream_t stream) {
    const int G = g.groups;
    Carve carve{g.workspace, g.workspace + kGroupedPlanBytes * (G + 1)};
    Plan plan{carve.take<typename Problem::UnderlyingProblemShape>(G), carve.take<const A*>(G),
              carve.take<const B*>(G), carve.take<D*>(G), carve.take<Stride>(G),
              carve.take<Stride>(G), carve.take<Stride>(G), carve.take<float>(G),
              carve.take<const float*>(G), carve.take<const float*>(G),
              carve.take<const float*>(G), carve.take<GroupFill>(G), carve.take<int64_t>(1)};
    int64_t* starts = carve.take<int64_t>(G + 1);
    if (!starts) return "the grouped GEMM's plan does not fit its workspace";
    D* d = static_cast<D*>(g.d);
    launch_pdl(grouped_gemm_setup_kernel<kForm, Scaling::kMode,
                                         typename Problem::UnderlyingProblemShape, Stride, A, B,
                                         D>,
               dim3(1), 256, stream, plan, g.sizes, G, static_cast<const A*>(g.a),
               static_cast<const B*>(g.b), d, g.a_scale, g.b_scale, g.b_scales, g.rows, g.n, g.k,
               starts);
    const int64_t slot = kForm == GroupedForm::kRows ? g.rows * g.n : g.k * g.n;
    launch_pdl(grouped_gemm_fill_kernel<kForm, D>, dim3(grid_size(slot, 256 * 4, 4)), 256, stream,
               d, plan.fill, plan.rows_end, G, g.rows, g.n, g.k);
    if (cudaError_t e = cudaGetLastError(); e != cudaSuccess) return cudaGetErrorString(e);

    typename Gemm::Arguments args;
    args.mode = cutlass::gemm::GemmUniversalMode::kGrouped;
    args.problem_shape = {G, plan.shape, nullptr};  // the shapes live on the device only
    if constexpr (kPerTensor) {
      args.mainloop = {plan.a, plan.stride_a, plan.b, plan.stride_b};
    } else {  // the scale layouts come from each group's shape: none to pass
      args.mainloop = {plan.a,       plan.stride_a, plan.b,       plan.stride_b,
                       plan.scale_a, nullptr,       plan.scale_b, nullptr};
    }
    args.epilogue = {{}, nullptr, plan.stride_d, plan.d, plan.stride_d};
    auto& fusion = args.epilogue.thread;
    fusion.beta = 0.0f;
    if constexpr (kPerTensor) {
      fusion.alpha = 0.0f;
      fusion.alpha_ptr_array = plan.alpha_ptr;
      fusion.dAlpha = {cute::_0{}, cute::_0{}, 1};  // one alpha per group
    } else {  // the block scales are in the accumulators already
      fusion.alpha = 1.0f;
    }
    int dev = 0;
    cudaGetDevice(&dev);
    args.hw_info.device_id = dev;
    args.hw_info.sm_count = device_info().sm_count;
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess)
      return "CUTLASS cannot run this grouped GEMM";
    if (Gemm::get_workspace_size(args) > kGroupedCutlassBytes)
      return "CUTLASS needs more workspace than jax_fp8 gives a grouped GEMM";
    char* cutlass_workspace = g.workspace + kGroupedPlanBytes * (G + 1);
    if (gemm.initialize(args, cutlass_workspace, stream) != cutlass::Status::kSuccess)
      return "CUTLASS could not initialize the grouped GEMM";
    if (gemm.run(stream) != cutlass::Status::kSuccess)
      return "the CUTLASS grouped GEMM failed to launch";
    return {};
  }

  // Block scales serve one form each; per-tensor ones both.
  static std::string run(const GroupedArgs& g, cudaStream_t stream) {
    if constexpr (Scaling::kMode == ScaleMode::kBlock128x128)
      return launch<GroupedForm::kRows>(g, stream);
    else if constexpr (Scaling::kMode == ScaleMode::kGroup1x128)
      return launch<GroupedForm::kWgrad>(g, stream);
    else
      return g.form == GroupedForm::kRows ? launch<GroupedForm::kRows>(g, stream)
                                          : launch<GroupedForm::kWgrad>(g, stream);
  }
};

using E4m3 = cutlass::float_e4m3_t;
using E5m2 = cutlass::float_e5m2_t;
using Bf16 = cutlass::bfloat16_t;

// The block-scaled grouped GEMMs (grouped_gemm_block_cuda.cu): e4m3 operands, g.mode's scales,
// into a bf16 or f32 d; an error message, or empty.
std::string run_grouped_block(ffi::DataType d, const GroupedArgs& g, cudaStream_t stream);

}  // namespace jax_fp8
