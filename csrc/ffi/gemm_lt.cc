// cuBLASLt plumbing of jax_fp8_gemm (gemm_lt.h). Scales are per-tensor (scale_mode 0) or block
// scales (DeepSeek-V3 recipe, cuBLASLt >= 12.9): a with 1 x 128 groups along K and b with
// 128 x 128 blocks (scale_mode 1) or 1 x 128 groups (scale_mode 2). Layouts cuBLASLt 13.1 reads
// on Hopper (tests/test_gemm.py checks them against an f32 reference): 1 x 128 scales
// outer-dimension-contiguous, [K/128, M] for a and [K/128, N] for b, with M a multiple of 4 (it
// offers no algorithm otherwise); 128 x 128 scales row-major with 16-byte rows,
// [ceil(N/128), ceil4(K/128)]. An e4m3 output is multiplied by d_scale (the reciprocal of the
// output's dequantization step) before the saturating cast, and cuBLASLt's epilogue writes the
// amax of the unscaled result (amax-D) beside it.
#include "gemm_lt.h"

#include <map>
#include <mutex>

namespace jax_fp8 {

static_assert(sizeof(cublasLtMatmulAlgo_t) == kGemmAlgorithmBytes);

namespace {

cudaDataType_t lt_type(ffi::DataType t) {
  switch (t) {
    case ffi::DataType::F8E4M3FN: return CUDA_R_8F_E4M3;
    case ffi::DataType::F8E5M2: return CUDA_R_8F_E5M2;
    case ffi::DataType::BF16: return CUDA_R_16BF;
    case ffi::DataType::F16: return CUDA_R_16F;
    default: return CUDA_R_32F;
  }
}

std::mutex& lt_mutex() {
  static std::mutex* mu = new std::mutex;
  return *mu;
}

std::map<std::pair<std::string, GemmProblem>, cublasLtMatmulAlgo_t>& chosen() {
  static auto* c = new std::map<std::pair<std::string, GemmProblem>, cublasLtMatmulAlgo_t>;
  return *c;  // never destroyed, like the handles: no static teardown order to respect
}

}  // namespace

#define JF8_LT(call)                                    \
  do {                                                  \
    const std::string e_ = lt_status((call), #call);    \
    if (!e_.empty()) return e_;                         \
  } while (0)

std::string lt_status(cublasStatus_t s, const char* call) {
  return s == CUBLAS_STATUS_SUCCESS ? std::string()
                                    : std::string(call) + " failed: " + std::to_string(int(s));
}

cublasLtHandle_t lt_handle(int dev) {
  static auto* handles = new std::map<int, cublasLtHandle_t>;
  std::lock_guard<std::mutex> lock(lt_mutex());
  auto it = handles->find(dev);
  if (it != handles->end()) return it->second;
  cublasLtHandle_t lt = nullptr;
  if (cublasLtCreate(&lt) != CUBLAS_STATUS_SUCCESS) return nullptr;
  (*handles)[dev] = lt;
  return lt;
}

const std::string& device_identity(int dev) {
  static auto* names = new std::map<int, std::string>;
  std::lock_guard<std::mutex> lock(lt_mutex());
  auto it = names->find(dev);
  if (it != names->end()) return it->second;
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, dev) != cudaSuccess) {
    cudaGetLastError();
    return (*names)[dev] = "CUDA device " + std::to_string(dev) + " (unknown)";
  }
  return (*names)[dev] = std::string(prop.name) + " (sm_" + std::to_string(prop.major) +
                         std::to_string(prop.minor) + ", " +
                         std::to_string(prop.multiProcessorCount) + " SMs, cuBLASLt " +
                         std::to_string(cublasLtGetVersion()) + ", workspace " +
                         std::to_string(kGemmWorkspaceBytes >> 20) + " MiB, block GEMM r" +
                         std::to_string(kBlockGemmRevision) + ")";
}

LtGemm::~LtGemm() {
  if (ld) cublasLtMatrixLayoutDestroy(ld);
  if (lc) cublasLtMatrixLayoutDestroy(lc);
  if (lb) cublasLtMatrixLayoutDestroy(lb);
  if (la) cublasLtMatrixLayoutDestroy(la);
  if (op) cublasLtMatmulDescDestroy(op);
}

