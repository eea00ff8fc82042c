"""``jax_fp8.convert.convert``: an existing Flax model's dense layers to FP8 in one line, the
model's own code unchanged. Needs the ``flax`` extra.

- Linen: ``convert(model, ...)`` returns a module that runs ``model`` with every ``nn.Dense``,
  ``nn.DenseGeneral`` and ``nn.Einsum`` call the filter selects intercepted
  (``flax.linen.intercept_methods``) and computed by ``jax_fp8.linear`` with the layer's own
  parameters (same names, shapes, initializers and paths: the converted model's "params" are
  the original's; boxed initializers such as ``nn.with_logical_partitioning`` /
  ``nn.with_partitioning`` keep their ``LogicallyPartitioned`` / ``Partitioned``
  annotations), its rings in the "fp8_state" collection under the layer's path (none under
  the stateless recipes). Only ``__call__`` of the model is converted. ``convert`` of a
  converted model converts the original anew with the new arguments (the recipe replaced); a
  bound module (``bind``, or built inside another module's method) is refused.
- NNX: ``convert(model, ...)`` replaces every ``nnx.Linear``, ``nnx.LinearGeneral`` (e.g. the
  projections of ``nnx.MultiHeadAttention``) and ``nnx.Einsum`` the filter selects, in place, by
  a ``jax_fp8.nnx.Linear``, ``LinearGeneral`` or ``Einsum`` holding the same parameter
  variables (a layer shared by several attributes stays shared), and returns the model (a new
  layer if ``model`` is itself one of those). Layers made by ``nnx.vmap`` (kernels with leading
  stack axes, e.g. [L, K, N]) get stacked rings and stochastic rounding streams, one a layer,
  so ``nnx.scan`` over them trains. A second ``convert`` of a model it converted is refused
  (the first recipe would stay): convert a freshly built model instead.

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
``exclude`` (default ``HEAD_PATTERN``: the usual names of an output head, any case: lm_head,
head, logits, logitdense, output_layer, output_projection, unembed, classifier; FP8 recipes keep
it in higher precision), when K and N (the contracted and output sizes) are multiples of 16 (128
under ``BlockScaling``), when some M would make the layer's intensity reach the recipe's
``fp8_min_intensity`` (``layer_checks.fp8_pays`` with M unbounded: a layer that can never pay
gets no FP8 state), and, for the general layers, when they are one GEMM as above, with no
custom ``dot_general`` / ``einsum_op``. Other layers, and embeddings, run as
before. A converted layer below ``fp8_min_intensity`` at a call's M runs in its input's dtype
(``linear``'s rule).

The default recipe (``default_recipe``) runs FP8 where it pays on this machine: from the
training crossover measured on the H200 (``CROSSOVER_INTENSITY``) on a GPU that jax_fp8's
kernels serve; nowhere on a CPU (``NEVER_INTENSITY``: emulated FP8 is never faster). Where
layers stay in higher precision for want of intensity, a ``ConversionWarning`` says how many and
how to force FP8 (a recipe with ``fp8_min_intensity=0``): linen when the model is traced (the
fallback at M from ``apply``, not ``init``, whose shapes may be placeholders), NNX at
``convert``. Another warns when the last dense layer a linen trace calls (its output
projection) was converted. ``conversion_report(model, *inputs)`` lists every dense layer,
converted or not and why, with its intensity at the traced shapes; its ``select`` is the
argument of ``jax_fp8.quantize_weights`` that quantizes the converted layers' kernels (2-D:
``nn.Dense``, ``nnx.Linear``) for inference.
"""

from __future__ import annotations

import contextvars
import functools
import math
import re
import weakref

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import convert_report as cr
from . import nnx as fp8_nnx
from ._contraction import Contraction, contract, dense_general_plan, einsum_plan
from ._ffi import cuda_available
from ._layer import create_state, linen_key
from .convert_report import NEVER_INTENSITY, ConversionReport, ConversionWarning, LayerReport
from .flax import fp8_state_variable
from .inference import Fp8Weight
from .layer_checks import fp8_pays, intensity
from .recipes import CROSSOVER_INTENSITY, DelayedScaling, Recipe, check_recipe

# The usual names of a model's output head (the last path component, any case), which FP8
# recipes keep in higher precision.
HEAD_PATTERN = (r"(?i)(^|/)(lm_?head|head|logits?|logits?_?dense|output_?layer|output_?projection|"
                r"unembed(ding)?|classifier)$")

