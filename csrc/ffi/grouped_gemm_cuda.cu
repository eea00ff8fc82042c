// CUDA FFI handler for jax_fp8_grouped_gemm: FP8 grouped GEMMs whose group sizes stay on the
// device (jax.lax.ragged_dot's semantics; the forms, scale modes and fill rules:
// csrc/kernels/grouped_gemm_setup.cuh), with per-tensor or block scales; how a call runs
// (setup, fill, CUTLASS) and its workspace: grouped_gemm_cutlass.cuh. This file holds the
// handler and the per-tensor kernels; grouped_gemm_block_cuda.cu the block-scaled ones. Built
// for sm_90a only (wgmma and TMA); the handler refuses other devices.
//
// Arguments: a, b (FP8), a_scale, b_scale (f32), group_sizes [G] int32.
// Results: d, workspace [kGroupedPlanBytes * (G + 1) + kGroupedCutlassBytes] u8.
// Attributes: form (GroupedForm), scale_mode (ScaleMode). Shapes: kRows a [M, K], b [G, N, K],
// d [M, N]; kWgrad a [K, M], b [N, M], d [G, K, N]. Scales: kPerTensor a_scale [], b_scale []
// or [G]; kBlock128x128 (kRows, e4m3) a_scale [M, K/128], b_scale [G, ceil(N/128), K/128];
// kGroup1x128 (kWgrad, e4m3) a_scale [M/128, K], b_scale [M/128, N].
#include <string>

#include "grouped_gemm_cutlass.cuh"

