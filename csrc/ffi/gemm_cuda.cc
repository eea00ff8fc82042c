// CUDA FFI handler for jax_fp8_gemm: FP8 x FP8 -> bf16 / f16 / f32 / e4m3 through cuBLASLt, TN
// layout, f32 accumulation, scales read on the device, optional bias in the epilogue. An e4m3
// output is multiplied by d_scale (the reciprocal of the output's dequantization step) before
// the saturating cast, and cuBLASLt's epilogue writes the amax of the unscaled result (amax-D)
// beside it, so the next layer's scale needs no extra pass. Scales are
// per-tensor (scale_mode 0) or block scales (DeepSeek-V3 recipe, cuBLASLt >= 12.9): a with
// 1 x 128 groups along K and b with 128 x 128 blocks (scale_mode 1) or 1 x 128 groups
// (scale_mode 2). Layouts cuBLASLt 13.1 reads on the H200 (checked against an f32 reference,
// 2026-11-29): 1 x 128 scales outer-dimension-contiguous, [K/128, M] for a and [K/128, N] for b,
// with M a multiple of 4 (it offers no algorithm otherwise); 128 x 128 scales row-major with
// 16-byte rows, [ceil(N/128), ceil4(K/128)].
//
// Row-major view: D[M, N] = (a_scale * b_scale) * A[M, K] . B[N, K]^T (+ bias[N]).
// cuBLASLt is column-major, so it computes D^T[N, M]: its "A" is our B seen as a K x N
// column-major matrix with op T, its "B" is our A seen as K x M column-major with op N, and
// D^T is N x M column-major, which is D row-major. The bias runs along cuBLASLt's rows (our N).
// Arguments: gemm_args.h.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <map>
#include <mutex>
#include <string>
#include <tuple>

#include "gemm_args.h"
#include "launch.h"

