"""jax_fp8: FP8 training for JAX (XLA FFI kernels, delayed and block scaling, Flax layers).

The core depends on jax and numpy only; ``jax_fp8.flax`` (the Flax layer) needs the ``flax``
extra and is imported on its own: ``import jax_fp8.flax``.
"""

from ._ffi import cuda_available
from .formats import fp8_dtype, fp8_max
from .cast_kernel import CastKernel, cast_kernel
from .inference import Fp8Weight, quantize_weight, quantize_weights
from .grouped_linear import grouped_linear
from .grouped_mlp import grouped_mlp
from .layer_state import (GroupedLinearState, GroupedMlpState, LinearState, MlpState,
                          MultiLinearState)
from .linear import linear, multi_linear
from .mlp import mlp
from .moe import MoeState, moe_mlp
from .ops import (activation_cast_transpose, activation_grad_cast_transpose,
                  activation_grad_group_cast_transpose, activation_group_cast_transpose,
                  block_quantize, cast_transpose_delayed,
                  dequantize, gemm, group_cast_transpose, group_quantize, grouped_gemm,
                  grouped_gemm_wgrad, mxfp8_dequantize,
                  mxfp8_gemm, mxfp8_quantize, norm_cast_transpose, norm_group_cast_transpose,
                  nvfp4_dequantize, nvfp4_gemm, nvfp4_quantize, nvfp4_quantize_cuda_kernel,
                  quantize, quantize_delayed)
from .quantized import DelayedQuantized, Quantized
from .recipes import (BlockScaling, CurrentScaling, DelayedScaling, MXFP8BlockScaling,
                      NVFP4BlockScaling, Recipe)
from .state import ScaleRing, combine_updates, share, update_state

__version__ = "0.3.0.dev0"

__all__ = [
    "BlockScaling", "CastKernel", "CurrentScaling", "DelayedQuantized", "DelayedScaling",
    "Fp8Weight", "GroupedLinearState", "GroupedMlpState", "LinearState", "MlpState", "MoeState",
    "MultiLinearState", "MXFP8BlockScaling", "NVFP4BlockScaling", "Quantized", "Recipe",
    "ScaleRing", "activation_cast_transpose", "activation_grad_cast_transpose",
    "activation_grad_group_cast_transpose", "activation_group_cast_transpose", "block_quantize",
    "cast_kernel", "cast_transpose_delayed", "combine_updates", "cuda_available", "dequantize",
    "fp8_dtype", "fp8_max", "gemm", "group_cast_transpose", "group_quantize", "grouped_gemm",
    "grouped_gemm_wgrad", "grouped_linear", "grouped_mlp", "linear", "mlp", "moe_mlp",
    "multi_linear", "mxfp8_dequantize", "mxfp8_gemm", "mxfp8_quantize", "norm_cast_transpose",
    "norm_group_cast_transpose", "nvfp4_dequantize", "nvfp4_gemm", "nvfp4_quantize",
    "nvfp4_quantize_cuda_kernel", "quantize", "quantize_delayed", "quantize_weight",
    "quantize_weights", "share", "update_state",
]
