"""The FP8 linear layer: a custom_vjp whose forward and backward run FP8 GEMMs.

Forward: x and kernel are quantized to E4M3 with their delayed-scaling rings by cast-transpose
kernels (one read writes both the row-major and the transposed FP8 copy, since Hopper's FP8
GEMMs are TN-only), then one FP8 GEMM with the bias in its epilogue. Backward: the gradient is
cast-transposed once (E5M2 under the HYBRID recipe), the same read giving dbias, and feeds both
dgrad (``dx = g @ kernel.T``) and wgrad (``dkernel = x.T @ g``) as FP8 GEMMs. Only FP8 copies
are saved: x transposed (for wgrad) and the kernel (for dgrad).

The rings' observations of the step, written by the cast-transpose kernels themselves, leave it
as the gradient with respect to the state; ``jax_fp8.update_state`` turns them into the next
rings (see ``jax_fp8.state``).

Under ``BlockScaling`` (stateless, DeepSeek-V3) the same three GEMMs run block-scaled: x and the
gradient are group cast-transposed (1 x 128 groups both ways from one read), the kernel is
block-quantized (128 x 128, whose transpose needs no requantization).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp

from . import checks, sharding
from .formats import FLOAT_DTYPES
from .ops import blockwise
from .ops._ring import check_ring
from .ops.cast_transpose import cast_transpose_delayed
from .ops.gemm import DIM_MULTIPLE, gemm
from .recipes import BlockScaling, DelayedScaling
from .state import ScaleRing


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


def _axis_names(amax_axis_name) -> set:
  """The names in amax_axis_name (None, a str or a tuple / list of str), each bound here;
  TypeError / ValueError otherwise."""
  if amax_axis_name is None:
    return set()
  names = (amax_axis_name,) if isinstance(amax_axis_name, str) else amax_axis_name
  if not isinstance(names, (tuple, list)) or not all(isinstance(a, str) for a in names):
    raise TypeError(f"amax_axis_name must be None, an axis name (str) or a tuple of them, got "
                    f"{amax_axis_name!r}")
  for a in names:
    try:
      jax.lax.axis_size(a)
    except NameError:
      raise ValueError(f"amax_axis_name names the axis {a!r}, which is not bound here: name an "
                       f"axis of the enclosing pmap or shard_map (or pass None outside them)"
                       ) from None
  return set(names)


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
  names = _axis_names(amax_axis_name)
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


def _shared(observations, states, axis_name):
  """Observations of rings that the devices of ``axis_name`` share, combined over them by an
  elementwise max (exact for observations: they differ only in the front amax, +inf for NaN or
  inf), in one collective, so every device records the same step; typed like their rings."""
  if axis_name is None:
    return observations
  leaves, tree = jax.tree.flatten(observations)
  flat = jax.lax.pmax(jnp.concatenate([jnp.ravel(v) for v in leaves]), axis_name)
  parts = jnp.split(flat, list(itertools.accumulate(v.size for v in leaves))[:-1])
  shared = jax.tree.unflatten(tree, [p.reshape(v.shape) for p, v in zip(parts, leaves)])
  return tuple(sharding.vary_like(o, r) for o, r in zip(shared, states))


def _gemm_bias(a, b, a_scale, b_scale, bias, dtype, fast_accum=False):
  """``a @ b.T + bias`` in ``dtype``, the bias fused into the GEMM's epilogue where cuBLASLt
  can (bf16 / f16 outputs)."""
  out = _gemm_dtype(dtype)
  fused_bias = bias is not None and out != jnp.float32
  y = gemm(a, b, a_scale, b_scale, bias=bias.astype(out) if fused_bias else None,
               out_dtype=out, fast_accum=fast_accum)
  if bias is not None and not fused_bias:
    y = y + bias.astype(out)
  return y.astype(dtype)


def _forward(x, kernel, bias, state, fast_accum):
  """y = x @ kernel + bias in FP8, what the backward needs, and the rings' observations."""
  # Cast-transposes: one read each gives both FP8 layouts (Hopper's FP8 GEMMs are TN-only).
  cx = cast_transpose_delayed(x, state.x, observe=True)  # q [M, K], qt [K, M16] e4m3
  ck = cast_transpose_delayed(kernel, state.kernel, observe=True)  # q [K, N], qt [N, K]
  y = _gemm_bias(cx.q, ck.qt, cx.scale, ck.scale, bias, x.dtype, "fprop" in fast_accum)
  return y, (cx.qt, cx.scale, ck.q, ck.scale), (cx.ring, ck.ring)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _linear(x, kernel, bias, state, axis_name, dtypes, fast_accum):
  del axis_name, dtypes  # used by the backward only
  return _forward(x, kernel, bias, state, fast_accum)[0]


def _linear_fwd(x, kernel, bias, state, axis_name, dtypes, fast_accum):
  del dtypes  # the backward's output dtypes (x, kernel, bias), static
  y, saved, observations = _forward(x, kernel, bias, state, fast_accum)
  return y, saved + (state.grad,) + _shared(observations, (state.x, state.kernel), axis_name)


