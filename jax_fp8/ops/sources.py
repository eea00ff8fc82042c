"""What a cast-transpose quantizes (``csrc/kernels/sources.cuh``): x itself, an activation of x,
the gradient through an activation, or a norm of x; x itself may come in parts, [R, C_i]
arrays side by side, quantized as their concatenation, which is never stored (the output
gradients of a layer whose output is split, such as q / k / v, reach its cast-transpose
separately). One description for the per-tensor
cast-transposes (``cast_transpose``) and block scaling's group cast-transposes
(``blockwise``): the argument checks, the kernel's inputs and attributes, and how the inputs
shard.
"""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from .. import _ffi, activations, checks, norms, sharding


MAX_PARTS = _ffi.CONSTANTS["max_parts"]  # the most arrays x may come in
COL_MULTIPLE = _ffi.CONSTANTS["col_multiple"]  # x's columns: whole 16-element vectors


class Source(NamedTuple):
  """A checked source: ``inputs`` (x, or x's parts; dh and y under ``grad``; x, row_stats and
  affine under a norm), the activation's and the norm's names (or None), and whether the
  activation is gated and whether this is the gradient through it."""
  inputs: tuple
  activation: str | None
  norm: str | None
  gated: bool
  grad: bool

  @property
  def plain(self) -> bool:
    """Whether x itself is quantized (in one array or in parts)."""
    return self.activation is None and self.norm is None

  @property
  def in_parts(self) -> bool:
    """Whether x comes in more than one array."""
    return self.plain and len(self.inputs) > 1

  def shape(self, *inputs) -> tuple[int, int]:
    """[R, C] of what is quantized, from the inputs (or their local pieces)."""
    x = inputs[0]
    if self.plain:
      return x.shape[0], sum(v.shape[1] for v in inputs)
    if self.activation is None:
      return x.shape
    if self.grad:
      return inputs[1].shape
    return (x.shape[0], x.shape[1] // 2 if self.gated else x.shape[1])

  def kernel_args(self, *inputs) -> tuple:
    """(x, y, stats, affine) as the FFI targets take them, with empty arrays for the unused."""
    x = inputs[0]
    y = inputs[1] if self.grad else jnp.zeros((0,), x.dtype)
    st, af = inputs[1:3] if self.norm is not None else (jnp.zeros((0, 0), jnp.float32),) * 2
    return x, y, st, af

  def more_parts(self, *inputs) -> tuple:
    """x's parts after the first (the cast-transpose's remaining arguments), or none."""
    return inputs[1:] if self.in_parts else ()

  def attrs(self) -> dict:
    act = (activations.check(self.activation)[0] if self.activation is not None
           else _ffi.CONSTANTS["activation_none"])
    norm = norms.check(self.norm) if self.norm is not None else _ffi.CONSTANTS["norm_none"]
    return {"activation": np.int64(act), "gated": self.gated, "grad": self.grad,
            "norm": np.int64(norm)}

  def splits_columns(self) -> bool:
    """Whether each output column needs only its own input columns (not under a gated
    activation, whose output columns read both halves of [gate | up], nor for x in parts,
    whose columns are not the output's)."""
    return not self.gated and not self.in_parts

  def rule(self, r: str, c: str) -> str:
    """The inputs' Shardy factors, the output being [r, c]."""
    if self.norm is not None:  # elementwise, given each row's statistics and each column's affine
      return f"{r} {c}, {r} s, s {c}"
    if self.in_parts:  # each part's columns are a factor of their own
      return ", ".join(f"{r} n{i}" for i in range(len(self.inputs)))
    if not self.gated:  # elementwise: the columns of x (and y) are the output's
      return f"{r} {c}" + (f", {r} {c}" if self.grad else "")
    # every output column reads both halves of [gate | up]: y's columns are a factor of their own
    return f"{r} h, {r} y2" if self.grad else f"{r} c2"

  def shardings(self, mesh, r, c) -> tuple:
    """The inputs' shardings, the output split as [r, c]."""
    if self.norm is not None:
      return (sharding.named(mesh, r, c), sharding.named(mesh, r, None),
              sharding.named(mesh, None, c))
    return (sharding.named(mesh, r, c),) * len(self.inputs)


def _check_2d(x, name: str, multiple: int, gated: bool = False) -> None:
  """x [R, C] (gated: [R, 2C], [gate | up]), C a positive multiple of ``multiple``."""
  if x.ndim != 2 or x.shape[1] <= 0 or x.shape[1] % (2 * multiple if gated else multiple):
    shape = "[R, 2C] ([gate | up] of a gated activation)" if gated else "[R, C]"
    raise ValueError(f"{name} must be {shape} with C a positive multiple of {multiple}, "
                     f"got shape {x.shape}")


def plain(x, multiple: int, name: str = "x") -> Source:
  """x [R, C] itself, C a positive multiple of ``multiple`` (``name``: the argument's name)."""
  x = checks.float_input(x, name)
  _check_2d(x, name, multiple)
  return Source((x,), None, None, False, False)


def in_parts(x) -> bool:
  """Whether x is given in parts: a tuple / list of arrays (a list of Python rows, no arrays in
  it, is one array, as every op takes it)."""
  return isinstance(x, (tuple, list)) and all(hasattr(v, "shape") for v in x)


def parts(xs, multiple: int, name: str = "x") -> Source:
  """x in parts: a tuple / list of 1 to ``MAX_PARTS`` arrays [R, C_i] of one float dtype, each
  C_i a positive multiple of ``multiple``, quantized as their concatenation [R, sum C_i]."""
  if not 1 <= len(xs) <= MAX_PARTS:
    raise ValueError(f"{name} in parts must be 1 to {MAX_PARTS} arrays, got {len(xs)}")
  xs = tuple(checks.float_input(v, f"{name}[{i}]") for i, v in enumerate(xs))
  for i, v in enumerate(xs):
    _check_2d(v, f"{name}[{i}]", multiple)
    if v.dtype != xs[0].dtype:
      raise TypeError(f"{name}[{i}] must have {name}[0]'s dtype {xs[0].dtype}, got {v.dtype}")
    if v.shape[0] != xs[0].shape[0]:
      raise ValueError(f"{name}[{i}] must have {name}[0]'s {xs[0].shape[0]} rows, got shape "
                       f"{v.shape}")
  return Source(xs, None, None, False, False)


def activation(y, activation: str, multiple: int) -> Source:
  """``activation(y)``: y [R, C], or [R, 2C] = [gate | up] under a gated activation."""
  y = checks.float_input(y, "y")
  gated = activations.check(activation)[1]
  _check_2d(y, "y", multiple, gated)
  return Source((y,), activation, None, gated, False)


def activation_grad(dh, y, activation: str, multiple: int) -> Source:
  """The gradient through ``activation`` from dh [R, C] and the pre-activation y ([R, C], or
  [R, 2C] under a gated activation, whose gradient is [dgate | dup] [R, 2C])."""
  dh = checks.float_input(dh, "dh")
  y = checks.float_input(y, "y")
  gated = activations.check(activation)[1]
  _check_2d(dh, "dh", multiple)
  if y.dtype != dh.dtype:
    raise TypeError(f"y must have dh's dtype {dh.dtype}, got {y.dtype}")
  want = (dh.shape[0], dh.shape[1] * (2 if gated else 1))
  if y.shape != want:
    raise ValueError(f"y must be {list(want)} for dh {list(dh.shape)} under {activation!r}, "
                     f"got {list(y.shape)}")
  return Source((dh, y), activation, None, gated, True)


def norm(x, row_stats, gamma, beta, norm: str, multiple: int) -> Source:
  """The norm of x [R, C] from its row statistics (``jax_fp8.norms.stats``) and gamma (and
  LayerNorm's beta) [C]."""
  x = checks.float_input(x)
  _check_2d(x, "x", multiple)
  gamma, beta = norms.check_params(norm, gamma, beta, x.shape[1])
  row_stats = checks.array(row_stats, "row_stats")
  per_row = 2 if norms.centered(norm) else 1
  if row_stats.dtype != jnp.float32:
    raise TypeError(f"row_stats must be float32 (jax_fp8.norms.stats), got {row_stats.dtype}")
  if row_stats.shape != (x.shape[0], per_row):
    raise ValueError(f"row_stats must be [{x.shape[0]}, {per_row}] (jax_fp8.norms.stats under "
                     f"{norm!r}), got {list(row_stats.shape)}")
  affine = (jnp.stack([gamma, beta]) if beta is not None else gamma[None]).astype(jnp.float32)
  return Source((x, row_stats, affine), None, norm, False, False)

