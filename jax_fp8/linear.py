"""The FP8 linear layer: a custom_vjp whose forward and backward run FP8 GEMMs.

Forward: x and kernel are quantized to E4M3 with their scale rings (delayed scaling's, or under
``CurrentScaling`` set to this step's amaxes) by cast-transpose kernels (one read writes both
the row-major and the transposed FP8 copy, since Hopper's FP8 GEMMs are TN-only), then one FP8
GEMM with the bias in its epilogue. Backward: the gradient is cast-transposed once (E5M2 under
the HYBRID format), the same read giving dbias, and feeds both dgrad (``dx = g @ kernel.T``)
and wgrad (``dkernel = x.T @ g``) as FP8 GEMMs. Only FP8 copies are saved: x transposed (for
wgrad) and the kernel (for dgrad).

The rings' observations of the step, written by the cast-transpose kernels themselves, leave it
as the gradient with respect to the state; ``jax_fp8.update_state`` turns them into the next
rings (see ``jax_fp8.state``).

Under ``BlockScaling`` (stateless, DeepSeek-V3) the same three GEMMs run block-scaled: x and the
gradient are group cast-transposed (1 x 128 groups both ways from one read), the kernel is
block-quantized (128 x 128, whose transpose needs no requantization). Under
``MXFP8BlockScaling`` (stateless) x, the kernel and the gradient are each MXFP8-quantized in
both directions from one read (1 x 32 blocks along each GEMM's contraction dimension) and the
GEMMs are ``mxfp8_gemm`` (emulated on Hopper). Under ``NVFP4BlockScaling`` (stateless; a global
amax per tensor and step) the NVFP4 report's recipe: x along K and, through the Hadamard
transform, along M; the kernel in 16 x 16 blocks; the gradient stochastically rounded along N
and, transformed, along M; the GEMMs ``nvfp4_gemm`` (emulated on Hopper).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp

from . import checks, norms, sharding
from ._residuals import op_outputs, packed, read_and_saved
from .formats import FLOAT_DTYPES, MX_BLOCK, NVFP4_BLOCK, amax, amax_of_parts, as_f32
from .hadamard import hadamard_amax
from .inference import Fp8Weight, check_weight, forward
from .ops import blockwise
from .ops._ring import check_ring
from .ops.cast_transpose import CastTransposed, cast_transpose_delayed, norm_cast_transpose
from .ops.gemm import DIM_MULTIPLE, gemm, gemm_bias, gemm_dtype
from .ops.mxfp8 import mxfp8_gemm, mxfp8_quantize
from .ops.nvfp4 import nvfp4_gemm, nvfp4_quantize
from .ops.sources import COL_MULTIPLE, MAX_PARTS
from .philox import key_words
from .recipes import (BlockScaling, CurrentScaling, DelayedScaling, MXFP8BlockScaling,
                      NVFP4BlockScaling, Recipe, check_recipe, draws_key)
from .state import ScaleRing, current


def _check_delayed(recipe, cls) -> None:
  if not isinstance(recipe, DelayedScaling):
    raise TypeError(f"{cls.__name__}.create takes a DelayedScaling recipe, got "
                    f"{type(recipe).__name__} (stateless: pass state=None)")


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
    _check_delayed(recipe, cls)
    return cls(recipe.ring(recipe.fwd_fmt), recipe.ring(recipe.fwd_fmt),
               recipe.ring(recipe.bwd_fmt))

  def named_rings(self):
    """(x's, the kernels', the gradients') (name, ring) pairs, as ``multi_linear`` orders
    them."""
    return ("state.x", self.x), (("state.kernel", self.kernel),), (("state.grad", self.grad),)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "kernels", "grads"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class MultiLinearState:
  """The scale rings of ``multi_linear``: its shared input x's, and per kernel the kernel's
  and its output gradient's (tuples in the kernels' order)."""

  x: ScaleRing
  kernels: tuple[ScaleRing, ...]
  grads: tuple[ScaleRing, ...]

  @classmethod
  def create(cls, outputs: int,
             recipe: DelayedScaling = DelayedScaling()) -> "MultiLinearState":
    """Fresh rings for x and ``outputs`` kernels and gradients (formats as in
    ``LinearState.create``). Raises TypeError / ValueError for outputs not an int >= 1 or a
    recipe other than DelayedScaling."""
    outputs = checks.integer(outputs, "outputs", lo=1)
    _check_delayed(recipe, cls)
    return cls(recipe.ring(recipe.fwd_fmt),
               tuple(recipe.ring(recipe.fwd_fmt) for _ in range(outputs)),
               tuple(recipe.ring(recipe.bwd_fmt) for _ in range(outputs)))

  def named_rings(self):
    """(x's, the kernels', the gradients') (name, ring) pairs."""
    for name in ("kernels", "grads"):
      if not isinstance(getattr(self, name), tuple):
        raise TypeError(f"state.{name} must be a tuple of jax_fp8.ScaleRing, got "
                        f"{type(getattr(self, name)).__name__}")
    return (("state.x", self.x),
            tuple((f"state.kernels[{i}]", r) for i, r in enumerate(self.kernels)),
            tuple((f"state.grads[{i}]", r) for i, r in enumerate(self.grads)))


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
    recipe: static, the recipe it was cast for; a layer running one of another ``cast_recipe``
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
  uses = jnp.zeros((), jnp.float32)
  if isinstance(recipe, BlockScaling):
    q, scale = blockwise.block_quantize(kernel, **recipe.kwargs())
    return (kernel, q, None, scale, uses), None
  current_ = isinstance(recipe, CurrentScaling)
  ck = kernel_fp8(kernel, None, recipe.ring(recipe.fwd_fmt) if current_ else ring, current_,
                  axis_name)
  observed = None if current_ else _shared(ck.ring, ring, axis_name)
  return (kernel, ck.q, ck.qt, ck.scale, uses), observed


def _cast_bwd(recipe, axis_name, observed, cts):
  # The kernel's gradient as it came; the ring's observation where an FP8 GEMM used the cast.
  used = cts[4] > 0
  return cts[0], jax.tree.map(lambda o: jnp.where(used, o, jnp.zeros_like(o)), observed)


_cast.defvjp(_cast_fwd, _cast_bwd)


def cast_kernel(kernel: jax.Array, ring: ScaleRing | None = None, *,
                recipe: DelayedScaling | CurrentScaling | BlockScaling = DelayedScaling(),
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
      or ``BlockScaling`` (128 x 128 blocks); the layers using the cast must run a recipe of
      the same ``cast_recipe``.
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
  kernel = checks.array(kernel, "kernel")
  if kernel.dtype not in FLOAT_DTYPES or kernel.ndim != 2:
    raise TypeError(f"kernel must be a float32 / bfloat16 / float16 [K, N] array, got "
                    f"{kernel.dtype}{list(kernel.shape)}")
  check_recipe(recipe, allowed=(DelayedScaling, CurrentScaling, BlockScaling))
  multiple, why = fp8_multiple(recipe)
  if kernel.shape[0] % multiple or kernel.shape[1] % multiple:
    raise ValueError(f"{why}, got kernel {list(kernel.shape)}")
  if isinstance(recipe, DelayedScaling):
    if not isinstance(ring, ScaleRing):
      raise TypeError(f"ring must be the kernel's jax_fp8.ScaleRing under DelayedScaling (e.g. "
                      f"state.kernel), got {type(ring).__name__}")
    check_rings((("ring", ring),), (recipe.fwd_fmt,), recipe)
  elif ring is not None:
    raise ValueError(f"{type(recipe).__name__} is stateless: pass ring=None, got a "
                     f"{type(ring).__name__}")
  if isinstance(recipe, BlockScaling):
    check_stateless(recipe, None, amax_axis_name)
    axis = None
  else:
    axis = _amax_axes(None, kernel, None, ring, amax_axis_name)
  kernel, q, qt, scale, uses = _cast(kernel, ring, recipe, axis)
  # No gradient flows into the FP8 copies (none accumulates over the microbatches either).
  q, qt, scale = sharding.vary_like(jax.lax.stop_gradient((q, qt, scale)), kernel)
  return CastKernel(kernel, q, qt, scale, uses, recipe, _names_given(amax_axis_name))


def _names_given(amax_axis_name) -> tuple[str, ...] | None:
  """amax_axis_name as a cast records it: None, or its names sorted."""
  return None if amax_axis_name is None else tuple(sorted(_axis_names(amax_axis_name)))


def cast_recipe(recipe) -> tuple:
  """What of ``recipe`` decides a ``CastKernel``'s bytes and its ring's protocol: the recipe's
  type and its forward format and margin (per-tensor) or its quantizers' arguments
  (BlockScaling). A layer takes casts made under a recipe with the same ``cast_recipe``."""
  if isinstance(recipe, BlockScaling):
    return type(recipe), tuple(sorted(recipe.kwargs().items()))
  return type(recipe), recipe.fwd_fmt, recipe.margin


def check_cast(cast, name: str, recipe, amax_axis_name):
  """A ``CastKernel``'s (FP8 copies..., uses) as the recipe's GEMMs take them ((q, qt, scale,
  uses) per-tensor, (q, scale, uses) under BlockScaling); TypeError for another type beside
  it or fields of the wrong dtype or shape, ValueError when it was cast for another recipe
  or with other amax axis names than the layer's ``amax_axis_name``."""
  if not isinstance(cast, CastKernel):
    got = "an array" if isinstance(cast, jax.Array) else f"a {type(cast).__name__}"
    raise TypeError(f"{name} is {got} beside CastKernel kernels: pass all kernels through "
                    f"cast_kernel or none")
  if cast_recipe(cast.recipe) != cast_recipe(recipe):
    raise ValueError(f"{name} was cast for {cast.recipe}, but the layer runs {recipe}: cast it "
                     f"with the layer's recipe")
  if cast.amax_axis_name != _names_given(amax_axis_name):
    raise ValueError(f"{name} was cast with amax_axis_name={cast.amax_axis_name!r}, but the "
                     f"layer's is {amax_axis_name!r}: cast it with the layer's amax_axis_name")
  k, n = jnp.shape(cast.kernel)
  block = isinstance(recipe, BlockScaling)
  want = {"q": (jnp.float8_e4m3fn, (k, n)), "qt": None if block else (jnp.float8_e4m3fn, (n, k)),
          "scale": (jnp.float32, (k // blockwise.BLOCK, n // blockwise.BLOCK) if block else ()),
          "uses": (jnp.float32, ())}
  for field, spec in want.items():
    v = getattr(cast, field)
    have = None if v is None else (jnp.result_type(v), jnp.shape(v))
    if have != (spec if spec is None else (jnp.dtype(spec[0]), spec[1])):
      raise TypeError(f"{name}.{field} must be {'None' if spec is None else spec} for a "
                      f"[{k}, {n}] kernel under {type(recipe).__name__} (cast_kernel's), got "
                      f"{have}")
  fp8 = (cast.q, cast.scale) if block else (cast.q, cast.qt, cast.scale)
  return (*fp8, cast.uses)


def cast_uses(casts):
  """The ``uses`` of a layer's ``casts`` (each None or (FP8 copies..., uses)), kept as
  residuals for ``cast_grads``."""
  return tuple(None if c is None else c[-1] for c in casts)


def cast_grads(uses, fields: int):
  """The cotangent of a layer's ``casts`` in its backward, from their ``cast_uses``
  (``fields``: the FP8 copies' count): one use each, none for the copies."""
  return tuple(None if u is None else (None,) * fields + (jnp.ones_like(u),) for u in uses)


def check_rings(named, fmts, recipe) -> None:
  """The (name, ring) pairs ``named`` valid ScaleRings of the formats ``fmts`` and of the
  recipe's history length, margin and algo; TypeError / ValueError naming them otherwise."""
  for name, ring in named:
    check_ring(ring, name)
  want = tuple((f, recipe.history_len, recipe.margin, recipe.algo) for f in fmts)
  have = tuple((r.fmt, jnp.shape(r.amax_history)[0], r.margin, r.algo) for _, r in named)
  if want != have:
    raise ValueError(f"rings (fmt, history_len, margin, algo) for "
                     f"({', '.join(name for name, _ in named)}) = {have} do not match the "
                     f"recipe's {want}")


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
  """The mesh axes to max-reduce the amaxes over, so that devices sharing rings agree (under
  CurrentScaling, ``state`` None: so that devices sharing a tensor quantize it with one scale).

  Axes named in amax_axis_name are always reduced over. Under a type-checked shard_map, x,
  kernel or bias vary over some axes (data parallel: x over the batch axis; tensor parallel:
  kernel over the model axis); rings replicated over such an axis need the amax reduced over
  it, so those axes must be among the names; rings that vary over it (one set per pipeline
  stage, say) keep their own amaxes unless the axis is named. Where the types tell nothing
  (pmap, shard_map with check_vma=False, or every input replicated), the default None means
  every manual axis (a no-op where the amaxes agree anyway), and () means none. Under
  CurrentScaling no state must stay in step: the names are taken as given (() for independent
  replicas), and None means every axis x, kernel or bias vary over.
  """
  names = _axis_names(amax_axis_name)
  needed = sharding.varying_axes(x, kernel, bias) - sharding.varying_axes(state)
  if state is None:  # CurrentScaling: the axes named, by default every axis a tensor varies over
    names = needed if amax_axis_name is None else names
  elif not needed <= names:
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


def _shared(observations, states, axis_name):
  """Observations of rings that the devices of ``axis_name`` share, combined over them by an
  elementwise max (exact for observations: they differ only in the front amax, +inf for NaN or
  inf), in one collective, so every device records the same step; typed like their rings
  (``states``: the rings, in the observations' structure)."""
  if axis_name is None:
    return observations
  leaves, tree = jax.tree.flatten(observations)
  flat = jax.lax.pmax(jnp.concatenate([jnp.ravel(v) for v in leaves]), axis_name)
  parts = jnp.split(flat, list(itertools.accumulate(v.size for v in leaves))[:-1])
  shared = jax.tree.unflatten(tree, [p.reshape(v.shape) for p, v in zip(parts, leaves)])
  return jax.tree.map(sharding.vary_like, shared, states,
                      is_leaf=lambda v: isinstance(v, ScaleRing))


# The per-tensor core, for one or several kernels sharing the input x: x [M, K] (or its norm)
# is cast-transposed once for all of them. ``rings`` = (x's ring, the kernels' rings, the output
# gradients' rings), the last two tuples in the kernels' order: the state's under
# DelayedScaling; under CurrentScaling (``current``) the recipe's blank rings, each set to the
# scale of its tensor's amax of this step just before its quantization (``scaled``), their
# observations dropped. ``norm``: None, or (name, epsilon) of the norm fused into x's
# cast-transpose, whose parameters ``norm_params`` = (gamma, beta) are differentiated as the
# kernels are.

def scaled(ring, value, current_, axis_name):
  """The ring to quantize ``value`` (an array, or a tuple of parts) with: ``ring`` itself
  (delayed scaling), or under current scaling ``ring`` set to the scale of value's amax,
  max-reduced over ``axis_name``."""
  if not current_:
    return ring
  a = amax_of_parts(value) if isinstance(value, tuple) else amax(value)
  return current(ring, a if axis_name is None else sharding.pmax_keep_nan(a, axis_name))


def zero_like(rings):
  """Zeros in the rings' structure and types: the gradient of current scaling's blank rings."""
  return jax.tree.map(jnp.zeros_like, rings)


def normalized(x, norm_params, norm):
  """x's norm by XLA in f32 (``norm``: (name, epsilon)), or x without one."""
  if norm is None:
    return x
  return norms.normalize(x, *norm_params, norm=norm[0], epsilon=norm[1])


def quantize_input(x, norm_params, ring, norm):
  """x's cast-transpose (observing its ring), or with a norm its norm's, the row statistics
  from XLA and the norm applied inside the kernel."""
  if norm is None:
    return cast_transpose_delayed(x, ring, observe=True)
  name, epsilon = norm
  return norm_cast_transpose(x, norms.stats(x, name, epsilon), *norm_params, ring, norm=name,
                             observe=True)


def input_grad(dx, x, norm_params, norm, x_dtype):
  """(dx, norm_params' gradients) from the gradient of the GEMMs' input: through the norm (its
  jnp backward, which XLA fuses), or dx itself in x's dtype without one."""
  if norm is None:
    return dx.astype(x_dtype), norm_params
  name, epsilon = norm
  _, vjp = jax.vjp(lambda x, g, b: norms.normalize(x, g, b, norm=name, epsilon=epsilon), x,
                   *norm_params)
  dx, *grads = vjp(dx.astype(jnp.float32))
  return dx, tuple(grads)


def kernel_fp8(kernel, cast, ring, current_, axis_name) -> CastTransposed:
  """A kernel for the per-tensor GEMMs (q [K, N], qt [N, K], scale, and as ``ring`` the ring's
  observation): its cast-transpose, or ``cast`` (a ``CastKernel``'s (q, qt, scale, uses), its
  ring observed by ``cast_kernel``'s backward) with a zero observation."""
  if cast is not None:
    q, qt, scale, _ = cast
    return CastTransposed(q, qt, None, zero_like(ring), None, scale)
  return cast_transpose_delayed(kernel, scaled(ring, kernel, current_, axis_name), observe=True)


def split_output(ys, split):
  """The one output of ``ys`` cut along its last axis into parts of ``split``'s sizes (None:
  ys as they are)."""
  if split is None:
    return ys
  return tuple(jnp.split(ys[0], list(itertools.accumulate(split))[:-1], axis=-1))


def _forward(x, norm_params, kernels, casts, biases, rings, fast_accum, norm, out_dtype,
             current_, axis_name, split):
  """ys = x @ kernel_i + bias_i in FP8 (in out_dtype; the one output cut as ``split`` says),
  what the backward needs, and the x and kernel rings' observations."""
  rx, rks, _ = rings
  if current_:
    rx = scaled(rx, normalized(x, norm_params, norm), current_, axis_name)
  # Cast-transposes: one read each gives both FP8 layouts (Hopper's FP8 GEMMs are TN-only).
  cx = quantize_input(x, norm_params, rx, norm)  # q [M, K], qt [K, M16] e4m3
  cks = [kernel_fp8(k, c, r, current_, axis_name)
         for k, c, r in zip(kernels, casts, rks)]  # [K, N]
  ys = split_output(tuple(gemm_bias(cx.q, ck.qt, cx.scale, ck.scale, b, out_dtype,
                                    "fprop" in fast_accum) for ck, b in zip(cks, biases)), split)
  saved = (cx.qt, cx.scale, tuple(ck.q for ck in cks), tuple(ck.scale for ck in cks),
           None if norm is None else (x, norm_params), cast_uses(casts))
  return ys, saved, (cx.ring, tuple(ck.ring for ck in cks))


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11))
def _linear(x, norm_params, kernels, casts, biases, rings, axis_name, dtypes, fast_accum, norm,
            current_, split):
  return _forward(x, norm_params, kernels, casts, biases, rings, fast_accum, norm, dtypes[1],
                  current_, axis_name, split)[0]


def _linear_fwd(x, norm_params, kernels, casts, biases, rings, axis_name, dtypes, fast_accum,
                norm, current_, split):
  # dtypes: x's, the outputs', the kernels' and the biases', static
  ys, saved, observations = _forward(x, norm_params, kernels, casts, biases, rings, fast_accum,
                                     norm, dtypes[1], current_, axis_name, split)
  # Current scaling drops the observations: its blank rings get zero gradients.
  observations = (zero_like(rings[:2]) if current_ else
                  _shared(observations, rings[:2], axis_name))
  return ys, saved + (zero_like(rings[2]) if current_ else rings[2],) + observations


def _linear_bwd(axis_name, dtypes, fast_accum, norm, current_, split, res, gs):
  qxt, sx, qks, sks, normed, uses, grad_rings, rx, rks = res
  x_dtype, _, k_dtypes, b_dtypes = dtypes
  if split is not None:  # the parts' gradients, quantized where they lie
    gs = (tuple(gs),)
  dx, dks, dbs, rgs = None, [], [], []
  for g, qk, sk, ring, k_dtype, b_dtype in zip(gs, qks, sks, grad_rings, k_dtypes, b_dtypes):
    # One quantization of g feeds both GEMMs; the same read gives dbias.
    cg = cast_transpose_delayed(g, scaled(ring, g, current_, axis_name),
                                with_dbias=b_dtype is not None, observe=True)
    dxi = gemm(cg.q, qk, cg.scale, sk, out_dtype=gemm_dtype(x_dtype),
               fast_accum="dgrad" in fast_accum)  # dgrad [M, K]
    dx = dxi if dx is None else dx + dxi  # summed as autodiff sums a shared input's gradients
    dks.append(gemm(qxt, cg.qt, sx, cg.scale, out_dtype=gemm_dtype(k_dtype),
                    fast_accum="wgrad" in fast_accum).astype(k_dtype))  # wgrad [K, N], over M16
    dbs.append(None if b_dtype is None else cg.dbias.astype(b_dtype))
    rgs.append(cg.ring)
  rgs = grad_rings if current_ else _shared(tuple(rgs), grad_rings, axis_name)
  dx, dnorm = input_grad(dx, *(normed or (None, (None, None))), norm, x_dtype)
  return dx, dnorm, tuple(dks), cast_grads(uses, 3), tuple(dbs), (rx, rks, rgs)


_linear.defvjp(*packed(_linear_fwd, _linear_bwd))


def block_quantize_input(x, norm_params, recipe, norm):
  """x's group cast-transpose (1 x 128 groups along K, 128 x 1 along M, transposed), or with a
  norm its norm's, the row statistics from XLA and the norm applied inside the kernel."""
  if norm is None:
    return blockwise.group_cast_transpose(x, **recipe.kwargs())
  name, epsilon = norm
  return blockwise.norm_group_cast_transpose(x, norms.stats(x, name, epsilon), *norm_params,
                                             norm=name, **recipe.kwargs())


def block_kernel_fp8(kernel, cast, recipe):
  """(q [K, N], scale [K/128, N/128]) of a kernel in 128 x 128 blocks: its block quantization,
  or ``cast``'s (a ``CastKernel``'s (q, scale, uses))."""
  return cast[:2] if cast is not None else blockwise.block_quantize(kernel, **recipe.kwargs())


def block_kernel_saved(kernel, cast, recipe):
  """``block_kernel_fp8`` for a rule that reads the blocks in its forward GEMM and saves them:
  where the rule quantizes them, both take them from behind ``read_and_saved`` (the quantize
  reads a slice of a scan's xs; with a reader before the barrier, XLA's dynamic-slice fusion
  ran it twice, once for each side); as they are where ``cast`` gave them (the rule's inputs)."""
  blocks = block_kernel_fp8(kernel, cast, recipe)
  return blocks if cast is not None else read_and_saved(blocks)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def _block_linear(x, norm_params, kernels, casts, biases, recipe, dtypes, norm):
  # Without a gradient no transposed copy is needed: the scales in cuBLASLt's layout.
  qx, sx_col = blockwise.group_quantize(normalized(x, norm_params, norm), scale_layout="col",
                                        **recipe.kwargs())
  out = []
  for kernel, cast, bias in zip(kernels, casts, biases):
    qk, sk = block_kernel_fp8(kernel, cast, recipe)
    out.append(gemm_bias(qx, qk.T, sx_col.T, sk.T, bias, dtypes[1]))
  return tuple(out)


def _block_linear_fwd(x, norm_params, kernels, casts, biases, recipe, dtypes, norm):
  qx, sx, qxt, sxt = block_quantize_input(x, norm_params, recipe, norm)  # [M,K], [K,M128]
  ys, saved = [], []
  for kernel, cast, bias in zip(kernels, casts, biases):
    qk, sk = block_kernel_saved(kernel, cast, recipe)  # [K, N], [K/128, N/128]
    ys.append(gemm_bias(qx, qk.T, sx, sk.T, bias, dtypes[1]))
    saved.append((qk, sk))
  return tuple(ys), (qxt, sxt, tuple(saved), None if norm is None else (x, norm_params),
                     cast_uses(casts))


def _block_linear_bwd(recipe, dtypes, norm, res, gs):
  qxt, sxt, saved, normed, uses = res
  x_dtype, _, k_dtypes, b_dtypes = dtypes
  dx, dks, dbs = None, [], []
  for g, (qk, sk), k_dtype, b_dtype in zip(gs, saved, k_dtypes, b_dtypes):
    qg, sg, qgt, sgt = blockwise.group_cast_transpose(g, **recipe.kwargs())  # [M,N], [N,M128]
    dxi = gemm(qg, qk, sg, sk, out_dtype=gemm_dtype(x_dtype))  # dgrad: 1x128 . 128x128
    dx = dxi if dx is None else dx + dxi
    dks.append(gemm(qxt, qgt, sxt, sgt, out_dtype=gemm_dtype(k_dtype)).astype(k_dtype))
    dbs.append(None if b_dtype is None else
               jnp.sum(g.astype(jnp.float32), axis=0).astype(b_dtype))
  dx, dnorm = input_grad(dx, *(normed or (None, (None, None))), norm, x_dtype)
  return dx, dnorm, tuple(dks), cast_grads(uses, 2), tuple(dbs)


_block_linear.defvjp(*packed(_block_linear_fwd, _block_linear_bwd))


def _pad_rows(v, multiple: int):
  """v [M, C] with zero rows appended up to a multiple of ``multiple``: whole MXFP8 / NVFP4
  blocks along M for wgrad. Zeros change no block's amax and add nothing to a sum; NVFP4's
  Hadamard transform, the same on both wgrad operands, cancels in their product whatever the
  rows hold."""
  return jnp.pad(v, ((0, -v.shape[0] % multiple), (0, 0)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _mxfp8_linear(x, kernels, biases, dtypes):
  # Without a gradient: x along K (rowwise) and each kernel along K (its columns) only.
  qx = mxfp8_quantize(x)
  out = []
  for kernel, bias in zip(kernels, biases):
    qk = mxfp8_quantize(kernel, rowwise=False, columnwise=True)  # [N, K]
    y = mxfp8_gemm(qx["data"], qk["data_t"], qx["scales"], qk["scales_t"], out_dtype=jnp.float32)
    out.append((y if bias is None else y + bias.astype(jnp.float32)).astype(dtypes[1]))
  return tuple(out)


def _mxfp8_linear_fwd(x, kernels, biases, dtypes):
  m = x.shape[0]
  qx = mxfp8_quantize(_pad_rows(x, MX_BLOCK), columnwise=True)  # along K (fprop), M (wgrad)
  ys, saved = [], []
  for kernel, bias in zip(kernels, biases):
    qk = mxfp8_quantize(kernel, columnwise=True)  # along N (dgrad) and along K (fprop)
    y = mxfp8_gemm(qx["data"], qk["data_t"], qx["scales"], qk["scales_t"], out_dtype=jnp.float32)
    ys.append((y[:m] if bias is None else y[:m] + bias.astype(jnp.float32)).astype(dtypes[1]))
    saved.append((qk["data"], qk["scales"]))
  return tuple(ys), (qx["data_t"], qx["scales_t"], tuple(saved))


def _mxfp8_linear_bwd(dtypes, res, gs):
  qxt, sxt, saved = res
  x_dtype, _, k_dtypes, b_dtypes = dtypes
  dx, dks, dbs = None, [], []
  for g, (qk, sk), k_dtype, b_dtype in zip(gs, saved, k_dtypes, b_dtypes):
    qg = mxfp8_quantize(_pad_rows(g, MX_BLOCK), columnwise=True)  # along N (dgrad), M (wgrad)
    dxi = mxfp8_gemm(qg["data"], qk, qg["scales"], sk, out_dtype=jnp.float32)  # [M32, K]
    dx = dxi if dx is None else dx + dxi
    dks.append(mxfp8_gemm(qxt, qg["data_t"], sxt, qg["scales_t"], out_dtype=k_dtype))  # [K, N]
    dbs.append(None if b_dtype is None else
               jnp.sum(g.astype(jnp.float32), axis=0).astype(b_dtype))
  return dx[:gs[0].shape[0]].astype(x_dtype), tuple(dks), tuple(dbs)


_mxfp8_linear.defvjp(*packed(_mxfp8_linear_fwd, _mxfp8_linear_bwd))


def _rht(recipe) -> dict:
  """nvfp4_quantize's transform arguments for the wgrad operands' copies along M."""
  return {"rht": True, "rht_seed": recipe.rht_seed} if recipe.rht else {}


def _wgrad_copy(q, recipe):
  """(data_t, scales_t, global scale) of an operand's copy along M: the transformed copy's own
  global scale under ``recipe.rht``."""
  return q["data_t"], q["scales_t"], q["global_scale_t" if recipe.rht else "global_scale"]


def _nvfp4_amaxes(v, recipe, axis_name, transformed: bool):
  """nvfp4_quantize's global amax arguments for v: None (v's own) outside ``axis_name``, else
  v's amax (and its transformed copy's, ``transformed``) max-reduced over the axes."""
  if axis_name is None:
    return {}
  out = {"global_amax": sharding.pmax_keep_nan(amax(v), axis_name)}
  if transformed:
    out["global_amax_t"] = sharding.pmax_keep_nan(
        hadamard_amax(as_f32(v), recipe.rht_seed, axis=0), axis_name)
  return out


def _nvfp4_x(x, recipe, axis_name, with_grad: bool):
  """x [M, K] quantized along K (fprop, rounded to nearest) and, ``with_grad``, along M for
  wgrad (M padded to 16, through the Hadamard transform under ``recipe.rht``)."""
  if not with_grad:
    return nvfp4_quantize(x, **_nvfp4_amaxes(x, recipe, axis_name, False))
  x = _pad_rows(x, NVFP4_BLOCK)
  return nvfp4_quantize(x, columnwise=True, **_rht(recipe),
                        **_nvfp4_amaxes(x, recipe, axis_name, recipe.rht))


def _nvfp4_kernel(kernel, recipe, axis_name, with_grad: bool):
  """The kernel [K, N] along K (fprop: ``data_t``) and, ``with_grad``, along N (dgrad:
  ``data``), in 16 x 16 blocks under ``recipe.weight_block_2d``, rounded to nearest."""
  return nvfp4_quantize(kernel, rowwise=with_grad, columnwise=True,
                        block_2d=recipe.weight_block_2d,
                        **_nvfp4_amaxes(kernel, recipe, axis_name, False))


def _nvfp4_fprop(qx, qk, bias, m, dtype):
  y = nvfp4_gemm(qx["data"], qk["data_t"], qx["scales"], qk["scales_t"], qx["global_scale"],
                 qk["global_scale"], out_dtype=jnp.float32)[:m]
  return (y if bias is None else y + bias.astype(jnp.float32)).astype(dtype)


def fold_key(words, data):
  """Threefry key words (uint32 [2]) folded with ``data`` (an int or an int32 scalar), as
  ``jax.random.fold_in`` folds a threefry key, whatever the default PRNG implementation."""
  key = jax.random.wrap_key_data(words, impl="threefry2x32")
  return jax.random.key_data(jax.random.fold_in(key, data))


def gradient_key(words, i, g, axis_name):
  """The key of kernel i's gradient g: the call's key folded with i, then with this device's
  index along the axes g varies over (under a typed shard_map; under pmap or an untyped
  shard_map, where the types tell nothing, along ``axis_name``), so that devices holding
  different rows or columns of a gradient draw different bits at the same local coordinates
  and replicas of one gradient draw the same."""
  words = fold_key(words, i)
  axes = tuple(sorted(sharding.varying_axes(g))) or axis_name
  return words if not axes else fold_key(words, jax.lax.axis_index(axes))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _nvfp4_linear(x, kernels, biases, words, recipe, axis_name, dtypes):
  qx = _nvfp4_x(x, recipe, axis_name, False)
  return tuple(_nvfp4_fprop(qx, _nvfp4_kernel(k, recipe, axis_name, False), b, x.shape[0],
                            dtypes[1]) for k, b in zip(kernels, biases))


def _nvfp4_linear_fwd(x, kernels, biases, words, recipe, axis_name, dtypes):
  qx = _nvfp4_x(x, recipe, axis_name, True)
  ys, saved = [], []
  for kernel, bias in zip(kernels, biases):
    qk = _nvfp4_kernel(kernel, recipe, axis_name, True)
    ys.append(_nvfp4_fprop(qx, qk, bias, x.shape[0], dtypes[1]))
    saved.append((qk["data"], qk["scales"], qk["global_scale"]))
  return tuple(ys), (_wgrad_copy(qx, recipe), tuple(saved), words)


def _nvfp4_linear_bwd(recipe, axis_name, dtypes, res, gs):
  (qxt, sxt, gxt), saved, words = res
  x_dtype, _, k_dtypes, b_dtypes = dtypes
  if recipe.stochastic_rounding and words is None:
    raise ValueError("NVFP4BlockScaling(stochastic_rounding=True) rounds the gradients at "
                     "random: pass key= (a fresh jax.random key each step) to linear / "
                     "multi_linear / mlp, or rngs={'stochastic_rounding': key} to a Flax "
                     "layer's apply (under nn.scan / nn.vmap also split_rngs="
                     "{'stochastic_rounding': True})")
  dx, dks, dbs = None, [], []
  for i, (g, (qk, sk, gk), k_dtype, b_dtype) in enumerate(zip(gs, saved, k_dtypes, b_dtypes)):
    m, g16 = g.shape[0], _pad_rows(g, NVFP4_BLOCK)
    sr = ({"stochastic_rounding": True, "key": gradient_key(words, i, g, axis_name)}
          if recipe.stochastic_rounding else {})
    qg = nvfp4_quantize(g16, columnwise=True, **sr, **_rht(recipe),
                        **_nvfp4_amaxes(g16, recipe, axis_name, recipe.rht))  # along N and M
    dxi = nvfp4_gemm(qg["data"], qk, qg["scales"], sk, qg["global_scale"], gk,
                     out_dtype=jnp.float32)[:m]  # dgrad [M, K]
    dx = dxi if dx is None else dx + dxi
    qgt, sgt, ggt = _wgrad_copy(qg, recipe)
    dks.append(nvfp4_gemm(qxt, qgt, sxt, sgt, gxt, ggt, out_dtype=k_dtype))  # wgrad [K, N]
    dbs.append(None if b_dtype is None else
               jnp.sum(g.astype(jnp.float32), axis=0).astype(b_dtype))
  return dx.astype(x_dtype), tuple(dks), tuple(dbs), None


_nvfp4_linear.defvjp(*packed(_nvfp4_linear_fwd, _nvfp4_linear_bwd))


_ARGS_DOC = """    recipe: a ``DelayedScaling`` (the state's rings must have been made by it), a
      ``CurrentScaling`` (stateless: each tensor's scale from its amax of this step), a
      ``BlockScaling`` (stateless; K and N multiples of 128), an ``MXFP8BlockScaling``
      (stateless; K and N multiples of 32; GEMMs emulated, ``mxfp8_gemm``) or an
      ``NVFP4BlockScaling`` (stateless; K and N multiples of 16; GEMMs emulated,
      ``nvfp4_gemm``; its global amaxes reduced over ``amax_axis_name`` as CurrentScaling's
      amaxes are). Each may set
      ``fp8_min_intensity``: a linear below it runs in the compute dtype (BF16 GEMMs through
      XLA), its rings untouched, where the FP8 path would be slower
      (``check_fp8_min_intensity``). The per-tensor recipes' ``fast_accum_gemms`` name the
      GEMMs (fprop, dgrad, wgrad) that accumulate the fast way.
    amax_axis_name: under ``pmap`` / ``shard_map``, the axis (or axes) whose devices share the
      scales; amaxes are max-reduced over it so all devices hold identical rings (under
      CurrentScaling: quantize each tensor with one scale, its amax reduced before the
      quantization; there None means every axis x, kernel or bias vary over). Under a
      type-checked ``shard_map`` it must include every axis x, kernel or bias vary over while
      the state is replicated. The default None means, where the types tell nothing (pmap,
      ``check_vma=False``), every manual axis; ``()`` means none (independent replicas, as in
      an ensemble under pmap). See ``_amax_axes``. Gradients of replicated inputs are summed
      over the axes they are replicated on, as JAX does for any op.
    norm: None, or "rmsnorm" / "layernorm" (``jax_fp8.norms``): x is normalized over K before
      the GEMMs, from x in its own dtype. On the FP8 path under the per-tensor recipes, and
      under BlockScaling when differentiated, the norm is applied inside x's cast-transpose
      (``norm_cast_transpose``, ``norm_group_cast_transpose``), so it is never stored in the
      compute dtype; its backward is XLA's. Elsewhere (BlockScaling's forward alone too) it is
      XLA's, then the quantization and the GEMMs.
      LayerNorm's variance is ``E[x^2] - mu^2`` (one pass, Flax's default), which loses
      precision where a row's mean dwarfs its spread.
    gamma: the norm's [K] gain, one per column (float32 / bfloat16 / float16); None without
      a norm.
    beta: LayerNorm's [K] shift; None otherwise.
    epsilon: the norm's epsilon, a finite float > 0.
    dtype: the outputs' dtype, in which the GEMMs compute (float32, bfloat16, float16); None:
      x's. x is cast to it, unless a norm reads x (an f32 residual stream, say) first; x's
      gradient comes back in x's dtype.
    key: under ``NVFP4BlockScaling`` with stochastic rounding, a JAX PRNG key (``jax.random.key``
      or a raw uint32 [2], threefry) for the gradients' rounding, a fresh one each step;
      kernel i's gradient draws from ``fold_in(key, i)``, under shard_map / pmap folded with
      the device's index along the axes the gradient varies over (``gradient_key``). Only the backward uses it: a forward may omit it, a gradient
      without it raises ValueError. None under the other recipes."""

_RAISES_DOC = """    ValueError / TypeError at trace time: K or N not a multiple of 16 (128 under
    BlockScaling, 32 under MXFP8BlockScaling), mismatched shapes, unsupported dtypes, rings that do
    not match the recipe, amax_axis_name not a str or tuple of str or naming an axis that is not
    bound, axes missing from amax_axis_name under shard_map, a state given to a stateless recipe or
    an amax axis to a block recipe, an Fp8Weight under MXFP8BlockScaling, a CastKernel cast for
    another recipe or beside a plain kernel, an unknown norm, gamma / beta of the wrong shape or
    dtype or given without their norm, epsilon not > 0, a key where the recipe draws none or that is
    not a PRNG key (or, when differentiating, none where NVFP4BlockScaling's stochastic rounding
    needs one)."""


def linear(x: jax.Array, kernel: jax.Array, bias: jax.Array | None = None, *,
           state: LinearState | None = None,
           recipe: Recipe = DelayedScaling(),
           amax_axis_name: str | tuple[str, ...] | None = None, norm: str | None = None,
           gamma: jax.Array | None = None, beta: jax.Array | None = None,
           epsilon: float = norms.EPSILON, dtype=None, key: jax.Array | None = None,
           split: tuple[int, ...] | list[int] | None = None) -> jax.Array | tuple[jax.Array, ...]:
  ys = _apply(x, (kernel,), (bias,), ("kernel",), ("bias",), state, LinearState, recipe,
              amax_axis_name, (norm, gamma, beta, epsilon), dtype, key, split)
  return ys[0] if split is None else ys


linear.__doc__ = f"""``y = x @ kernel + bias`` with low-precision GEMMs forward and backward
  (FP8 per-tensor or block scaling, MXFP8, NVFP4).

  Args:
    x: [..., K] float32 / bfloat16 / float16.
    kernel: [K, N] (Flax layout), float32 / bfloat16 / float16, quantized from its own dtype;
      or its ``CastKernel`` (``cast_kernel``: quantized once for the step's microbatches), or
      an ``Fp8Weight`` (inference).
    bias: optional [N].
    state: under ``DelayedScaling``, the layer's ``LinearState`` (create with
      ``LinearState.create(recipe)``); differentiate with respect to it and pass that gradient
      to ``jax_fp8.update_state`` for the next rings. Under the other recipes: None.
{_ARGS_DOC}
    split: None, or the sizes (N_0, ..., N_{{n-1}}) to cut the output into along N (as
      ``torch.split`` takes them): 1 to 4 positive multiples of 16 that sum to N, e.g. a fused
      q / k / v projection's. The parts are returned separately, so under the per-tensor
      recipes their gradients reach the backward separately and its cast-transpose reads each
      where it lies (``cast_transpose_delayed`` of x in parts), where cutting the output after
      the layer makes XLA write their concatenation first. The values are those of the output
      cut by ``jnp.split``.
  Returns:
    [..., N] in ``dtype`` (default x's); with ``split``, a tuple of n arrays [..., N_i].
  Raises:
{_RAISES_DOC}
    Also: ``split`` not a tuple / list of ints (TypeError), or not 1 to 4 positive multiples
    of 16 that sum to N (ValueError).

  Method: per-tensor delayed scaling with the HYBRID format (Micikevicius et al. 2022;
  NVIDIA TransformerEngine); block scaling after the DeepSeek-V3 technical report
  (arXiv 2412.19437, section 3.3); MXFP8 after the OCP MX v1.0 spec; NVFP4 after NVIDIA's
  NVFP4 pretraining report (arXiv 2509.25149).
  """


def multi_linear(x: jax.Array, kernels, biases=None, *, state: MultiLinearState | None = None,
                 recipe: Recipe = DelayedScaling(),
                 amax_axis_name: str | tuple[str, ...] | None = None, norm: str | None = None,
                 gamma: jax.Array | None = None, beta: jax.Array | None = None,
                 epsilon: float = norms.EPSILON, dtype=None,
                 key: jax.Array | None = None) -> tuple[jax.Array, ...]:
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


multi_linear.__doc__ = f"""``y_i = x @ kernels[i] + biases[i]`` for several kernels sharing one
  input (q / k / v projections; an MLP's gate and up), with one FP8 quantization of x for all
  of them: each output, kernel gradient and ring is what ``linear`` with that kernel and x's
  ring computes, less the repeated quantizations of x (``fp8_min_intensity`` aside: it is
  decided once, for the GEMM of all kernels side by side, [M, sum N_i, K]). The backward
  sums the kernels' dgrads into one dx (in x's dtype, as autodiff sums a shared input's
  gradients) and runs each wgrad on the one transposed FP8 copy of x.

  Args:
    x: [..., K] float32 / bfloat16 / float16.
    kernels: tuple / list of n [K, N_i] arrays, float32 / bfloat16 / float16 (or all
      ``CastKernel``s, or all ``Fp8Weight``s, as in ``linear``).
    biases: None, or n entries each None or [N_i] float32 / bfloat16 / float16.
    state: under ``DelayedScaling``, a ``MultiLinearState`` (``MultiLinearState.create(n,
      recipe)``), used as ``linear``'s state is. Under the other recipes: None.
{_ARGS_DOC}
  Returns:
    tuple of n arrays [..., N_i] in ``dtype`` (default x's).
  Raises:
{_RAISES_DOC}
    Also: kernels not a non-empty tuple / list, a kernel with N = 0 beside others, biases of
    another count, a state whose ring tuples do not hold one ring per kernel.

  Method: as ``linear``; one quantization of a shared input as TransformerEngine's fused
  q / k / v and gate / up layers do.
  """


STATELESS = (BlockScaling, MXFP8BlockScaling)  # and device-local: no amax is reduced
BLOCK_RECIPES = STATELESS + (NVFP4BlockScaling,)  # no scale rings


def fp8_multiple(recipe) -> tuple[int, str]:
  """The multiple that K and N (an MLP's F and D too) must be of on the FP8 path under
  ``recipe``, and the rule in words for an error."""
  if isinstance(recipe, BlockScaling):
    return blockwise.BLOCK, (f"BlockScaling needs K and N multiples of {blockwise.BLOCK} (the "
                             f"groups of x along K and of the gradient along N)")
  if isinstance(recipe, MXFP8BlockScaling):
    return MX_BLOCK, (f"MXFP8BlockScaling needs K and N multiples of {MX_BLOCK} (whole MXFP8 "
                      f"blocks of x and the kernel along K, of the gradient and the kernel "
                      f"along N)")
  if isinstance(recipe, NVFP4BlockScaling):
    return NVFP4_BLOCK, (f"NVFP4BlockScaling needs K and N multiples of {NVFP4_BLOCK} (whole "
                         f"NVFP4 blocks of x and the kernel along K, of the gradient and the "
                         f"kernel along N)")
  return DIM_MULTIPLE, f"K and N must be multiples of {DIM_MULTIPLE} for the FP8 GEMMs"


def check_stateless(recipe, state, amax_axis_name) -> None:
  """The block recipes take no state and reduce no amax: ValueError naming the argument
  otherwise."""
  name = type(recipe).__name__
  if state is not None:
    raise ValueError(f"{name} is stateless: pass state=None, got a {type(state).__name__}")
  if amax_axis_name not in (None, ()):
    raise ValueError(f"{name} reduces no amax (its block scales come from each device's own "
                     f"tensors): pass amax_axis_name=None, got {amax_axis_name!r}")


def check_key(recipe, key):
  """The key words (uint32 [2]) that ``recipe``'s stochastic rounding draws from, or None;
  ValueError for a key the recipe does not use or that is not a JAX PRNG key."""
  if key is None:
    return None
  if not draws_key(recipe):
    raise ValueError(f"key serves NVFP4BlockScaling's stochastic rounding of the gradients; "
                     f"{type(recipe).__name__}"
                     f"{'(stochastic_rounding=False)' if isinstance(recipe, NVFP4BlockScaling) else ''}"
                     f" draws no random bits: pass key=None")
  return key_words(key)


def check_stateless_global(recipe, state) -> None:
  """The recipes with per-tensor amaxes of this step (CurrentScaling, NVFP4BlockScaling's
  global scales) take no state: ValueError otherwise."""
  if state is not None:
    raise ValueError(f"{type(recipe).__name__} is stateless: pass no state (each tensor's "
                     f"scale comes from its own amax in this step)")


def check_norm(x, norm_args):
  """((gamma, beta), (norm, epsilon)) of a layer's fused norm, checked against x [..., K]
  (``norm_args``: norm, gamma, beta, epsilon as the caller got them); ((None, None), None)
  without one."""
  norm, gamma, beta, epsilon = norm_args
  if norm is None:
    if gamma is not None or beta is not None:
      raise TypeError("gamma and beta are a norm's parameters: pass norm='rmsnorm' or "
                      "'layernorm' with them, or neither")
    return (None, None), None
  if x.ndim < 1:
    raise ValueError(f"x must be [..., K] for a norm, got shape {x.shape}")
  return norms.check_params(norm, gamma, beta, x.shape[-1]), (norm, norms.check_epsilon(epsilon))


def compute_dtype(x, dtype):
  """The outputs' dtype: ``dtype`` (float32, bfloat16 or float16), or x's where None."""
  if dtype is None:
    return x.dtype
  try:
    dt = jnp.dtype(dtype)
  except TypeError:
    dt = None
  if dt not in FLOAT_DTYPES:
    got = repr(dtype) if dt is None else dt.name
    raise TypeError(f"dtype must be None, float32, bfloat16 or float16, got {got}")
  return dt


def gemm_input(x, norm_params, norm, dtype):
  """What the GEMMs multiply where no kernel fuses the norm: x, or its norm by XLA (from x in
  its own dtype), in ``dtype``."""
  if norm is not None:
    x = norms.normalize(x, *norm_params, norm=norm[0], epsilon=norm[1])
  return x.astype(dtype)


def check_split(split, n: int) -> tuple[int, ...] | None:
  """``linear``'s ``split`` for an output of N = ``n`` columns, as a tuple (or None);
  TypeError / ValueError saying which rule it breaks."""
  if split is None:
    return None
  if not isinstance(split, (tuple, list)):
    raise TypeError(f"split must be None or a tuple / list of ints, got {checks.describe(split)}")
  split = tuple(checks.integer(v, f"split[{i}]") for i, v in enumerate(split))
  if not 1 <= len(split) <= MAX_PARTS:
    raise ValueError(f"split must hold 1 to {MAX_PARTS} sizes, got {len(split)}: {split}")
  if any(v <= 0 or v % COL_MULTIPLE for v in split):
    raise ValueError(f"split's sizes must be positive multiples of {COL_MULTIPLE}, got {split}")
  if sum(split) != n:
    raise ValueError(f"split's sizes must sum to the output's N={n} (the kernel's columns, a "
                     f"layer's features), got {split}, which sum to {sum(split)}")
  return split


def _apply(x, kernels, biases, kernel_names, bias_names, state, state_cls, recipe,
           amax_axis_name, norm_args, dtype, key, split=None):
  """``linear`` and ``multi_linear``: the arguments checked (``*_names``: how errors call the
  kernels and biases), then the FP8 (or, below ``fp8_min_intensity``, the plain) path; the one
  kernel's output cut as ``split`` says."""
  x = checks.array(x, "x")
  if x.dtype not in FLOAT_DTYPES:
    raise TypeError(f"x must be float32, bfloat16 or float16, got {x.dtype}")
  norm_params, norm = check_norm(x, norm_args)
  out_dtype = compute_dtype(x, dtype)
  check_recipe(recipe)
  casts = (None,) * len(kernels)
  if any(isinstance(k, CastKernel) for k in kernels):
    casts = tuple(check_cast(c, name, recipe, amax_axis_name)
                  for c, name in zip(kernels, kernel_names))
    kernels = tuple(c.kernel for c in kernels)
  weights = [isinstance(k, Fp8Weight) for k in kernels]
  if any(weights) and not all(weights):
    raise TypeError("kernels must be all arrays or all Fp8Weight (inference), not a mix")
  if all(weights):
    shapes = tuple(check_weight(w, name, recipe) for w, name in zip(kernels, kernel_names))
  else:
    kernels = tuple(checks.array(k, name) for k, name in zip(kernels, kernel_names))
    for name, kernel in zip(kernel_names, kernels):
      if kernel.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32, bfloat16 or float16, got {kernel.dtype}")
      if kernel.ndim != 2:
        raise ValueError(f"{name} must be [K, N], got shape {kernel.shape}")
    shapes = tuple(kernel.shape for kernel in kernels)
  for name, (kk, _) in zip(kernel_names, shapes):
    if x.ndim < 1 or x.shape[-1] != kk:
      raise ValueError(f"x [..., K] and {name} [K, N] must share K, got x {x.shape} and "
                       f"{name} with K={kk}")
  k, ns = shapes[0][0], tuple(n for _, n in shapes)
  biases = list(biases)
  for i, (name, n) in enumerate(zip(bias_names, ns)):
    if biases[i] is None:
      continue
    biases[i] = checks.array(biases[i], name)
    if biases[i].dtype not in FLOAT_DTYPES:
      raise TypeError(f"{name} must be float32, bfloat16 or float16, got {biases[i].dtype}")
    if biases[i].shape != (n,):
      raise ValueError(f"{name} must be [{n}], got {list(biases[i].shape)}")
  biases = tuple(biases)
  split = check_split(split, ns[0])
  outs = ns if split is None else split  # the outputs' N
  words = check_key(recipe, key)
  # else XLA in the compute dtype, any shape
  fp8 = _fp8_pays(recipe, math.prod(x.shape[:-1]), sum(ns), k)
  if fp8 and 0 in ns:
    raise ValueError(f"{kernel_names[ns.index(0)]} has N = 0 beside other kernels: leave it out")
  multiple, why = fp8_multiple(recipe)
  if fp8 and (k % multiple or any(n % multiple for n in ns)):
    raise ValueError(f"{why}, got K={k}, N={', '.join(map(str, ns))}")
  if isinstance(recipe, STATELESS):
    check_stateless(recipe, state, amax_axis_name)
    rings = None
  elif isinstance(recipe, (CurrentScaling, NVFP4BlockScaling)):  # amaxes of this step
    check_stateless_global(recipe, state)
    amax_axis_name = _amax_axes(x, kernels, biases, None, amax_axis_name)
    rings = None if isinstance(recipe, NVFP4BlockScaling) else (
        recipe.ring(recipe.fwd_fmt), tuple(recipe.ring(recipe.fwd_fmt) for _ in kernels),
        tuple(recipe.ring(recipe.bwd_fmt) for _ in kernels))
  else:
    if not isinstance(state, state_cls):
      raise TypeError(f"state must be a jax_fp8.{state_cls.__name__}, got "
                      f"{type(state).__name__}")
    named_x, named_k, named_g = state.named_rings()
    if len(named_k) != len(kernels) or len(named_g) != len(kernels):
      raise ValueError(f"state holds {len(named_k)} kernel and {len(named_g)} gradient rings "
                       f"for {len(kernels)} kernels")
    check_rings((named_x,) + named_k + named_g,
                (recipe.fwd_fmt,) * (1 + len(kernels)) + (recipe.bwd_fmt,) * len(kernels), recipe)
    amax_axis_name = _amax_axes(x, kernels, biases, state, amax_axis_name)
    rings = (named_x[1], tuple(r for _, r in named_k), tuple(r for _, r in named_g))
  fused_norm = (fp8 and not all(weights) and norm is not None
                and (rings is not None or isinstance(recipe, BlockScaling)))
  if not fused_norm:
    x = gemm_input(x, norm_params, norm, out_dtype)  # else the norm's kernel reads x itself
  if all(weights):
    x2 = x.reshape(math.prod(x.shape[:-1]), k)
    x_ring = None if rings is None else scaled(rings[0], x2, isinstance(recipe, CurrentScaling),
                                               amax_axis_name)
    ys = split_output(op_outputs(forward(x2, kernels, biases, x_ring, recipe, fp8, x.dtype)),
                      split)
    return tuple(y.reshape(*x.shape[:-1], n) for y, n in zip(ys, outs))
  if not fp8:
    return split_output(tuple(_linear_in_dtype(x, kernel, bias)
                              for kernel, bias in zip(kernels, biases)), split)
  x, norm_params, kernels, casts, biases = sharding.vary_like(
      (x, norm_params, kernels, casts, biases), x, norm_params, kernels, casts, biases)
  dtypes = (x.dtype, out_dtype, tuple(kernel.dtype for kernel in kernels),
            tuple(None if b is None else b.dtype for b in biases))
  x2 = x.reshape(math.prod(x.shape[:-1]), k)
  cut = split  # where the output is cut after the op
  if isinstance(recipe, BlockScaling):
    ys = _block_linear(x2, norm_params, kernels, casts, biases, recipe, dtypes, norm)
  elif isinstance(recipe, MXFP8BlockScaling):
    ys = _mxfp8_linear(x2, kernels, biases, dtypes)
  elif isinstance(recipe, NVFP4BlockScaling):
    ys = _nvfp4_linear(x2, kernels, biases, words, recipe, amax_axis_name, dtypes)
  else:  # cut inside, so that the parts' gradients reach the backward separately
    ys = _linear(x2, norm_params, kernels, casts, biases, rings, amax_axis_name, dtypes,
                 recipe.fast_accum_gemms, norm, isinstance(recipe, CurrentScaling), split)
    cut = None
  ys = split_output(op_outputs(ys), cut)
  return tuple(y.reshape(*x.shape[:-1], n) for y, n in zip(ys, outs))
