// CUTLASS kernels of block-scaled FP8 GEMMs (gemm_cutlass.h), built for sm_90a only.
//
// Row-major view, as gemm_lt.h: D[M, N] = sum over K groups g of a_scale[m, g] * b_scale[., g]
// * (A[m, g] . B[n, g]). CUTLASS's A is our a (M x K row-major), its B is our b (K x N
// column-major, i.e. [N, K] row-major), its D is our d (row-major). Scale layouts, as
// cuBLASLt reads them: a_scale [K/128, M] (M contiguous, "MN-major" in CUTLASS's terms);
// b_scale [ceil(N/128), ceil4(K/128)] row-major for 128 x 128 blocks (K-major, with the padded
// row stride), [K/128, N] for 1 x 128 groups (MN-major).
#include "gemm_cutlass.h"

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/detail/blockwise_scale_layout.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/dispatch_policy.hpp"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"
#include "cutlass/version.h"

namespace jax_fp8 {
namespace {

using namespace cute;

// One kernel: tile shape, cluster shape, kernel schedule, the output type and the scale mode.
template <class Tile, class Cluster, bool kPingpong, class Out, ScaleMode kMode>
struct BlockGemm {
  static constexpr int kGroupN = kMode == ScaleMode::kBlock128x128 ? kBlockTile : 1;
  static constexpr auto kMajorSFB =
      kMode == ScaleMode::kBlock128x128 ? GMMA::Major::K : GMMA::Major::MN;
  using ScaleConfig =
      cutlass::detail::Sm90BlockwiseScaleConfig<1, kGroupN, kBlockTile, GMMA::Major::MN, kMajorSFB>;
  using LayoutSFA = decltype(ScaleConfig::deduce_layoutSFA());
  using LayoutSFB = decltype(ScaleConfig::deduce_layoutSFB());
  using Fp8 = cutlass::float_e4m3_t;
  static constexpr int kAlignOut = 16 / sizeof(Out);

  using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Tile, Cluster,
      cutlass::epilogue::collective::EpilogueTileAuto, float, float, void,
      cutlass::layout::RowMajor, kAlignOut, Out, cutlass::layout::RowMajor, kAlignOut,
      std::conditional_t<kPingpong, cutlass::epilogue::TmaWarpSpecialized,
                         cutlass::epilogue::TmaWarpSpecializedCooperative>>::CollectiveOp;
  using Mainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, Fp8,
      cute::tuple<cutlass::layout::RowMajor, LayoutSFA>, 16, Fp8,
      cute::tuple<cutlass::layout::ColumnMajor, LayoutSFB>, 16, float, Tile, Cluster,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
      std::conditional_t<kPingpong, cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise,
                         cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise>>::
      CollectiveOp;
  using Kernel =
      cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, Mainloop, Epilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;

  static std::string run(const GemmArgs& g, cudaStream_t stream) {
    const int M = int(g.p.M), N = int(g.p.N), K = int(g.p.K);
    const auto problem = make_shape(M, N, K, 1);
    LayoutSFA layout_sfa = ScaleConfig::tile_atom_to_shape_SFA(problem);
    LayoutSFB layout_sfb = ScaleConfig::tile_atom_to_shape_SFB(problem);
    if constexpr (kMode == ScaleMode::kBlock128x128) {  // rows of b_scale padded to 16 bytes
      const int kb4 = (K / kBlockTile + 3) / 4 * 4;
      layout_sfb = make_layout(shape(layout_sfb),
                               make_stride(make_stride(_0{}, kb4), make_stride(_0{}, _1{}),
                                           kb4 * ((N + kBlockTile - 1) / kBlockTile)));
    }
    typename Gemm::Arguments args{
        cutlass::gemm::GemmUniversalMode::kGemm,
        {M, N, K, 1},
        {static_cast<const Fp8*>(g.a),
         cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(M, K, 1)),
         static_cast<const Fp8*>(g.b),
         cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(N, K, 1)),
         g.a_scale, layout_sfa, g.b_scale, layout_sfb},
        {{},
         nullptr,
         cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, make_shape(M, N, 1)),
         static_cast<Out*>(g.d),
         cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(M, N, 1))}};
    args.epilogue.thread.alpha = 1.0f;
    args.epilogue.thread.beta = 0.0f;
    Gemm gemm;
    if (gemm.can_implement(args) != cutlass::Status::kSuccess)
      return "CUTLASS cannot run this block-scaled GEMM";
    if (Gemm::get_workspace_size(args) > kGemmWorkspaceBytes)
      return "CUTLASS needs more workspace than jax_fp8 gives a GEMM";
    if (gemm.initialize(args, g.workspace, stream) != cutlass::Status::kSuccess)
      return "CUTLASS could not initialize the block-scaled GEMM";
    if (gemm.run(stream) != cutlass::Status::kSuccess)
      return "the CUTLASS block-scaled GEMM failed to launch";
    return {};
  }
};

using Tile128 = Shape<_128, _128, _128>;
using Tile64 = Shape<_64, _128, _128>;
using Cluster1x2 = Shape<_1, _2, _1>;

struct Config {
  const char* name;
  ScaleMode mode;
  ffi::DataType out;
  std::string (*run)(const GemmArgs&, cudaStream_t);
};

template <class Tile, bool kPingpong, ScaleMode kMode, class Out>
constexpr Config config(const char* name) {
  return {name, kMode, std::is_same_v<Out, float> ? ffi::DataType::F32 : ffi::DataType::BF16,
          &BlockGemm<Tile, Cluster1x2, kPingpong, Out, kMode>::run};
}

constexpr auto kBlock = ScaleMode::kBlock128x128;
constexpr auto kGroup = ScaleMode::kGroup1x128;
using Bf16 = cutlass::bfloat16_t;
const Config kConfigs[] = {
    config<Tile128, false, kBlock, Bf16>("cutlass_cooperative_128x128x128_1x2"),
    config<Tile64, true, kBlock, Bf16>("cutlass_pingpong_64x128x128_1x2"),
    config<Tile128, false, kBlock, float>("cutlass_cooperative_128x128x128_1x2"),
    config<Tile64, true, kBlock, float>("cutlass_pingpong_64x128x128_1x2"),
    config<Tile128, false, kGroup, Bf16>("cutlass_cooperative_128x128x128_1x2"),
    config<Tile64, true, kGroup, Bf16>("cutlass_pingpong_64x128x128_1x2"),
    config<Tile128, false, kGroup, float>("cutlass_cooperative_128x128x128_1x2"),
    config<Tile64, true, kGroup, float>("cutlass_pingpong_64x128x128_1x2"),
};

bool matches(const Config& c, const GemmProblem& p) {
  return c.mode == p.scale_mode && c.out == p.d_type && !p.has_bias &&
         p.a_type == ffi::DataType::F8E4M3FN && p.b_type == ffi::DataType::F8E4M3FN;
}

}  // namespace

std::string cutlass_version() {
  return std::to_string(CUTLASS_MAJOR) + "." + std::to_string(CUTLASS_MINOR) + "." +
         std::to_string(CUTLASS_PATCH);
}

std::vector<std::string> cutlass_configs(const GemmProblem& p, int cc) {
  std::vector<std::string> out;
  if (cc == 90)
    for (const Config& c : kConfigs)
      if (matches(c, p)) out.push_back(c.name);
  return out;
}

std::string run_cutlass(const GemmArgs& g, const std::string& name, cudaStream_t stream) {
  for (const Config& c : kConfigs)
    if (matches(c, g.p) && name == c.name) return c.run(g, stream);
  return "no CUTLASS configuration " + name + " for this GEMM";
}

}  // namespace jax_fp8
