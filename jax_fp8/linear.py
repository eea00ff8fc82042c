"""The FP8 linear layer: a custom_vjp whose forward and backward run FP8 GEMMs.

Forward: x and kernel are quantized to E4M3 with their delayed-scaling rings by cast-transpose
kernels (one read writes both the row-major and the transposed FP8 copy, since Hopper's FP8
GEMMs are TN-only), then one FP8 GEMM with the bias in its epilogue. Backward: the gradient is
cast-transposed once (E5M2 under the HYBRID recipe), the same read giving dbias, and feeds both
dgrad (``dx = g @ kernel.T``) and wgrad (``dkernel = x.T @ g``) as FP8 GEMMs. Only FP8 copies
are saved: x transposed (for wgrad) and the kernel (for dgrad).

The rings' observations of the step leave it as the gradient with respect to the state;
``jax_fp8.update_state`` turns them into the next rings (see ``jax_fp8.scaling``).

Under ``BlockScaling`` (stateless, DeepSeek-V3) the same three GEMMs run block-scaled: x and the
gradient are group cast-transposed (1 x 128 groups both ways from one read), the kernel is
block-quantized (128 x 128, whose transpose needs no requantization).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp

from . import blockwise, ops, sharding
from .blockwise import BlockScaling
from .scaling import DelayedScaling, ScaleRing, observe, scale_for_step


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "kernel", "grad"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LinearState:
  """The three scale rings of one linear layer: input x, kernel, and output gradient."""

  x: ScaleRing
  kernel: ScaleRing
  grad: ScaleRing

  @classmethod
  def create(cls, recipe: DelayedScaling = DelayedScaling()) -> "LinearState":
    """Fresh rings for x and the kernel (the recipe's forward format) and for the gradient
    (its backward format). Raises TypeError for a recipe other than DelayedScaling
    (BlockScaling is stateless: its linear takes no state)."""
    if not isinstance(recipe, DelayedScaling):
      raise TypeError(f"LinearState.create takes a DelayedScaling recipe, got "
                      f"{type(recipe).__name__} (BlockScaling is stateless: pass state=None)")
    return cls(recipe.ring(recipe.fwd_fmt), recipe.ring(recipe.fwd_fmt),
               recipe.ring(recipe.bwd_fmt))


def _vary(v, axes):
  """v made varying over `axes` (shard_map), or v itself."""
  missing = tuple(sorted(axes - sharding.varying_axes(v))) if v is not None else ()
  return jax.lax.pcast(v, missing, to="varying") if missing else v


def _amax_axes(x, kernel, bias, state, amax_axis_name):
  """The mesh axes to max-reduce the amaxes over, so that devices sharing rings agree.

  Axes named in amax_axis_name are always reduced over. Under a type-checked shard_map, x,
  kernel or bias vary over some axes (data parallel: x over the batch axis; tensor parallel:
  kernel over the model axis); rings replicated over such an axis need the amax reduced over
  it, so those axes must be among the names; rings that vary over it (one set per pipeline
  stage, say) keep their own amaxes unless the axis is named. Where the types tell nothing
  (pmap, shard_map with check_vma=False, or every input replicated), the default None means
  every manual axis (a no-op where the amaxes agree anyway), and () means none.
  """
  names = {amax_axis_name} if isinstance(amax_axis_name, str) else set(amax_axis_name or ())
  needed = sharding.varying_axes(x, kernel, bias) - sharding.varying_axes(state)
  if not needed <= names:
    raise ValueError(f"x, kernel or bias vary over the shard_map axes {sorted(needed)}, over "
                     f"which the state is replicated: pass them as amax_axis_name so every "
                     f"device keeps the same scale rings, got {amax_axis_name!r}")
  typed = bool(sharding.varying_axes(x, kernel, bias, state))
  if amax_axis_name is None and not typed:
    return tuple(sorted(sharding.manual_axes())) or None
  return tuple(sorted(names)) or None


def _fp8_pays(recipe, m, n, k) -> bool:
  """Whether this GEMM's intensity reaches the recipe's ``fp8_min_intensity`` (never for an
  empty K or N: nothing to quantize)."""
  return k > 0 and n > 0 and m * n * k >= recipe.fp8_min_intensity * (m * k + k * n + m * n)


def _linear_in_dtype(x, kernel, bias):
  """The linear where FP8 cannot pay: XLA's GEMM in x's dtype, no ring touched."""
  y = x @ kernel.astype(x.dtype)
  return y if bias is None else y + bias.astype(x.dtype)


def _gemm_dtype(dtype):
  """cuBLASLt writes bf16 / f16 directly; f32 inputs get an f32 GEMM output."""
  return dtype if dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def _global_amax(amaxes, axis_name):
  """The amaxes max-reduced over the devices that share the scales, in one collective (NaN
  counted as inf, so the max keeps it), so every device records the same observation."""
  a = jnp.stack(amaxes)
  if axis_name is not None:
    a = jax.lax.pmax(jnp.where(jnp.isnan(a), jnp.inf, a), axis_name)
  return tuple(a)


def _gemm_bias(a, b, a_scale, b_scale, bias, dtype, fast_accum=False):
  """``a @ b.T + bias`` in ``dtype``, the bias fused into the GEMM's epilogue where cuBLASLt
  can (bf16 / f16 outputs)."""
  out = _gemm_dtype(dtype)
  fused_bias = bias is not None and out != jnp.float32
  y = ops.gemm(a, b, a_scale, b_scale, bias=bias.astype(out) if fused_bias else None,
               out_dtype=out, fast_accum=fast_accum)
  if bias is not None and not fused_bias:
    y = y + bias.astype(out)
  return y.astype(dtype)


def _forward(x, kernel, bias, state, fast_accum):
  """y = x @ kernel + bias in FP8, and what the backward and the state update need."""
  # Cast-transposes: one read each gives both FP8 layouts (Hopper's FP8 GEMMs are TN-only).
  qx, qxt, ax, _, _ = ops.cast_transpose_delayed(x, state.x)  # [M, K], [K, M16] e4m3
  qk, qkt, ak, _, _ = ops.cast_transpose_delayed(kernel, state.kernel)  # [K, N], [N, K]
  sx, sk = scale_for_step(state.x, ax), scale_for_step(state.kernel, ak)  # what the kernels used
  y = _gemm_bias(qx, qkt, sx, sk, bias, x.dtype, "fprop" in fast_accum)
  return y, (qxt, sx, qk, sk), (ax, ak)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _linear(x, kernel, bias, state, axis_name, dtypes, fast_accum):
  del axis_name, dtypes  # used by the backward only
  return _forward(x, kernel, bias, state, fast_accum)[0]


def _linear_fwd(x, kernel, bias, state, axis_name, dtypes, fast_accum):
  del dtypes  # the backward's output dtypes (x, kernel, bias), static
  y, saved, (ax, ak) = _forward(x, kernel, bias, state, fast_accum)
  ax, ak = _global_amax((ax, ak), axis_name)
  return y, saved + (state.grad, observe(state.x, ax), observe(state.kernel, ak))


def _linear_bwd(axis_name, dtypes, fast_accum, res, g):
  qxt, sx, qk, sk, grad_ring, rx, rk = res
  x_dtype, k_dtype, b_dtype = dtypes
  # One quantization of g feeds both GEMMs; the same read gives dbias.
  qg, qgt, ag, _, db = ops.cast_transpose_delayed(g, grad_ring, with_dbias=b_dtype is not None)
  sg = scale_for_step(grad_ring, ag)
  rg = observe(grad_ring, *_global_amax((ag,), axis_name))
  dx = ops.gemm(qg, qk, sg, sk, out_dtype=_gemm_dtype(x_dtype),
                fast_accum="dgrad" in fast_accum)  # dgrad [M, K]
  dk = ops.gemm(qxt, qgt, sx, sg, out_dtype=_gemm_dtype(k_dtype),
                fast_accum="wgrad" in fast_accum)  # wgrad [K, N], over M16
  db = None if b_dtype is None else db.astype(b_dtype)
  return dx.astype(x_dtype), dk.astype(k_dtype), db, LinearState(rx, rk, rg)


_linear.defvjp(_linear_fwd, _linear_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _block_linear(x, kernel, bias, recipe, dtypes):
  del dtypes  # used by the backward only
  # Without a gradient no transposed copy is needed: the scales in cuBLASLt's layout.
  qx, sx_col = blockwise.group_quantize(x, scale_layout="col", **recipe.kwargs())
  qk, sk = blockwise.block_quantize(kernel, **recipe.kwargs())
  return _gemm_bias(qx, qk.T, sx_col.T, sk.T, bias, x.dtype)


def _block_linear_fwd(x, kernel, bias, recipe, dtypes):
  del dtypes
  qx, sx, qxt, sxt = blockwise.group_cast_transpose(x, **recipe.kwargs())  # [M,K], [K,M128]
  qk, sk = blockwise.block_quantize(kernel, **recipe.kwargs())  # [K, N], [K/128, N/128]
  return _gemm_bias(qx, qk.T, sx, sk.T, bias, x.dtype), (qxt, sxt, qk, sk)


def _block_linear_bwd(recipe, dtypes, res, g):
  qxt, sxt, qk, sk = res
  x_dtype, k_dtype, b_dtype = dtypes
  qg, sg, qgt, sgt = blockwise.group_cast_transpose(g, **recipe.kwargs())  # [M,N], [N,M128]
  dx = ops.gemm(qg, qk, sg, sk, out_dtype=_gemm_dtype(x_dtype))  # dgrad: 1x128 . 128x128
  dk = ops.gemm(qxt, qgt, sxt, sgt, out_dtype=_gemm_dtype(k_dtype))  # wgrad: 1x128 . 1x128
  db = None if b_dtype is None else jnp.sum(g.astype(jnp.float32), axis=0).astype(b_dtype)
  return dx.astype(x_dtype), dk.astype(k_dtype), db


_block_linear.defvjp(_block_linear_fwd, _block_linear_bwd)


def linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
           state: LinearState | None = None,
           recipe: DelayedScaling | BlockScaling = DelayedScaling(),
           amax_axis_name: str | tuple[str, ...] | None = None) -> jax.Array:
  """``y = x @ kernel + bias`` with FP8 GEMMs forward and backward (delayed or block scaling).

  Args:
    x: [..., K] float32 / bfloat16 / float16.
    kernel: [K, N] (Flax layout), float32 / bfloat16 / float16.
    bias: optional [N].
    state: under ``DelayedScaling``, the layer's ``LinearState`` (create with
      ``LinearState.create(recipe)``); differentiate with respect to it and pass that gradient
      to ``jax_fp8.update_state`` for the next rings. Under ``BlockScaling``: None.
    recipe: a ``DelayedScaling`` (the state's rings must have been made by it) or a
      ``BlockScaling`` (stateless; K and N multiples of 128). Either may set
      ``fp8_min_intensity``: a linear below it runs in x's dtype (BF16 GEMMs through XLA),
      its rings untouched, where the FP8 path would be slower (``check_fp8_min_intensity``).
      ``DelayedScaling.fast_accum`` names the GEMMs (fprop, dgrad, wgrad) that accumulate
      the fast way.
    amax_axis_name: under ``pmap`` / ``shard_map``, the axis (or axes) whose devices share the
      scales; amaxes are max-reduced over it so all devices hold identical rings. Under a
      type-checked ``shard_map`` it must include every axis x, kernel or bias vary over while
      the state is replicated. The default None means, where the types tell nothing (pmap,
      ``check_vma=False``), every manual axis; ``()`` means none (independent replicas, as in
      an ensemble under pmap). See ``_amax_axes``. Gradients of replicated inputs are summed
      over the axes they are replicated on, as JAX does for any op.
  Returns:
    [..., N] in x's dtype.
  Raises:
    ValueError / TypeError at trace time: K or N not a multiple of 16 (128 under
    BlockScaling), mismatched shapes, unsupported dtypes, rings that do not match the recipe,
    axes missing from amax_axis_name under shard_map, a state or amax axis given to
    BlockScaling.

  Method: per-tensor delayed scaling with the HYBRID format (Micikevicius et al. 2022;
  NVIDIA TransformerEngine); block scaling after the DeepSeek-V3 technical report
  (arXiv 2412.19437, section 3.3).
  """
  x, kernel = jnp.asarray(x), jnp.asarray(kernel)
  for name, v in (("x", x), ("kernel", kernel)):
    if v.dtype not in ops._FLOAT_DTYPES:
      raise TypeError(f"{name} must be float32, bfloat16 or float16, got {v.dtype}")
  if kernel.ndim != 2:
    raise ValueError(f"kernel must be [K, N], got shape {kernel.shape}")
  if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"x [..., K] and kernel [K, N] must share K, got x {x.shape} and kernel "
                     f"{kernel.shape}")
  k, n = kernel.shape
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (n,) or not jnp.issubdtype(bias.dtype, jnp.floating):
      raise ValueError(f"bias must be a float [{n}], got {bias.dtype}{list(bias.shape)}")
  if not isinstance(recipe, (DelayedScaling, BlockScaling)):
    raise TypeError(f"recipe must be a DelayedScaling or a BlockScaling, got "
                    f"{type(recipe).__name__}")
  fp8 = _fp8_pays(recipe, math.prod(x.shape[:-1]), n, k)  # else XLA in x's dtype, any shape
  if fp8 and (k % 16 or n % 16):
    raise ValueError(f"K and N must be multiples of 16 for the FP8 GEMMs, got K={k}, N={n}")
  if isinstance(recipe, BlockScaling):
    return _linear_block_scaled(x, kernel, bias, state, recipe, amax_axis_name, fp8)
  if not isinstance(state, LinearState):
    raise TypeError(f"state must be a jax_fp8.LinearState, got {type(state).__name__}")
  want = tuple((f, recipe.history_len, recipe.margin, recipe.algo)
               for f in (recipe.fwd_fmt, recipe.fwd_fmt, recipe.bwd_fmt))
  have = tuple((r.fmt, jnp.shape(r.amax_history)[0], r.margin, r.algo)
               for r in (state.x, state.kernel, state.grad))
  if want != have:
    raise ValueError(f"state rings (fmt, history_len, margin, algo) for (x, kernel, grad) = "
                     f"{have} do not match the recipe's {want}")
  amax_axis_name = _amax_axes(x, kernel, bias, state, amax_axis_name)
  if not fp8:
    return _linear_in_dtype(x, kernel, bias)
  x, kernel, bias = _vary_all(x, kernel, bias)
  dtypes = (x.dtype, kernel.dtype, None if bias is None else bias.dtype)
  y = _linear(x.reshape(math.prod(x.shape[:-1]), k), kernel, bias, state, amax_axis_name, dtypes,
              recipe.fast_accum)
  return y.reshape(*x.shape[:-1], n)


def _vary_all(x, kernel, bias):
  """Under shard_map, every input made varying over the axes any of them varies over, so that a
  replicated input's gradient is summed over those axes, as JAX does for any op."""
  axes = sharding.varying_axes(x, kernel, bias)
  return tuple(_vary(v, axes) for v in (x, kernel, bias)) if axes else (x, kernel, bias)


def _linear_block_scaled(x, kernel, bias, state, recipe, amax_axis_name, fp8):
  """``linear`` under BlockScaling (arguments checked by ``linear`` up to the recipe)."""
  k, n = kernel.shape
  if fp8 and (k % recipe.group_size or n % recipe.group_size):
    raise ValueError(f"BlockScaling needs K and N multiples of {recipe.group_size} (the groups "
                     f"of x along K and of the gradient along N), got K={k}, N={n}")
  if state is not None or amax_axis_name not in (None, ()):
    raise ValueError("BlockScaling is stateless: pass no state and no amax_axis_name (its "
                     "scales come from each device's own tensors)")
  if not fp8:
    return _linear_in_dtype(x, kernel, bias)
  x, kernel, bias = _vary_all(x, kernel, bias)
  dtypes = (x.dtype, kernel.dtype, None if bias is None else bias.dtype)
  y = _block_linear(x.reshape(math.prod(x.shape[:-1]), k), kernel, bias, recipe, dtypes)
  return y.reshape(*x.shape[:-1], n)
