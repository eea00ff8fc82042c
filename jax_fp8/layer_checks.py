"""The argument checks that ``linear``, ``multi_linear``, ``mlp``, ``grouped_linear`` and
``grouped_mlp`` share, each written once: float arrays, the fused norm, the compute dtype,
``split``, the PRNG key, an MLP's kernel shapes, a grouped layer's operands and recipe, the
state against the recipe, the amax axes, and whether the FP8 path pays at a shape. Every check
raises TypeError / ValueError at trace time naming the argument, the rule and the value seen."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from . import activations, checks, norms, sharding
from .formats import FLOAT_DTYPES
from .ops._ring import check_ring
from .ops.grouped_gemm import MAX_GROUPS
from .ops.sources import COL_MULTIPLE, MAX_PARTS
from .philox import key_words
from .recipes import RECIPES, Recipe, check_recipe
from .state import ScaleRing


def float_array(v, name: str) -> jax.Array:
  """``v`` as a float32 / bfloat16 / float16 array; TypeError naming ``name`` otherwise."""
  v = checks.array(v, name)
  if v.dtype not in FLOAT_DTYPES:
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {v.dtype}")
  return v


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


def mlp_dims(activation: str, x, kernel_in, kernel_out) -> tuple[int, int, int, int]:
  """(K, N, F, D) of an MLP's kernel_in [..., K, N] and kernel_out [..., F, D] (a grouped
  MLP's with the experts' axis G in front), checked against x [..., K] and the activation: N =
  2F for a gated one (gate and up side by side), else N = F; ValueError naming the shapes
  otherwise (and the activation's error for an unknown one)."""
  _, gated = activations.check(activation)
  k, n = kernel_in.shape[-2:]
  f, d = kernel_out.shape[-2:]
  if x.shape[-1] != k or n != (2 * f if gated else f):
    lead = "G, " * (kernel_in.ndim - 2)
    raise ValueError(f"x [..., K], kernel_in [{lead}K, N] and kernel_out [{lead}F, D] need x's "
                     f"K = kernel_in's K and N = "
                     f"{'2F (gate and up side by side)' if gated else 'F'} under "
                     f"{activation!r}, got x {x.shape}, kernel_in {kernel_in.shape}, "
                     f"kernel_out {kernel_out.shape}")
  return k, n, f, d


def grouped_operands(x, kernels, group_sizes, name: str = "kernels"):
  """A grouped layer's (x [M, K], kernels [G, K, N], group_sizes int32 [G]) as arrays, checked:
  x and the kernels (the argument ``name``) float arrays of those ranks sharing K, group_sizes
  int32 [G] of the kernels' G, 1 <= G <= ``MAX_GROUPS``; TypeError / ValueError naming the
  argument otherwise."""
  x = float_array(x, "x")
  if x.ndim != 2:
    raise ValueError(f"x must be [M, K] (the rows grouped consecutively by expert), got shape "
                     f"{list(x.shape)}")
  kernels = float_array(kernels, name)
  if kernels.ndim != 3 or kernels.shape[1] != x.shape[1]:
    raise ValueError(f"{name} must be [G, K, N] with x's K={x.shape[1]}, got shape "
                     f"{list(kernels.shape)}")
  groups = kernels.shape[0]
  group_sizes = checks.array(group_sizes, "group_sizes")
  if group_sizes.dtype != jnp.int32 or group_sizes.ndim != 1:
    raise TypeError(f"group_sizes must be int32 [G], got {checks.describe(group_sizes)}")
  if group_sizes.shape[0] != groups:
    raise ValueError(f"group_sizes [G] and {name} [G, K, N] must share G, got group_sizes "
                     f"[{group_sizes.shape[0]}] and {name} {list(kernels.shape)}")
  if not 1 <= groups <= MAX_GROUPS:
    raise ValueError(f"{name} must hold 1 to {MAX_GROUPS} experts, got G={groups}")
  return x, kernels, group_sizes


def grouped_bias(bias, name: str, groups: int, width: int, dim: str):
  """None, or ``bias`` (the argument ``name``) as a float array [G, width], one bias per
  expert (``dim``: width's letter in the message); TypeError / ValueError otherwise."""
  if bias is None:
    return None
  bias = float_array(bias, name)
  if bias.shape != (groups, width):
    raise ValueError(f"{name} must be [G, {dim}] = [{groups}, {width}], got {list(bias.shape)}")
  return bias


def check_grouped_recipe(recipe, op: str, name: str = "recipe") -> None:
  """TypeError unless ``recipe`` (the argument or attribute ``name``) is a recipe that the
  grouped layers serve (``Recipe.grouped``), naming those (``op``: the function or layer called,
  for the message)."""
  check_recipe(recipe, name)
  if not recipe.grouped:
    raise TypeError(ungrouped_reason(recipe, op))


def ungrouped_reason(recipe: Recipe, op: str = "grouped_linear") -> str:
  """Why ``op`` (a grouped layer) does not serve ``recipe``, one whose ``grouped`` is False,
  naming the recipes it serves (``check_grouped_recipe``'s error, ``convert``'s reason)."""
  *rest, last = [c.article() for c in RECIPES if c.grouped]
  return (f"{op} takes {', '.join(rest)} or {last} (the scalings of the grouped FP8 GEMMs: "
          f"per-tensor, one scale per expert for the kernels, or DeepSeek-V3's blocks), got "
          f"{type(recipe).__name__}: no grouped FP8 GEMM takes its scales")


def check_key(recipe: Recipe, key):
  """The key words (uint32 [2]) that ``recipe``'s stochastic rounding draws from, or None;
  ValueError for a key the recipe does not use or that is not a JAX PRNG key."""
  if key is None:
    return None
  if not recipe.draws_key:
    off = ("(stochastic_rounding=False)"
           if getattr(recipe, "stochastic_rounding", None) is False else "")
    raise ValueError(f"key serves NVFP4BlockScaling's stochastic rounding of the gradients; "
                     f"{type(recipe).__name__}{off} draws no random bits: pass key=None")
  return key_words(key)


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


def state_rings(state, cls, recipe: Recipe, groups: int | None = None) -> tuple:
  """The rings of a layer's ``state`` in its ``named_rings`` order, checked: ``state`` a
  ``cls`` (``MlpState``, ``GroupedLinearState``, ``GroupedMlpState``), every ring a ScaleRing
  of the recipe's history length, margin and algo, the gradients' (named "state.grad...") of
  its backward format and the others of its forward format. With ``groups`` (a grouped layer's
  G) the kernels' rings ("state.kernel...") hold one ring per expert, stacked: amax_history
  [G, L], scale [G], steps [G]. TypeError / ValueError naming what is wrong."""
  create = f"{cls.__name__}.create({'' if groups is None else f'{groups}, '}recipe)"
  if not isinstance(state, cls):
    raise TypeError(f"state must be a jax_fp8.{cls.__name__} ({create}), got "
                    f"{type(state).__name__}")
  named = state.named_rings()
  checked = tuple((f"{name}[0]", _first_of_stack(name, ring, groups, create))
                  if groups is not None and name.startswith("state.kernel") else (name, ring)
                  for name, ring in named)
  check_rings(checked, tuple(recipe.bwd_fmt if name.startswith("state.grad") else
                             recipe.fwd_fmt for name, _ in named), recipe)
  return tuple(r for _, r in named)


def _first_of_stack(name: str, ring, groups: int, create: str) -> ScaleRing:
  """Expert 0's ring of ``ring``, one ring per expert stacked over ``groups``; TypeError /
  ValueError naming ``name`` where it is no ScaleRing or not stacked so."""
  if not isinstance(ring, ScaleRing):
    raise TypeError(f"{name} must be a jax_fp8.ScaleRing stacked over the experts, got "
                    f"{type(ring).__name__}")
  shapes = tuple(jnp.shape(v) for v in (ring.amax_history, ring.scale, ring.steps))
  if (len(shapes[0]) != 2 or shapes[0][0] != groups or shapes[1] != (groups,)
      or shapes[2] != (groups,)):
    raise ValueError(f"{name} must hold one ring per expert, stacked: amax_history [G, L], "
                     f"scale [G] and steps [G] with G={groups} ({create}), got amax_history "
                     f"{list(shapes[0])}, scale {list(shapes[1])}, steps {list(shapes[2])}")
  return dataclasses.replace(ring, amax_history=ring.amax_history[0], scale=ring.scale[0],
                             steps=ring.steps[0])


def check_stateless(recipe: Recipe, state, amax_axis_name) -> None:
  """A recipe without rings takes no state; one of device-local block scales reduces no amax
  either: ValueError naming the argument otherwise."""
  name = type(recipe).__name__
  if recipe.amax_scope != "local":  # each tensor's scale from its amax of this step
    if state is not None:
      raise ValueError(f"{name} is stateless: pass no state (each tensor's scale comes from its "
                       f"own amax in this step)")
    return
  if state is not None:
    raise ValueError(f"{name} is stateless: pass state=None, got a {type(state).__name__}")
  if amax_axis_name not in (None, ()):
    raise ValueError(f"{name} reduces no amax (its block scales come from each device's own "
                     f"tensors): pass amax_axis_name=None, got {amax_axis_name!r}")


def axis_names(amax_axis_name) -> set:
  """The names in amax_axis_name (None, a str or a tuple / list of str), each bound here;
  TypeError / ValueError otherwise."""
  if amax_axis_name is None:
    return set()
  names = (amax_axis_name,) if isinstance(amax_axis_name, str) else amax_axis_name
  if not isinstance(names, (tuple, list)) or not all(isinstance(a, str) for a in names):
    raise TypeError(f"amax_axis_name must be None, an axis name (str) or a tuple of them, got "
                    f"{amax_axis_name!r}")
  for a in names:
    if not axis_bound(a):
      raise ValueError(f"amax_axis_name names the axis {a!r}, which is not bound here: name an "
                       f"axis of the enclosing pmap or shard_map (or pass None outside them)")
  return set(names)


def axis_bound(name: str) -> bool:
  """Whether an enclosing pmap or shard_map binds the axis ``name`` here."""
  try:
    jax.lax.axis_size(name)
  except NameError:
    return False
  return True


def amax_axes(x, kernel, bias, state, amax_axis_name):
  """The mesh axes to max-reduce the amaxes over, so that devices sharing rings agree (under
  an "tensor" ``amax_scope``, ``state`` None: so that devices sharing a tensor quantize it with
  one scale).

  Axes named in amax_axis_name are always reduced over. Under a type-checked shard_map, x,
  kernel or bias vary over some axes (data parallel: x over the batch axis; tensor parallel:
  kernel over the model axis); rings replicated over such an axis need the amax reduced over
  it, so those axes must be among the names; rings that vary over it (one set per pipeline
  stage, say) keep their own amaxes unless the axis is named. Where the types tell nothing
  (pmap, shard_map with check_vma=False, or every input replicated), the default None means
  every manual axis (a no-op where the amaxes agree anyway), and () means none. Without state
  no rings must stay in step: the names are taken as given (() for independent replicas), and
  None means every axis x, kernel or bias vary over.
  """
  names = axis_names(amax_axis_name)
  needed = sharding.varying_axes(x, kernel, bias) - sharding.varying_axes(state)
  if state is None:  # amaxes of this step: the axes named, by default every axis they vary over
    names = needed if amax_axis_name is None else names
  elif not needed <= names:
    raise ValueError(f"x, kernel or bias vary over the shard_map axes {sorted(needed)}, over "
                     f"which the state is replicated: pass them as amax_axis_name so every "
                     f"device keeps the same scale rings, got {amax_axis_name!r}")
  typed = bool(sharding.varying_axes(x, kernel, bias, state))
  if amax_axis_name is None and not typed:
    return tuple(sorted(sharding.manual_axes())) or None
  return tuple(sorted(names)) or None


def names_given(amax_axis_name) -> tuple[str, ...] | None:
  """amax_axis_name as a ``CastKernel`` records it: None, or its names sorted."""
  return None if amax_axis_name is None else tuple(sorted(axis_names(amax_axis_name)))


def fp8_pays(recipe: Recipe, m: int | None, n: int, k: int, groups: int = 1) -> bool:
  """Whether this GEMM's intensity ``M*N*K / (M*K + K*N + M*N)`` reaches the recipe's
  ``fp8_min_intensity`` (never for an empty K or N: nothing to quantize). ``m`` None: at some
  M, however large (the intensity grows with M towards ``N*K / (N + K)``), so False means
  that no batch makes this layer's FP8 path pay. ``groups``: a grouped GEMM's kernel count G,
  whose M rows meet G kernels: ``M*N*K / (M*K + G*K*N + M*N)``."""
  t = recipe.fp8_min_intensity
  if m is None:
    return k > 0 and n > 0 and (t == 0 or n * k > t * (n + k))  # the bound is never reached
  return k > 0 and n > 0 and m * n * k >= t * (m * k + groups * k * n + m * n)


def intensity(m: int | None, n: int, k: int, groups: int = 1) -> float:
  """``M*N*K / (M*K + G*K*N + M*N)``, the GEMM's multiply-adds per element of x, kernels and
  output that ``fp8_pays`` compares with ``fp8_min_intensity`` (``groups``: G, the kernels of
  a grouped GEMM; 1 for a dense one); ``m`` None: its bound as M grows, ``N*K / (N + K)``. 0
  for an empty GEMM."""
  if m is None:
    return n * k / (n + k) if n > 0 and k > 0 else 0.0
  den = m * k + groups * k * n + m * n
  return m * n * k / den if den else 0.0


def kernel_to_cast(kernel, recipe: Recipe) -> jax.Array:
  """A kernel [K, N] to quantize once (``cast_kernel``, ``quantize_weight``), checked with its
  recipe: a float32 / bfloat16 / float16 2-D array, a recipe that serves casts and FP8 weights
  (``casts_kernel``), K and N multiples of its ``dim_multiple``; TypeError / ValueError
  otherwise."""
  kernel = checks.array(kernel, "kernel")
  if kernel.dtype not in FLOAT_DTYPES or kernel.ndim != 2:
    raise TypeError(f"kernel must be a float32 / bfloat16 / float16 [K, N] array, got "
                    f"{kernel.dtype}{list(kernel.shape)}")
  check_recipe(recipe, casts_kernel=True)
  if kernel.shape[0] % recipe.dim_multiple or kernel.shape[1] % recipe.dim_multiple:
    raise ValueError(f"{recipe.dim_rule}, got kernel {list(kernel.shape)}")
  return kernel


def check_dims(recipe: Recipe, dims: dict) -> None:
  """ValueError unless every size in ``dims`` (name -> a size or a tuple of sizes: K, N, ...)
  is a multiple of the recipe's ``dim_multiple``."""
  sizes = {k: v if isinstance(v, tuple) else (v,) for k, v in dims.items()}
  if any(v % recipe.dim_multiple for vs in sizes.values() for v in vs):
    got = ", ".join(f"{k}={', '.join(map(str, vs))}" for k, vs in sizes.items())
    raise ValueError(f"{recipe.dim_rule}, got {got}")


def gemm_input(x, norm_params, norm, dtype):
  """What the GEMMs multiply where no kernel fuses the norm: x, or its norm by XLA (from x in
  its own dtype), in ``dtype``."""
  if norm is not None:
    x = norms.normalize(x, *norm_params, norm=norm[0], epsilon=norm[1])
  return x.astype(dtype)
