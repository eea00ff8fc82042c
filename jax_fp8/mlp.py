"""The FP8 MLP: up projection, activation, down projection, with the activation and its
gradient computed inside the cast-transposes that quantize them, so neither is ever stored in
the compute dtype (TransformerEngine's LayerNormMLP fuses the same steps).

This module checks the arguments once and dispatches once: under a recipe that fuses
(``Recipe.fuses``: the per-tensor recipes and ``BlockScaling``, when differentiated) its family's
fused rule (``jax_fp8.families``); otherwise (``MXFP8BlockScaling``, ``NVFP4BlockScaling``, the
block forward alone, or below ``fp8_min_intensity``) the composition ``linear``,
``jax_fp8.activations.apply``, ``linear`` (or XLA's GEMMs in the compute dtype).
"""

from __future__ import annotations

import functools
import math

import jax

from . import activations, norms, sharding
from .cast_kernel import CastKernel, check_cast
from .families import family
from .families.nvfp4 import fold_key
from .inference import Fp8Weight
from .layer_checks import (amax_axes, check_dims, check_key, check_norm, check_stateless,
                           compute_dtype, float_array, fp8_pays, gemm_input, mlp_dims,
                           state_rings)
from .layer_state import MlpState
from .linear import linear
from .recipes import DelayedScaling, Recipe, check_recipe

