"""What ``jax_fp8.convert`` did to a model: one ``LayerReport`` per dense layer (and per
``jax.lax.ragged_dot`` call site of a mixture of experts) found, converted or not and why, and
the intensity at the shapes a trace saw; a ``ConversionReport`` holds them
(``jax_fp8.convert.conversion_report`` builds it) and prints as a table. Also the warning the
conversion gives where layers stay in higher precision for want of intensity, or where the
model's last projection runs in FP8."""

from __future__ import annotations

import dataclasses
import re
import sys
import warnings

from .layer_checks import fp8_pays, intensity
from .recipes import Recipe

# A layer's status. Converted (runs through jax_fp8):
FP8 = "fp8"                  # the recipe's GEMMs (FP8, MXFP8 or NVFP4) at the traced shapes
BELOW = "below_intensity"    # converted, in its input's dtype at the traced M (fp8_min_intensity)
CONVERTED = "converted"      # converted, not called in the trace (NNX: shapes unknown)
# Left as it was (the original layer runs, in its own dtype, with no FP8 state):
NEVER_PAYS = "never_pays"    # K and N too small: no M reaches fp8_min_intensity
EXCLUDED = "excluded"        # the path matches ``exclude`` (default: the LM head pattern)
NOT_INCLUDED = "not_included"  # the path does not match ``include``
UNALIGNED = "unaligned"      # K or N not a multiple of the recipe's dim_multiple
UNSUPPORTED = "unsupported"  # a layer type or configuration convert does not map to a GEMM
CONVERTED_STATUSES = (FP8, BELOW, CONVERTED)
# convert's default fp8_min_intensity where no GPU runs jax_fp8's kernels (CPU: FP8 is
# emulated there, never faster than the model's own dtype): no shape reaches it.
NEVER_INTENSITY = sys.float_info.max


def threshold(recipe: Recipe) -> str:
  """The recipe's ``fp8_min_intensity`` in words."""
  t = recipe.fp8_min_intensity
  return "NEVER_INTENSITY (no layer reaches it)" if t == NEVER_INTENSITY else f"{t:g}"


class ConversionWarning(UserWarning):
  """``jax_fp8.convert``'s warnings: layers left in higher precision because FP8 would not pay
  (on this device or at these shapes), or a model whose last projection was converted."""


@dataclasses.dataclass(frozen=True)
class LayerReport:
  """One dense layer of a converted model, or one ``jax.lax.ragged_dot`` call site.

  Attributes:
    path: the layer's module path, its names joined by "/" (as ``quantize_weights`` sees its
      params, less the parameter's name); a ragged dot's: its module's path and
      "ragged_dot_<i>", the i-th ragged dot that one call of the module makes (where its rings
      lie in "fp8_state").
    layer: its type, e.g. "nn.Dense", "nn.DenseGeneral", "nnx.Linear", "nnx.LinearGeneral",
      "lax.ragged_dot", "lax.ragged_dot_general".
    k, n: the GEMM's contracted and output sizes (flattened; None where unknown).
    m: the rows of its input at the traced shapes (the product of the axes not contracted;
      the smallest over its calls), None where the trace did not call it or it is unknown.
    status: one of ``FP8``, ``BELOW``, ``CONVERTED`` (converted) or ``NEVER_PAYS``,
      ``EXCLUDED``, ``NOT_INCLUDED``, ``UNALIGNED``, ``UNSUPPORTED`` (left as it was).
    detail: the reason in words ("" for FP8).
    groups: a ragged dot's expert count G (its rhs [G, K, N]); None for a dense layer.
  """

  path: str
  layer: str
  k: int | None
  n: int | None
  m: int | None
  status: str
  detail: str
  groups: int | None = None

  @property
  def converted(self) -> bool:
    """Whether the layer runs through jax_fp8 (FP8 state, FP8 where its intensity allows)."""
    return self.status in CONVERTED_STATUSES

  @property
  def intensity(self) -> float | None:
    """``M*N*K / (M*K + G*K*N + M*N)`` (G = 1 for a dense layer) at the traced M (its bound
    ``N*K / (N + K)`` where M is unknown), None without K and N."""
    if self.k is None or self.n is None:
      return None
    return intensity(self.m, self.n, self.k, self.groups or 1)


