"""``convert`` for linen models: ``Converted``, the module that runs a model with its dense
calls intercepted (``nn.intercept_methods``) and its ``jax.lax.ragged_dot`` calls too
(``_convert_ragged``), the intercepts that run the selected ``nn.Dense`` / ``nn.DenseGeneral`` /
``nn.Einsum`` calls through ``_contraction.contract`` with the layer's own parameters, and the
trace that notes every dense call and ragged dot as a ``LayerReport`` (for the warnings and
``conversion_report``). See ``jax_fp8.convert``'s docstring for the contract."""

from __future__ import annotations

import contextvars
import functools
import math
import types

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import convert_report as cr
from ._contraction import Contraction, contract, dense_general_plan, einsum_plan
from ._convert_ragged import RaggedCalls, intercepted
from ._convert_rules import _device_note, _selects, _status
from ._layer import create_state, linen_key
from .convert_report import LayerReport
from .flax import fp8_state_variable
from .inference import Fp8Weight
from .recipes import Recipe

class Converted(nn.Module):
  """A linen model run with its selected dense layers and ragged dots through jax_fp8
  (``convert``). It shares the model's scope, so the variables keep the model's paths. Its
  ``__call__`` runs the model's; the model's other methods run converted by name
  (``apply(variables, x, method="decode")``, ``init`` alike)."""

  module: nn.Module
  recipe: Recipe
  include: str | None
  exclude: str | None

  def setup(self):
    nn.share_scope(self, self.module)

  def __call__(self, *args, **kwargs):
    return self.call_method("__call__", *args, **kwargs)

  @nn.nowrap
  def __getattr__(self, name: str):
    """The model's public method ``name`` run converted (what ``apply(..., method=name)`` looks
    up). AttributeError for any other name: saying, for a public one, that methods are passed
    by name (a method passed as a function runs on this wrapper and looks its attributes up
    here)."""
    try:
      return super().__getattr__(name)
    except AttributeError as e:
      if name.startswith("_"):
        raise
      cls = type(self.__dict__.get("module"))
      if not callable(getattr(cls, name, None)):
        raise AttributeError(
            f"{e} jax_fp8.convert: {cls.__name__} has no method {name!r}; pass the model's "
            f'methods by name, apply(variables, x, method="decode"), not as functions '
            f"({cls.__name__}.decode would run on the converted wrapper)") from None
    return types.MethodType(lambda converted, *a, **k: converted.call_method(name, *a, **k), self)

  def call_method(self, name: str, *args, **kwargs):
    """The model's method ``name`` (e.g. "__call__", "decode") on ``args`` and ``kwargs``
    with the selected dense layers and ragged dots through jax_fp8, then the warnings (or,
    under ``conversion_report``, the report's layers)."""
    if _TRACE.get() is not None:
      raise ValueError("a model that jax_fp8.convert returned runs inside another converted "
                       "model: convert the outer model once, from its original layers")
    trace = _Trace()
    token = _TRACE.set(trace)
    try:
      intercept = functools.partial(_intercept, self.recipe, self.include, self.exclude)
      calls = RaggedCalls(self.recipe, self.include, self.exclude,
                          functools.partial(trace.note, dense=False))
      with (nn.intercept_methods(calls.intercept), nn.intercept_methods(intercept),
            intercepted(calls)):
        out = getattr(self.module, name)(*args, **kwargs)
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
      cr.warn_unsupported(layers, stacklevel=4)
    return out


class _Trace:
  """The dense layers and ragged dots one call of a converted linen model met, in call order."""

  def __init__(self):
    self.seen = {}   # path -> [LayerReport with the status of convert's rules, smallest M]
    self.last = None  # the path of the last dense layer called
    self.last_shape = None  # its output's shape

  def note(self, layer: LayerReport, dense: bool = True):
    """Note a call of ``layer`` (``dense`` False: a ragged dot, never the output projection)."""
    old = self.seen.get(layer.path)
    if old is not None and old.m is not None and (layer.m is None or old.m <= layer.m):
      layer = old
    self.seen[layer.path] = layer
    if dense:
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
