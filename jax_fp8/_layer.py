"""What the Flax layers (``jax_fp8.flax``, linen, and ``jax_fp8.nnx``) share: their argument
checks, their state, and the call of ``linear`` / ``multi_linear`` / ``mlp`` in the compute
dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes

from . import _names, activations, checks, norms
from .formats import FLOAT_DTYPES
from .inference import Fp8Weight
from .cast_kernel import CastKernel, cast_kernel
from .layer_checks import check_grouped_recipe
from .layer_state import LinearState, MlpState, MultiLinearState
from .linear import linear, multi_linear
from .mlp import mlp
from .moe import moe_mlp
from .ops.grouped_gemm import MAX_GROUPS
from .recipes import DelayedScaling, check_recipe

# The Flax rng stream that NVFP4's stochastic rounding draws its key from, each call.
SR_STREAM = "stochastic_rounding"


def _canonical_dtype(v):
  """``v`` as JAX canonicalizes a dtype (float64 is float32 without x64), or None where it
  names none."""
  try:
    return jax.dtypes.canonicalize_dtype(v)
  except TypeError:
    return None


def _dtype_name(v) -> str:
  d = _canonical_dtype(v)
  return d.name if d is not None else repr(v)


def check_dtypes(name: str, dtype, param_dtype) -> None:
  """Layer ``name``'s dtype (None, float32, bfloat16 or float16) and param_dtype (those but
  None or, under x64, float64); TypeError naming the attribute."""
  if dtype is not None and _canonical_dtype(dtype) not in FLOAT_DTYPES:
    raise TypeError(f"{name}.dtype must be None, float32, bfloat16 or float16, got "
                    f"{_dtype_name(dtype)}")
  # None (no dtype named) is tested apart: numpy's dtype == None compares with float64
  param = _canonical_dtype(param_dtype)
  if param is None or param not in (*FLOAT_DTYPES, jnp.dtype(jnp.float64)):
    raise TypeError(f"{name}.param_dtype must be float32, bfloat16 or float16 (or float64 "
                    f"under x64), got {_dtype_name(param_dtype)}")


def check_moe_layer(recipe, num_experts, top_k, hidden_features, activation,
                    shared_hidden_features, normalize_weights, dtype, param_dtype,
                    in_features=None) -> tuple[int, int, bool]:
  """(E, H, gated) of a MoeMlp layer (linen's or NNX's), its attributes checked: a recipe of
  the grouped GEMMs, E in [1, MAX_GROUPS], top_k in [1, E], the activation, H, the shared
  expert's hidden size (None or an int) and D (NNX's in_features; linen's comes with the input)
  ints >= 1 and multiples of the recipe's ``dim_multiple``, normalize_weights a bool, the
  dtypes. TypeError / ValueError naming the attribute."""
  check_grouped_recipe(recipe, "MoeMlp", "MoeMlp.recipe")
  e = checks.integer(num_experts, "MoeMlp.num_experts", lo=1, hi=MAX_GROUPS)
  checks.integer(top_k, "MoeMlp.top_k", lo=1, hi=e)
  h = checks.integer(hidden_features, "MoeMlp.hidden_features", lo=1)
  _, gated = activations.check(activation, "MoeMlp.activation")
  sizes = {"hidden_features": h, "shared_hidden_features": shared_hidden_features,
           "in_features": in_features}
  for name, v in sizes.items():
    if v is not None and checks.integer(v, f"MoeMlp.{name}", lo=1) % recipe.dim_multiple:
      raise ValueError(f"MoeMlp.{name} must be a multiple of {recipe.dim_multiple} "
                       f"({type(recipe).__name__}'s FP8 GEMMs), got {v}")
  checks.boolean(normalize_weights, "MoeMlp.normalize_weights")
  check_dtypes("MoeMlp", dtype, param_dtype)
  return e, h, gated


def check_layer(name: str, features, use_bias, recipe, multi: bool, dtype, param_dtype,
                features_name="features"):
  """(features as a tuple of ints, use_bias) of layer ``name``, checked with its dtype (None,
  float32, bfloat16 or float16) and param_dtype (those or, under x64, float64); ``multi``:
  features is a tuple (one layer of several outputs); ``features_name``: what the layer calls
  it. TypeError / ValueError naming the attribute."""
  check_recipe(recipe, f"{name}.recipe")
  check_dtypes(name, dtype, param_dtype)
  if not multi:
    features = (checks.integer(features, f"{name}.{features_name}", lo=1),)
  elif isinstance(features, (tuple, list)) and features:
    features = tuple(checks.integer(f, f"{name}.{features_name}[{i}]", lo=1)
                     for i, f in enumerate(features))
  else:
    raise TypeError(f"{name}.{features_name} must be a non-empty tuple of ints, got "
                    f"{features!r}")
  return features, checks.boolean(use_bias, f"{name}.use_bias")


def check_norm_attr(name: str, norm, epsilon) -> bool:
  """Whether layer ``name``'s fused input norm (None, "rmsnorm" or "layernorm") has a beta
  (LayerNorm), its attributes (the epsilon also without a norm) checked; TypeError /
  ValueError naming the attribute."""
  norms.check_epsilon(epsilon, f"{name}.norm_epsilon")
  if norm is None:
    return False
  norms.check(norm, f"{name}.norm")
  return norms.centered(norm)


def linen_key(module, recipe):
  """A linen module's key for ``recipe``'s stochastic rounding: the next of its
  "stochastic_rounding" rng stream where the recipe draws one and ``apply`` was given the
  stream, else None (a forward needs none; the backward then asks for it)."""
  return module.make_rng(SR_STREAM) if recipe.draws_key and module.has_rng(SR_STREAM) else None


def create_state(recipe: DelayedScaling, outputs: int | None):
  """A fresh ``LinearState`` (``outputs`` None: one kernel) or ``MultiLinearState``."""
  return LinearState.create(recipe) if outputs is None else MultiLinearState.create(outputs, recipe)


def check_cast_kernels(recipe, fp8_state, select, state_name: str) -> bool:
  """The arguments that linen's and NNX's ``cast_kernels`` share, checked (``state_name``: what
  the API calls its FP8 state): whether the recipe is ``DelayedScaling`` (whose casts take
  their rings from ``fp8_state``)."""
  if not callable(select):
    raise TypeError(f"select must be a callable (path, kernel) -> bool, got {select!r}")
  check_recipe(recipe, casts_kernel=True)
  delayed = recipe.stateful
  if delayed and fp8_state is None:
    raise TypeError(f"cast_kernels under DelayedScaling takes {state_name}, whose kernel rings "
                    f"the casts observe: pass fp8_state")
  if not delayed and fp8_state is not None:
    raise ValueError(f"{type(recipe).__name__} is stateless: pass fp8_state=None")
  return delayed


def kernel_ring(layer_state, name: str):
  """The ring of kernel parameter ``name`` in a layer's state (its ``LinearState``,
  ``MultiLinearState`` or ``MlpState``), or None where that state has none for it."""
  i = _names.multi_index(name)
  if name == "kernel" and isinstance(layer_state, LinearState):
    return layer_state.kernel
  if i is not None and isinstance(layer_state, MultiLinearState):
    return layer_state.kernels[i] if i < len(layer_state.kernels) else None
  if name in ("kernel_in", "kernel_out") and isinstance(layer_state, MlpState):
    return getattr(layer_state, name)
  return None


def cast_leaf(where: str, kernel, ring, recipe, amax_axis_name, select):
  """``kernel`` (a parameter leaf at path ``where``) as its ``CastKernel``, cast layer by layer
  where layers are stacked on leading axes (``ring`` likewise), or None where it is no
  kernel to cast: not an array of at least 2 dimensions, no ring under ``DelayedScaling``, or
  ``select`` says no. TypeError for a ``CastKernel`` (params cast already);
  ``cast_kernel``'s errors are prefixed with ``where``."""
  if isinstance(kernel, CastKernel):
    raise TypeError(f"{where} is a CastKernel already (cast_kernels' output): pass the float "
                    f"params")
  if (not isinstance(kernel, (jax.Array, np.ndarray)) or jnp.ndim(kernel) < 2
      or (recipe.stateful and ring is None)):
    return None
  if not checks.selected(select, where, kernel):
    return None
  fn = lambda k, r: cast_kernel(k, r, recipe=recipe, amax_axis_name=amax_axis_name)  # noqa: E731
  for _ in range(jnp.ndim(kernel) - 2):
    fn = jax.vmap(fn, in_axes=(0, None if ring is None else 0))
  try:
    return fn(kernel, ring)
  except (TypeError, ValueError) as e:
    raise type(e)(f"{where}: {e}") from None


