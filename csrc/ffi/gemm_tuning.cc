// Timing of cuBLASLt's candidate algorithms for one GEMM problem (gemm_lt.h: tune_gemm), as XLA
// autotunes its own GEMMs: jax_fp8.ops.gemm_algorithms calls it once per problem and kind of
// device while tracing, outside any XLA computation (usually before the first step runs: work
// already queued on the device is not waited for), and keeps the fastest for the process and in
// a file for later runs. It runs on its own stream, on buffers of its own that hold random
// finite data (sign and magnitude bits vary, as in training; unit scales), so nothing XLA owns
// is read or written.
#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <stdexcept>

#include "gemm_lt.h"

namespace jax_fp8 {
namespace {

constexpr int kTuneCandidates = 8;        // of cuBLASLt's heuristic list, best first
constexpr double kTuneWindowUs = 5000.0;  // each candidate runs back to back about this long
constexpr int kTuneMaxReps = 100;
constexpr size_t kBufferAlign = 256;

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(e));
  }
}

// The device made current for the timing, the previous one restored, everything freed.
struct TuneScope {
  int previous = 0;
  char* base = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  explicit TuneScope(int dev) {
    cudaGetDevice(&previous);
    check(cudaSetDevice(dev), "cudaSetDevice");
  }
  ~TuneScope() {
    if (stream) cudaStreamSynchronize(stream);
    if (stop) cudaEventDestroy(stop);
    if (start) cudaEventDestroy(start);
    if (stream) cudaStreamDestroy(stream);
    if (base) cudaFree(base);
    cudaSetDevice(previous);
  }
};

// Bytes [offset, offset + n) of the private allocation, each piece 256-byte aligned.
struct Layout {
  size_t total = 0;
  size_t take(size_t n) {
    const size_t at = total;
    total += (n + kBufferAlign - 1) / kBufferAlign * kBufferAlign;
    return at;
  }
};

// Random finite inputs: each byte masked with 0xB7 keeps its sign and low bits random and the
// magnitude below 1 for e4m3 / e5m2 (tiny for 16-bit biases); scales are 1.
void fill_inputs(char* dev_ptr, size_t bytes, const std::vector<size_t>& scale_offsets,
                 const std::vector<size_t>& scale_counts) {
  std::vector<unsigned char> chunk(size_t(1) << 20);
  std::mt19937 gen(0);
  for (auto& c : chunk) c = static_cast<unsigned char>(gen() & 0xB7);
  for (size_t at = 0; at < bytes; at += chunk.size())
    check(cudaMemcpy(dev_ptr + at, chunk.data(), std::min(chunk.size(), bytes - at),
                     cudaMemcpyHostToDevice),
          "cudaMemcpy");
  for (size_t i = 0; i < scale_offsets.size(); ++i) {
    const std::vector<float> ones(scale_counts[i], 1.0f);
    check(cudaMemcpy(dev_ptr + scale_offsets[i], ones.data(), ones.size() * sizeof(float),
                     cudaMemcpyHostToDevice),
          "cudaMemcpy");
  }
}

}  // namespace

TunedGemm tune_gemm(int dev, const GemmProblem& p) {
  TuneScope scope(dev);
  const auto [na, nb] = scale_sizes(p.scale_mode, p.M, p.N, p.K);
  Layout at;
  const size_t a = at.take(p.M * p.K * ffi::ByteWidth(p.a_type));
  const size_t b = at.take(p.N * p.K * ffi::ByteWidth(p.b_type));
  const size_t bias = at.take(p.has_bias ? p.N * ffi::ByteWidth(epilogue_type(p.d_type)) : 0);
  const size_t a_scale = at.take(na * sizeof(float));
  const size_t b_scale = at.take(nb * sizeof(float));
  const size_t d_scale = at.take(sizeof(float));
  const size_t inputs = at.total;
  const size_t d = at.take(p.M * p.N * ffi::ByteWidth(p.d_type));
  const size_t amax_d = at.take(sizeof(float));
  const size_t workspace = at.take(kGemmWorkspaceBytes);
  check(cudaMalloc(&scope.base, at.total), "cudaMalloc of the GEMM timing buffers");
  fill_inputs(scope.base, inputs, {a_scale, b_scale, d_scale}, {size_t(na), size_t(nb), 1});
  char* base = scope.base;
  const GemmArgs g{p,
                   base + a,
                   base + b,
                   p.has_bias ? base + bias : nullptr,
                   reinterpret_cast<const float*>(base + a_scale),
                   reinterpret_cast<const float*>(base + b_scale),
                   reinterpret_cast<const float*>(base + d_scale),
                   base + d,
                   reinterpret_cast<float*>(base + amax_d),
                   base + workspace};

  const cublasLtHandle_t lt = lt_handle(dev);
  if (!lt) throw std::runtime_error("cublasLtCreate failed");
  LtGemm desc;
  if (std::string e = desc.describe(g); !e.empty()) throw std::runtime_error(e);
  std::string error;
  TunedGemm t;
  t.candidates = desc.candidates(lt, kTunedAlignment, kTuneCandidates, &error);
  if (t.candidates.empty()) throw std::runtime_error(error);

  check(cudaStreamCreateWithFlags(&scope.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaEventCreate(&scope.start), "cudaEventCreate");
  check(cudaEventCreate(&scope.stop), "cudaEventCreate");
  // Microseconds per run over `reps` back-to-back runs; negative when a run fails.
  auto time = [&](const cublasLtMatmulAlgo_t& algo, int reps) {
    cudaEventRecord(scope.start, scope.stream);
    for (int r = 0; r < reps; ++r)
      if (!desc.run(lt, g, algo, scope.stream).empty()) return -1.0;
    cudaEventRecord(scope.stop, scope.stream);
    float ms = 0;
    if (cudaEventSynchronize(scope.stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, scope.start, scope.stop) != cudaSuccess) {
      cudaGetLastError();
      return -1.0;
    }
    return 1000.0 * ms / reps;
  };
  double best_us = std::numeric_limits<double>::infinity();
  for (size_t i = 0; i < t.candidates.size(); ++i) {
    double us = time(t.candidates[i], 1);  // also the warm-up
    if (us >= 0) {
      const int reps = std::clamp(int(std::ceil(kTuneWindowUs / std::max(us, 1.0))), 1, kTuneMaxReps);
      us = std::numeric_limits<double>::infinity();
      for (int window = 0; window < 2 && us >= 0; ++window) {
        const double w = time(t.candidates[i], reps);
        us = w < 0 ? -1.0 : std::min(us, w);
      }
    }
    t.us.push_back(us);
    if (us >= 0 && us < best_us) {
      best_us = us;
      t.best = static_cast<int>(i);
    }
  }
  if (t.best < 0) throw std::runtime_error("none of cuBLASLt's candidate algorithms ran");
  return t;
}

}  // namespace jax_fp8
