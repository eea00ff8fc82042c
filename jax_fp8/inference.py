"""FP8 weights for inference: a trained kernel quantized once into an ``Fp8Weight``, which
``linear`` / ``multi_linear`` and the Flax layers take in place of the kernel and use without
requantizing (forward only), at about half the memory of bf16 weights.

Under ``DelayedScaling`` the weight has one E4M3 scale (current scaling of the trained kernel:
its amax onto 448 with the recipe's margin), and x is quantized with the layer's x ring (one
pass: the scale the training run last set). Under ``CurrentScaling`` the weight is the same and
x is quantized with the scale of its own amax (XLA's reduction, then the quantize kernel).
Under ``BlockScaling`` the weight has 128 x 128
block scales and x 1 x 128 group scales, as in training. Below the recipe's
``fp8_min_intensity`` the weight is dequantized to x's dtype for XLA's GEMM instead; on the
H200 that was slower than the FP8 GEMM at every shape measured, decode-like M included (XLA
writes the dequantized weight before its GEMM; docs/performance.md, ``benchmarks.inference``):
for inference, keep ``fp8_min_intensity`` at 0.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from . import _names, checks
from .cast_kernel import CastKernel
from .families import family
from .formats import BLOCK
from .layer_checks import kernel_to_cast
from .ops.gemm import expand_scales, gemm_bias
from .recipes import BlockScaling, CurrentScaling, DelayedScaling, Recipe


class Fp8Weight(NamedTuple):
  """A kernel [K, N] quantized for the forward GEMM (TN: stored transposed).

  Attributes:
    q: float8_e4m3fn [N, K], the kernel transposed.
    scale: float32, the dequantization step: [] (DelayedScaling, CurrentScaling) or
      [ceil(N/128), K/128]
      (BlockScaling's 128 x 128 blocks).
  """

  q: jax.Array
  scale: jax.Array


def quantize_weight(kernel: jax.Array,
                    recipe: DelayedScaling | CurrentScaling | BlockScaling) -> Fp8Weight:
  """``kernel`` [K, N] (float32 / bfloat16 / float16) as an ``Fp8Weight`` for ``recipe``.

  Raises TypeError / ValueError for another dtype or rank, a recipe that does not serve FP8
  weights (``casts_kernel`` False), or K, N not multiples of 128 under BlockScaling (16 under
  the per-tensor recipes). Method: per-tensor current scaling of the weight (DelayedScaling,
  CurrentScaling) or DeepSeek-V3's 128 x 128 blocks (BlockScaling)."""
  kernel = kernel_to_cast(kernel, recipe)
  t = family(recipe).quantize_weight(kernel, recipe)
  return Fp8Weight(q=t.data, scale=t.scale)


def quantize_weights(params, recipe, *, select=lambda path, kernel: True, stacked_axes: int = 0):
  """``params`` (a pytree: a linen "params" collection, or ``nnx.state(model, nnx.Param)`` to
  pass to ``nnx.update``) with every 2-D leaf named "kernel" or "kernel_<i>" (the kernels of
  jax_fp8's layers) that ``select(path, kernel)`` accepts (path: the keys joined by "/")
  replaced by its ``Fp8Weight`` for ``recipe``. ``stacked_axes`` (an int >= 0; 1 for layers
  under ``nn.scan``): such a kernel with that many leading axes more ([L, K, N]) becomes the
  stack of its slices' ``Fp8Weight``s (each leaf with the same leading axes), which the scan
  slices back into one a layer. Other leaves stay as they are (a kernel of another rank, such
  as ``nn.DenseGeneral``'s or ``nn.Conv``'s): ``Mlp``'s
  ``kernel_in`` / ``kernel_out`` stay float (``mlp`` takes float kernels). Quantize only the
  kernels of layers that run through jax_fp8 (after ``jax_fp8.convert``: those its filter
  chose; e.g. ``select=lambda path, kernel: "lm_head" not in path``). ``recipe``:
  ``DelayedScaling``, ``CurrentScaling`` or ``BlockScaling`` (the layers then run with that
  recipe; under ``DelayedScaling`` they still take their ``fp8_state`` for the inputs).
  Raises TypeError for a select that is not callable or returns no bool, a ``stacked_axes``
  that is not an int >= 0 (ValueError for a negative one) or a ``CastKernel`` among the params
  (``flax.cast_kernels``' output, for training: quantize the float params), and
  ``quantize_weight``'s errors."""
  if not callable(select):
    raise TypeError(f"select must be a callable (path, kernel) -> bool, got {select!r}")
  stacked_axes = checks.integer(stacked_axes, "stacked_axes", lo=0)

  def one(path, leaf):
    keys = _names.path_keys(path)
    if keys and keys[-1] == "value" and isinstance(path[-1], jax.tree_util.GetAttrKey):
      keys = keys[:-1]  # the array inside an NNX Variable (nnx.state(model, nnx.Param))
    if isinstance(leaf, CastKernel):
      raise TypeError(f"params holds a CastKernel at {'/'.join(keys)} (cast_kernels', for "
                      f"training): quantize the float params")
    name = keys[-1] if keys else ""
    kernel = name == "kernel" or _names.multi_index(name) is not None
    if (kernel and jnp.ndim(leaf) in (2, 2 + stacked_axes)
        and checks.selected(select, "/".join(keys), leaf)):
      quantize_one = lambda k: quantize_weight(k, recipe)
      for _ in range(jnp.ndim(leaf) - 2):
        quantize_one = jax.vmap(quantize_one)
      try:
        return quantize_one(leaf)
      except (TypeError, ValueError) as e:  # say which kernel
        raise type(e)(f"params' kernel at {'/'.join(keys)}: {e}") from None
    return leaf
  return jax.tree_util.tree_map_with_path(one, params,
                                          is_leaf=lambda v: isinstance(v, CastKernel))


def dequantized(w: Fp8Weight, dtype) -> jax.Array:
  """The kernel [K, N] in ``dtype`` (plain XLA: fuses into the GEMM that reads it)."""
  n, k = w.q.shape
  scale = w.scale if w.scale.ndim == 0 else expand_scales(w.scale, n, k, BLOCK)
  return (w.q.astype(jnp.float32) * scale).astype(dtype).T


def check_weight(w: Fp8Weight, name: str, recipe: Recipe) -> tuple[int, int]:
  """(K, N) of an Fp8Weight quantized for ``recipe``; TypeError / ValueError naming it (and
  TypeError under a recipe that has no FP8 weights: MXFP8BlockScaling, NVFP4BlockScaling)."""
  if not recipe.casts_kernel:
    raise TypeError(f"{name} is an Fp8Weight, which serves DelayedScaling, CurrentScaling and "
                    f"BlockScaling; under {type(recipe).__name__} pass the float kernel")
  q, scale = checks.array(w.q, f"{name}.q"), checks.array(w.scale, f"{name}.scale")
  if q.dtype != jnp.float8_e4m3fn or q.ndim != 2 or scale.dtype != jnp.float32:
    raise TypeError(f"{name} must hold float8_e4m3fn q [N, K] and a float32 scale, got "
                    f"{q.dtype}{list(q.shape)} and {scale.dtype}")
  n, k = q.shape
  want = family(recipe).weight_scale_shape(n, k)
  if scale.shape != want:
    raise ValueError(f"{name}.scale must be {list(want)} for a {type(recipe).__name__} "
                     f"recipe (quantize_weight with the recipe the layer runs), got "
                     f"{list(scale.shape)}")
  return k, n


def forward(x2, weights, biases, x_ring, quantize_x, fp8: bool, dtype):
  """The outputs [M, N_i] in ``dtype`` of x2 [M, K] against ``weights``: FP8 GEMMs with x
  quantized once by ``quantize_x`` ((x2, x_ring) -> its ``Quantized``, the family's
  ``weight_input``; x_ring the state's ring or None), or below ``fp8_min_intensity`` (``fp8``
  False) XLA's GEMMs on the dequantized weights. Not differentiable, in any argument (the ring
  too: a TypeError)."""
  @jax.custom_jvp
  def run(x2, weights, biases, x_ring):
    if not fp8:
      return tuple(x2 @ dequantized(w, dtype) + (0 if b is None else b.astype(dtype))
                   for w, b in zip(weights, biases))
    qx = quantize_x(x2, x_ring)
    return tuple(gemm_bias(qx.data, w.q, qx.scale, w.scale, b, dtype)
                 for w, b in zip(weights, biases))

  @run.defjvp
  def _(primals, tangents):
    raise TypeError("a linear on Fp8Weight kernels is inference-only: differentiate the layer "
                    "with its float kernels")
  return run(x2, weights, biases, x_ring)