namespace jax_fp8 {
namespace {

#define JF8_LT(call)                                                                \
  do {                                                                              \
    const cublasStatus_t s_ = (call);                                               \
    if (s_ != CUBLAS_STATUS_SUCCESS)                                                \
      return ffi::Error::Internal(std::string(#call) + " failed: " + std::to_string(int(s_))); \
  } while (0)

cudaDataType_t lt_type(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: return CUDA_R_8F_E4M3;
    case ffi::DataType::F8E5M2: return CUDA_R_8F_E5M2;
    case ffi::DataType::BF16: return CUDA_R_16BF;
    case ffi::DataType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

// One cuBLASLt handle per device and one heuristic choice per problem, found once, outside
// later executions, so every execution of a given call issues the same device work.
using AlgoKey = std::tuple<int, int64_t, int64_t, int64_t, int, int, int, bool, bool, int, int64_t>;

// Largest power of two (up to 256) dividing every pointer: the heuristic must only offer
// algorithms valid for the alignment XLA gave these buffers.
int common_alignment(std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 256;
  for (const void* p : ptrs)
    if (p) bits |= reinterpret_cast<uintptr_t>(p);
  return static_cast<int>(bits & (~bits + 1));
}
struct Cache {
  std::mutex mu;
  std::map<int, cublasLtHandle_t> handles;
  std::map<AlgoKey, cublasLtMatmulAlgo_t> algos;
};
Cache& cache() {
  static Cache* c = new Cache;  // never destroyed: handles outlive static teardown order
  return *c;
}

struct Descs {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
  ~Descs() {
    if (ld) cublasLtMatrixLayoutDestroy(ld);
    if (lc) cublasLtMatrixLayoutDestroy(lc);
    if (lb) cublasLtMatrixLayoutDestroy(lb);
    if (la) cublasLtMatrixLayoutDestroy(la);
    if (op) cublasLtMatmulDescDestroy(op);
  }
};

ffi::Error GemmImpl(cudaStream_t stream, const GemmArgs& g) {
  const int64_t M = g.M, N = g.N, K = g.K;
  if (M == 0) return ffi::Error::Success();

  int dev = 0;
  cudaGetDevice(&dev);
  cublasLtHandle_t lt;
  {
    std::lock_guard<std::mutex> lock(cache().mu);
    auto it = cache().handles.find(dev);
    if (it == cache().handles.end()) {
      JF8_LT(cublasLtCreate(&lt));
      cache().handles[dev] = lt;
    } else {
      lt = it->second;
    }
  }

  Descs ds;
  JF8_LT(cublasLtMatmulDescCreate(&ds.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  const int8_t fast = g.fast_accum ? 1 : 0;
  JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  const void* sa = g.b_scale;  // cuBLASLt's A is our b
  const void* sb = g.a_scale;
  JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  if (g.scale_mode != ScaleMode::kPerTensor) {
#if CUBLAS_VERSION >= 120900
    const cublasLtMatmulMatrixScale_t mode_a = g.scale_mode == ScaleMode::kBlock128x128
                                                   ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                                   : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const cublasLtMatmulMatrixScale_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
    JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
#else
    return ffi::Error::Unimplemented("block-scaled GEMMs need cuBLASLt 12.9 or newer at build time");
#endif
  }
  if (g.fp8_out) {
    const void* dsp = g.d_scale;
    void* amp = g.amax_d;
    JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &dsp, sizeof(dsp)));
    JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &amp, sizeof(amp)));
  }
  if (g.bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const void* bp = g.bias;
    const cudaDataType_t bt = lt_type(g.epilogue_type);
    JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
    JF8_LT(cublasLtMatmulDescSetAttribute(ds.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  JF8_LT(cublasLtMatrixLayoutCreate(&ds.la, lt_type(g.b_type), K, N, K));
  JF8_LT(cublasLtMatrixLayoutCreate(&ds.lb, lt_type(g.a_type), K, M, K));
  JF8_LT(cublasLtMatrixLayoutCreate(&ds.ld, lt_type(g.d_type), N, M, N));
  // C is never read (beta = 0), but its layout must be 16-bit beside an FP8 D, and C may only
  // share D's pointer when the layouts match: an FP8 D gets no C pointer at all.
  JF8_LT(cublasLtMatrixLayoutCreate(&ds.lc, lt_type(g.epilogue_type), N, M, N));

  const int align = common_alignment({g.a, g.b, g.d, g.bias});
  const AlgoKey key{dev, M, N, K, int(g.a_type), int(g.b_type), int(g.d_type), g.bias != nullptr,
                    g.fast_accum, align, int64_t(g.scale_mode)};
  cublasLtMatmulAlgo_t algo;
  {
    std::lock_guard<std::mutex> lock(cache().mu);
    auto it = cache().algos.find(key);
    if (it == cache().algos.end()) {
      cublasLtMatmulPreference_t pref;
      JF8_LT(cublasLtMatmulPreferenceCreate(&pref));
      size_t ws = kGemmWorkspaceBytes;
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                           sizeof(ws));
      const uint32_t al = static_cast<uint32_t>(align);
      for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
        cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al));
      cublasLtMatmulHeuristicResult_t res;
      int found = 0;
      const cublasStatus_t st =
          cublasLtMatmulAlgoGetHeuristic(lt, ds.op, ds.la, ds.lb, ds.lc, ds.ld, pref, 1, &res, &found);
      cublasLtMatmulPreferenceDestroy(pref);
      if (st != CUBLAS_STATUS_SUCCESS || found == 0)
        return ffi::Error::Internal("cuBLASLt found no FP8 algorithm for this GEMM (scale mode " +
                                    std::to_string(int64_t(g.scale_mode)) + ")");
      cache().algos[key] = res.algo;
      algo = res.algo;
    } else {
      algo = it->second;
    }
  }
  const float alpha = 1.0f, beta = 0.0f;
  if (g.fp8_out && cudaMemsetAsync(g.amax_d, 0, sizeof(float), stream) != cudaSuccess)
    return ffi::Error::Internal("cudaMemsetAsync of amax_d failed");
  JF8_LT(cublasLtMatmul(lt, ds.op, &alpha, g.b, ds.la, g.a, ds.lb, &beta,
                        g.fp8_out ? nullptr : g.d, ds.lc, g.d, ds.ld, &algo, g.workspace,
                        kGemmWorkspaceBytes, stream));
  return last_error();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmCudaHandler, DecodeThen(DecodeGemm, GemmImpl),
                              BindGemm(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
