// CUDA FFI handler for jax_fp8_grouped_gemm: FP8 grouped GEMMs whose group sizes stay on the
// device (jax.lax.ragged_dot's semantics; the forms and the fill rules: grouped_gemm_setup.cuh).
// Three launches on the stream, no host synchronization and no allocation, so the call is
// safe in XLA's command buffers and never recompiles when the sizes change:
//   1. the setup kernel turns group_sizes into each group's problem shape, pointers, leading
//      dimensions and alpha (a_scale * b_scale[g]) in the workspace;
//   2. the fill kernel zeroes what no group writes (NaN for a misaligned wgrad group);
//   3. CUTLASS's Hopper ptr-array grouped GEMM (TMA loads, warp-specialized cooperative
//      consumers, f32 accumulation promoted out of the FP8 tensor cores' accumulators, its
//      tile scheduler walking the problem shapes it reads from device memory) runs every group.
// Built for sm_90a only (wgmma and TMA); the handler refuses other devices.
//
// Arguments: a, b (FP8), a_scale [] f32, b_scale [] or [G] f32, group_sizes [G] int32.
// Results: d, workspace [kGroupedPlanBytes * (G + 1) + kGroupedCutlassBytes] u8.
// Attribute: form (GroupedForm). Shapes: kRows a [M, K], b [G, N, K], d [M, N];
// kWgrad a [K, M], b [N, M], d [G, K, N].
#include <string>

#include "../kernels/grouped_gemm_setup.cuh"
#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/group_array_problem_shape.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "launch.h"

