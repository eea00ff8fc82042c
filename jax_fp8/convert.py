"""``jax_fp8.convert.convert``: an existing Flax model's dense layers to FP8 in one line, the
model's own code unchanged. Needs the ``flax`` extra.

- Linen: ``convert(model, ...)`` returns a module that runs ``model`` with every ``nn.Dense``,
  ``nn.DenseGeneral`` and ``nn.Einsum`` call the filter selects intercepted
  (``flax.linen.intercept_methods``) and computed by ``jax_fp8.linear`` with the layer's own
  parameters (same names, shapes, initializers and paths: the converted model's "params" are
  the original's), its rings in the "fp8_state" collection under the layer's path (none under
  the stateless recipes). Only ``__call__`` of the model is converted.
- NNX: ``convert(model, ...)`` replaces every ``nnx.Linear``, ``nnx.LinearGeneral`` (e.g. the
  projections of ``nnx.MultiHeadAttention``) and ``nnx.Einsum`` the filter selects, in place, by
  a ``jax_fp8.nnx.Linear``, ``LinearGeneral`` or ``Einsum`` holding the same parameter
  variables (a layer shared by several attributes stays shared), and returns the model (a new
  layer if ``model`` is itself one of those). Layers made by ``nnx.vmap`` (kernels with leading
  stack axes, e.g. [L, K, N]) get stacked rings and stochastic rounding streams, one a layer,
  so ``nnx.scan`` over them trains.

``DenseGeneral`` / ``LinearGeneral`` and ``Einsum`` run as one GEMM (``_contraction``): the
input's trailing axes contracted into the kernel's, the output the input's other axes followed by
the kernel's (the kernel transposed where its axes lie otherwise, e.g. Gemma's
"BTD,NDH->BTNH"); other contractions (batch dims, a batched or summing einsum, leading axes
contracted, an ``nnx.LinearGeneral`` axis given as a non-negative index) stay as they are
(``nnx_contraction_plan`` gives an NNX layer's reason).

Linen under ``nn.scan`` / ``nn.vmap``: the FP8 rings are a variable collection like the
parameters, so the transform needs ``"fp8_state"`` in ``variable_axes`` (as ``"params"``), and
under ``NVFP4BlockScaling`` ``"stochastic_rounding"`` in ``split_rngs`` (one key a layer).

Selection: a layer is converted when its path (its module names joined by "/", e.g.
"layers_0/mlp/up") matches ``include`` (``re.search``; None: every path) and does not match
``exclude`` (default ``HEAD_PATTERN``: the usual names of an LM head, which FP8 recipes keep in
higher precision), when K and N (the contracted and output sizes) are multiples of 16 (128
under ``BlockScaling``), and, for the general layers, when they are one GEMM as above, with no
custom ``dot_general`` / ``einsum_op``. Other layers, and embeddings, run as
before. The default recipe sets ``fp8_min_intensity`` to ``CROSSOVER_INTENSITY`` (measured on
the H200 for training), so at call time layers too small for FP8 to pay run in their input's
dtype: a small model converted with the default recipe may run no FP8 GEMM at all (pass a
recipe with ``fp8_min_intensity=0`` to force FP8). ``jax_fp8.quantize_weights`` applies to a
converted model's parameters for inference (2-D kernels: ``nn.Dense``, ``nnx.Linear``).
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from . import nnx as fp8_nnx
from ._contraction import Contraction, contract, dense_general_plan, einsum_plan
from ._layer import create_state, linen_key
from .flax import fp8_state_variable
from .inference import Fp8Weight
from .recipes import CROSSOVER_INTENSITY, DelayedScaling, Recipe, check_recipe

HEAD_PATTERN = r"(^|/)(lm_head|head|logits|unembed|unembedding|output_projection)$"


def convert(model, recipe: Recipe | None = None, *,
            include: str | None = None, exclude: str | None = HEAD_PATTERN,
            rngs: nnx.Rngs | None = None):
  """The model with its selected dense layers in FP8 (see the module docstring).

  Args:
    model: a ``flax.linen.Module`` (unbound) or a ``flax.nnx.Module``.
    recipe: the layers' recipe; None: ``DelayedScaling(fp8_min_intensity=CROSSOVER_INTENSITY)``.
    include, exclude: regular expressions over a layer's path, or None.
    rngs: NNX under a recipe with stochastic rounding (``NVFP4BlockScaling``): the
      ``nnx.Rngs`` whose "stochastic_rounding" stream (or default stream) the converted
      layers draw their keys from; None otherwise. (A converted linen model draws from the
      "stochastic_rounding" stream given to ``apply``.)
  Returns:
    linen: a new module (apply it as the original, ``__call__`` only; variables gain
    "fp8_state" under ``DelayedScaling``). NNX: ``model`` itself, converted in place (or the
    replacement of a top-level ``nnx.Linear``, ``nnx.LinearGeneral`` or ``nnx.Einsum``).
  Raises:
    TypeError for a model that is neither, a bad recipe or patterns that are not str / None;
    ValueError for a pattern that does not compile, rngs missing where an NNX model's recipe
    draws keys, or given where it does not.
  """
  check_recipe(recipe, none_ok=True)
  recipe = DelayedScaling(fp8_min_intensity=CROSSOVER_INTENSITY) if recipe is None else recipe
  for name, pattern in (("include", include), ("exclude", exclude)):
    if pattern is not None and not isinstance(pattern, str):
      raise TypeError(f"{name} must be a regular expression (str) or None, got {pattern!r}")
    try:
      re.compile(pattern or "")
    except re.error as e:
      raise ValueError(f"{name} is not a valid regular expression: {pattern!r} ({e})") from None
  if not isinstance(model, (nn.Module, nnx.Module)):
    raise TypeError(f"model must be a flax.linen.Module or a flax.nnx.Module, got "
                    f"{type(model).__name__}")
  if isinstance(model, nnx.Module) and recipe.draws_key != (rngs is not None):
    raise ValueError(f"rngs: an NNX model converted under {type(recipe).__name__}"
                     f"{' with stochastic rounding needs an nnx.Rngs for its keys' if rngs is None else ' draws no keys: pass rngs=None'}")
  if not isinstance(model, nnx.Module) and rngs is not None:
    raise ValueError("rngs serves NNX models: a linen model draws its keys from the "
                     "'stochastic_rounding' stream given to apply; pass rngs=None")
  if rngs is not None and not isinstance(rngs, nnx.Rngs):
    raise TypeError(f"rngs must be a flax.nnx.Rngs or None, got {type(rngs).__name__}")
  if isinstance(model, nnx.Module):
    return _convert_nnx(model, recipe, include, exclude, rngs)
  return Converted(model, recipe, include, exclude)


def _selects(path: str, k: int, n: int, recipe, include, exclude) -> bool:
  multiple = recipe.dim_multiple
  return (k % multiple == 0 and n % multiple == 0 and k > 0 and n > 0
          and (include is None or re.search(include, path) is not None)
          and (exclude is None or re.search(exclude, path) is None))


class Converted(nn.Module):
  """A linen model run with its selected dense layers through jax_fp8 (``convert``). It shares
  the model's scope, so the variables keep the model's paths."""

  module: nn.Module
  recipe: Recipe
  include: str | None
  exclude: str | None

  def setup(self):
    nn.share_scope(self, self.module)

  def __call__(self, *args, **kwargs):
    intercept = functools.partial(_intercept, self.recipe, self.include, self.exclude)
    with nn.intercept_methods(intercept):
      return self.module(*args, **kwargs)


def _dense_plan(m, x):
  """(kernel shape, flat K, flat N, features) of a dense call jax_fp8 can run, else None."""
  if isinstance(m, nn.Dense):  # exact type checked by the caller
    if m.dot_general is not None or m.dot_general_cls is not None:
      return None
    return (x.shape[-1], m.features), x.shape[-1], m.features, (m.features,)
  plan = dense_general_plan(m.axis, x.shape, m.features, m.batch_dims)
  if isinstance(plan, str) or m.dot_general is not None or m.dot_general_cls is not None:
    return None
  return plan.contracted + plan.features, plan.k, plan.n, plan.features


def _intercept(recipe, include, exclude, next_fun, args, kwargs, context):
  m = context.module
  if context.method_name == "__call__" and type(m) is nn.Einsum:
    return _intercept_einsum(recipe, include, exclude, next_fun, args, kwargs, m)
  # The layer's one argument, ``inputs``, given by position or by name.
  x = args[0] if len(args) == 1 and not kwargs else (
      kwargs["inputs"] if not args and set(kwargs) == {"inputs"} else None)
  if (context.method_name != "__call__" or type(m) not in (nn.Dense, nn.DenseGeneral)
      or x is None or jnp.ndim(x) < 1):
    return next_fun(*args, **kwargs)
  plan = _dense_plan(m, x)
  if plan is None or not _selects("/".join(map(str, m.scope.path)), plan[1], plan[2], recipe,
                                  include, exclude):
    return next_fun(*args, **kwargs)
  kernel_shape, k, n, features = plan

  def flat_init(init, flat_shape):  # as the layer initializes: flat, then reshaped
    return lambda key, shape, dtype: jnp.reshape(init(key, flat_shape, dtype), shape)
  stored = m.get_variable("params", "kernel") if m.has_variable("params", "kernel") else None
  kernel = (stored if isinstance(stored, Fp8Weight) else  # quantize_weights: inference
            m.param("kernel", flat_init(m.kernel_init, (k, n)), kernel_shape,
                    m.param_dtype).reshape(k, n))
  bias = (m.param("bias", flat_init(m.bias_init, (n,)), features, m.param_dtype)
          if m.use_bias else None)
  state = (fp8_state_variable(m, "linear", create_state, recipe, None)
           if recipe.stateful else None)
  n_contract = len(kernel_shape) - len(features)
  contraction = Contraction(n_contract, tuple(x.shape[x.ndim - n_contract:]), None, features, k, n)
  return contract(x, kernel, bias, contraction, state, recipe, m.dtype, None,
                  key=linen_key(m, recipe))


def _einsum_call(m, args, kwargs):
  """(inputs, einsum_str) of a linen ``nn.Einsum`` call (the call's einsum_str, else the
  module's), or None where the call is not ``(inputs, einsum_str=None)``."""
  names = ("inputs", "einsum_str")
  if len(args) > 2 or set(kwargs) - set(names[len(args):]):
    return None
  given = dict(zip(names, args), **kwargs)
  spec = given.get("einsum_str") or m.einsum_str
  x = given.get("inputs")
  return None if x is None or spec is None or jnp.ndim(x) < 1 else (x, spec)


def _intercept_einsum(recipe, include, exclude, next_fun, args, kwargs, m):
  """A linen ``nn.Einsum`` call through jax_fp8 where its einsum is one GEMM
  (``_contraction.einsum_plan``) and the filter selects it: parameters "kernel" (``shape``)
  and "bias" (the output features), as the layer's own."""
  call = _einsum_call(m, args, kwargs)
  plan = None if call is None else einsum_plan(call[1], m.shape)
  if (plan is None or isinstance(plan, str)
      or not _selects("/".join(map(str, m.scope.path)), plan.k, plan.n, recipe, include,
                      exclude)):
    return next_fun(*args, **kwargs)
  stored = m.get_variable("params", "kernel") if m.has_variable("params", "kernel") else None
  kernel = (stored if isinstance(stored, Fp8Weight) else
            m.param("kernel", m.kernel_init, m.shape, m.param_dtype))
  bias = m.param("bias", m.bias_init, plan.features, m.param_dtype) if m.use_bias else None
  state = (fp8_state_variable(m, "linear", create_state, recipe, None)
           if recipe.stateful else None)
  return contract(call[0], kernel, bias, plan, state, recipe, m.dtype, None,
                  key=linen_key(m, recipe))


def _convert_nnx(model, recipe, include, exclude, rngs):
  new = {}  # id of a converted nnx.Linear -> its replacement (a module shared stays shared)

  def replacement(path, node):
    if type(node) in (nnx.LinearGeneral, nnx.Einsum):
      if id(node) not in new:
        layer = _nnx_contraction(path, node, recipe, include, exclude, rngs)
        if layer is None:
          return None
        new[id(node)] = layer
      return new[id(node)]
    if type(node) is not nnx.Linear or node.dot_general is not jax.lax.dot_general:
      return None
    if id(node) not in new:
      if not _selects("/".join(map(str, path)), node.in_features, node.out_features, recipe,
                      include, exclude):
        return None
      layer = fp8_nnx.Linear(node.in_features, node.out_features,
                             use_bias=node.bias is not None, dtype=node.dtype,
                             param_dtype=node.param_dtype,
                             kernel_init=nnx.initializers.zeros_init(), recipe=recipe,
                             rngs=nnx.Rngs(0))  # its own parameters are replaced below
      layer.kernel, layer.bias = node.kernel, node.bias  # the same variables
      layer.rngs = fp8_nnx.sr_stream(recipe, rngs)
      new[id(node)] = _stacked(layer, jnp.shape(node.kernel.get_value())[:-2])
    return new[id(node)]

  top = replacement((), model)
  if top is not None:
    return top
  graph = list(nnx.iter_graph(model))
  for path, node in graph:  # each layer chosen once, by its first path
    if path:
      replacement(path, node)
  # Replace every reference (iter_graph visits a shared layer once): attributes of modules,
  # items of NNX lists and dicts.
  for _, node in graph:
    if isinstance(node, (nnx.List, nnx.Dict)):
      for key in (range(len(node)) if isinstance(node, nnx.List) else list(node.keys())):
        if id(node[key]) in new:
          node[key] = new[id(node[key])]
    elif isinstance(node, nnx.Module):
      for key, value in list(vars(node).items()):
        if id(value) in new:
          setattr(node, key, new[id(value)])
  return model


def nnx_contraction_plan(node):
  """An ``nnx.LinearGeneral`` / ``nnx.Einsum``'s contraction as one GEMM (a ``Contraction``,
  per layer where the layer is stacked), or the reason (a str) ``convert`` leaves it."""
  if isinstance(node, nnx.Einsum):
    if node.einsum_op is not jnp.einsum:
      return "it has its own einsum_op"
    return einsum_plan(node.einsum_str, node.kernel_shape)
  if node.dot_general is not None or node.dot_general_cls is not None:
    return "it has its own dot_general"
  if any(a >= 0 for a in node.axis):
    return (f"axis {node.axis} is not negative: which input axes it names depends on the "
            f"input's rank")
  return dense_general_plan(node.axis, node.in_features, node.out_features, node.batch_axis)


def _nnx_contraction(path, node, recipe, include, exclude, rngs):
  """The ``jax_fp8.nnx.LinearGeneral`` / ``Einsum`` replacing ``node`` (holding its parameter
  variables, stacked as they are), or None where it does not map or the filter leaves it."""
  plan = nnx_contraction_plan(node)
  if isinstance(plan, str) or not _selects("/".join(map(str, path)), plan.k, plan.n, recipe,
                                           include, exclude):
    return None
  kw = dict(dtype=node.dtype, param_dtype=node.param_dtype, recipe=recipe,
            kernel_init=nnx.initializers.zeros_init(), rngs=nnx.Rngs(0))
  if isinstance(node, nnx.Einsum):
    layer = fp8_nnx.Einsum(node.einsum_str, node.kernel_shape, node.bias_shape, **kw)
    per_layer = len(node.kernel_shape)
  else:
    layer = fp8_nnx.LinearGeneral(node.in_features, node.out_features, axis=node.axis,
                                  use_bias=node.bias is not None, **kw)
    per_layer = len(node.in_features) + len(node.out_features)
  layer.kernel, layer.bias = node.kernel, node.bias  # the same variables
  layer.rngs = fp8_nnx.sr_stream(recipe, rngs)
  kernel_shape = jnp.shape(node.kernel.get_value())
  return _stacked(layer, kernel_shape[:len(kernel_shape) - per_layer])


def _stacked(layer, lead: tuple[int, ...]):
  """``layer`` with its rings and stochastic rounding stream stacked on the leading axes
  ``lead`` of its parameters (layers made by ``nnx.vmap``, applied by ``nnx.scan``): one ring
  and one stream a layer, the streams split from the layer's as ``nnx.split_rngs`` splits."""
  if not lead:
    return layer
  if layer.fp8_state is not None:
    layer.fp8_state.set_value(jax.tree.map(lambda a: jnp.broadcast_to(a, (*lead, *jnp.shape(a))),
                                           layer.fp8_state.get_value()))
  if layer.rngs is not None:
    layer.rngs = nnx.RngStream(jax.random.split(layer.rngs(), lead), tag=layer.rngs.tag)
  return layer
