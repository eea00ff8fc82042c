"""The FP8 MLP: up projection, activation, down projection, with the activation and its
gradient computed inside the cast-transposes that quantize them, so neither is ever stored in
the compute dtype (TransformerEngine's LayerNormMLP fuses the same steps).

Forward: x and both kernels are cast-transposed with their scale rings (as in
``jax_fp8.linear``, delayed or current scaling); ``y = x @ kernel_in + bias_in`` in one FP8
GEMM (a gated activation's gate and up projections side by side in one kernel, one GEMM);
``activation_cast_transpose`` reads y once and writes ``act(y)`` in both FP8 layouts;
``out = act(y) @ kernel_out + bias_out``.
Saved: x's and act(y)'s transposed FP8 copies, the kernels' FP8 copies, and y.
Backward: the output gradient g is cast-transposed (``dbias_out`` from the same read);
``dh = g @ kernel_out.T`` (dgrad), ``dkernel_out = act(y).T @ g`` (wgrad);
``activation_grad_cast_transpose`` reads dh and y once and writes the up projection's output
gradient dy in both FP8 layouts (``dbias_in`` from the same read); ``dx = dy @ kernel_in.T``,
``dkernel_in = x.T @ dy``.

Under ``BlockScaling`` the same steps run in 1 x 128 groups (x, the activation and the
gradients; 128 x 128 blocks for the kernels): ``group_cast_transpose`` and its norm and
activation forms (``jax_fp8.ops.blockwise``) in place of the cast-transposes, and the bias
gradients by XLA (``dbias_in`` from dh and y). Under ``MXFP8BlockScaling`` and
``NVFP4BlockScaling`` the MLP is the composition ``linear``, ``jax_fp8.activations.apply``,
``linear`` (block-scaled GEMMs; the activation is XLA's, not fused).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from . import activations, checks, norms, sharding
from ._residuals import op_outputs, packed, read_and_saved
from .formats import FLOAT_DTYPES
from .inference import Fp8Weight
from .linear import (BLOCK_RECIPES, STATELESS, CastKernel, _amax_axes, _check_delayed,
                     _fp8_pays, _shared, block_kernel_saved,
                     block_quantize_input, cast_grads, cast_uses, check_cast, check_key,
                     check_norm, check_rings, check_stateless, fold_key, check_stateless_global,
                     compute_dtype, fp8_multiple, gemm_input, input_grad, kernel_fp8, linear,
                     normalized, quantize_input, scaled, zero_like)
from .ops import blockwise
from .ops.cast_transpose import (activation_cast_transpose, activation_grad_cast_transpose,
                                 cast_transpose_delayed)
from .ops.gemm import gemm, gemm_bias, gemm_dtype
from .recipes import BlockScaling, CurrentScaling, DelayedScaling, Recipe, check_recipe
from .state import ScaleRing

_RINGS = ("x", "kernel_in", "grad_in", "hidden", "kernel_out", "grad_out")


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(_RINGS), meta_fields=[])
@dataclasses.dataclass(frozen=True)
class MlpState:
  """The scale rings of ``mlp``: its input x, kernel_in, the up projection's output gradient
  (grad_in), the activation (hidden), kernel_out, and the output gradient (grad_out)."""

  x: ScaleRing
  kernel_in: ScaleRing
  grad_in: ScaleRing
  hidden: ScaleRing
  kernel_out: ScaleRing
  grad_out: ScaleRing

  @classmethod
  def create(cls, recipe: DelayedScaling = DelayedScaling()) -> "MlpState":
    """Fresh rings: the recipe's forward format for x, the kernels and the activation, its
    backward format for the two gradients. Raises TypeError for a recipe other than
    DelayedScaling (BlockScaling is stateless: pass state=None)."""
    _check_delayed(recipe, cls)
    fwd, bwd = recipe.ring(recipe.fwd_fmt), recipe.ring(recipe.bwd_fmt)
    return cls(fwd, fwd, bwd, fwd, fwd, bwd)


def _forward(x, norm_params, k_in, k_out, casts, b_in, b_out, rings, activation, fast_accum,
             norm, out_dtype, current_, axis_name):
  """out, what the backward needs, and the forward rings' observations (x, kernel_in, hidden,
  kernel_out). Under current scaling (``current_``) each ring is first set to its tensor's
  scale (``linear.scaled``; the activation's amax from XLA's activation of y)."""
  rx, rk_in, _, rh, rk_out, _ = rings
  fast = "fprop" in fast_accum
  if current_:
    rx = scaled(rx, normalized(x, norm_params, norm), current_, axis_name)
  cx = quantize_input(x, norm_params, rx, norm)  # [M, K], [K, M16]
  ck_in = kernel_fp8(k_in, casts[0], rk_in, current_, axis_name)  # [K, N], [N, K]
  y = gemm_bias(cx.q, ck_in.qt, cx.scale, ck_in.scale, b_in, out_dtype, fast)  # [M, N]
  if current_:
    rh = scaled(rh, activations.apply(y, activation), current_, axis_name)
  ch = activation_cast_transpose(y, rh, activation=activation, observe=True)  # [M, F], [F, M16]
  ck_out = kernel_fp8(k_out, casts[1], rk_out, current_, axis_name)  # [F, D], [D, F]
  out = gemm_bias(ch.q, ck_out.qt, ch.scale, ck_out.scale, b_out, out_dtype, fast)  # [M, D]
  saved = (cx.qt, cx.scale, ck_in.q, ck_in.scale, read_and_saved(y), ch.qt, ch.scale, ck_out.q,
           ck_out.scale, None if norm is None else (x, norm_params), cast_uses(casts))
  return out, saved, (cx.ring, ck_in.ring, ch.ring, ck_out.ring)


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9, 10, 11, 12, 13))
def _mlp(x, norm_params, k_in, k_out, casts, b_in, b_out, rings, activation, axis_name, dtypes,
         fast_accum, norm, current_):
  return _forward(x, norm_params, k_in, k_out, casts, b_in, b_out, rings, activation,
                  fast_accum, norm, dtypes[1], current_, axis_name)[0]


def _mlp_fwd(x, norm_params, k_in, k_out, casts, b_in, b_out, rings, activation, axis_name,
             dtypes, fast_accum, norm, current_):
  out, saved, observed = _forward(x, norm_params, k_in, k_out, casts, b_in, b_out, rings,
                                  activation, fast_accum, norm, dtypes[1], current_, axis_name)
  forward_rings, grad_rings = tuple(rings[i] for i in (0, 1, 3, 4)), (rings[2], rings[5])
  if current_:  # the observations are dropped: the blank rings get zero gradients
    return out, (saved, zero_like(grad_rings), zero_like(forward_rings))
  return out, (saved, grad_rings, _shared(observed, forward_rings, axis_name))


def _mlp_bwd(activation, axis_name, dtypes, fast_accum, norm, current_, res, g):
  (qxt, sx, qk_in, sk_in, y, qht, sh, qk_out, sk_out, normed, uses), grad_rings, observed = res
  rg_in, rg_out = grad_rings
  x_dtype, _, k_in_dtype, k_out_dtype, b_in_dtype, b_out_dtype = dtypes
  cg = cast_transpose_delayed(g, scaled(rg_out, g, current_, axis_name),
                              with_dbias=b_out_dtype is not None, observe=True)
  dh = gemm(cg.q, qk_out, cg.scale, sk_out, out_dtype=gemm_dtype(y.dtype),
            fast_accum="dgrad" in fast_accum).astype(y.dtype)  # [M, F]
  dk_out = gemm(qht, cg.qt, sh, cg.scale, out_dtype=gemm_dtype(k_out_dtype),
                fast_accum="wgrad" in fast_accum).astype(k_out_dtype)  # [F, D]
  if current_:
    rg_in = scaled(rg_in, activations.grad(dh, y, activation), current_, axis_name)
  cdy = activation_grad_cast_transpose(dh, y, rg_in, activation=activation,
                                       with_dbias=b_in_dtype is not None, observe=True)
  dx = gemm(cdy.q, qk_in, cdy.scale, sk_in, out_dtype=gemm_dtype(x_dtype),
            fast_accum="dgrad" in fast_accum)  # [M, K]
  dk_in = gemm(qxt, cdy.qt, sx, cdy.scale, out_dtype=gemm_dtype(k_in_dtype),
               fast_accum="wgrad" in fast_accum).astype(k_in_dtype)  # [K, N]
  db_in = None if b_in_dtype is None else cdy.dbias.astype(b_in_dtype)
  db_out = None if b_out_dtype is None else cg.dbias.astype(b_out_dtype)
  rg = grad_rings if current_ else _shared((cdy.ring, cg.ring), grad_rings, axis_name)
  ox, ok_in, oh, ok_out = observed
  dx, dnorm = input_grad(dx, *(normed or (None, (None, None))), norm, x_dtype)
  return (dx, dnorm, dk_in, dk_out, cast_grads(uses, 3), db_in, db_out,
          (ox, ok_in, rg[0], oh, ok_out, rg[1]))


_mlp.defvjp(*packed(_mlp_fwd, _mlp_bwd))


def _block_forward(x, norm_params, k_in, k_out, casts, b_in, b_out, recipe, activation, norm,
                   out_dtype):
  """BlockScaling's forward (1 x 128 groups for x and the activation, 128 x 128 blocks for the
  kernels): out, and what the backward needs."""
  kw = recipe.kwargs()
  qx, sx, qxt, sxt = block_quantize_input(x, norm_params, recipe, norm)  # [M, K], [K, M128]
  qk_in, sk_in = block_kernel_saved(k_in, casts[0], recipe)  # [K, N], [K/128, N/128]
  y = gemm_bias(qx, qk_in.T, sx, sk_in.T, b_in, out_dtype)  # [M, N]
  qh, sh, qht, sht = blockwise.activation_group_cast_transpose(y, activation=activation, **kw)
  qk_out, sk_out = block_kernel_saved(k_out, casts[1], recipe)  # [F, D], [F/128, D/128]
  out = gemm_bias(qh, qk_out.T, sh, sk_out.T, b_out, out_dtype)  # [M, D]
  return out, (qxt, sxt, qk_in, sk_in, read_and_saved(y), qht, sht, qk_out, sk_out,
               None if norm is None else (x, norm_params), cast_uses(casts))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _block_mlp(x, norm_params, k_in, k_out, casts, b_in, b_out, recipe, activation, dtypes,
               norm):
  return _block_forward(x, norm_params, k_in, k_out, casts, b_in, b_out, recipe, activation,
                        norm, dtypes[1])[0]


def _block_mlp_fwd(x, norm_params, k_in, k_out, casts, b_in, b_out, recipe, activation, dtypes,
                   norm):
  return _block_forward(x, norm_params, k_in, k_out, casts, b_in, b_out, recipe, activation,
                        norm, dtypes[1])


def _block_mlp_bwd(recipe, activation, dtypes, norm, res, g):
  qxt, sxt, qk_in, sk_in, y, qht, sht, qk_out, sk_out, normed, uses = res
  x_dtype, _, k_in_dtype, k_out_dtype, b_in_dtype, b_out_dtype = dtypes
  kw = recipe.kwargs()
  qg, sg, qgt, sgt = blockwise.group_cast_transpose(g, **kw)  # [M, D], [D, M128]
  dh = gemm(qg, qk_out, sg, sk_out, out_dtype=gemm_dtype(y.dtype)).astype(y.dtype)  # [M, F]
  dk_out = gemm(qht, qgt, sht, sgt, out_dtype=gemm_dtype(k_out_dtype)).astype(k_out_dtype)
  qdy, sdy, qdyt, sdyt = blockwise.activation_grad_group_cast_transpose(
      dh, y, activation=activation, **kw)  # [M, N], [N, M128]
  dx = gemm(qdy, qk_in, sdy, sk_in, out_dtype=gemm_dtype(x_dtype))  # [M, K]
  dk_in = gemm(qxt, qdyt, sxt, sdyt, out_dtype=gemm_dtype(k_in_dtype)).astype(k_in_dtype)
  # The bias gradients by XLA (the block kernels take no column sums): dy's from dh and y.
  db_in = None if b_in_dtype is None else jnp.sum(
      activations.grad(dh, y, activation), axis=0).astype(b_in_dtype)
  db_out = None if b_out_dtype is None else jnp.sum(
      g.astype(jnp.float32), axis=0).astype(b_out_dtype)
  dx, dnorm = input_grad(dx, *(normed or (None, (None, None))), norm, x_dtype)
  return dx, dnorm, dk_in, dk_out, cast_grads(uses, 2), db_in, db_out


_block_mlp.defvjp(*packed(_block_mlp_fwd, _block_mlp_bwd))


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
    the FP8 path K, F and D multiples of 16, or 128 under BlockScaling, 32 under
    MXFP8BlockScaling), unknown activation, a state that is not an MlpState of the recipe's
    rings, a state given to a stateless recipe or an amax axis to a block recipe, and the
    amax_axis_name, norm and key errors of ``linear``.

  Method: per-tensor delayed scaling as in ``linear`` (Micikevicius et al. 2022, NVIDIA
  TransformerEngine); gated activations after Shazeer 2020 (arXiv 2002.05202).
  """
  x = checks.array(x, "x")
  _, gated = activations.check(activation)
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
  named = {"x": x, "kernel_in": checks.array(kernel_in, "kernel_in"),
           "kernel_out": checks.array(kernel_out, "kernel_out")}
  for name, v in (("bias_in", bias_in), ("bias_out", bias_out)):
    if v is not None:
      named[name] = checks.array(v, name)
  for name, v in named.items():
    if v.dtype not in FLOAT_DTYPES:
      raise TypeError(f"{name} must be float32, bfloat16 or float16, got {v.dtype}")
  x, kernel_in, kernel_out = named["x"], named["kernel_in"], named["kernel_out"]
  bias_in, bias_out = named.get("bias_in"), named.get("bias_out")
  if x.ndim < 1 or kernel_in.ndim != 2 or kernel_out.ndim != 2:
    raise ValueError(f"x must be [..., K], kernel_in [K, N] and kernel_out [F, D], got x "
                     f"{x.shape}, kernel_in {kernel_in.shape}, kernel_out {kernel_out.shape}")
  k, n = kernel_in.shape
  f, d = kernel_out.shape
  if x.shape[-1] != k or n != (2 * f if gated else f):
    raise ValueError(f"x [..., K], kernel_in [K, N] and kernel_out [F, D] need x's K = "
                     f"kernel_in's K and N = {'2F (gate and up side by side)' if gated else 'F'}"
                     f" under {activation!r}, got x {x.shape}, kernel_in {kernel_in.shape}, "
                     f"kernel_out {kernel_out.shape}")
  for name, b, size in (("bias_in", bias_in, n), ("bias_out", bias_out, d)):
    if b is not None and b.shape != (size,):
      raise ValueError(f"{name} must be [{size}], got {list(b.shape)}")
  words = check_key(recipe, key)
  m = math.prod(x.shape[:-1])
  fp8 = _fp8_pays(recipe, m, n, k) and _fp8_pays(recipe, m, d, f)
  block, current_ = isinstance(recipe, BLOCK_RECIPES), isinstance(recipe, CurrentScaling)
  if isinstance(recipe, STATELESS):
    check_stateless(recipe, state, amax_axis_name)
  elif block or current_:
    check_stateless_global(recipe, state)
  elif not isinstance(state, MlpState):
    raise TypeError(f"state must be a jax_fp8.MlpState, got {type(state).__name__}")
  else:
    check_rings(tuple((f"state.{name}", getattr(state, name)) for name in _RINGS),
                tuple(recipe.bwd_fmt if name.startswith("grad") else recipe.fwd_fmt
                      for name in _RINGS), recipe)
  multiple, _ = fp8_multiple(recipe)
  if fp8 and any(v % multiple for v in (k, f, d)):
    raise ValueError(f"K, F and D must be multiples of {multiple} for the FP8 GEMMs"
                     f"{f' under {type(recipe).__name__}' if block else ''}, got K={k}, F={f}, "
                     f"D={d}")
  if not isinstance(recipe, STATELESS):  # checked on every path, as linear does
    axis = _amax_axes(x, (kernel_in, kernel_out), (bias_in, bias_out), state, amax_axis_name)
  fused_block = fp8 and isinstance(recipe, BlockScaling)
  if not fp8 or (block and not fused_block) or norm is None:  # else the norm's kernel reads x
    x = gemm_input(x, norm_params, norm, out_dtype)
  if not fp8 or (block and not fused_block):
    keys = (None, None) if words is None else (fold_key(words, 0), fold_key(words, 1))
    axes = {} if isinstance(recipe, STATELESS) else {"amax_axis_name": axis or ()}
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
  if fused_block:
    out = _block_mlp(x.reshape(m, k), norm_params, kernel_in, kernel_out, casts, bias_in,
                     bias_out, recipe, activation, dtypes, norm)
    return op_outputs(out).reshape(*x.shape[:-1], d)
  rings = (tuple(recipe.ring(recipe.bwd_fmt if name.startswith("grad") else recipe.fwd_fmt)
                 for name in _RINGS) if current_ else
           tuple(getattr(state, name) for name in _RINGS))
  out = _mlp(x.reshape(m, k), norm_params, kernel_in, kernel_out, casts, bias_in, bias_out,
             rings, activation, axis, dtypes, recipe.fast_accum_gemms, norm, current_)
  return op_outputs(out).reshape(*x.shape[:-1], d)