def at_rows(layer: LayerReport, recipe: Recipe, m: int | None) -> LayerReport:
  """``layer`` as a trace saw it, called with ``m`` rows (None: not called); a converted
  layer's status then says whether it ran FP8 (``fp8_pays``, the rule ``linear`` applies)."""
  if not layer.converted:
    return dataclasses.replace(layer, m=m)
  if m is None:
    return dataclasses.replace(layer, m=m, status=CONVERTED)
  groups = layer.groups or 1
  if fp8_pays(recipe, m, layer.n, layer.k, groups):
    return dataclasses.replace(layer, m=m, status=FP8, detail="")
  return dataclasses.replace(
      layer, m=m, status=BELOW,
      detail=f"{intensity(m, layer.n, layer.k, groups):.0f} < fp8_min_intensity="
             f"{threshold(recipe)} at M={m}: runs in its input's dtype")


@dataclasses.dataclass(frozen=True)
class ConversionReport:
  """What ``convert`` made of a model's dense layers (``conversion_report``'s result).

  Attributes:
    recipe: the recipe of the converted layers.
    layers: one ``LayerReport`` a layer, in the order the trace first called them (NNX: the
      model's graph order for layers it did not call).
    last: the path of the model's output projection: the last dense layer the trace called,
      where an output of the model has that layer's output shape (None otherwise, e.g. where
      the logits come from a tied embedding after it).
  ``str(report)`` is a table; ``converted``, ``fp8``, ``left`` select rows; ``select`` is the
  ``select`` argument of ``jax_fp8.quantize_weights`` that quantizes the converted dense
  layers' kernels only (a ragged dot's expert weights stay as they are).
  """

  recipe: Recipe
  layers: tuple[LayerReport, ...]
  last: str | None = None

  @property
  def converted(self) -> tuple[LayerReport, ...]:
    """The layers that run through jax_fp8."""
    return tuple(r for r in self.layers if r.converted)

  @property
  def fp8(self) -> tuple[LayerReport, ...]:
    """The layers that ran FP8 GEMMs at the traced shapes."""
    return tuple(r for r in self.layers if r.status == FP8)

  @property
  def left(self) -> tuple[LayerReport, ...]:
    """The layers left as they were (in the model's own dtype, no FP8 state)."""
    return tuple(r for r in self.layers if not r.converted)

  def __getitem__(self, path: str) -> LayerReport:
    """The report of the layer at ``path``; KeyError naming the paths otherwise."""
    for r in self.layers:
      if r.path == path:
        return r
    raise KeyError(f"no layer at {path!r}; the report has {[r.path for r in self.layers]}")

  def select(self, path: str, kernel=None) -> bool:
    """Whether ``path`` (a parameter's path, e.g. "block_0/Dense_0/kernel", as
    ``quantize_weights`` passes it) is a parameter of a converted dense layer."""
    return path.rpartition("/")[0] in {r.path for r in self.converted if r.groups is None}

  def __str__(self) -> str:
    grouped = any(r.groups is not None for r in self.layers)  # a column G for ragged dots
    head = ("path", "layer", "K", "N", "M", *("G",) * grouped, "intensity", "status")
    fmt = lambda v: "-" if v is None else str(v)  # noqa: E731
    rows = [(r.path or "(model)", r.layer, fmt(r.k), fmt(r.n), fmt(r.m),
             *(fmt(r.groups),) * grouped,
             "-" if r.intensity is None else f"{r.intensity:.0f}{'' if r.m is not None else '*'}",
             r.status + (f": {r.detail}" if r.detail else "")) for r in self.layers]
    widths = [max(len(row[i]) for row in (head, *rows)) for i in range(len(head) - 1)]
    line = lambda row: "  ".join([*(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                                    for i, (c, w) in enumerate(zip(row, widths))), row[-1]])
    recipe = repr(self.recipe).replace(repr(NEVER_INTENSITY), "NEVER_INTENSITY")
    title = (f"jax_fp8.convert, {recipe}: {len(self.converted)} of {len(self.layers)} "
             f"layers converted, {len(self.fp8)} ran {self.recipe.gemm_format} at the "
             f"traced shapes")
    notes = (f"(intensity: M*N*K / (M*K + {'G*' * grouped}K*N + M*N) at the traced M; * where M "
             f"is unknown: its bound N*K / (N + K))")
    lines = [title, line(head), *map(line, rows), notes]
    if self.last is not None and self[self.last].converted:
      lines.append(f"the last projection, {self.last!r}, is converted: FP8 recipes keep an "
                   f"output head in higher precision (exclude it)")
    return "\n".join(lines)


