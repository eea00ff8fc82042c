"""jax_fp8: FP8 training for JAX (XLA FFI kernels, delayed scaling, Flax layers)."""

from . import flax  # noqa: F401  (registers the state classes with flax.serialization)
from . import reference
from ._ffi import cuda_available
from .blockwise import BlockScaling, block_quantize, group_cast_transpose, group_quantize
from .linear import LinearState, linear
from .ops import cast_transpose_delayed, dequantize, gemm, quantize, quantize_delayed
from .scaling import (DelayedScaling, ScaleRing, combine_updates, fp8_dtype, fp8_max, share,
                      update_state)

__all__ = [
    "BlockScaling", "block_quantize", "group_cast_transpose", "group_quantize",
    "DelayedScaling", "LinearState", "ScaleRing", "cast_transpose_delayed", "combine_updates",
    "cuda_available",
    "dequantize", "fp8_dtype", "fp8_max", "gemm", "linear", "quantize", "quantize_delayed",
    "reference", "share", "update_state",
]