def _linear_bwd(axis_name, dtypes, fast_accum, res, g):
  qxt, sx, qk, sk, grad_ring, rx, rk = res
  x_dtype, k_dtype, b_dtype = dtypes
  # One quantization of g feeds both GEMMs; the same read gives dbias.
  cg = cast_transpose_delayed(g, grad_ring, with_dbias=b_dtype is not None, observe=True)
  dx = gemm(cg.q, qk, cg.scale, sk, out_dtype=_gemm_dtype(x_dtype),
            fast_accum="dgrad" in fast_accum)  # dgrad [M, K]
  dk = gemm(qxt, cg.qt, sx, cg.scale, out_dtype=_gemm_dtype(k_dtype),
            fast_accum="wgrad" in fast_accum)  # wgrad [K, N], over M16
  db = None if b_dtype is None else cg.dbias.astype(b_dtype)
  rg, = _shared((cg.ring,), (grad_ring,), axis_name)
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
  dx = gemm(qg, qk, sg, sk, out_dtype=_gemm_dtype(x_dtype))  # dgrad: 1x128 . 128x128
  dk = gemm(qxt, qgt, sxt, sgt, out_dtype=_gemm_dtype(k_dtype))  # wgrad: 1x128 . 1x128
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
      ``DelayedScaling.fast_accum_gemms`` names the GEMMs (fprop, dgrad, wgrad) that accumulate
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
    amax_axis_name not a str or tuple of str or naming an axis that is not bound, axes missing
    from amax_axis_name under shard_map, a state or amax axis given to BlockScaling.

  Method: per-tensor delayed scaling with the HYBRID format (Micikevicius et al. 2022;
  NVIDIA TransformerEngine); block scaling after the DeepSeek-V3 technical report
  (arXiv 2412.19437, section 3.3).
  """
  x, kernel = checks.array(x, "x"), checks.array(kernel, "kernel")
  for name, v in (("x", x), ("kernel", kernel)):
    if v.dtype not in FLOAT_DTYPES:
      raise TypeError(f"{name} must be float32, bfloat16 or float16, got {v.dtype}")
  if kernel.ndim != 2:
    raise ValueError(f"kernel must be [K, N], got shape {kernel.shape}")
  if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"x [..., K] and kernel [K, N] must share K, got x {x.shape} and kernel "
                     f"{kernel.shape}")
  k, n = kernel.shape
  if bias is not None:
    bias = checks.array(bias, "bias")
    if bias.dtype not in FLOAT_DTYPES:
      raise TypeError(f"bias must be float32, bfloat16 or float16, got {bias.dtype}")
    if bias.shape != (n,):
      raise ValueError(f"bias must be [{n}], got {list(bias.shape)}")
  if not isinstance(recipe, (DelayedScaling, BlockScaling)):
    raise TypeError(f"recipe must be a DelayedScaling or a BlockScaling, got "
                    f"{type(recipe).__name__}")
  fp8 = _fp8_pays(recipe, math.prod(x.shape[:-1]), n, k)  # else XLA in x's dtype, any shape
  if isinstance(recipe, BlockScaling):
    return _linear_block_scaled(x, kernel, bias, state, recipe, amax_axis_name, fp8)
  if fp8 and (k % DIM_MULTIPLE or n % DIM_MULTIPLE):
    raise ValueError(f"K and N must be multiples of {DIM_MULTIPLE} for the FP8 GEMMs, got K={k}, "
                     f"N={n}")
  if not isinstance(state, LinearState):
    raise TypeError(f"state must be a jax_fp8.LinearState, got {type(state).__name__}")
  for name in ("x", "kernel", "grad"):
    check_ring(getattr(state, name), f"state.{name}")
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
  x, kernel, bias = sharding.vary_like((x, kernel, bias), x, kernel, bias)
  dtypes = (x.dtype, kernel.dtype, None if bias is None else bias.dtype)
  y = _linear(x.reshape(math.prod(x.shape[:-1]), k), kernel, bias, state, amax_axis_name, dtypes,
              recipe.fast_accum_gemms)
  return y.reshape(*x.shape[:-1], n)


def _linear_block_scaled(x, kernel, bias, state, recipe, amax_axis_name, fp8):
  """``linear`` under BlockScaling (arguments checked by ``linear`` up to the recipe)."""
  k, n = kernel.shape
  if fp8 and (k % blockwise.BLOCK or n % blockwise.BLOCK):
    raise ValueError(f"BlockScaling needs K and N multiples of {blockwise.BLOCK} (the groups "
                     f"of x along K and of the gradient along N), got K={k}, N={n}")
  if state is not None or amax_axis_name not in (None, ()):
    raise ValueError("BlockScaling is stateless: pass no state and no amax_axis_name (its "
                     "scales come from each device's own tensors)")
  if not fp8:
    return _linear_in_dtype(x, kernel, bias)
  x, kernel, bias = sharding.vary_like((x, kernel, bias), x, kernel, bias)
  dtypes = (x.dtype, kernel.dtype, None if bias is None else bias.dtype)
  y = _block_linear(x.reshape(math.prod(x.shape[:-1]), k), kernel, bias, recipe, dtypes)
  return y.reshape(*x.shape[:-1], n)