def warn_fallback(layers, recipe: Recipe, note: str = "", stacklevel: int = 3,
                  below: bool = True) -> None:
  """One ``ConversionWarning`` where any of ``layers`` stays in higher precision for want of
  intensity (``NEVER_PAYS``, and with ``below`` ``BELOW``): how many, why, and how to force
  FP8. ``note``: a sentence on the device (convert's default on a machine without FP8
  kernels)."""
  never = [r for r in layers if r.status == NEVER_PAYS]
  below = [r for r in layers if r.status == BELOW and below]
  if not never and not below:
    return
  total = len(layers)
  parts = []
  if never:
    why = ("this device runs no FP8" if recipe.fp8_min_intensity == NEVER_INTENSITY else
           "their K and N are too small")
    parts.append(f"{len(never)} never reach it at any batch ({why}: left unconverted, no FP8 "
                 f"state)")
  if below:
    parts.append(f"{len(below)} converted ones fall below it at these shapes (M rows), so their "
                 f"FP8 state is unused here")
  warnings.warn(
      f"jax_fp8.convert: {len(never) + len(below)} of {total} layers run in higher "
      f"precision, not FP8, under fp8_min_intensity={threshold(recipe)}: "
      f"{'; '.join(parts)}.{(' ' + note) if note else ''} To force FP8 pass a recipe with "
      f"fp8_min_intensity=0, e.g. convert(model, jax_fp8.DelayedScaling()); "
      f"jax_fp8.convert.conversion_report(model, *inputs) lists the layers.",
      ConversionWarning, stacklevel=stacklevel)


def warn_last_converted(last: LayerReport | None, stacklevel: int = 3) -> None:
  """A ``ConversionWarning`` where the last dense layer a trace called (the model's output
  projection, an LM head) was converted: FP8 recipes keep it in higher precision."""
  if last is None or not last.converted:
    return
  warnings.warn(
      f"jax_fp8.convert: the model's last projection, {last.layer} at {last.path!r} "
      f"(K={last.k}, N={last.n}), was converted to FP8; FP8 training recipes keep the output "
      f"head in higher precision. Its name does not match the exclude pattern: add it, e.g. "
      f"exclude=jax_fp8.convert.HEAD_PATTERN + r'|^{re.escape(last.path)}$' (or, where FP8 "
      f"there is meant, filter jax_fp8.convert.ConversionWarning).",
      ConversionWarning, stacklevel=stacklevel)


def warn_unaligned(layers, recipe: Recipe, stacklevel: int = 3) -> None:
  """A ``ConversionWarning`` where ``convert`` converted none of ``layers`` and left some for
  their sizes (``UNALIGNED``): the recipe's K / N rule, which a model of other widths (or
  another recipe) meets."""
  unaligned = [r for r in layers if r.status == UNALIGNED]
  if not unaligned or any(r.converted for r in layers):
    return
  warnings.warn(
      f"jax_fp8.convert: none of the {len(layers)} layers was converted; "
      f"{len(unaligned)} of them for their sizes: {recipe.dim_rule} (e.g. "
      f"{unaligned[0].path!r}: K={unaligned[0].k}, N={unaligned[0].n}). A recipe of smaller "
      f"blocks (DelayedScaling: multiples of 16) may take them; "
      f"jax_fp8.convert.conversion_report(model, *inputs) lists the layers.",
      ConversionWarning, stacklevel=stacklevel)


def warn_unsupported(layers, stacklevel: int = 3) -> None:
  """A ``ConversionWarning`` where any of ``layers`` is left as it was for its type, call or
  recipe (``UNSUPPORTED``): how many, and each distinct reason with a layer it applies to (a
  mixture's experts left in BF16 should not pass unnoticed)."""
  left = [r for r in layers if r.status == UNSUPPORTED]
  if not left:
    return
  first = {}
  for r in left:
    first.setdefault(r.detail, r)
  reasons = "; ".join(f"{r.path or '(model)'!r} ({r.layer}): {why}" for why, r in first.items())
  warnings.warn(
      f"jax_fp8.convert: {len(left)} of {len(layers)} layers stay in higher precision, left "
      f"unsupported: {reasons}. jax_fp8.convert.conversion_report(model, *inputs) lists the "
      f"layers.", ConversionWarning, stacklevel=stacklevel)