__all__ = ["HEAD_PATTERN", "NEVER_INTENSITY", "ConversionReport", "ConversionWarning",
           "Converted", "LayerReport", "conversion_report", "convert", "default_recipe"]


def convert(model, recipe: Recipe | None = None, *,
            include: str | None = None, exclude: str | None = HEAD_PATTERN,
            rngs: nnx.Rngs | None = None):
  """The model with its selected dense layers in FP8 (see the module docstring).

  Args:
    model: a ``flax.linen.Module`` (unbound) or a ``flax.nnx.Module``.
    recipe: the layers' recipe; None: ``default_recipe()`` (FP8 where it pays here).
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
    TypeError for a model that is neither, a bound linen module, a bad recipe or patterns that
    are not str / None; ValueError for a pattern that does not compile, an NNX model converted
    already, rngs missing where an NNX model's recipe draws keys, or given where it does not.
  Warns:
    ``ConversionWarning`` where layers stay in higher precision for want of intensity, or the
    last projection is converted (see the module docstring).
  """
  check_recipe(recipe, none_ok=True)
  recipe = default_recipe() if recipe is None else recipe
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
    _check_nnx_unconverted(model)
    before = {id(node) for _, node in nnx.iter_graph(model)}
    converted = _convert_nnx(model, recipe, include, exclude, rngs)
    _record_nnx(converted, before, recipe, include, exclude)
    return converted
  if isinstance(model, Converted):  # convert again: the original with the new arguments
    model = model.module
  _check_unbound(model)
  return Converted(model, recipe, include, exclude)


def default_recipe() -> DelayedScaling:
  """``convert``'s recipe where none is given: ``DelayedScaling`` with ``fp8_min_intensity``
  where FP8 pays on this machine's default backend: ``CROSSOVER_INTENSITY`` (the training
  crossover measured on the H200) where jax_fp8's CUDA kernels serve its GPUs, else
  ``NEVER_INTENSITY`` (on a CPU FP8 is emulated and never faster, so every layer keeps its own
  dtype and ``convert`` warns so)."""
  gpu = jax.default_backend() == "gpu" and cuda_available()
  return DelayedScaling(fp8_min_intensity=CROSSOVER_INTENSITY if gpu else NEVER_INTENSITY)


def _device_note(recipe) -> str:
  return ("" if recipe.fp8_min_intensity != NEVER_INTENSITY else
          f"(convert's default on {jax.default_backend()}: no GPU here runs jax_fp8's FP8 "
          f"kernels, and emulated FP8 is never faster than the model's own dtype.)")


def _status(path: str, k: int, n: int, recipe, include, exclude) -> tuple[str, str]:
  """(status, reason) of a dense layer at ``path`` whose GEMM contracts K = ``k`` into N =
  ``n``, by ``convert``'s selection rules: converted (``cr.CONVERTED``) or why not."""
  if include is not None and re.search(include, path) is None:
    return cr.NOT_INCLUDED, f"the path does not match include={include!r}"
  if exclude is not None and re.search(exclude, path) is not None:
    return cr.EXCLUDED, ("the path matches HEAD_PATTERN (an output head)" if exclude == HEAD_PATTERN
                         else f"the path matches exclude={exclude!r}")
  multiple = recipe.dim_multiple
  if k <= 0 or n <= 0 or k % multiple or n % multiple:
    return cr.UNALIGNED, recipe.dim_rule
  if not fp8_pays(recipe, None, n, k):
    return cr.NEVER_PAYS, (f"intensity below {intensity(None, n, k):.0f} at any M, "
                           f"fp8_min_intensity={cr.threshold(recipe)}")
  return cr.CONVERTED, ""


