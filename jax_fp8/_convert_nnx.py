"""``convert`` for NNX models: the selected ``nnx.Linear`` / ``nnx.LinearGeneral`` /
``nnx.Einsum`` nodes swapped in place for ``jax_fp8.nnx`` layers holding the same parameter
variables (stacked where ``nnx.vmap`` made them), and the bookkeeping behind
``conversion_report`` and the refusal of a second ``convert``: each converted model's recipe
and static ``LayerReport``s, and the abstract call that adds each layer's M. See
``jax_fp8.convert``'s docstring for the contract."""

from __future__ import annotations

import functools
import math
import weakref

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from . import convert_report as cr
from . import nnx as fp8_nnx
from ._contraction import Contraction, dense_general_plan, einsum_plan
from ._convert_ragged import RaggedCalls, intercepted
from ._convert_rules import _device_note, _selects, _status
from .convert_report import LayerReport

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
  ours = type(node).__module__.startswith("jax_fp8.")  # a jax_fp8 NNX layer
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
  convert) and warn where layers stay in higher precision: for want of intensity, for their
  sizes or unsupported."""
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
  cr.warn_unsupported(layers, stacklevel=4)


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


# Why convert leaves an NNX model's ragged dots as they are (docs/convert.md says more).
NNX_RAGGED = ("NNX: convert swaps layers in place and runs nothing around the model's call, so "
              "no function the model calls is intercepted (docs/convert.md): call "
              "jax_fp8.grouped_linear there, or use jax_fp8.nnx.MoeMlp")


def _nnx_trace(model, static, inputs, values):
  """(path -> the smallest M each dense layer of ``static`` and each ragged dot call site was
  called with, in first-call order; the path of the last dense layer called; the ragged dots'
  ``LayerReport``s, each left as it was with ``NNX_RAGGED``) for one abstract call of the NNX
  ``model``. The model's module classes' ``__call__`` are wrapped while it runs, to tell the
  dense layers' M and the module that makes each ragged dot."""
  graphdef, state = nnx.split(model)
  wanted = {r.path for r in static}
  rows, last, last_shape, ragged = {}, [None], [None], {}
  classes = {type(node) for _, node in nnx.iter_graph(model) if isinstance(node, nnx.Module)
             and any("__call__" in vars(c) for c in type(node).__mro__)}
  paths = {}

  def called(path, m):
    old = rows.get(path)
    rows[path] = m if old is None or (m is not None and m < old) else old

  def note(row):  # a ragged dot call
    ragged.setdefault(row.path, row)
    called(row.path, row.m)
  calls = RaggedCalls(None, None, None, note, leave=NNX_RAGGED)

  def recording(call):
    @functools.wraps(call)
    def wrapper(self, *a, **kw):
      path = paths.get(id(self))
      if path is None:
        return call(self, *a, **kw)
      name = "/".join(map(str, path))
      if name in wanted and a:
        called(name, _rows(self, a[0]))
        last[0] = name
      out = calls.within(path, None, call, self, *a, **kw)
      if name in wanted:
        last_shape[0] = jnp.shape(out)
      return out
    return wrapper

  def run(state, *values):
    copy = nnx.merge(graphdef, state)
    paths.update({id(node): p for p, node in nnx.iter_graph(copy) if isinstance(node, nnx.Module)})
    a, kw = inputs(values)
    return copy(*a, **kw)

  saved = {cls: cls.__dict__.get("__call__") for cls in classes}
  try:
    for cls in classes:
      cls.__call__ = recording(cls.__call__)
    with intercepted(calls):
      out = jax.eval_shape(run, state, *values)
  finally:
    for cls, call in saved.items():
      if call is None:
        del cls.__call__
      else:
        cls.__call__ = call
  output = last[0] if last_shape[0] in {v.shape for v in jax.tree.leaves(out)} else None
  return rows, output, tuple(ragged.values())
