// Timing of the candidate algorithms for one GEMM problem (gemm_lt.h: tune_gemm), as XLA
// autotunes its own GEMMs: cuBLASLt's, and for a block-scaled problem on sm_90 jax_fp8's own
// kernels (block_gemm.h). jax_fp8.ops.gemm_algorithms calls it once per problem and kind of
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

#include "block_gemm.h"
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

// The argument of jax_fp8's kernels for a block-scaled problem (the output's dtype, the scale
// mode), or false where they do not serve it: per-tensor scales, other operands or outputs, a
// device other than sm_90.
bool block_gemm_serves(int dev, const GemmProblem& p, BlockGemmOut* out) {
  if (p.scale_mode == ScaleMode::kPerTensor || p.a_type != ffi::DataType::F8E4M3FN ||
      p.b_type != ffi::DataType::F8E4M3FN)
    return false;
  switch (p.d_type) {
    case ffi::DataType::BF16: *out = BlockGemmOut::kBf16; break;
    case ffi::DataType::F16: *out = BlockGemmOut::kF16; break;
    case ffi::DataType::F32: *out = BlockGemmOut::kF32; break;
    default: return false;
  }
  int major = 0;
  check(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev),
        "cudaDeviceGetAttribute");
  return major == 9 && !(p.has_bias && p.d_type == ffi::DataType::F32);
}

TunedGemm tune_gemm(int dev, const GemmProblem& p) {
  TuneScope scope(dev);
  BlockGemmOut out;
  const bool ours = block_gemm_serves(dev, p, &out);
  auto [na, nb] = scale_sizes(p.scale_mode, p.M, p.N, p.K);
  if (ours) {  // room for either layout of the scales (all ones)
    const auto [oa, ob] = block_gemm_scale_sizes(p.scale_mode, p.M, p.N, p.K);
    na = std::max(na, oa);
    nb = std::max(nb, ob);
  }
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
  if (t.candidates.empty() && !ours) throw std::runtime_error(error);

  check(cudaStreamCreateWithFlags(&scope.stream, cudaStreamNonBlocking), "cudaStreamCreate");
  check(cudaEventCreate(&scope.start), "cudaEventCreate");
  check(cudaEventCreate(&scope.stop), "cudaEventCreate");
  // Microseconds per run over `reps` back-to-back runs of run(); negative when a run fails.
  auto time = [&](const auto& run, int reps) {
    cudaEventRecord(scope.start, scope.stream);
    for (int r = 0; r < reps; ++r)
      if (!run().empty()) return -1.0;
    cudaEventRecord(scope.stop, scope.stream);
    float ms = 0;
    if (cudaEventSynchronize(scope.stop) != cudaSuccess ||
        cudaEventElapsedTime(&ms, scope.start, scope.stop) != cudaSuccess) {
      cudaGetLastError();
      return -1.0;
    }
    return 1000.0 * ms / reps;
  };
  // A warm-up run, then the faster of two windows of back-to-back runs of about kTuneWindowUs.
  auto measure = [&](const auto& run) {
    double us = time(run, 1);
    if (us >= 0) {
      const int reps = std::clamp(int(std::ceil(kTuneWindowUs / std::max(us, 1.0))), 1, kTuneMaxReps);
      us = std::numeric_limits<double>::infinity();
      for (int window = 0; window < 2 && us >= 0; ++window) {
        const double w = time(run, reps);
        us = w < 0 ? -1.0 : std::min(us, w);
      }
    }
    return us;
  };
  bool ran = false;
  for (const cublasLtMatmulAlgo_t& algo : t.candidates) {
    const double us = measure([&] { return desc.run(lt, g, algo, scope.stream); });
    t.us.push_back(us);
    ran |= us >= 0;
  }
  if (ours) {
    const BlockGemmArgs bg{p.M, p.N, p.K, p.scale_mode, out, g.a, g.b, g.a_scale, g.b_scale,
                           g.bias, g.d};
    for (int k = 0; k < kNumBlockGemmKernels; ++k) {
      const double us = measure([&] { return run_block_gemm(bg, k, scope.stream); });
      t.kernels.push_back(kBlockGemmKernels[k].name);
      t.kernel_us.push_back(us);
      ran |= us >= 0;
    }
  }
  if (!ran) throw std::runtime_error("none of the candidate algorithms ran");
  return t;
}

}  // namespace jax_fp8
