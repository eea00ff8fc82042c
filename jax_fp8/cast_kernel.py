"""``cast_kernel``: a kernel quantized once for several uses in one step (the microbatches of a
``lax.scan``, a tied layer), as a ``CastKernel`` that ``linear``, ``multi_linear`` and ``mlp``
take in place of the kernel (TransformerEngine's weight caching across microbatches). The
family of the recipe (``jax_fp8.families``) makes the FP8 copies."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from . import sharding
from .families import family
from .families._shared import Cast
from .layer_checks import amax_axes, check_rings, check_stateless, kernel_to_cast, names_given
from .quantized import Quantized
from .recipes import DelayedScaling, Recipe
from .state import ScaleRing


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["kernel", "q", "qt", "scale", "uses"],
                   meta_fields=["recipe", "amax_axis_name"])
@dataclasses.dataclass(frozen=True)
class CastKernel:
  """A kernel with its FP8 copies, made once by ``cast_kernel`` for several uses in one step
  (the microbatches of a ``lax.scan``; a tied layer whose uses share one state through
  ``share``), which ``linear``, ``multi_linear`` and ``mlp`` take in place of the kernel and
  use without quantizing it again.

  Attributes:
    kernel: the float kernel [K, N] itself, through which its gradient flows.
    q: float8_e4m3fn [K, N], the kernel quantized (dgrad's operand; under BlockScaling also the
      forward's).
    qt: float8_e4m3fn [N, K], the same bytes transposed (the forward's operand under the
      per-tensor recipes); None under BlockScaling (its 128 x 128 blocks serve both GEMMs).
    scale: float32 dequantization step: [] (per-tensor) or [K/128, N/128] (BlockScaling).
    uses: float32 [] zero, whose gradient counts the layers' FP8 uses of the cast: the ring
      gets the cast's observation only where it is nonzero (a layer below
      ``fp8_min_intensity`` runs XLA's GEMM on ``kernel`` and leaves the ring as it is).
    recipe: static, the recipe it was cast for; a layer running one of another ``cast_key``
      raises ValueError.
    amax_axis_name: static, the ``amax_axis_name`` it was cast with (None, or the names as a
      sorted tuple); a layer given other names raises ValueError.
  """

  kernel: jax.Array
  q: jax.Array
  qt: jax.Array | None
  scale: jax.Array
  uses: jax.Array
  recipe: Recipe
  amax_axis_name: tuple[str, ...] | None


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _cast(kernel, ring, recipe, axis_name):
  return _cast_fwd(kernel, ring, recipe, axis_name)[0]


def _cast_fwd(kernel, ring, recipe, axis_name):
  fp8, observed = family(recipe).cast(kernel, ring, recipe, axis_name)
  return (kernel, fp8, jnp.zeros((), jnp.float32)), observed


def _cast_bwd(recipe, axis_name, observed, cts):
  # The kernel's gradient as it came; the ring's observation where an FP8 GEMM used the cast.
  d_kernel, _, d_uses = cts
  used = d_uses > 0
  return d_kernel, jax.tree.map(lambda o: jnp.where(used, o, jnp.zeros_like(o)), observed)


_cast.defvjp(_cast_fwd, _cast_bwd)


def cast_kernel(kernel: jax.Array, ring: ScaleRing | None = None, *,
                recipe: Recipe = DelayedScaling(),
                amax_axis_name: str | tuple[str, ...] | None = None) -> CastKernel:
  """``kernel`` quantized once for several uses in one step, e.g. outside a ``lax.scan`` over
  microbatches, whose body then passes the ``CastKernel`` to ``linear`` / ``multi_linear`` /
  ``mlp`` in place of the kernel: those quantize x and the gradients per microbatch, the
  kernel not again (TransformerEngine's weight caching across microbatches).

  Differentiate through it as through the kernel: the kernel's gradient (the microbatches'
  wgrads, summed) flows back to ``kernel``; under ``DelayedScaling`` ``ring``'s gradient is
  this cast's observation (none where no FP8 GEMM used the cast), and the layers give the
  kernel rings of their (``share``d) state a zero one, so ``update_state`` advances the ring
  once per step by this cast's amax. Layers that do not share that ring (two layers with
  states of their own on one cast) leave theirs as they are.

  Args:
    kernel: [K, N] float32 / bfloat16 / float16 (f32 master weights quantized straight from
      f32), K and N multiples of 16 (128 under BlockScaling).
    ring: under ``DelayedScaling``, the kernel's ring in the layer's state (``state.kernel``,
      ``state.kernels[i]``, ``state.kernel_in`` / ``kernel_out`` of an ``MlpState``), outside
      ``share``; under the stateless recipes None.
    recipe: ``DelayedScaling`` (default), ``CurrentScaling`` (the kernel's amax of this step)
      or ``BlockScaling`` (128 x 128 blocks): a recipe whose ``casts_kernel`` is True. The
      layers using the cast must run a recipe of the same ``cast_key``.
    amax_axis_name: as in ``linear``: the axes over which devices share the ring (or, under
      ``CurrentScaling``, hold parts of the kernel), the amax max-reduced over them.
  Returns:
    ``CastKernel``.
  Raises:
    TypeError / ValueError at trace time: kernel's dtype, rank, K or N not multiples of 16
    (128 under BlockScaling); another recipe (MXFP8BlockScaling, NVFP4BlockScaling: their
    layers quantize the kernel themselves); under DelayedScaling a ring that is missing, not a
    ``ScaleRing`` or not of the recipe's format, history length, margin and algo; a ring
    given to a stateless recipe; amax_axis_name as ``linear`` raises them.
  """
  kernel = kernel_to_cast(kernel, recipe)
  if recipe.stateful:
    if not isinstance(ring, ScaleRing):
      raise TypeError(f"ring must be the kernel's jax_fp8.ScaleRing under DelayedScaling (e.g. "
                      f"state.kernel), got {type(ring).__name__}")
    check_rings((("ring", ring),), (recipe.fwd_fmt,), recipe)
  elif ring is not None:
    raise ValueError(f"{type(recipe).__name__} is stateless: pass ring=None, got a "
                     f"{type(ring).__name__}")
  if recipe.amax_scope == "local":
    check_stateless(recipe, None, amax_axis_name)
    axis = None
  else:
    axis = amax_axes(None, kernel, None, ring, amax_axis_name)
  kernel, fp8, uses = _cast(kernel, ring, recipe, axis)
  # No gradient flows into the FP8 copies (none accumulates over the microbatches either).
  fp8 = sharding.vary_like(jax.lax.stop_gradient(fp8), kernel)
  return CastKernel(kernel, fp8.data, fp8.data_t, fp8.scale, uses, recipe,
                    names_given(amax_axis_name))


def check_cast(cast, name: str, recipe: Recipe, amax_axis_name) -> Cast:
  """A ``CastKernel`` as the recipe's rules take it: its FP8 copies as a ``Quantized`` (data q,
  data_t qt, scale; qt None under BlockScaling) with its ``uses``; TypeError for another type
  beside it or fields of the wrong dtype or shape, ValueError when it was cast for another
  recipe or with other amax axis names than the layer's ``amax_axis_name``."""
  if not isinstance(cast, CastKernel):
    got = "an array" if isinstance(cast, jax.Array) else f"a {type(cast).__name__}"
    raise TypeError(f"{name} is {got} beside CastKernel kernels: pass all kernels through "
                    f"cast_kernel or none")
  if not recipe.casts_kernel or cast.recipe.cast_key() != recipe.cast_key():
    raise ValueError(f"{name} was cast for {cast.recipe}, but the layer runs {recipe}: cast it "
                     f"with the layer's recipe")
  if cast.amax_axis_name != names_given(amax_axis_name):
    raise ValueError(f"{name} was cast with amax_axis_name={cast.amax_axis_name!r}, but the "
                     f"layer's is {amax_axis_name!r}: cast it with the layer's amax_axis_name")
  k, n = jnp.shape(cast.kernel)
  want = family(recipe).cast_fields(k, n)
  want["uses"] = (jnp.float32, ())
  for field, spec in want.items():
    v = getattr(cast, field)
    have = None if v is None else (jnp.result_type(v), jnp.shape(v))
    if have != (spec if spec is None else (jnp.dtype(spec[0]), spec[1])):
      raise TypeError(f"{name}.{field} must be {'None' if spec is None else spec} for a "
                      f"[{k}, {n}] kernel under {type(recipe).__name__} (cast_kernel's), got "
                      f"{have}")
  return Cast(Quantized(data=cast.q, data_t=cast.qt, scale=cast.scale), cast.uses)