def mlp(x: jax.Array, kernel_in: jax.Array, kernel_out: jax.Array,
        bias_in: jax.Array | None = None, bias_out: jax.Array | None = None, *,
        activation: str = "swiglu", state: MlpState | None = None,
        recipe: Recipe = DelayedScaling(),
        amax_axis_name: str | tuple[str, ...] | None = None, norm: str | None = None,
        gamma: jax.Array | None = None, beta: jax.Array | None = None,
        epsilon: float = norms.EPSILON, dtype=None, key: jax.Array | None = None) -> jax.Array:
  """``act(x @ kernel_in + bias_in) @ kernel_out + bias_out`` with FP8 GEMMs forward and
  backward, the activation and its gradient fused into the cast-transposes (see the module
  docstring).

  Args:
    x: [..., K] float32 / bfloat16 / float16.
    kernel_in: [K, N] float32 / bfloat16 / float16; N = F, or 2F for a gated activation
      (columns [gate | up]).
    kernel_out: [F, D] float32 / bfloat16 / float16. Or both kernels ``CastKernel``s
      (``cast_kernel``, quantized once for the step's microbatches).
    bias_in: optional [N]; bias_out: optional [D].
    activation: "silu", "gelu" (tanh approximation), "swiglu" or "geglu"
      (``jax_fp8.activations``).
    state: under ``DelayedScaling``, an ``MlpState`` (``MlpState.create(recipe)``), used as
      ``linear``'s state is (differentiate with respect to it, pass that gradient to
      ``jax_fp8.update_state``). Under the other recipes: None.
    recipe: ``DelayedScaling``, ``CurrentScaling`` (the activation's amax from XLA's
      activation of the up projection, its gradient's likewise), ``BlockScaling`` (K, N, F
      and D multiples of 128), ``MXFP8BlockScaling`` (multiples of 32) or
      ``NVFP4BlockScaling`` (multiples of 16; the two linears draw from ``key`` folded with 0
      and 1). The FP8
      path runs where both GEMMs reach the recipe's ``fp8_min_intensity``; otherwise the MLP
      runs through XLA in the compute dtype (``dtype``, x's where None) and the rings are
      untouched.
    amax_axis_name: as in ``linear``.
    norm, gamma, beta, epsilon: the input's norm, as in ``linear`` (TransformerEngine's
      LayerNormMLP): fused into x's cast-transpose under the per-tensor recipes and
      BlockScaling on the FP8 path.
    dtype: the compute dtype of the GEMMs and the activation, and the output's, as in
      ``linear``.
    key: as in ``linear`` (``NVFP4BlockScaling``'s stochastic rounding only).
  Returns:
    [..., D] in ``dtype`` (default x's).
  Raises:
    TypeError / ValueError at trace time: dtypes, shapes (N = 2F for a gated activation; on
    the FP8 path K, F and D multiples of the recipe's ``dim_multiple``: 16, or 128 under
    BlockScaling, 32 under MXFP8BlockScaling), unknown activation, a state that is not an MlpState of the recipe's
    rings, a state given to a stateless recipe or an amax axis to a block recipe, and the
    amax_axis_name, norm and key errors of ``linear``.

  Method: per-tensor delayed scaling as in ``linear`` (Micikevicius et al. 2022, NVIDIA
  TransformerEngine); gated activations after Shazeer 2020 (arXiv 2002.05202).
  """
  x = float_array(x, "x")
  activations.check(activation)
  norm_params, norm = check_norm(x, (norm, gamma, beta, epsilon))
  out_dtype = compute_dtype(x, dtype)
  check_recipe(recipe)
  casts = (None, None)
  if isinstance(kernel_in, CastKernel) or isinstance(kernel_out, CastKernel):
    casts = (check_cast(kernel_in, "kernel_in", recipe, amax_axis_name),
             check_cast(kernel_out, "kernel_out", recipe, amax_axis_name))
    kernel_in, kernel_out = kernel_in.kernel, kernel_out.kernel
  for name, k in (("kernel_in", kernel_in), ("kernel_out", kernel_out)):
    if isinstance(k, Fp8Weight):
      raise TypeError(f"{name} is an Fp8Weight; mlp takes float kernels (Fp8Weight serves "
                      f"linear and multi_linear, and quantize_weights leaves Mlp's kernels "
                      f"float)")
  kernel_in, kernel_out = float_array(kernel_in, "kernel_in"), float_array(kernel_out,
                                                                           "kernel_out")
  bias_in = None if bias_in is None else float_array(bias_in, "bias_in")
  bias_out = None if bias_out is None else float_array(bias_out, "bias_out")
  if x.ndim < 1 or kernel_in.ndim != 2 or kernel_out.ndim != 2:
    raise ValueError(f"x must be [..., K], kernel_in [K, N] and kernel_out [F, D], got x "
                     f"{x.shape}, kernel_in {kernel_in.shape}, kernel_out {kernel_out.shape}")
  k, n, f, d = mlp_dims(activation, x, kernel_in, kernel_out)
  for name, b, size in (("bias_in", bias_in, n), ("bias_out", bias_out, d)):
    if b is not None and b.shape != (size,):
      raise ValueError(f"{name} must be [{size}], got {list(b.shape)}")
  words = check_key(recipe, key)
  m = math.prod(x.shape[:-1])
  fp8 = fp8_pays(recipe, m, n, k) and fp8_pays(recipe, m, d, f)
  rings = None
  if recipe.stateful:
    rings = state_rings(state, MlpState, recipe)
  else:
    check_stateless(recipe, state, amax_axis_name)
  if fp8:
    check_dims(recipe, {"K": k, "F": f, "D": d})
  axis = None
  if recipe.amax_scope != "local":  # checked on every path, as linear does
    axis = amax_axes(x, (kernel_in, kernel_out), (bias_in, bias_out), state, amax_axis_name)
  fused = fp8 and recipe.fuses
  if not fused or norm is None:  # else the norm's kernel reads x
    x = gemm_input(x, norm_params, norm, out_dtype)
  if not fused:
    keys = (None, None) if words is None else (fold_key(words, 0), fold_key(words, 1))
    axes = {} if recipe.amax_scope == "local" else {"amax_axis_name": axis or ()}
    lin = (functools.partial(linear, recipe=recipe, **axes) if fp8 else
           lambda v, w, b, key: v @ w.astype(v.dtype) + (0 if b is None else b.astype(v.dtype)))
    h = activations.apply(lin(x, kernel_in, bias_in, key=keys[0]), activation).astype(x.dtype)
    return lin(h, kernel_out, bias_out, key=keys[1])
  x, norm_params, kernel_in, kernel_out, casts, bias_in, bias_out = sharding.vary_like(
      (x, norm_params, kernel_in, kernel_out, casts, bias_in, bias_out), x, norm_params,
      kernel_in, kernel_out, casts, bias_in, bias_out)
  dtypes = (x.dtype, out_dtype, kernel_in.dtype, kernel_out.dtype,
            None if bias_in is None else bias_in.dtype,
            None if bias_out is None else bias_out.dtype)
  out = family(recipe).mlp(x.reshape(m, k), norm_params, kernel_in, kernel_out, casts, bias_in,
                           bias_out, rings, recipe, activation, axis, dtypes, norm, words)
  return out.reshape(*x.shape[:-1], d)
