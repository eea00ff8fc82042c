"""The scale rings of a layer under a stateful recipe (``DelayedScaling``): ``LinearState``
(``linear``), ``MultiLinearState`` (``multi_linear``), ``MlpState`` (``mlp``),
``GroupedLinearState`` (``grouped_linear``) and ``GroupedMlpState`` (``grouped_mlp``), pytrees
to differentiate with respect to and to advance with ``jax_fp8.update_state``."""

from __future__ import annotations

import dataclasses
import functools

import jax

from . import checks
from .recipes import DelayedScaling, Recipe
from .state import ScaleRing, stacked


def check_stateful(recipe: Recipe, cls) -> None:
  """TypeError naming ``cls.create`` unless ``recipe`` is a stateful recipe (delayed scaling)."""
  if not isinstance(recipe, Recipe):
    raise TypeError(f"{cls.__name__}.create takes a DelayedScaling recipe, got "
                    f"{checks.describe(recipe)}")
  if not recipe.stateful:
    raise TypeError(f"{cls.__name__}.create takes a DelayedScaling recipe, got "
                    f"{type(recipe).__name__} (stateless: pass state=None)")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "kernel", "grad"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class LinearState:
  """The three scale rings of one linear layer: input x, kernel, and output gradient."""

  x: ScaleRing
  kernel: ScaleRing
  grad: ScaleRing

  @classmethod
  def create(cls, recipe: DelayedScaling = DelayedScaling()) -> "LinearState":
    """Fresh rings for x and the kernel (the recipe's forward format) and for the gradient
    (its backward format). Raises TypeError for a stateless recipe (its linear takes no
    state)."""
    check_stateful(recipe, cls)
    return cls(recipe.ring(recipe.fwd_fmt), recipe.ring(recipe.fwd_fmt),
               recipe.ring(recipe.bwd_fmt))

  def named_rings(self):
    """(x's, the kernels', the gradients') (name, ring) pairs, as ``multi_linear`` orders
    them."""
    return ("state.x", self.x), (("state.kernel", self.kernel),), (("state.grad", self.grad),)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "kernels", "grads"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class MultiLinearState:
  """The scale rings of ``multi_linear``: its shared input x's, and per kernel the kernel's
  and its output gradient's (tuples in the kernels' order)."""

  x: ScaleRing
  kernels: tuple[ScaleRing, ...]
  grads: tuple[ScaleRing, ...]

  @classmethod
  def create(cls, outputs: int,
             recipe: DelayedScaling = DelayedScaling()) -> "MultiLinearState":
    """Fresh rings for x and ``outputs`` kernels and gradients (formats as in
    ``LinearState.create``). Raises TypeError / ValueError for outputs not an int >= 1 or a
    stateless recipe."""
    outputs = checks.integer(outputs, "outputs", lo=1)
    check_stateful(recipe, cls)
    return cls(recipe.ring(recipe.fwd_fmt),
               tuple(recipe.ring(recipe.fwd_fmt) for _ in range(outputs)),
               tuple(recipe.ring(recipe.bwd_fmt) for _ in range(outputs)))

  def named_rings(self):
    """(x's, the kernels', the gradients') (name, ring) pairs."""
    for name in ("kernels", "grads"):
      if not isinstance(getattr(self, name), tuple):
        raise TypeError(f"state.{name} must be a tuple of jax_fp8.ScaleRing, got "
                        f"{type(getattr(self, name)).__name__}")
    return (("state.x", self.x),
            tuple((f"state.kernels[{i}]", r) for i, r in enumerate(self.kernels)),
            tuple((f"state.grads[{i}]", r) for i, r in enumerate(self.grads)))


MLP_RINGS = ("x", "kernel_in", "grad_in", "hidden", "kernel_out", "grad_out")