def _selects(path: str, k: int, n: int, recipe, include, exclude) -> bool:
  return _status(path, k, n, recipe, include, exclude)[0] == cr.CONVERTED


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
    if _TRACE.get() is not None:
      raise ValueError("a model that jax_fp8.convert returned runs inside another converted "
                       "model: convert the outer model once, from its original layers")
    trace = _Trace()
    token = _TRACE.set(trace)
    try:
      intercept = functools.partial(_intercept, self.recipe, self.include, self.exclude)
      with nn.intercept_methods(intercept):
        out = self.module(*args, **kwargs)
    finally:
      _TRACE.reset(token)
    layers = trace.layers(self.recipe)
    # The last dense layer is the output projection where the output has its output's shape
    # (not where, say, the logits come from a tied embedding after it).
    last = (trace.last if trace.last_shape in {jnp.shape(v) for v in jax.tree.leaves(out)}
            else None)
    sink = _REPORT.get()
    if sink is not None:
      sink.append((layers, last))
    else:  # at init the shapes may be placeholders: the fallback at M is told at apply
      cr.warn_fallback(layers, self.recipe, _device_note(self.recipe), stacklevel=4,
                       below=not self.is_initializing())
      cr.warn_last_converted(next((r for r in layers if r.path == last), None), stacklevel=4)
      cr.warn_unaligned(layers, self.recipe, stacklevel=4)
    return out


class _Trace:
  """The dense layers one call of a converted linen model met, in call order."""

  def __init__(self):
    self.seen = {}   # path -> [LayerReport with the status of convert's rules, smallest M]
    self.last = None  # the path of the last dense layer called
    self.last_shape = None  # its output's shape

  def note(self, layer: LayerReport):
    old = self.seen.get(layer.path)
    if old is not None and old.m is not None and (layer.m is None or old.m <= layer.m):
      layer = old
    self.seen[layer.path] = layer
    self.last = layer.path

  def layers(self, recipe) -> tuple[LayerReport, ...]:
    """The layers, a converted one's status at its smallest M (FP8 or below intensity)."""
    return tuple(cr.at_rows(r, recipe, r.m) for r in self.seen.values())


# The converted linen model being traced (its layers noted by the intercept), and where
# conversion_report collects them.
_TRACE = contextvars.ContextVar("jax_fp8_convert_trace", default=None)
_REPORT = contextvars.ContextVar("jax_fp8_convert_report", default=None)


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
    _note_unsupported(m, context.method_name)
    return _output(m, next_fun(*args, **kwargs))
  plan = _dense_plan(m, x)
  if plan is None or not _selects("/".join(map(str, m.scope.path)), plan[1], plan[2], recipe,
                                  include, exclude):
    _note_left(m, x, plan, recipe, include, exclude)
    return _output(m, next_fun(*args, **kwargs))
  kernel_shape, k, n, features = plan
  _note(m, k, n, math.prod(x.shape[:x.ndim - (len(kernel_shape) - len(features))]), cr.CONVERTED,
        "")

  def flat_init(init, flat_shape):  # as the layer initializes: flat, then reshaped (boxed
    def fn(key, shape, dtype):      # partitioning metadata kept, as Flax's DenseGeneral does)
      kernel = init(key, flat_shape, dtype)
      if isinstance(kernel, nn.meta.AxisMetadata):
        return nn.meta.replace_boxed(kernel, jnp.reshape(kernel.unbox(), shape))
      return jnp.reshape(kernel, shape)
    return fn
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
  return _output(m, contract(x, kernel, bias, contraction, state, recipe, m.dtype, None,
                          key=linen_key(m, recipe)))


def _output(m, y):
  """``y``, the output of module ``m``'s call; its shape kept where ``m`` is the dense layer
  the trace noted last (the candidate output projection)."""
  trace = _TRACE.get()
  if trace is not None and trace.last is not None and trace.last == _path(m):
    trace.last_shape = getattr(y, "shape", None)
  return y


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
  plan = ("called with arguments other than (inputs, einsum_str)" if call is None
          else einsum_plan(call[1], m.shape))
  if isinstance(plan, str):
    _note(m, None, None, None, cr.UNSUPPORTED, plan)
    return _output(m, next_fun(*args, **kwargs))
  x = call[0]
  status, why = _status(_path(m), plan.k, plan.n, recipe, include, exclude)
  _note(m, plan.k, plan.n, math.prod(x.shape[:x.ndim - plan.n_contract]), status, why)
  if status != cr.CONVERTED:
    return _output(m, next_fun(*args, **kwargs))
  stored = m.get_variable("params", "kernel") if m.has_variable("params", "kernel") else None
  kernel = (stored if isinstance(stored, Fp8Weight) else
            m.param("kernel", m.kernel_init, m.shape, m.param_dtype))
  bias = m.param("bias", m.bias_init, plan.features, m.param_dtype) if m.use_bias else None
  state = (fp8_state_variable(m, "linear", create_state, recipe, None)
           if recipe.stateful else None)
  return _output(m, contract(x, kernel, bias, plan, state, recipe, m.dtype, None,
                          key=linen_key(m, recipe)))


