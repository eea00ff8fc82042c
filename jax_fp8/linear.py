"""``linear`` and ``multi_linear``: ``y = x @ kernel + bias`` with low-precision GEMMs forward
and backward, as a ``jax.custom_vjp`` of the recipe's family (``jax_fp8.families``). This module
checks the arguments once and dispatches once: the FP8 path of the recipe's family, FP8
inference weights (``Fp8Weight``), or below the recipe's ``fp8_min_intensity`` XLA's GEMM in
the compute dtype."""

from __future__ import annotations

import math

import jax

from . import norms, sharding
from ._residuals import op_outputs
from .cast_kernel import CastKernel, check_cast
from .families import family
from .families._shared import split_output
from .inference import Fp8Weight, check_weight, forward
from .layer_checks import (amax_axes, check_dims, check_key, check_norm, check_rings,
                           check_split, check_stateless, compute_dtype, float_array, fp8_pays,
                           gemm_input)
from .layer_state import LinearState, MultiLinearState
from .recipes import DelayedScaling, Recipe, check_recipe


def linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
           state: LinearState | None = None,
           recipe: Recipe = DelayedScaling(),
           amax_axis_name: str | tuple[str, ...] | None = None, norm: str | None = None,
           gamma: jax.Array | None = None, beta: jax.Array | None = None,
           epsilon: float = norms.EPSILON, dtype=None, key: jax.Array | None = None,
           split: tuple[int, ...] | list[int] | None = None) -> jax.Array | tuple[jax.Array, ...]:
  """``y = x @ kernel + bias`` with low-precision GEMMs forward and backward (FP8 per-tensor or
  block scaling, MXFP8, NVFP4).

  Args:
    x: [..., K] float32 / bfloat16 / float16.
    kernel: [K, N] (Flax layout), float32 / bfloat16 / float16, quantized from its own dtype;
      or its ``CastKernel`` (``cast_kernel``: quantized once for the step's microbatches), or
      an ``Fp8Weight`` (inference).
    bias: optional [N].
    state: under ``DelayedScaling``, the layer's ``LinearState`` (create with
      ``LinearState.create(recipe)``); differentiate with respect to it and pass that gradient
      to ``jax_fp8.update_state`` for the next rings. Under the other recipes: None.
    recipe: a ``DelayedScaling`` (the state's rings must have been made by it), a
      ``CurrentScaling`` (stateless: each tensor's scale from its amax of this step), a
      ``BlockScaling`` (stateless; K and N multiples of 128), an ``MXFP8BlockScaling``
      (stateless; K and N multiples of 32; GEMMs emulated, ``mxfp8_gemm``) or an
      ``NVFP4BlockScaling`` (stateless; K and N multiples of 16; GEMMs emulated,
      ``nvfp4_gemm``; its global amaxes reduced over ``amax_axis_name`` as CurrentScaling's
      amaxes are). Each may set ``fp8_min_intensity``: a linear below it runs in the compute
      dtype (BF16 GEMMs through XLA), its rings untouched, where the FP8 path would be slower
      (``recipes.check_fp8_min_intensity``). The per-tensor recipes' ``fast_accum_gemms`` name
      the GEMMs (fprop, dgrad, wgrad) that accumulate the fast way.
    amax_axis_name: under ``pmap`` / ``shard_map``, the axis (or axes) whose devices share the
      scales; amaxes are max-reduced over it so all devices hold identical rings (under
      CurrentScaling: quantize each tensor with one scale, its amax reduced before the
      quantization; there None means every axis x, kernel or bias vary over). Under a
      type-checked ``shard_map`` it must include every axis x, kernel or bias vary over while
      the state is replicated. The default None means, where the types tell nothing (pmap,
      ``check_vma=False``), every manual axis; ``()`` means none (independent replicas, as in
      an ensemble under pmap). See ``layer_checks.amax_axes``. Gradients of replicated inputs
      are summed over the axes they are replicated on, as JAX does for any op.
    norm: None, or "rmsnorm" / "layernorm" (``jax_fp8.norms``): x is normalized over K before
      the GEMMs, from x in its own dtype. On the FP8 path under the recipes that fuse it
      (``Recipe.fuses``: the per-tensor recipes, and BlockScaling when differentiated), the norm
      is applied inside x's cast-transpose (``norm_cast_transpose``,
      ``norm_group_cast_transpose``), so it is never stored in the compute dtype; its backward
      is XLA's. Elsewhere it is XLA's, then the quantization and the GEMMs. LayerNorm's
      variance is ``E[x^2] - mu^2`` (one pass, Flax's default), which loses precision where a
      row's mean dwarfs its spread.
    gamma: the norm's [K] gain, one per column (float32 / bfloat16 / float16); None without
      a norm.
    beta: LayerNorm's [K] shift; None otherwise.
    epsilon: the norm's epsilon, a finite float > 0.
    dtype: the outputs' dtype, in which the GEMMs compute (float32, bfloat16, float16); None:
      x's. x is cast to it, unless a norm reads x (an f32 residual stream, say) first; x's
      gradient comes back in x's dtype.
    key: under ``NVFP4BlockScaling`` with stochastic rounding, a JAX PRNG key
      (``jax.random.key`` or a raw uint32 [2], threefry) for the gradients' rounding, a fresh
      one each step; kernel i's gradient draws from ``fold_in(key, i)``, under shard_map / pmap
      folded with the device's index along the axes the gradient varies over
      (``families.nvfp4.gradient_key``). Only the backward uses it: a forward may omit it, a
      gradient without it raises ValueError. None under the other recipes.
    split: None, or the sizes (N_0, ..., N_{n-1}) to cut the output into along N (as
      ``torch.split`` takes them): 1 to 4 positive multiples of 16 that sum to N, e.g. a fused
      q / k / v projection's. The parts are returned separately, so under the per-tensor
      recipes their gradients reach the backward separately and its cast-transpose reads each
      where it lies (``cast_transpose_delayed`` of x in parts), where cutting the output after
      the layer makes XLA write their concatenation first. The values are those of the output
      cut by ``jnp.split``.
  Returns:
    [..., N] in ``dtype`` (default x's); with ``split``, a tuple of n arrays [..., N_i].
  Raises:
    ValueError / TypeError at trace time: K or N not a multiple of the recipe's
    ``dim_multiple`` (16; 128 under BlockScaling, 32 under MXFP8BlockScaling), mismatched
    shapes, unsupported dtypes, rings that do not match the recipe, amax_axis_name not a str or
    tuple of str or naming an axis that is not bound, axes missing from amax_axis_name under
    shard_map, a state given to a stateless recipe or an amax axis to a block recipe, an
    Fp8Weight under MXFP8BlockScaling or NVFP4BlockScaling, a CastKernel cast for another recipe
    or beside a plain kernel, an unknown norm, gamma / beta of the wrong shape or dtype or given
    without their norm, epsilon not > 0, a key where the recipe draws none or that is not a PRNG
    key (or, when differentiating, none where NVFP4BlockScaling's stochastic rounding needs
    one); ``split`` not a tuple / list of ints (TypeError), or not 1 to 4 positive multiples of
    16 that sum to N (ValueError).

  Method: per-tensor delayed scaling with the HYBRID format (Micikevicius et al. 2022;
  NVIDIA TransformerEngine); block scaling after the DeepSeek-V3 technical report
  (arXiv 2412.19437, section 3.3); MXFP8 after the OCP MX v1.0 spec; NVFP4 after NVIDIA's
  NVFP4 pretraining report (arXiv 2509.25149).
  """
  ys = _apply(x, (kernel,), (bias,), ("kernel",), ("bias",), state, LinearState, recipe,
              amax_axis_name, (norm, gamma, beta, epsilon), dtype, key, split)
  return ys[0] if split is None else ys


