"""The FP8 linear layer: a custom_vjp whose forward and backward run FP8 GEMMs.

Forward: x and kernel are quantized to E4M3 with their delayed-scaling rings by cast-transpose
kernels (one read writes both the row-major and the transposed FP8 copy, since Hopper's FP8
GEMMs are TN-only), then one FP8 GEMM with the bias in its epilogue. Backward: the gradient is
cast-transposed once (E5M2 under the HYBRID recipe), the same read giving dbias, and feeds both
dgrad (``dx = g @ kernel.T``) and wgrad (``dkernel = x.T @ g``) as FP8 GEMMs. Only FP8 copies
are saved: x transposed (for wgrad) and the kernel (for dgrad).

The rings' observations of the step leave it as the gradient with respect to the state;
``jax_fp8.update_state`` turns them into the next rings (see ``jax_fp8.scaling``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import ops
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
    return cls(recipe.ring(recipe.fwd_fmt), recipe.ring(recipe.fwd_fmt),
               recipe.ring(recipe.bwd_fmt))


def _gemm_dtype(dtype):
  """cuBLASLt writes bf16 / f16 directly; f32 inputs get an f32 GEMM output."""
  return dtype if dtype in (jnp.bfloat16, jnp.float16) else jnp.float32


def _cast_transpose(v, ring, axis_name, with_dbias=False):
  """Delayed-scaling cast-transpose (one read, both FP8 layouts). Returns (q, qt, the scale
  used, the ring's observation of this step, dbias). With an axis name the observation holds
  the amax max-reduced over the replicas, so every replica ends the step with the same ring."""
  q, qt, amax, _, dbias = ops.cast_transpose_delayed(v, ring, with_dbias=with_dbias)
  scale = scale_for_step(ring, amax)  # what the kernel used
  if axis_name is not None:
    amax = jax.lax.pmax(jnp.where(jnp.isnan(amax), jnp.inf, amax), axis_name)
  return q, qt, scale, observe(ring, amax), dbias


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _linear(x, kernel, bias, state, axis_name, dtypes):
  return _linear_fwd(x, kernel, bias, state, axis_name, dtypes)[0]


def _linear_fwd(x, kernel, bias, state, axis_name, dtypes):
  del dtypes  # the backward's output dtypes (x, kernel, bias), static
  qx, qxt, sx, rx, _ = _cast_transpose(x, state.x, axis_name)  # [M, K], [K, M16] e4m3
  qk, qkt, sk, rk, _ = _cast_transpose(kernel, state.kernel, axis_name)  # [K, N], [N, K]
  out = _gemm_dtype(x.dtype)
  fused_bias = bias is not None and out != jnp.float32
  y = ops.gemm(qx, qkt, sx, sk, bias=bias.astype(out) if fused_bias else None, out_dtype=out)
  if bias is not None and not fused_bias:
    y = y + bias.astype(out)
  return y.astype(x.dtype), (qxt, sx, qk, sk, state.grad, rx, rk)


def _linear_bwd(axis_name, dtypes, res, g):
  qxt, sx, qk, sk, grad_ring, rx, rk = res
  x_dtype, k_dtype, b_dtype = dtypes
  # One quantization of g feeds both GEMMs; the same read gives dbias.
  qg, qgt, sg, rg, db = _cast_transpose(g, grad_ring, axis_name, with_dbias=b_dtype is not None)
  dx = ops.gemm(qg, qk, sg, sk, out_dtype=_gemm_dtype(x_dtype))  # dgrad [M, K]
  dk = ops.gemm(qxt, qgt, sx, sg, out_dtype=_gemm_dtype(k_dtype))  # wgrad [K, N], over M16
  db = None if b_dtype is None else db.astype(b_dtype)
  return dx.astype(x_dtype), dk.astype(k_dtype), db, LinearState(rx, rk, rg)


_linear.defvjp(_linear_fwd, _linear_bwd)


def linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
           state: LinearState, recipe: DelayedScaling = DelayedScaling(),
           amax_axis_name: str | tuple[str, ...] | None = None) -> jax.Array:
  """``y = x @ kernel + bias`` with FP8 GEMMs forward and backward (delayed scaling).

  Args:
    x: [..., K] float32 / bfloat16 / float16.
    kernel: [K, N] (Flax layout), float32 / bfloat16 / float16.
    bias: optional [N].
    state: the layer's ``LinearState`` (create with ``LinearState.create(recipe)``).
      Differentiate with respect to it and pass that gradient to ``jax_fp8.update_state``
      for the next rings.
    recipe: a ``DelayedScaling``; the state's rings must have been made by it.
    amax_axis_name: under ``pmap`` / ``shard_map``, the axis (or axes) whose devices share the
      scales; amaxes are max-reduced over it so all devices hold identical rings. Under
      ``shard_map`` it must name every axis x varies over; the gradients of kernel and bias
      are then summed over those axes, as JAX does for a replicated parameter.
  Returns:
    [..., N] in x's dtype.
  Raises:
    ValueError / TypeError at trace time: K or N not a multiple of 16, mismatched shapes,
    unsupported dtypes, rings that do not match the recipe.

  Method: per-tensor delayed scaling with the HYBRID format (Micikevicius et al. 2022;
  NVIDIA TransformerEngine).
  """
  x, kernel = jnp.asarray(x), jnp.asarray(kernel)
  if kernel.ndim != 2:
    raise ValueError(f"kernel must be [K, N], got shape {kernel.shape}")
  if x.ndim < 1 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"x [..., K] and kernel [K, N] must share K, got x {x.shape} and kernel "
                     f"{kernel.shape}")
  k, n = kernel.shape
  if k % 16 or n % 16:
    raise ValueError(f"K and N must be multiples of 16 for the FP8 GEMMs, got K={k}, N={n}")
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (n,) or not jnp.issubdtype(bias.dtype, jnp.floating):
      raise ValueError(f"bias must be a float [{n}], got {bias.dtype}{list(bias.shape)}")
  if not isinstance(state, LinearState):
    raise TypeError(f"state must be a jax_fp8.LinearState, got {type(state).__name__}")
  want = tuple((f, recipe.history_len, recipe.margin, recipe.algo)
               for f in (recipe.fwd_fmt, recipe.fwd_fmt, recipe.bwd_fmt))
  have = tuple((r.fmt, jnp.shape(r.amax_history)[0], r.margin, r.algo)
               for r in (state.x, state.kernel, state.grad))
  if want != have:
    raise ValueError(f"state rings (fmt, history_len, margin, algo) for (x, kernel, grad) = "
                     f"{have} do not match the recipe's {want}")
  # Under shard_map: x varies over some mesh axes. The rings must see the amax reduced over all
  # of them (so they stay replicated), and kernel / bias become varying inside the custom_vjp so
  # that their gradients are summed over those axes on the way out, as JAX does for any op.
  axes = ops.varying_axes(x)
  if axes:
    names = {amax_axis_name} if isinstance(amax_axis_name, str) else set(amax_axis_name or ())
    if not axes <= names:
      raise ValueError(f"x varies over the shard_map axes {sorted(axes)}: pass them as "
                       f"amax_axis_name so every device keeps the same scale rings, got "
                       f"amax_axis_name={amax_axis_name!r}")
    amax_axis_name = tuple(sorted(axes))
    kernel, bias = (None if v is None else
                    jax.lax.pcast(v, tuple(sorted(axes - ops.varying_axes(v))), to="varying")
                    if axes - ops.varying_axes(v) else v for v in (kernel, bias))
  dtypes = (x.dtype, kernel.dtype, None if bias is None else bias.dtype)
  y = _linear(x.reshape(-1, k), kernel, bias, state, amax_axis_name, dtypes)
  return y.reshape(*x.shape[:-1], n)