_LINEN_DENSE = (nn.Dense, nn.DenseGeneral, nn.Einsum)


def _path(m) -> str:
  return "/".join(map(str, m.scope.path))


def _note(m, k, n, rows, status, detail):
  trace = _TRACE.get()
  if trace is not None:
    trace.note(LayerReport(_path(m), f"nn.{type(m).__name__}" if type(m) in _LINEN_DENSE
                           else type(m).__name__, k, n, rows, status, detail))


def _note_unsupported(m, method_name):
  """A dense layer the intercept does not convert for its type or call (nn.Einsum, a subclass
  of nn.Dense with its own call, a call other than ``__call__`` or without one array)."""
  if isinstance(m, _LINEN_DENSE) and method_name == "__call__":
    why = ("a subclass: convert maps nn.Dense, nn.DenseGeneral and nn.Einsum"
           if type(m) not in _LINEN_DENSE else "called with arguments other than one input array")
    _note(m, None, None, None, cr.UNSUPPORTED, why)


def _note_left(m, x, plan, recipe, include, exclude):
  """A dense layer left as it was (``plan`` None: a configuration convert does not map); where
  the params hold an Fp8Weight for it (quantize_weights), a clear error instead of Flax's."""
  if plan is None:
    status, why, k, n, rows = (cr.UNSUPPORTED, "a custom dot_general, batch dims or axes other "
                               "than the input's trailing ones", None, None, None)
  else:
    kernel_shape, k, n, features = plan
    rows = math.prod(x.shape[:x.ndim - (len(kernel_shape) - len(features))])
    status, why = _status(_path(m), k, n, recipe, include, exclude)
  _note(m, k, n, rows, status, why)
  if m.has_variable("params", "kernel") and isinstance(m.get_variable("params", "kernel"),
                                                       Fp8Weight):
    raise ValueError(f"the params of the layer at /{_path(m)} hold an Fp8Weight kernel, but "
                     f"convert left this layer as it was ({status}: {why}): quantize only the "
                     f"converted layers' kernels, quantize_weights(params, recipe, select="
                     f"jax_fp8.convert.conversion_report(model, *inputs).select)")


def _check_unbound(model):
  if model.scope is not None:
    raise TypeError(f"convert takes an unbound linen module (a model definition), got a "
                    f"{type(model).__name__} bound to a scope (model.bind(...), or built inside "
                    f"another module's setup / compact method): convert the definition and "
                    f"init / apply the result (model.unbind() gives the definition and its "
                    f"variables)")


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


# NNX: the layers each convert made (a second convert of them is refused), and per converted
# model its recipe and the static part of its report (paths, sizes, statuses); by id, with a
# weak reference that tells a live object (NNX modules need not be hashable).
_CONVERTED_LAYERS = weakref.WeakValueDictionary()  # id -> layer
_NNX_CONVERSIONS = {}  # id -> (weak reference to the model, recipe, static LayerReports)


def _nnx_conversion(model):
  entry = _NNX_CONVERSIONS.get(id(model))
  return entry[1:] if entry is not None and entry[0]() is model else None


_NNX_DENSE = (nnx.Linear, nnx.LinearGeneral, nnx.Einsum)


def _check_nnx_unconverted(model):
  done = [("/".join(map(str, p)) or "(model)", node.recipe) for p, node in nnx.iter_graph(model)
          if isinstance(node, nnx.Module) and _CONVERTED_LAYERS.get(id(node)) is node]
  if done:
    raise ValueError(f"this NNX model was converted already (convert converts in place): the "
                     f"layers at {[p for p, _ in done]} run through jax_fp8 under {done[0][1]!r}; "
                     f"to use another recipe or filter, convert a freshly built model (or load "
                     f"its parameters into one)")


def _size(v, parts=math.prod) -> int | None:
  """in_features / out_features (an int, or a tuple of ints combined by ``parts``: the
  product for the axes of one kernel, the sum for several kernels) as one size, else None."""
  if isinstance(v, (int, np.integer)):
    return int(v)
  if isinstance(v, tuple) and v and all(isinstance(i, (int, np.integer)) for i in v):
    return int(parts(v))
  return None