def multi_linear(x: jax.Array, kernels, biases=None, *, state: MultiLinearState | None = None,
                 recipe: Recipe = DelayedScaling(),
                 amax_axis_name: str | tuple[str, ...] | None = None, norm: str | None = None,
                 gamma: jax.Array | None = None, beta: jax.Array | None = None,
                 epsilon: float = norms.EPSILON, dtype=None,
                 key: jax.Array | None = None) -> tuple[jax.Array, ...]:
  """``y_i = x @ kernels[i] + biases[i]`` for several kernels sharing one input (q / k / v
  projections; an MLP's gate and up), with one FP8 quantization of x for all of them: each
  output, kernel gradient and ring is what ``linear`` with that kernel and x's ring computes,
  less the repeated quantizations of x (``fp8_min_intensity`` aside: it is decided once, for
  the GEMM of all kernels side by side, [M, sum N_i, K]). The backward sums the kernels' dgrads
  into one dx (in x's dtype, as autodiff sums a shared input's gradients) and runs each wgrad
  on the one transposed FP8 copy of x.

  Args:
    x: [..., K] float32 / bfloat16 / float16.
    kernels: tuple / list of n [K, N_i] arrays, float32 / bfloat16 / float16 (or all
      ``CastKernel``s, or all ``Fp8Weight``s, as in ``linear``).
    biases: None, or n entries each None or [N_i] float32 / bfloat16 / float16.
    state: under ``DelayedScaling``, a ``MultiLinearState`` (``MultiLinearState.create(n,
      recipe)``), used as ``linear``'s state is. Under the other recipes: None.
    recipe, amax_axis_name, norm, gamma, beta, epsilon, dtype, key: as in ``linear``.
  Returns:
    tuple of n arrays [..., N_i] in ``dtype`` (default x's).
  Raises:
    ``linear``'s errors; also: kernels not a non-empty tuple / list, a kernel with N = 0
    beside others, biases of another count, a state whose ring tuples do not hold one ring per
    kernel.

  Method: as ``linear``; one quantization of a shared input as TransformerEngine's fused
  q / k / v and gate / up layers do.
  """
  if not isinstance(kernels, (tuple, list)) or not kernels:
    raise TypeError(f"kernels must be a non-empty tuple or list of [K, N_i] arrays, got "
                    f"{'an empty ' if isinstance(kernels, (tuple, list)) else ''}"
                    f"{type(kernels).__name__}")
  if biases is None:
    biases = (None,) * len(kernels)
  if not isinstance(biases, (tuple, list)) or len(biases) != len(kernels):
    got = (f"{len(biases)} of them" if isinstance(biases, (tuple, list)) else
           type(biases).__name__)
    raise TypeError(f"biases must be None or a tuple / list of {len(kernels)} biases (None for "
                    f"none), one per kernel, got {got}")
  return _apply(x, tuple(kernels), tuple(biases),
                tuple(f"kernels[{i}]" for i in range(len(kernels))),
                tuple(f"biases[{i}]" for i in range(len(kernels))), state, MultiLinearState,
                recipe, amax_axis_name, (norm, gamma, beta, epsilon), dtype, key)


