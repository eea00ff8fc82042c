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
- Linen mixtures of experts (``_convert_ragged``): while the converted ``__call__`` runs,
  ``jax.lax.ragged_dot`` and ``jax.lax.ragged_dot_general`` are replaced on the ``jax.lax``
  module (restored in ``finally``; calls from other threads and outside the model run as
  before). A call made inside one of the model's modules with lhs [M, K], rhs [G, K, N]
  (``ragged_dot_general``: ragged_dot's own dimension numbers), integer group sizes [G], the
  default precision, float operands and a float output (``preferred_element_type`` None or a
  float) and nothing else (no ``group_offset`` / ``out_sharding``) runs as
  ``jax_fp8.grouped_linear(lhs, rhs, group_sizes, recipe=..., state=..., dtype=<the call's
  output dtype>)``: the rhs (the module's expert weights, or what the module made of them) as
  the kernels, so gradients reach them and lhs as ragged_dot's would. Its rings (a
  ``GroupedLinearState`` under ``DelayedScaling``, one kernel ring per expert) are the variable
  "ragged_dot_<i>" in "fp8_state" under the calling module's path, for the i-th ragged dot
  (from 0, in call order) that one call of that module makes: a module called twice reuses its
  names and rings, as a dense layer does. The selection below applies to the path
  "<module path>/ragged_dot_<i>" (a pattern naming the module matches it unless anchored with
  ``$``), the intensity is the grouped GEMM's ``M*N*K / (M*K + G*K*N + M*N)``. Left as they
  were, with the reason in the report: other forms; every call under a recipe without grouped
  GEMMs (``recipe.grouped`` False: ``MXFP8BlockScaling``, ``NVFP4BlockScaling``); under ``DelayedScaling`` a call from a method Flax makes no variables
  in (a setup-style module's ``__call__``) or from inside a JAX transform within the method
  (``jax.checkpoint``, ``jax.jit``, ``lax.scan``: the ring would be observed apart from its
  module; Flax's ``nn.remat`` / ``nn.scan`` serve; JAX has no ``vmap`` of a ragged dot to begin
  with). Not seen at all: a ``ragged_dot`` the model's code bound before the call (``from
  jax.lax import ragged_dot`` at import), which the report cannot list either.
- NNX: ``convert(model, ...)`` replaces every ``nnx.Linear``, ``nnx.LinearGeneral`` (e.g. the
  projections of ``nnx.MultiHeadAttention``) and ``nnx.Einsum`` the filter selects, in place, by
  a ``jax_fp8.nnx.Linear``, ``LinearGeneral`` or ``Einsum`` holding the same parameter
  variables (a layer shared by several attributes stays shared), and returns the model (a new
  layer if ``model`` is itself one of those). Layers made by ``nnx.vmap`` (kernels with leading
  stack axes, e.g. [L, K, N]) get stacked rings and stochastic rounding streams, one a layer,
  so ``nnx.scan`` over them trains. A second ``convert`` of a model it converted is refused
  (the first recipe would stay): convert a freshly built model instead. Its ragged dots stay
  as they are (nothing of jax_fp8 runs around an NNX model's call, docs/convert.md says why);
  ``conversion_report`` lists them with that reason.

``DenseGeneral`` / ``LinearGeneral`` and ``Einsum`` run as one GEMM (``_contraction``): the
input's trailing axes contracted into the kernel's, the output holding the input's other axes
and the kernel's (the kernel transposed where its axes lie otherwise, e.g. Gemma's
"BTD,NDH->BTNH", the output where they are not the input's then the kernel's, e.g. Gemma's
"BSD,CKDH->CBSKH"); other contractions (batch dims, a batched or summing einsum, leading axes
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

import re

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from . import convert_report as cr
from ._convert_linen import _REPORT, Converted, _check_unbound
from ._convert_nnx import (_check_nnx_unconverted, _convert_nnx, _nnx_conversion, _nnx_trace,
                           _record_nnx, nnx_contraction_plan)
from ._convert_rules import HEAD_PATTERN
from ._ffi import cuda_available
from .convert_report import NEVER_INTENSITY, ConversionReport, ConversionWarning, LayerReport
from .recipes import CROSSOVER_INTENSITY, DelayedScaling, Recipe, check_recipe

__all__ = ["HEAD_PATTERN", "NEVER_INTENSITY", "ConversionReport", "ConversionWarning",
           "Converted", "LayerReport", "conversion_report", "convert", "default_recipe",
           "nnx_contraction_plan"]


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
    linen: a new module (apply it as the original: its ``__call__``, and its other methods
    named in ``apply(..., method="decode")`` / ``init``, run converted; a method passed as a
    function is an AttributeError; variables gain "fp8_state" under ``DelayedScaling``).
    NNX: ``model`` itself, converted in place (or the replacement of a top-level
    ``nnx.Linear``, ``nnx.LinearGeneral`` or ``nnx.Einsum``).
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
    ``nnx.LinearGeneral``, ``nnx.Einsum`` and the jax_fp8 layers) and per ``jax.lax``
    ragged dot call site ("lax.ragged_dot", its expert count in ``groups``), converted or not,
    why, and each converted layer's status at the traced M (``fp8`` or ``below_intensity``).
    ``print(report)`` shows the table.
  Raises:
    TypeError for a model that ``convert`` did not return, or rngs given for NNX. The NNX
    trace patches the model's module classes' ``__call__`` while it runs (not thread-safe).
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
    rows, last, ragged = _nnx_trace(model, static, lambda values: inputs(values),
                                    [leaves[i] for i in dyn])
    called = [r for r in static if r.path in rows] + list(ragged)
    layers = sorted(called, key=lambda r: list(rows).index(r.path)) + [
        r for r in static if r.path not in rows]
    layers = tuple(cr.at_rows(r, recipe, rows.get(r.path)) for r in layers)
    return ConversionReport(recipe, layers, last)
  raise TypeError(f"model must be a model that jax_fp8.convert returned (a linen module it "
                  f"wrapped, or an NNX model it converted), got {type(model).__name__}")