def _einsum_layer_plan(node) -> Contraction | str:
  """An NNX einsum layer's (Flax's or jax_fp8's) contraction as one GEMM, or why not."""
  return einsum_plan(node.einsum_str, node.kernel_shape)


def _nnx_sizes(node) -> tuple[int | None, int | None]:
  """K and N of a dense NNX layer's GEMM, None where they are unknown."""
  if isinstance(node, (nnx.Einsum, fp8_nnx.Einsum)):
    plan = _einsum_layer_plan(node)
    return (None, None) if isinstance(plan, str) else (plan.k, plan.n)
  return (_size(getattr(node, "in_features", None)),
          _size(getattr(node, "out_features", None),
                sum if isinstance(node, fp8_nnx.MultiLinear) else math.prod))


def _nnx_layer(path, node, new, recipe, include, exclude) -> LayerReport | None:
  """The static report of a graph node that is a dense layer (None otherwise): converted by
  this convert (``new``), a jax_fp8 layer built by hand, or left as it was and why."""
  k, n = _nnx_sizes(node)
  ours = type(node).__module__ == fp8_nnx.__name__
  name = f"{'jax_fp8.nnx.' if ours else ''}{type(node).__name__}"
  if new:
    return LayerReport(path, name, k, n, None, cr.CONVERTED, "")
  if ours and hasattr(node, "recipe"):
    return LayerReport(path, name, k, n, None, cr.CONVERTED, "built as a jax_fp8 layer")
  if not isinstance(node, _NNX_DENSE):
    return None
  if type(node) not in _NNX_DENSE:
    return LayerReport(path, type(node).__name__, k, n, None, cr.UNSUPPORTED,
                       "a subclass: convert maps nnx.Linear, nnx.LinearGeneral and nnx.Einsum")
  name = f"nnx.{type(node).__name__}"
  if type(node) is nnx.Linear and node.dot_general is not jax.lax.dot_general:
    return LayerReport(path, name, k, n, None, cr.UNSUPPORTED, "a custom dot_general")
  plan = None if type(node) is nnx.Linear else nnx_contraction_plan(node)
  if isinstance(plan, str):
    return LayerReport(path, name, k, n, None, cr.UNSUPPORTED, plan)
  return LayerReport(path, name, k, n, None, *_status(path, k, n, recipe, include, exclude))


def _record_nnx(model, before, recipe, include, exclude):
  """Remember what convert made of an NNX model (for ``conversion_report`` and a second
  convert) and warn where layers stay in higher precision for want of intensity."""
  layers = []
  for p, node in nnx.iter_graph(model):
    new = id(node) not in before and isinstance(node, nnx.Module) and hasattr(node, "recipe")
    if new:
      _CONVERTED_LAYERS[id(node)] = node
    row = _nnx_layer("/".join(map(str, p)), node, new, recipe, include, exclude)
    if row is not None:
      layers.append(row)
  for key in [key for key, entry in _NNX_CONVERSIONS.items() if entry[0]() is None]:
    del _NNX_CONVERSIONS[key]
  _NNX_CONVERSIONS[id(model)] = (weakref.ref(model), recipe, tuple(layers))
  cr.warn_fallback(layers, recipe, _device_note(recipe), stacklevel=4)
  cr.warn_unaligned(layers, recipe, stacklevel=4)