namespace jax_fp8 {
namespace {

using namespace cute;

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

struct GroupedArgs {
  GroupedForm form;
  int groups;
  int64_t rows, n, k;  // kRows: a [rows, k], b [G, n, k]; kWgrad: a [k, rows], b [n, rows]
  const void *a, *b;
  const float *a_scale, *b_scale;
  int b_scales;  // 1 or groups
  const int32_t* sizes;
  void* d;
  char* workspace;
};

// One CUTLASS grouped kernel for a pair of FP8 operand types and an output type.
template <class A, class B, class D>
struct GroupedGemm {
  using Tile = Shape<_128, _128, _128>;
  using Cluster = Shape<_1, _1, _1>;
  using Problem = cutlass::gemm::GroupProblemShape<Shape<int, int, int>>;
  static constexpr int kAlignD = 16 / sizeof(D);
  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor*, kAlignD, D, cutlass::layout::RowMajor*, kAlignD,
      cutlass::epilogue::PtrArrayTmaWarpSpecializedCooperative,
      cutlass::epilogue::fusion::LinearCombination<D, float>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, A, cutlass::layout::RowMajor*, 16, B,
      cutlass::layout::ColumnMajor*, 16, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      cutlass::gemm::KernelPtrArrayTmaWarpSpecializedCooperative>::CollectiveOp;
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
              carve.take<const float*>(G), carve.take<GroupFill>(G), carve.take<int64_t>(1)};
    int64_t* starts = carve.take<int64_t>(G + 1);
    if (!starts) return "the grouped GEMM's plan does not fit its workspace";
    D* d = static_cast<D*>(g.d);
    launch_pdl(grouped_gemm_setup_kernel<kForm, typename Problem::UnderlyingProblemShape, Stride,
                                         A, B, D>,
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
    args.mainloop = {plan.a, plan.stride_a, plan.b, plan.stride_b};
    args.epilogue = {{}, nullptr, plan.stride_d, plan.d, plan.stride_d};
    auto& fusion = args.epilogue.thread;
    fusion.alpha = 0.0f;
    fusion.beta = 0.0f;
    fusion.alpha_ptr_array = plan.alpha_ptr;
    fusion.dAlpha = {_0{}, _0{}, 1};  // one alpha per group
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

  static std::string run(const GroupedArgs& g, cudaStream_t stream) {
    return g.form == GroupedForm::kRows ? launch<GroupedForm::kRows>(g, stream)
                                        : launch<GroupedForm::kWgrad>(g, stream);
  }
};

using E4m3 = cutlass::float_e4m3_t;
using E5m2 = cutlass::float_e5m2_t;
using Bf16 = cutlass::bfloat16_t;

// The operand pairs jax_fp8's layers use: e4m3 x e4m3 (forward), e5m2 x e4m3 (HYBRID dgrad),
// e4m3 x e5m2 (HYBRID wgrad); each into bf16 or f32.
template <class D>
std::string run_typed(ffi::DataType a, ffi::DataType b, const GroupedArgs& g,
                      cudaStream_t stream) {
  if (a == ffi::DataType::F8E4M3FN && b == ffi::DataType::F8E4M3FN)
    return GroupedGemm<E4m3, E4m3, D>::run(g, stream);
  if (a == ffi::DataType::F8E5M2 && b == ffi::DataType::F8E4M3FN)
    return GroupedGemm<E5m2, E4m3, D>::run(g, stream);
  if (a == ffi::DataType::F8E4M3FN && b == ffi::DataType::F8E5M2)
    return GroupedGemm<E4m3, E5m2, D>::run(g, stream);
  return "grouped GEMM operands must be e4m3 x e4m3, e5m2 x e4m3 or e4m3 x e5m2";
}

ffi::Error GroupedGemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                           F32Buffer a_scale, F32Buffer b_scale,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> d,
                           ffi::Result<ffi::Buffer<ffi::U8>> workspace, int64_t form) {
  if (form != int64_t(GroupedForm::kRows) && form != int64_t(GroupedForm::kWgrad))
    return invalid("form must be 0 (rows) or 1 (wgrad)");
  const auto ad = a.dimensions(), bd = b.dimensions(), dd = d->dimensions();
  const bool rows_form = form == int64_t(GroupedForm::kRows);
  if (ad.size() != 2 || bd.size() != (rows_form ? 3u : 2u) || dd.size() != (rows_form ? 2u : 3u))
    return invalid("grouped GEMM operands of the wrong rank");
  GroupedArgs g{};
  g.form = static_cast<GroupedForm>(form);
  g.groups = int(group_sizes.element_count());
  if (g.groups < 1 || g.groups > kMaxGroups) return invalid("group_sizes must have 1..1024 groups");
  if (rows_form) {
    g.rows = ad[0], g.k = ad[1], g.n = bd[1];
    if (bd[0] != g.groups || bd[2] != g.k || dd[0] != g.rows || dd[1] != g.n)
      return invalid("grouped GEMM shapes do not match: a [M, K], b [G, N, K], d [M, N]");
  } else {
    g.k = ad[0], g.rows = ad[1], g.n = bd[0];
    if (bd[1] != g.rows || dd[0] != g.groups || dd[1] != g.k || dd[2] != g.n)
      return invalid("grouped GEMM shapes do not match: a [K, M], b [N, M], d [G, K, N]");
  }
  if (g.k % kGemmDimMultiple || g.n % kGemmDimMultiple || (!rows_form && g.rows % kGroupedRowAlign))
    return invalid("grouped GEMM dimensions must be multiples of 16");
  g.b_scales = int(b_scale.element_count());
  if (a_scale.element_count() != 1 || (g.b_scales != 1 && g.b_scales != g.groups))
    return invalid("a_scale must be one float32, b_scale one or one per group");
  const size_t need = kGroupedPlanBytes * (g.groups + 1) + kGroupedCutlassBytes;
  if (workspace->element_count() < need) return invalid("grouped GEMM workspace too small");
  if (device_info().major != 9) return invalid("jax_fp8's grouped GEMM runs on sm_90 (Hopper)");
  g.a = a.untyped_data(), g.b = b.untyped_data();
  g.a_scale = a_scale.typed_data(), g.b_scale = b_scale.typed_data();
  g.sizes = group_sizes.typed_data();
  g.d = d->untyped_data();
  g.workspace = reinterpret_cast<char*>(workspace->typed_data());
  std::string error;
  if (d->element_type() == ffi::DataType::BF16)
    error = run_typed<Bf16>(a.element_type(), b.element_type(), g, stream);
  else if (d->element_type() == ffi::DataType::F32)
    error = run_typed<float>(a.element_type(), b.element_type(), g, stream);
  else
    return invalid("grouped GEMM output must be bfloat16 or float32");
  if (!error.empty()) return ffi::Error::Internal(error);
  return last_error();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmCudaHandler, GroupedGemmImpl,
                              BindCuda()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<F32Buffer>()
                                  .Arg<F32Buffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::U8>>()
                                  .Attr<int64_t>("form"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
