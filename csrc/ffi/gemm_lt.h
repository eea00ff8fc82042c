// The cuBLASLt plumbing of jax_fp8_gemm, shared by its handler (gemm_cuda.cc) and by the timing
// of its candidate algorithms (gemm_tuning.cc): handles, the matmul description of a GEMM, the
// heuristic's candidates, and the algorithm chosen for each problem on each kind of device.
//
// Row-major view: D[M, N] = (a_scale * b_scale) * A[M, K] . B[N, K]^T (+ bias[N]).
// cuBLASLt is column-major, so it computes D^T[N, M]: its "A" is our B seen as a K x N
// column-major matrix with op T, its "B" is our A seen as K x M column-major with op N, and
// D^T is N x M column-major, which is D row-major. The bias runs along cuBLASLt's rows (our N).
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <string>
#include <vector>

#include "gemm_args.h"

namespace jax_fp8 {

// A failed cuBLASLt call as a message: the call and its status. Empty on success.
std::string lt_status(cublasStatus_t s, const char* call);

// One cuBLASLt handle per device, created on first use and never destroyed.
cublasLtHandle_t lt_handle(int dev);

// What identifies a kind of device to an algorithm choice: its name, compute capability, SM
// count, cuBLASLt's version, the workspace the algorithms may use and the revision of jax_fp8's
// own candidates (kBlockGemmRevision), e.g.
// "NVIDIA H200 (sm_90, 132 SMs, cuBLASLt 130100, workspace 32 MiB, block GEMM r1)".
const std::string& device_identity(int dev);

// The matmul description of one GEMM (its pointers included: scales, bias, D scale, amax-D).
struct LtGemm {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t la = nullptr, lb = nullptr, lc = nullptr, ld = nullptr;
  LtGemm() = default;
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;
  ~LtGemm();
  std::string describe(const GemmArgs& g);  // empty on success, else what failed

  // Up to `count` candidate algorithms from cuBLASLt's heuristic, best first, valid for
  // pointers aligned to `align` bytes; the failing call in *error when there are none.
  std::vector<cublasLtMatmulAlgo_t> candidates(cublasLtHandle_t lt, int align, int count,
                                               std::string* error) const;
  // cublasLtMatmul with this algorithm (the amax-D of an e4m3 output zeroed first).
  std::string run(cublasLtHandle_t lt, const GemmArgs& g, const cublasLtMatmulAlgo_t& algo,
                  cudaStream_t stream) const;
};

// Candidates are valid for pointers aligned to this many bytes (cuBLASLt's FP8 minimum); the
// handler falls back to the heuristic's first choice for less-aligned pointers.
constexpr int kTunedAlignment = 16;

// The algorithm chosen for a problem on a kind of device (device_identity): set once per
// process by jax_fp8.ops.gemm_algorithms (timed, or read from its file), read by the handler.
void choose_algorithm(const std::string& device, const GemmProblem& p,
                      const cublasLtMatmulAlgo_t& algo);
bool chosen_algorithm(const std::string& device, const GemmProblem& p, cublasLtMatmulAlgo_t* algo);

// cuBLASLt's candidates with their times in microseconds (-1 where one failed to run); for a
// block-scaled problem on sm_90, jax_fp8's own kernels (block_gemm.h: kBlockGemmKernels'
// names) with their times.
struct TunedGemm {
  std::vector<cublasLtMatmulAlgo_t> candidates;
  std::vector<double> us;
  std::vector<std::string> kernels;
  std::vector<double> kernel_us;
};
// Times up to kTuneCandidates of cuBLASLt's candidates for p on device `dev`, and jax_fp8's
// kernels where they serve p, on its own stream and its own buffers of random finite data;
// throws std::runtime_error when none runs. Never inside an XLA computation: jax_fp8 calls it
// while tracing (gemm_tuning.cc).
TunedGemm tune_gemm(int dev, const GemmProblem& p);

}  // namespace jax_fp8