def conversion_report(model, *args, rngs=None, **kwargs) -> ConversionReport:
  """What ``convert`` made of ``model``'s dense layers, traced (``jax.eval_shape``: no compute)
  at the shapes of ``model(*args, **kwargs)``.

  Args:
    model: what ``convert`` returned (a linen module, or the converted NNX model).
    *args, **kwargs: the model's inputs (arrays or ``jax.ShapeDtypeStruct``s; other values are
      passed as they are), as to ``apply`` / the NNX call.
    rngs: linen only, ``init``'s rngs (default ``jax.random.key(0)``; a dict to name streams
      such as "dropout").
  Returns:
    a ``ConversionReport``: one ``LayerReport`` per dense layer (linen: ``nn.Dense``,
    ``nn.DenseGeneral``, ``nn.Einsum`` and subclasses; NNX: ``nnx.Linear``,
    ``nnx.LinearGeneral``, ``nnx.Einsum`` and the jax_fp8 layers), converted or not, why, and
    each converted layer's status at the traced M (``fp8`` or ``below_intensity``).
    ``print(report)`` shows the table.
  Raises:
    TypeError for a model that ``convert`` did not return, or rngs given for NNX. The NNX
    trace patches the dense layer classes' ``__call__`` while it runs (not thread-safe).
  """
  leaves, tree = jax.tree.flatten((args, kwargs))
  dyn = [i for i, v in enumerate(leaves)
         if isinstance(v, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))]

  def inputs(values):
    full = list(leaves)
    for i, v in zip(dyn, values):
      full[i] = v
    return jax.tree.unflatten(tree, full)

  if isinstance(model, Converted):
    sink = []
    key = jax.random.key(0) if rngs is None else rngs

    def init(*values):
      a, kw = inputs(values)
      return model.init(key, *a, **kw)
    token = _REPORT.set(sink)
    try:
      jax.eval_shape(init, *[leaves[i] for i in dyn])
    finally:
      _REPORT.reset(token)
    layers, last = sink[0]
    return ConversionReport(model.recipe, layers, last)
  if isinstance(model, nnx.Module) and _nnx_conversion(model) is not None:
    if rngs is not None:
      raise TypeError("rngs serves linen models' init; an NNX model holds its own: pass none")
    recipe, static = _nnx_conversion(model)
    rows, last = _nnx_trace(model, static, lambda values: inputs(values),
                            [leaves[i] for i in dyn])
    called = [r for r in static if r.path in rows]
    layers = sorted(called, key=lambda r: list(rows).index(r.path)) + [
        r for r in static if r.path not in rows]
    layers = tuple(cr.at_rows(r, recipe, rows.get(r.path)) for r in layers)
    return ConversionReport(recipe, layers, last)
  raise TypeError(f"model must be a model that jax_fp8.convert returned (a linen module it "
                  f"wrapped, or an NNX model it converted), got {type(model).__name__}")


def _rows(node, x) -> int | None:
  """The rows M of a dense NNX layer's input ``x``: the axes before the contracted ones."""
  shape = getattr(x, "shape", None)
  k = getattr(node, "in_features", None)
  contracted = len(k) if isinstance(k, tuple) else 1 if k is not None else None
  if isinstance(node, (nnx.Einsum, fp8_nnx.Einsum)):
    plan = _einsum_layer_plan(node)
    contracted = None if isinstance(plan, str) else plan.n_contract
  if shape is None or contracted is None or len(shape) < contracted:
    return None
  return math.prod(shape[:len(shape) - contracted])


def _nnx_trace(model, static, inputs, values):
  """(path -> the smallest M each dense layer of ``static`` was called with, in first-call
  order; the path of the last one called) for one abstract call of the NNX ``model``."""
  graphdef, state = nnx.split(model)
  wanted = {r.path for r in static}
  rows, last, last_shape = {}, [None], [None]
  classes = {type(node) for p, node in nnx.iter_graph(model) if "/".join(map(str, p)) in wanted}
  paths = {}

  def recording(call):
    @functools.wraps(call)
    def wrapper(self, *a, **kw):
      path = paths.get(id(self))
      if path is not None and a:
        m = _rows(self, a[0])
        old = rows.get(path)
        rows[path] = m if old is None or (m is not None and m < old) else old
        last[0] = path
      out = call(self, *a, **kw)
      if path is not None:
        last_shape[0] = jnp.shape(out)
      return out
    return wrapper

  def run(state, *values):
    copy = nnx.merge(graphdef, state)
    paths.update({id(node): "/".join(map(str, p)) for p, node in nnx.iter_graph(copy)
                  if "/".join(map(str, p)) in wanted})
    a, kw = inputs(values)
    return copy(*a, **kw)

  saved = {cls: cls.__dict__.get("__call__") for cls in classes}
  try:
    for cls in classes:
      cls.__call__ = recording(cls.__call__)
    out = jax.eval_shape(run, state, *values)
  finally:
    for cls, call in saved.items():
      if call is None:
        del cls.__call__
      else:
        cls.__call__ = call
  output = last[0] if last_shape[0] in {v.shape for v in jax.tree.leaves(out)} else None
  return rows, output
