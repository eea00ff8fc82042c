"""``convert``'s selection rules, shared by its linen (``_convert_linen``) and NNX
(``_convert_nnx``) halves: ``HEAD_PATTERN``, a dense layer's status by its path and GEMM sizes
(``_status``), and the note a fallback warning adds under the CPU default recipe."""

from __future__ import annotations

import re

import jax

from . import convert_report as cr
from .convert_report import NEVER_INTENSITY
from .layer_checks import fp8_pays, intensity

# The usual names of a model's output head (the last path component, any case), which FP8
# recipes keep in higher precision.
HEAD_PATTERN = (r"(?i)(^|/)(lm_?head|head|logits?|logits?_?dense|output_?layer|output_?projection|"
                r"unembed(ding)?|classifier)$")


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
