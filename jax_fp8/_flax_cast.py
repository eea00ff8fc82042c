"""``jax_fp8.flax.cast_kernels``: a linen "params" collection with the kernels of jax_fp8's
layers cast once (``jax_fp8.CastKernel``), for a step that scans over microbatches."""

from __future__ import annotations

from typing import Callable

from . import _names
from ._layer import cast_leaf, check_cast_kernels, kernel_ring
from .recipes import DelayedScaling, Recipe


def _ring(state, name: str):
  """The scale ring of kernel parameter ``name`` in a linen module's "fp8_state" entries
  (``state``: a mapping, or None), or None where the module has none for it."""
  if not hasattr(state, "get"):
    return None
  ring = kernel_ring(state.get("linear"), name)
  return kernel_ring(state.get("mlp"), name) if ring is None else ring


def cast_kernels(params, fp8_state=None, recipe: Recipe = DelayedScaling(), *,
                 amax_axis_name: str | tuple[str, ...] | None = None,
                 select: Callable = lambda path, kernel: True):
  """``params`` (a linen "params" collection) with the kernels of jax_fp8's layers replaced by
  their ``jax_fp8.CastKernel`` (``jax_fp8.cast_kernel``), which the layers then use without
  quantizing them again: call it once per step, inside the differentiated function and
  outside the ``lax.scan`` over microbatches, and apply the model in the scan's body with the
  result as its "params" (``fp8_state``: ``jax_fp8.share``d copies, as without it). The
  gradients with respect to ``params`` and ``fp8_state`` are those of the uncast model
  (except the kernel ring of a layer run twice in a microbatch, or of layers with states of
  their own on one kernel: the cast observes the kernel once, ``jax_fp8.cast_kernel``); the
  kernels are quantized once per step instead of once per microbatch.

  Args:
    params: the "params" collection: nested mappings whose kernel leaves are named "kernel"
      (``Dense``), "kernel_<i>" (``MultiDense``) or "kernel_in" / "kernel_out" (``Mlp``),
      [K, N], or [L, ..., K, N] when stacked by ``nn.scan`` / ``nn.vmap`` (cast layer by
      layer).
    fp8_state: under ``DelayedScaling`` the "fp8_state" collection (unshared): a kernel is cast
      where its layer's state holds its ring, other leaves (e.g. a ``flax.linen.Dense``'s
      kernel) stay as they are. Under ``CurrentScaling`` and ``BlockScaling``: None, and every
      kernel leaf so named is cast: leave out the layers that do not run through jax_fp8 with
      ``select``.
    recipe: the layers' recipe: ``DelayedScaling``, ``CurrentScaling`` or ``BlockScaling``.
    amax_axis_name: as in ``jax_fp8.cast_kernel``.
    select: ``select(path, kernel) -> bool`` (path: the keys joined by "/"): False keeps that
      kernel as it is.
  Returns:
    ``params`` with those leaves replaced, the mappings rebuilt as plain dicts.
  Raises:
    TypeError / ValueError: params not a mapping, a kernel cast already, select not callable or
    not returning a bool, fp8_state missing under DelayedScaling or given under a stateless
    recipe, no kernel finding its ring in fp8_state under DelayedScaling (the collections
    passed at the wrong level), and ``jax_fp8.cast_kernel``'s errors for a kernel, prefixed
    with its path.
  """
  delayed = check_cast_kernels(recipe, fp8_state, select, 'the "fp8_state" collection')
  found = []

  def walk(node, state, path):
    out = {}
    for name, value in node.items():
      where = f"{path}/{name}" if path else name
      if hasattr(value, "items"):
        out[name] = walk(value, state.get(name) if hasattr(state, "get") else None, where)
        continue
      out[name] = value
      if _names.is_kernel(name):
        ring = _ring(state, name) if delayed else None
        found.append(ring is not None)
        cast = cast_leaf(where, value, ring, recipe, amax_axis_name, select)
        out[name] = value if cast is None else cast
    return out
  if not hasattr(params, "items"):
    raise TypeError(f"params must be a linen \"params\" collection (a mapping), got "
                    f"{type(params).__name__}")
  out = walk(params, fp8_state, "")
  if delayed and not any(found):
    raise ValueError("no kernel of params found its ring in fp8_state: pass the \"params\" "
                     "and \"fp8_state\" collections themselves (variables[\"params\"], "
                     "variables[\"fp8_state\"]), of a model with jax_fp8 layers")
  return out