def _readable(a, dtype):
  """A parameter in a dtype the kernels read: its own, or (float64 under x64) ``dtype``; None,
  ``Fp8Weight`` and ``CastKernel`` as they are."""
  if a is None or isinstance(a, (Fp8Weight, CastKernel)) or a.dtype in FLOAT_DTYPES:
    return a
  return a.astype(dtype)


def _float_inputs(inputs) -> jax.Array:
  """The layer's inputs as an array; TypeError where they are not one of floats."""
  inputs = checks.array(inputs, "the layer's inputs")
  if not jnp.issubdtype(inputs.dtype, jnp.floating):
    raise TypeError(f"the layer's inputs must be floats (float32, bfloat16 or float16), got "
                    f"{inputs.dtype}")
  return inputs


def _compute_dtype(inputs, params, dtype):
  """The compute dtype: ``dtype`` (as JAX canonicalizes it: float64 is float32 without x64),
  or where None the promotion of the inputs' and parameters' dtypes by Flax's rules (absent
  parameters and ``Fp8Weight``s, for inference, left out; a ``CastKernel`` counts as its float
  kernel); TypeError where that is not float32 / bfloat16 / float16 (float64 parameters or
  inputs under x64), or where the inputs are not floats."""
  inputs = _float_inputs(inputs)
  if dtype is not None:  # check_layer checked it
    return _canonical_dtype(dtype)
  params = tuple(p.kernel if isinstance(p, CastKernel) else p for p in params
                 if p is not None and not isinstance(p, Fp8Weight))
  out = jnp.dtype(dtypes.canonicalize_dtype(inputs, *params, dtype=dtype))
  if out in FLOAT_DTYPES:
    return out
  given = ", ".join(f"{jnp.result_type(v)}" for v in (inputs, *params))
  raise TypeError(f"the layer's dtype is None, so it would compute in {out}, the promotion of "
                  f"its inputs' and parameters' dtypes ({given}); jax_fp8 computes in float32, "
                  f"bfloat16 or float16: set the layer's dtype")