def state_rings(recipe: Recipe, state, state_cls, count: int):
  """The rings of ``state`` as the families take them, ``(x, kernels, grads)`` (``count``
  kernels), checked against the recipe: TypeError / ValueError naming what is wrong."""
  if not isinstance(state, state_cls):
    raise TypeError(f"state must be a jax_fp8.{state_cls.__name__}, got "
                    f"{type(state).__name__}")
  named_x, named_k, named_g = state.named_rings()
  if len(named_k) != count or len(named_g) != count:
    raise ValueError(f"state holds {len(named_k)} kernel and {len(named_g)} gradient rings "
                     f"for {count} kernels")
  check_rings((named_x,) + named_k + named_g,
              (recipe.fwd_fmt,) * (1 + count) + (recipe.bwd_fmt,) * count, recipe)
  return named_x[1], tuple(r for _, r in named_k), tuple(r for _, r in named_g)


def _check_kernels(kernels, kernel_names, recipe, amax_axis_name):
  """(kernels, casts, weights?, (K, N) per kernel): the float kernels (a ``CastKernel``'s
  own), the casts' FP8 copies (None each without), whether they are ``Fp8Weight``s."""
  casts = (None,) * len(kernels)
  if any(isinstance(k, CastKernel) for k in kernels):
    casts = tuple(check_cast(c, name, recipe, amax_axis_name)
                  for c, name in zip(kernels, kernel_names))
    kernels = tuple(c.kernel for c in kernels)
  weights = [isinstance(k, Fp8Weight) for k in kernels]
  if any(weights) and not all(weights):
    raise TypeError("kernels must be all arrays or all Fp8Weight (inference), not a mix")
  if all(weights):
    return kernels, casts, True, tuple(check_weight(w, name, recipe)
                                       for w, name in zip(kernels, kernel_names))
  kernels = tuple(float_array(k, name) for k, name in zip(kernels, kernel_names))
  for name, kernel in zip(kernel_names, kernels):
    if kernel.ndim != 2:
      raise ValueError(f"{name} must be [K, N], got shape {kernel.shape}")
  return kernels, casts, False, tuple(kernel.shape for kernel in kernels)