std::string LtGemm::describe(const GemmArgs& g) {
  const GemmProblem& p = g.p;
  JF8_LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  const int8_t fast = p.fast_accum ? 1 : 0;
  JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_FAST_ACCUM, &fast, sizeof(fast)));
  const void* sa = g.b_scale;  // cuBLASLt's A is our b
  const void* sb = g.a_scale;
  JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
  JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
  if (p.scale_mode != ScaleMode::kPerTensor) {
#if CUBLAS_VERSION >= 120900
    const cublasLtMatmulMatrixScale_t mode_a = p.scale_mode == ScaleMode::kBlock128x128
                                                   ? CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F
                                                   : CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    const cublasLtMatmulMatrixScale_t mode_b = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode_a, sizeof(mode_a)));
    JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode_b, sizeof(mode_b)));
#else
    return "block-scaled GEMMs need cuBLASLt 12.9 or newer at build time";
#endif
  }
  if (p.fp8_out()) {
    const void* dsp = g.d_scale;
    void* amp = g.amax_d;
    JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_D_SCALE_POINTER, &dsp, sizeof(dsp)));
    JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_AMAX_D_POINTER, &amp, sizeof(amp)));
  }
  if (p.has_bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    const void* bp = g.bias;
    const cudaDataType_t bt = lt_type(epilogue_type(p.d_type));
    JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi)));
    JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof(bp)));
    JF8_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bt, sizeof(bt)));
  }
  JF8_LT(cublasLtMatrixLayoutCreate(&la, lt_type(p.b_type), p.K, p.N, p.K));
  JF8_LT(cublasLtMatrixLayoutCreate(&lb, lt_type(p.a_type), p.K, p.M, p.K));
  JF8_LT(cublasLtMatrixLayoutCreate(&ld, lt_type(p.d_type), p.N, p.M, p.N));
  // C is never read (beta = 0), but its layout must be 16-bit beside an FP8 D, and C may only
  // share D's pointer when the layouts match: an FP8 D gets no C pointer at all (run).
  JF8_LT(cublasLtMatrixLayoutCreate(&lc, lt_type(epilogue_type(p.d_type)), p.N, p.M, p.N));
  return {};
}

std::vector<cublasLtMatmulAlgo_t> LtGemm::candidates(cublasLtHandle_t lt, int align, int count,
                                                     std::string* error) const {
  std::vector<cublasLtMatmulAlgo_t> out;
  cublasLtMatmulPreference_t pref;
  if (!(*error = lt_status(cublasLtMatmulPreferenceCreate(&pref), "cublasLtMatmulPreferenceCreate"))
           .empty())
    return out;
  size_t ws = kGemmWorkspaceBytes;
  cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof(ws));
  const uint32_t al = static_cast<uint32_t>(align);
  for (auto attr : {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES})
    cublasLtMatmulPreferenceSetAttribute(pref, attr, &al, sizeof(al));
  std::vector<cublasLtMatmulHeuristicResult_t> res(count);
  int found = 0;
  *error = lt_status(cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, lc, ld, pref, count,
                                                    res.data(), &found),
                     "cublasLtMatmulAlgoGetHeuristic");
  cublasLtMatmulPreferenceDestroy(pref);
  for (int i = 0; i < found && error->empty(); ++i) out.push_back(res[i].algo);
  if (out.empty() && error->empty()) *error = "cuBLASLt found no FP8 algorithm for this GEMM";
  return out;
}

std::string LtGemm::run(cublasLtHandle_t lt, const GemmArgs& g, const cublasLtMatmulAlgo_t& algo,
                        cudaStream_t stream) const {
  const float alpha = 1.0f, beta = 0.0f;
  if (g.p.fp8_out() && cudaMemsetAsync(g.amax_d, 0, sizeof(float), stream) != cudaSuccess)
    return "cudaMemsetAsync of amax_d failed";
  JF8_LT(cublasLtMatmul(lt, op, &alpha, g.b, la, g.a, lb, &beta, g.p.fp8_out() ? nullptr : g.d,
                        lc, g.d, ld, &algo, g.workspace, kGemmWorkspaceBytes, stream));
  return {};
}

void choose_algorithm(const std::string& device, const GemmProblem& p,
                      const cublasLtMatmulAlgo_t& algo) {
  std::lock_guard<std::mutex> lock(lt_mutex());
  chosen()[{device, p}] = algo;
}

bool chosen_algorithm(const std::string& device, const GemmProblem& p, cublasLtMatmulAlgo_t* algo) {
  std::lock_guard<std::mutex> lock(lt_mutex());
  auto it = chosen().find({device, p});
  if (it == chosen().end()) return false;
  *algo = it->second;
  return true;
}

}  // namespace jax_fp8