namespace jax_fp8 {
namespace {

// The per-tensor operand pairs jax_fp8's layers use: e4m3 x e4m3 (forward), e5m2 x e4m3
// (HYBRID dgrad), e4m3 x e5m2 (HYBRID wgrad); each into bf16 or f32.
template <class D>
std::string run_per_tensor(ffi::DataType a, ffi::DataType b, const GroupedArgs& g,
                           cudaStream_t stream) {
  if (a == ffi::DataType::F8E4M3FN && b == ffi::DataType::F8E4M3FN)
    return GroupedGemm<E4m3, E4m3, D, PerTensorScaling>::run(g, stream);
  if (a == ffi::DataType::F8E5M2 && b == ffi::DataType::F8E4M3FN)
    return GroupedGemm<E5m2, E4m3, D, PerTensorScaling>::run(g, stream);
  if (a == ffi::DataType::F8E4M3FN && b == ffi::DataType::F8E5M2)
    return GroupedGemm<E4m3, E5m2, D, PerTensorScaling>::run(g, stream);
  return "grouped GEMM operands must be e4m3 x e4m3, e5m2 x e4m3 or e4m3 x e5m2";
}

// The block scale modes' rules: e4m3 operands, K (rows form) or M (wgrad) a multiple of 128,
// and the element counts of a_scale and b_scale; an error message, or empty.
std::string check_block_scales(const GroupedArgs& g, ffi::DataType a, ffi::DataType b,
                               size_t a_scales, size_t b_scales) {
  if (a != ffi::DataType::F8E4M3FN || b != ffi::DataType::F8E4M3FN)
    return "block-scaled grouped GEMMs take e4m3 operands";
  const int64_t kb = g.k / kBlockTile, nb = (g.n + kBlockTile - 1) / kBlockTile;
  if (g.mode == ScaleMode::kBlock128x128) {
    if (g.k % kBlockTile) return "block scales need K a multiple of 128";
    if (a_scales != size_t(g.rows * kb) || b_scales != size_t(g.groups * nb * kb))
      return "block scales must be a_scale [M, K/128] and b_scale [G, ceil(N/128), K/128]";
  } else {
    if (g.rows % kGroupedBlockRowAlign) return "block scales need M a multiple of 128";
    const int64_t mb = g.rows / kBlockTile;
    if (a_scales != size_t(mb * g.k) || b_scales != size_t(mb * g.n))
      return "block scales must be a_scale [M/128, K] and b_scale [M/128, N]";
  }
  return {};
}

ffi::Error GroupedGemmImpl(cudaStream_t stream, ffi::AnyBuffer a, ffi::AnyBuffer b,
                           F32Buffer a_scale, F32Buffer b_scale,
                           ffi::Buffer<ffi::S32> group_sizes, ffi::Result<ffi::AnyBuffer> d,
                           ffi::Result<ffi::Buffer<ffi::U8>> workspace, int64_t form,
                           int64_t scale_mode) {
  if (form != int64_t(GroupedForm::kRows) && form != int64_t(GroupedForm::kWgrad))
    return invalid("form must be 0 (rows) or 1 (wgrad)");
  const bool rows_form = form == int64_t(GroupedForm::kRows);
  const ScaleMode block_mode = rows_form ? ScaleMode::kBlock128x128 : ScaleMode::kGroup1x128;
  if (scale_mode != int64_t(ScaleMode::kPerTensor) && scale_mode != int64_t(block_mode))
    return invalid("scale_mode must be per-tensor, or 1 x 128 x 128 x 128 block scales in the "
                   "rows form and 1 x 128 groups of both operands in wgrad");
  const auto ad = a.dimensions(), bd = b.dimensions(), dd = d->dimensions();
  if (ad.size() != 2 || bd.size() != (rows_form ? 3u : 2u) || dd.size() != (rows_form ? 2u : 3u))
    return invalid("grouped GEMM operands of the wrong rank");
  GroupedArgs g{};
  g.form = static_cast<GroupedForm>(form);
  g.mode = static_cast<ScaleMode>(scale_mode);
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
  if (g.mode == ScaleMode::kPerTensor) {
    g.b_scales = int(b_scale.element_count());
    if (a_scale.element_count() != 1 || (g.b_scales != 1 && g.b_scales != g.groups))
      return invalid("a_scale must be one float32, b_scale one or one per group");
  } else if (std::string e = check_block_scales(g, a.element_type(), b.element_type(),
                                                a_scale.element_count(),
                                                b_scale.element_count());
             !e.empty()) {
    return invalid(e);
  }
  const size_t need = kGroupedPlanBytes * (g.groups + 1) + kGroupedCutlassBytes;
  if (workspace->element_count() < need) return invalid("grouped GEMM workspace too small");
  if (device_info().major != 9) return invalid("jax_fp8's grouped GEMM runs on sm_90 (Hopper)");
  g.a = a.untyped_data(), g.b = b.untyped_data();
  g.a_scale = a_scale.typed_data(), g.b_scale = b_scale.typed_data();
  g.sizes = group_sizes.typed_data();
  g.d = d->untyped_data();
  g.workspace = reinterpret_cast<char*>(workspace->typed_data());
  const ffi::DataType out = d->element_type();
  if (out != ffi::DataType::BF16 && out != ffi::DataType::F32)
    return invalid("grouped GEMM output must be bfloat16 or float32");
  std::string error;
  if (g.mode != ScaleMode::kPerTensor)
    error = run_grouped_block(out, g, stream);
  else if (out == ffi::DataType::BF16)
    error = run_per_tensor<Bf16>(a.element_type(), b.element_type(), g, stream);
  else
    error = run_per_tensor<float>(a.element_type(), b.element_type(), g, stream);
  if (!error.empty()) return ffi::Error::Internal(error);
  return last_error();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GroupedGemmCudaHandler, GroupedGemmImpl,
                              BindCuda()
                                  .Arg<ffi::AnyBuffer>()         // a
                                  .Arg<ffi::AnyBuffer>()         // b
                                  .Arg<F32Buffer>()              // a_scale
                                  .Arg<F32Buffer>()              // b_scale
                                  .Arg<ffi::Buffer<ffi::S32>>()  // group_sizes
                                  .Ret<ffi::AnyBuffer>()         // d
                                  .Ret<ffi::Buffer<ffi::U8>>()   // workspace
                                  .Attr<int64_t>("form")
                                  .Attr<int64_t>("scale_mode"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
