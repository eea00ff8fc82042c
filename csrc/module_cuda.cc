// The CUDA extension: exports the CUDA FFI handlers and the shared constants (constants_py.h).
// Built when nvcc and cuBLASLt are found; cudart is linked statically, cuBLASLt dynamically, so
// importing it fails cleanly (and jax_fp8 carries on with the CPU targets) where those
// libraries are missing.
#include <nanobind/nanobind.h>

#include "constants_py.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* QuantizeCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* QuantizeRingCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CastTransposeRingCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* GroupQuantizeCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* BlockQuantizeCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* GroupCastTransposeCudaHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* GemmCudaHandler(XLA_FFI_CallFrame* call_frame);
}

NB_MODULE(_jax_fp8_cuda, m) {
  m.def("constants", &jax_fp8::constants_dict);
  m.def("registrations", []() {
    nb::dict d;
    d["jax_fp8_quantize"] = nb::capsule(reinterpret_cast<void*>(QuantizeCudaHandler));
    d["jax_fp8_quantize_ring"] = nb::capsule(reinterpret_cast<void*>(QuantizeRingCudaHandler));
    d["jax_fp8_gemm"] = nb::capsule(reinterpret_cast<void*>(GemmCudaHandler));
    d["jax_fp8_cast_transpose_ring"] =
        nb::capsule(reinterpret_cast<void*>(CastTransposeRingCudaHandler));
    d["jax_fp8_group_quantize"] = nb::capsule(reinterpret_cast<void*>(GroupQuantizeCudaHandler));
    d["jax_fp8_block_quantize"] = nb::capsule(reinterpret_cast<void*>(BlockQuantizeCudaHandler));
    d["jax_fp8_group_cast_transpose"] =
        nb::capsule(reinterpret_cast<void*>(GroupCastTransposeCudaHandler));
    return d;
  });
}
