"""Plain-jnp twins of every jax_fp8 op: the specification and the test oracle (also of MXFP8 and
NVFP4 quantization, with stochastic rounding and the random Hadamard transform, ahead of their
kernels).

Same signatures and results as the fast ops; unfused and written to be read. Quantize results
must match the CUDA and CPU kernels bit for bit; GEMM and linear results within stated
tolerances. Tests and benchmarks import this module; the library does not. The ring rules and
the formats' numerics come from ``jax_fp8.state``, ``jax_fp8.formats``, ``stochastic_rounding``,
``hadamard`` and ``philox`` (their one jnp definition), so the twins check the kernels against
them; the result types from ``jax_fp8.quantized`` (the ops' own, so a test compares a twin's
result with the op's field by field); from ``jax_fp8.ops`` only layout constants, none of the
ops' argument checks: a twin raises only where it cannot compute. One module per family:
``per_tensor`` (quantize, the delayed cast-transposes, gemm, linear), ``grouped`` (the
mixture of experts' ragged GEMMs, per-tensor or block-scaled, and linears), ``block`` (DeepSeek-V3 block scaling), ``mx`` (MXFP8,
NVFP4); every twin is importable from here.
"""

from __future__ import annotations

from .per_tensor import (activation_cast_transpose, activation_grad_cast_transpose,
                         cast_transpose_delayed, dequantize, gemm, linear, norm_cast_transpose,
                         quantize, quantize_delayed)
from .grouped import block_grouped_linear, grouped_gemm, grouped_gemm_wgrad, grouped_linear
from .block import (activation_grad_group_cast_transpose, activation_group_cast_transpose,
                    block_gemm, block_linear, block_quantize, expand_scales, group_cast_transpose,
                    group_quantize, group_scale, norm_group_cast_transpose)
from .mx import (mxfp8_dequantize, mxfp8_gemm, mxfp8_quantize, nvfp4_dequantize, nvfp4_gemm,
                 nvfp4_quantize)

__all__ = ["activation_cast_transpose", "activation_grad_cast_transpose",
           "activation_grad_group_cast_transpose", "activation_group_cast_transpose", "block_gemm",
           "block_grouped_linear", "block_linear", "block_quantize", "cast_transpose_delayed", "dequantize",
           "expand_scales", "gemm", "group_cast_transpose", "group_quantize", "group_scale",
           "grouped_gemm", "grouped_gemm_wgrad", "grouped_linear", "linear", "mxfp8_dequantize",
           "mxfp8_gemm", "mxfp8_quantize", "norm_cast_transpose", "norm_group_cast_transpose",
           "nvfp4_dequantize", "nvfp4_gemm", "nvfp4_quantize", "quantize", "quantize_delayed"]
