"""Stateless FP8 primitives, one module per op: validate at trace time, shape the results, call
the FFI target (``csrc/ffi``), with a sharding rule for a plain sharded jit. Each op has a
plain-jnp twin of the same name in ``jax_fp8.reference``. Every quantize op returns a
``jax_fp8.quantized.Quantized`` (the delayed-scaling ones a ``DelayedQuantized`` holding one)."""

from .blockwise import (activation_grad_group_cast_transpose, activation_group_cast_transpose,
                        block_quantize, group_cast_transpose, group_quantize,
                        norm_group_cast_transpose)
from .cast_transpose import (activation_cast_transpose, activation_grad_cast_transpose,
                             cast_transpose_delayed, norm_cast_transpose)
from .gemm import gemm
from .grouped_gemm import grouped_gemm, grouped_gemm_wgrad
from .mxfp8 import mxfp8_dequantize, mxfp8_gemm, mxfp8_quantize
from .nvfp4 import nvfp4_dequantize, nvfp4_gemm, nvfp4_quantize, nvfp4_quantize_cuda_kernel
from .quantize import dequantize, quantize, quantize_delayed

__all__ = ["activation_cast_transpose", "activation_grad_cast_transpose",
           "activation_grad_group_cast_transpose", "activation_group_cast_transpose",
           "block_quantize", "cast_transpose_delayed", "dequantize", "gemm", "group_cast_transpose",
           "grouped_gemm", "grouped_gemm_wgrad",
           "group_quantize", "mxfp8_dequantize", "mxfp8_gemm", "mxfp8_quantize",
           "norm_cast_transpose", "norm_group_cast_transpose", "nvfp4_dequantize", "nvfp4_gemm",
           "nvfp4_quantize", "nvfp4_quantize_cuda_kernel", "quantize", "quantize_delayed"]
