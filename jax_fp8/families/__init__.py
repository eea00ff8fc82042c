"""The families of rules behind ``linear``, ``multi_linear`` and ``mlp``: one module per family
of recipes (``Recipe.family`` names it), each holding its ``custom_vjp`` rules and what it
quantizes x, the kernel and the gradient with.

Every family module has ``linear(x2, norm_params, kernels, casts, biases, rings, recipe,
axis_name, dtypes, norm, words, split)``, the FP8 path of x2 [M, K] against one or several
kernels. Families whose recipes fuse the norm and the MLP's activation (``Recipe.fuses``) also
have ``mlp``; those that serve ``cast_kernel`` and ``Fp8Weight`` (``Recipe.casts_kernel``) have
``cast``, ``cast_fields``, ``quantize_weight``, ``weight_scale_shape`` and ``weight_input``.
The families of recipes that ``grouped_linear`` and ``grouped_mlp`` serve (``Recipe.grouped``)
have a module of grouped rules, ``grouped_family(recipe)``, with ``grouped_linear(x, kernels,
bias, group_sizes, rings, recipe, axis_name, dtypes, aligned)`` and ``grouped_mlp(x, kernel_in,
kernel_out, bias_in, bias_out, group_sizes, rings, recipe, activation, axis_name, dtypes,
aligned)``.
"""

from __future__ import annotations

from ..recipes import Recipe
from . import block, block_grouped, mxfp8, nvfp4, per_tensor, per_tensor_grouped

_FAMILIES = {"per_tensor": per_tensor, "block": block, "mxfp8": mxfp8, "nvfp4": nvfp4}
_GROUPED = {"per_tensor": per_tensor_grouped, "block": block_grouped}


def family(recipe: Recipe):
  """The family module that serves ``recipe``."""
  return _FAMILIES[recipe.family]


def grouped_family(recipe: Recipe):
  """The module of grouped rules that serves ``recipe`` (one with ``recipe.grouped``)."""
  return _GROUPED[recipe.family]
