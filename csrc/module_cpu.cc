// The CPU extension: exports the CPU FFI handlers and the shared constants (constants_py.h).
// Always built; needs no CUDA.
#include <nanobind/nanobind.h>

#include "constants_py.h"
#include "xla/ffi/api/ffi.h"

namespace nb = nanobind;

extern "C" {
XLA_FFI_Error* QuantizeCpuHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* QuantizeRingCpuHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* CastTransposeRingCpuHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* GroupQuantizeCpuHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* BlockQuantizeCpuHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* GroupCastTransposeCpuHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* Mxfp8QuantizeCpuHandler(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* Nvfp4QuantizeCpuHandler(XLA_FFI_CallFrame* call_frame);
}

NB_MODULE(_jax_fp8_cpu, m) {
  m.def("constants", &jax_fp8::constants_dict);
  m.def("registrations", []() {
    nb::dict d;
    d["jax_fp8_quantize"] = nb::capsule(reinterpret_cast<void*>(QuantizeCpuHandler));
    d["jax_fp8_quantize_ring"] = nb::capsule(reinterpret_cast<void*>(QuantizeRingCpuHandler));
    d["jax_fp8_cast_transpose_ring"] =
        nb::capsule(reinterpret_cast<void*>(CastTransposeRingCpuHandler));
    d["jax_fp8_group_quantize"] = nb::capsule(reinterpret_cast<void*>(GroupQuantizeCpuHandler));
    d["jax_fp8_block_quantize"] = nb::capsule(reinterpret_cast<void*>(BlockQuantizeCpuHandler));
    d["jax_fp8_group_cast_transpose"] =
        nb::capsule(reinterpret_cast<void*>(GroupCastTransposeCpuHandler));
    d["jax_fp8_mxfp8_quantize"] = nb::capsule(reinterpret_cast<void*>(Mxfp8QuantizeCpuHandler));
    d["jax_fp8_nvfp4_quantize"] = nb::capsule(reinterpret_cast<void*>(Nvfp4QuantizeCpuHandler));
    return d;
  });
}