def _check_biases(biases, bias_names, ns):
  out = []
  for b, name, n in zip(biases, bias_names, ns):
    if b is not None:
      b = float_array(b, name)
      if b.shape != (n,):
        raise ValueError(f"{name} must be [{n}], got {list(b.shape)}")
    out.append(b)
  return tuple(out)


def _apply(x, kernels, biases, kernel_names, bias_names, state, state_cls, recipe,
           amax_axis_name, norm_args, dtype, key, split=None):
  """``linear`` and ``multi_linear``: the arguments checked (``*_names``: how errors call the
  kernels and biases), then the family's FP8 path, FP8 weights, or below
  ``fp8_min_intensity`` XLA's GEMMs; the one kernel's output cut as ``split`` says."""
  x = float_array(x, "x")
  norm_params, norm = check_norm(x, norm_args)
  out_dtype = compute_dtype(x, dtype)
  check_recipe(recipe)
  kernels, casts, weights, shapes = _check_kernels(kernels, kernel_names, recipe,
                                                   amax_axis_name)
  for name, (kk, _) in zip(kernel_names, shapes):
    if x.ndim < 1 or x.shape[-1] != kk:
      raise ValueError(f"x [..., K] and {name} [K, N] must share K, got x {x.shape} and "
                       f"{name} with K={kk}")
  k, ns = shapes[0][0], tuple(n for _, n in shapes)
  biases = _check_biases(biases, bias_names, ns)
  split = check_split(split, ns[0])
  outs = ns if split is None else split  # the outputs' N
  words = check_key(recipe, key)
  fp8 = fp8_pays(recipe, math.prod(x.shape[:-1]), sum(ns), k)
  if fp8 and 0 in ns:
    raise ValueError(f"{kernel_names[ns.index(0)]} has N = 0 beside other kernels: leave it out")
  if fp8:
    check_dims(recipe, {"K": k, "N": ns})
  rings = None
  if recipe.stateful:
    rings = state_rings(recipe, state, state_cls, len(kernels))
  else:
    check_stateless(recipe, state, amax_axis_name)
  if recipe.amax_scope != "local":
    amax_axis_name = amax_axes(x, kernels, biases, state, amax_axis_name)
  fused_norm = fp8 and not weights and norm is not None and recipe.fuses
  if not fused_norm:
    x = gemm_input(x, norm_params, norm, out_dtype)  # else the norm's kernel reads x itself
  if not fp8 and not weights:
    return split_output(tuple(_linear_in_dtype(x, kernel, b)
                              for kernel, b in zip(kernels, biases)), split)
  if weights:
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    quantize_x = family(recipe).weight_input(recipe, amax_axis_name) if fp8 else None
    x_ring = None if rings is None else rings[0]
    ys = split_output(op_outputs(forward(x2, kernels, biases, x_ring, quantize_x, fp8,
                                         x.dtype)), split)
  else:
    x, norm_params, kernels, casts, biases = sharding.vary_like(
        (x, norm_params, kernels, casts, biases), x, norm_params, kernels, casts, biases)
    dtypes = (x.dtype, out_dtype, tuple(kernel.dtype for kernel in kernels),
              tuple(None if b is None else b.dtype for b in biases))
    ys = family(recipe).linear(x.reshape(math.prod(x.shape[:-1]), k), norm_params, kernels,
                               casts, biases, rings, recipe, amax_axis_name, dtypes, norm, words,
                               split)
  return tuple(y.reshape(*x.shape[:-1], n) for y, n in zip(ys, outs))


def _linear_in_dtype(x, kernel, bias):
  """The linear where FP8 cannot pay: XLA's GEMM in x's dtype, no ring touched."""
  y = x @ kernel.astype(x.dtype)
  return y if bias is None else y + bias.astype(x.dtype)