def _layer_inputs(inputs, norm, dtype):
  """The inputs as the layer passes them: in the compute dtype, or with a norm in their own
  float dtype, which the norm reads (as ``nn.LayerNorm`` reads an f32 residual stream)."""
  inputs = jnp.asarray(inputs)
  return inputs if norm is not None and inputs.dtype in FLOAT_DTYPES else inputs.astype(dtype)


def call_layer(inputs, kernels, biases, state, recipe, dtype, amax_axis_name, multi: bool,
               norm_args=(None, None, None, norms.EPSILON), key=None, split=None):
  """The layer's outputs (a tuple) in the compute dtype (``dtype``, or by Flax's rules when
  None): inputs (unless a norm reads them) and biases promoted to it, the kernels left in
  their parameter dtype (f32, bf16 or f16; ``CastKernel``s, cast once per step; or
  ``Fp8Weight``s, for inference), so f32 master weights are quantized straight from f32 (one
  rounding, no copy in ``dtype``) and get f32 gradients from the wgrad GEMMs. ``norm_args``:
  (norm, gamma, beta, epsilon) of the fused input norm, gamma and beta in their parameter
  dtype. ``key``: for NVFP4's stochastic rounding, or None. ``split``: ``linear``'s, for the
  one kernel's output."""
  dtype = _compute_dtype(inputs, (*kernels, *biases), dtype)
  biases = dtypes.promote_dtype(*biases, dtype=dtype)
  norm, gamma, beta, epsilon = norm_args
  kernels = tuple(_readable(k, dtype) for k in kernels)
  kw = dict(state=state, recipe=recipe, amax_axis_name=amax_axis_name, norm=norm,
            gamma=_readable(gamma, dtype), beta=_readable(beta, dtype), epsilon=epsilon,
            dtype=dtype, key=key)
  inputs = _layer_inputs(inputs, norm, dtype)
  if multi:
    return multi_linear(inputs, kernels, tuple(biases), **kw)
  ys = linear(inputs, kernels[0], biases[0], split=split, **kw)
  return (ys,) if split is None else ys


def call_mlp(inputs, kernels, biases, state, recipe, dtype, activation, amax_axis_name,
             norm_args, key=None):
  """An ``Mlp`` layer's output: ``mlp`` with inputs and biases (``biases``: (bias_in,
  bias_out), None without bias) promoted to the compute dtype and the kernels (kernel_in,
  kernel_out) and the norm's parameters in their parameter dtype, as in ``call_layer``."""
  dtype = _compute_dtype(inputs, (*kernels, *biases), dtype)
  biases = dtypes.promote_dtype(*biases, dtype=dtype)
  norm, gamma, beta, epsilon = norm_args
  return mlp(_layer_inputs(inputs, norm, dtype), *(_readable(k, dtype) for k in kernels),
             *biases, activation=activation, state=state, recipe=recipe,
             amax_axis_name=amax_axis_name, norm=norm, gamma=_readable(gamma, dtype),
             beta=_readable(beta, dtype), epsilon=epsilon, dtype=dtype, key=key)


def call_moe(inputs, router, w_in, w_out, dtype, **kwargs):
  """A ``MoeMlp`` layer's ``moe_mlp`` call (``kwargs``: its arguments after the kernels): the
  inputs in the compute dtype (``dtype``; None: their own), the router's and the experts'
  kernels in their parameter dtype, float64 ones (under x64) in ``dtype``. TypeError for
  inputs that are not floats, and with dtype None for float64 inputs or parameters (as
  ``call_layer``: set the layer's dtype)."""
  x = _float_inputs(inputs)
  params = [jnp.asarray(p) for p in (router, w_in, w_out)]
  if dtype is None:
    wide = [v.dtype for v in (x, *params) if v.dtype not in FLOAT_DTYPES]
    if wide:
      raise TypeError(f"the layer's dtype is None, so it would compute in {wide[0]}, its "
                      f"inputs' or parameters' dtype; jax_fp8 computes in float32, bfloat16 or "
                      f"float16: set the layer's dtype")
  else:
    dtype = _canonical_dtype(dtype)
    x = x.astype(dtype)
    params = [p if p.dtype in FLOAT_DTYPES else p.astype(dtype) for p in params]
  return moe_mlp(x, *params, **kwargs)
