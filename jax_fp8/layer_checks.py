"""The argument checks that ``linear``, ``multi_linear`` and ``mlp`` share, each written once:
float arrays, the fused norm, the compute dtype, ``split``, the PRNG key, the state against the
recipe, the amax axes, and whether the FP8 path pays at a shape. Every check raises TypeError /
ValueError at trace time naming the argument, the rule and the value seen."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import checks, norms, sharding
from .formats import FLOAT_DTYPES
from .ops._ring import check_ring
from .ops.sources import COL_MULTIPLE, MAX_PARTS
from .philox import key_words
from .recipes import Recipe, check_recipe


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
    try:
      jax.lax.axis_size(a)
    except NameError:
      raise ValueError(f"amax_axis_name names the axis {a!r}, which is not bound here: name an "
                       f"axis of the enclosing pmap or shard_map (or pass None outside them)"
                       ) from None
  return set(names)


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