@dataclasses.dataclass(frozen=True)
class _MlpRings:
  """The six rings of an MLP, in ``MLP_RINGS``' order: its input x, kernel_in, the up
  projection's output gradient (grad_in), the activation (hidden), kernel_out, and the output
  gradient (grad_out)."""

  x: ScaleRing
  kernel_in: ScaleRing
  grad_in: ScaleRing
  hidden: ScaleRing
  kernel_out: ScaleRing
  grad_out: ScaleRing

  def named_rings(self):
    """(name, ring) pairs in ``MLP_RINGS``' order."""
    return tuple((f"state.{name}", getattr(self, name)) for name in MLP_RINGS)


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(MLP_RINGS),
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class MlpState(_MlpRings):
  """The scale rings of ``mlp``: its input x, kernel_in, the up projection's output gradient
  (grad_in), the activation (hidden), kernel_out, and the output gradient (grad_out), one
  ScaleRing each."""

  @classmethod
  def create(cls, recipe: DelayedScaling = DelayedScaling()) -> "MlpState":
    """Fresh rings: the recipe's forward format for x, the kernels and the activation, its
    backward format for the two gradients. Raises TypeError for a stateless recipe (pass
    state=None)."""
    check_stateful(recipe, cls)
    fwd, bwd = recipe.ring(recipe.fwd_fmt), recipe.ring(recipe.bwd_fmt)
    return cls(fwd, fwd, bwd, fwd, fwd, bwd)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["x", "kernels", "grad"],
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class GroupedLinearState:
  """The scale rings of ``grouped_linear``: its input x's and output gradient's (one each, as
  the grouped GEMMs take one scale for them), and one ring per expert kernel, stacked.

  Attributes:
    x: ScaleRing (the recipe's forward format).
    kernels: one ScaleRing whose leaves are stacked over the G experts: amax_history f32
      [G, L], scale f32 [G], steps f32 [G] (the layout ``share`` and a scan over layers make,
      which ``update_state`` advances ring by ring). Expert g's kernel is quantized with ring
      g's scale, and ring g observes that kernel's amax.
    grad: ScaleRing (the recipe's backward format).
  """

  x: ScaleRing
  kernels: ScaleRing
  grad: ScaleRing

  @classmethod
  def create(cls, groups: int,
             recipe: DelayedScaling = DelayedScaling()) -> "GroupedLinearState":
    """Fresh rings for x, ``groups`` expert kernels (stacked) and the gradient (formats as in
    ``LinearState.create``). Raises TypeError / ValueError for groups not an int >= 1 or a
    stateless recipe."""
    groups = checks.integer(groups, "groups", lo=1)
    check_stateful(recipe, cls)
    return cls(recipe.ring(recipe.fwd_fmt), stacked(recipe.ring(recipe.fwd_fmt), groups),
               recipe.ring(recipe.bwd_fmt))

  def named_rings(self):
    """(x's, the kernels' (stacked), the gradient's) (name, ring) pairs."""
    return ("state.x", self.x), ("state.kernels", self.kernels), ("state.grad", self.grad)


@functools.partial(jax.tree_util.register_dataclass, data_fields=list(MLP_RINGS),
                   meta_fields=[])
@dataclasses.dataclass(frozen=True)
class GroupedMlpState(_MlpRings):
  """The scale rings of ``grouped_mlp``, ``MlpState``'s six with each kernel's ring one per
  expert: x, kernel_in, the up projection's output gradient (grad_in), the activation
  (hidden), kernel_out and the output gradient (grad_out).

  Attributes:
    x, grad_in, hidden, grad_out: one ScaleRing each (the grouped GEMMs take one scale for
      those operands): the recipe's forward format for x and hidden, its backward format for
      the gradients.
    kernel_in, kernel_out: one ScaleRing each whose leaves are stacked over the G experts
      (amax_history f32 [G, L], scale f32 [G], steps f32 [G]), as ``GroupedLinearState``'s
      kernels: expert g's kernel is quantized with ring g's scale and ring g observes it.
  """

  @classmethod
  def create(cls, groups: int,
             recipe: DelayedScaling = DelayedScaling()) -> "GroupedMlpState":
    """Fresh rings (formats as in ``MlpState.create``), the kernels' for ``groups`` experts,
    stacked. Raises TypeError / ValueError for groups not an int >= 1 or a stateless
    recipe."""
    groups = checks.integer(groups, "groups", lo=1)
    check_stateful(recipe, cls)
    fwd, bwd = recipe.ring(recipe.fwd_fmt), recipe.ring(recipe.bwd_fmt)
    return cls(fwd, stacked(fwd, groups), bwd, fwd, stacked(fwd, groups), bwd)
