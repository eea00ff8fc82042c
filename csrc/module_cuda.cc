// The CUDA extension: exports the CUDA FFI handlers, the shared constants (constants_py.h) and
// the GEMM algorithm choice (gemm_lt.h; jax_fp8's own block-scaled kernels among the
// candidates: block_gemm.h) that jax_fp8/ops/gemm_algorithms.py drives.
// Built when nvcc and cuBLASLt are found; cudart is linked statically, cuBLASLt dynamically, so
// importing it fails cleanly (and jax_fp8 carries on with the CPU targets) where those
// libraries are missing.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <map>

#include "constants_py.h"
#include "ffi/gemm_lt.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

namespace {

// A GEMM problem from Python: dtypes by their numpy names; ValueError for others.
jax_fp8::GemmProblem gemm_problem(int64_t m, int64_t n, int64_t k, const std::string& a,
                                  const std::string& b, const std::string& d, bool has_bias,
                                  bool fast_accum, int64_t scale_mode) {
  using xla::ffi::DataType;
  static const std::map<std::string, DataType> types = {
      {"float8_e4m3fn", DataType::F8E4M3FN}, {"float8_e5m2", DataType::F8E5M2},
      {"bfloat16", DataType::BF16}, {"float16", DataType::F16}, {"float32", DataType::F32}};
  auto type = [&](const std::string& name) {
    auto it = types.find(name);
    if (it == types.end()) throw nb::value_error(("no GEMM dtype " + name).c_str());
    return it->second;
  };
  if (scale_mode < 0 || scale_mode > int64_t(jax_fp8::ScaleMode::kGroup1x128))
    throw nb::value_error("scale_mode must be 0, 1 or 2");
  return {m, n, k, type(a), type(b), type(d), has_bias, fast_accum,
          static_cast<jax_fp8::ScaleMode>(scale_mode)};
}

nb::bytes algo_bytes(const cublasLtMatmulAlgo_t& algo) {
  return nb::bytes(reinterpret_cast<const char*>(&algo), sizeof(algo));
}

}  // namespace

extern "C" {
XLA_FFI_Error* QuantizeCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* QuantizeRingCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CastTransposeRingCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* GroupQuantizeCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* BlockQuantizeCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* GroupCastTransposeCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* Mxfp8QuantizeCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* Nvfp4QuantizeCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* GemmCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* GroupedGemmCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* BlockGemmCudaHandler(XLA_FFI_CallFrame* call_frame);
}

NB_MODULE(_jax_fp8_cuda, m) {
  m.def("constants", &jax_fp8::constants_dict);
  m.def("registrations", []() {
    nb::dict d;
    d["jax_fp8_quantize"] = nb::capsule(reinterpret_cast<void*>(QuantizeCudaHandler));
    d["jax_fp8_quantize_ring"] = nb::capsule(reinterpret_cast<void*>(QuantizeRingCudaHandler));
    d["jax_fp8_gemm"] = nb::capsule(reinterpret_cast<void*>(GemmCudaHandler));
    d["jax_fp8_grouped_gemm"] = nb::capsule(reinterpret_cast<void*>(GroupedGemmCudaHandler));
    d["jax_fp8_block_gemm"] = nb::capsule(reinterpret_cast<void*>(BlockGemmCudaHandler));
    d["jax_fp8_cast_transpose_ring"] =
        nb::capsule(reinterpret_cast<void*>(CastTransposeRingCudaHandler));
    d["jax_fp8_group_quantize"] = nb::capsule(reinterpret_cast<void*>(GroupQuantizeCudaHandler));
    d["jax_fp8_block_quantize"] = nb::capsule(reinterpret_cast<void*>(BlockQuantizeCudaHandler));
    d["jax_fp8_group_cast_transpose"] =
        nb::capsule(reinterpret_cast<void*>(GroupCastTransposeCudaHandler));
    d["jax_fp8_mxfp8_quantize"] = nb::capsule(reinterpret_cast<void*>(Mxfp8QuantizeCudaHandler));
    d["jax_fp8_nvfp4_quantize"] = nb::capsule(reinterpret_cast<void*>(Nvfp4QuantizeCudaHandler));
    return d;
  });
  // The identity of CUDA device `ordinal`'s kind (gemm_lt.h: device_identity).
  m.def("gemm_device", [](int ordinal) { return jax_fp8::device_identity(ordinal); });
  // (cuBLASLt's candidate algorithms as bytes, their microseconds per run or -1, jax_fp8's
  // kernels timed (names), their microseconds per run or -1).
  m.def("gemm_tune", [](int device, int64_t m_, int64_t n, int64_t k, const std::string& a,
                        const std::string& b, const std::string& d, bool has_bias,
                        bool fast_accum, int64_t scale_mode) {
    const auto problem = gemm_problem(m_, n, k, a, b, d, has_bias, fast_accum, scale_mode);
    jax_fp8::TunedGemm t;
    {
      nb::gil_scoped_release release;  // the timing takes up to a second
      t = jax_fp8::tune_gemm(device, problem);
    }
    nb::list algos;
    for (const auto& algo : t.candidates) algos.append(algo_bytes(algo));
    return nb::make_tuple(algos, t.us, t.kernels, t.kernel_us);
  });
  m.def("gemm_choose", [](const std::string& device, int64_t m_, int64_t n, int64_t k,
                          const std::string& a, const std::string& b, const std::string& d,
                          bool has_bias, bool fast_accum, int64_t scale_mode, nb::bytes algo) {
    cublasLtMatmulAlgo_t chosen;
    if (algo.size() != sizeof(chosen))
      throw nb::value_error(
          ("a cuBLASLt algorithm is " + std::to_string(sizeof(chosen)) + " bytes").c_str());
    std::memcpy(&chosen, algo.c_str(), sizeof(chosen));
    jax_fp8::choose_algorithm(device, gemm_problem(m_, n, k, a, b, d, has_bias, fast_accum,
                                                   scale_mode), chosen);
  });
}
