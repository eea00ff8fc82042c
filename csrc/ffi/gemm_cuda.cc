// CUDA FFI handler for jax_fp8_gemm: FP8 x FP8 -> bf16 / f16 / f32 / e4m3 through cuBLASLt, TN
// layout, f32 accumulation, scales read on the device, optional bias in the epilogue, and for an
// e4m3 output cuBLASLt's amax-D beside it, so the next layer's scale needs no extra pass. The
// cuBLASLt calls, scale modes and layouts: gemm_lt.h / gemm_lt.cc. Arguments: gemm_args.h.
//
// The algorithm: the one chosen for this problem on this kind of device
// (jax_fp8.ops.gemm_algorithms times the candidates while tracing, or reads an earlier run's
// choice), else cuBLASLt's first heuristic choice, found once per problem and pointer
// alignment. Either way every execution of a given call issues the same device work, with no
// timing, allocation or synchronization inside it.
#include <map>
#include <mutex>
#include <tuple>

#include "gemm_lt.h"
#include "launch.h"

namespace jax_fp8 {
namespace {

// Largest power of two (up to 256) dividing every pointer: the heuristic must only offer
// algorithms valid for the alignment XLA gave these buffers.
int common_alignment(std::initializer_list<const void*> ptrs) {
  uintptr_t bits = 256;
  for (const void* p : ptrs)
    if (p) bits |= reinterpret_cast<uintptr_t>(p);
  return static_cast<int>(bits & (~bits + 1));
}

// cuBLASLt's first heuristic choice per device, problem and alignment.
bool heuristic_algorithm(int dev, const GemmProblem& p, int align, cublasLtHandle_t lt,
                         const LtGemm& desc, cublasLtMatmulAlgo_t* algo, std::string* error) {
  static std::mutex mu;
  static auto* found = new std::map<std::tuple<int, GemmProblem, int>, cublasLtMatmulAlgo_t>;
  std::lock_guard<std::mutex> lock(mu);
  const auto key = std::make_tuple(dev, p, align);
  auto it = found->find(key);
  if (it == found->end()) {
    const auto c = desc.candidates(lt, align, 1, error);
    if (c.empty()) return false;
    it = found->emplace(key, c[0]).first;
  }
  *algo = it->second;
  return true;
}

ffi::Error GemmImpl(cudaStream_t stream, const GemmArgs& g) {
  if (g.p.M == 0) return ffi::Error::Success();
  int dev = 0;
  cudaGetDevice(&dev);
  const cublasLtHandle_t lt = lt_handle(dev);
  if (!lt) return ffi::Error::Internal("cublasLtCreate failed");
  LtGemm desc;
  if (std::string e = desc.describe(g); !e.empty()) return ffi::Error::Internal(e);
  const int align = common_alignment({g.a, g.b, g.d, g.bias});
  cublasLtMatmulAlgo_t algo;
  if (align < kTunedAlignment || !chosen_algorithm(device_identity(dev), g.p, &algo)) {
    std::string error;
    if (!heuristic_algorithm(dev, g.p, align, lt, desc, &algo, &error))
      return ffi::Error::Internal(error + " (scale mode " + std::to_string(int64_t(g.p.scale_mode)) +
                                  ")");
  }
  if (std::string e = desc.run(lt, g, algo, stream); !e.empty()) return ffi::Error::Internal(e);
  return last_error();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GemmCudaHandler, DecodeThen(DecodeGemm, GemmImpl),
                              BindGemm(BindCuda()), {ffi::Traits::kCmdBufferCompatible});

}  // namespace jax_fp8
