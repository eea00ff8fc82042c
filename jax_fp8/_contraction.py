"""The one mapping of a Flax contraction layer onto jax_fp8's GEMM: linen ``nn.DenseGeneral`` and
``nn.Einsum`` (through ``jax_fp8.convert``), NNX ``LinearGeneral`` and ``Einsum``. A contraction
maps when it contracts trailing axes of the input (C) with axes of the kernel, and its output
holds the input's other axes (B) and the kernel's other axes (F): then
``y = (x [B..., C...] -> [tokens, K]) @ (kernel -> [K, N]) -> [B..., F...]`` with K = prod(C),
N = prod(F), the kernel transposed to (C in the input's order, F in the output's) where its axes
lie otherwise (e.g. Gemma's ``BTD,NDH->BTNH``: kernel [N, D, H] -> [D, N, H]), and ``y``
transposed to the output's order where that is not B then F (Gemma's key-value projection
``BSD,CKDH->CBSKH``: [B, S, C, K, H] -> [C, B, S, K, H]). Contractions that share an axis among
input, kernel and output (batched), sum an axis away, or contract leading axes of the input do
not map (the plan functions return the reason)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from ._layer import call_layer
from .cast_kernel import CastKernel
from .inference import Fp8Weight

ELLIPSIS = "..."


@dataclasses.dataclass(frozen=True)
class Contraction:
  """A contraction as one GEMM.

  Attributes:
    n_contract: how many trailing input axes are contracted (C).
    contracted: their sizes (the kernel's C axes, in the input's order).
    kernel_perm: the kernel's axes in (C, F) order, or None where they are so already.
    features: the output's trailing shape (F, in the output's order).
    k, n: K = prod(C sizes), N = prod(features).
    batch: the input's other axes' labels, "..." as one (empty where the layer names none).
    out_perm: the output's labels as positions in (``batch``, then the features), or None
      where the output is in that order.
  """

  n_contract: int
  contracted: tuple[int, ...]
  kernel_perm: tuple[int, ...] | None
  features: tuple[int, ...]
  k: int
  n: int
  batch: tuple[str, ...] = ()
  out_perm: tuple[int, ...] | None = None


def _tokens(spec: str) -> list[str]:
  """The axis labels of one einsum operand, "..." as one label."""
  head, dots, tail = spec.partition(ELLIPSIS)
  return [*head, *([ELLIPSIS] if dots else []), *tail]


def einsum_plan(einsum_str: str, kernel_shape) -> Contraction | str:
  """``einsum_str`` ("<input>,<kernel>-><output>", "..." allowed in input and output) as a
  ``Contraction`` for a kernel of ``kernel_shape``, or the reason (a str) it does not map."""
  spec = einsum_str.replace(" ", "")
  if spec.count("->") != 1 or spec.split("->")[0].count(",") != 1:
    return f"{einsum_str!r} is not an explicit two-operand einsum ('<input>,<kernel>-><output>')"
  ins, out = spec.split("->")
  xs, ks, os = (_tokens(s) for s in (*ins.split(","), out))
  if any(len(set(t)) != len(t) for t in (xs, ks, os)):
    return f"{einsum_str!r} repeats an axis within an operand (a diagonal or trace)"
  if ELLIPSIS in ks or len(ks) != len(kernel_shape):
    return (f"{einsum_str!r}: the kernel's labels {''.join(ks)!r} do not name its "
            f"{len(kernel_shape)} axes one by one")
  contracted = [a for a in xs if a in ks and a not in os]
  if any(a in ks and a in os for a in xs):
    return f"{einsum_str!r} has an axis in input, kernel and output (a batched contraction)"
  if any(a not in os and a not in ks for a in xs) or any(a not in os and a not in xs for a in ks):
    return f"{einsum_str!r} sums an axis of one operand away"
  nb = len(xs) - len(contracted)
  if not contracted or xs[nb:] != contracted:
    return f"{einsum_str!r} does not contract the input's trailing axes"
  batch = xs[:nb]
  free = [a for a in os if a not in batch]
  if sorted(free) != sorted(a for a in ks if a not in xs) or not free:
    return f"{einsum_str!r}: the output does not hold the kernel's other axes"
  perm = tuple(ks.index(a) for a in (*contracted, *free))
  out_perm = tuple((*batch, *free).index(a) for a in os)
  features = tuple(int(kernel_shape[ks.index(a)]) for a in free)
  sizes = tuple(int(kernel_shape[ks.index(a)]) for a in contracted)
  return Contraction(len(contracted), sizes, None if perm == tuple(range(len(ks))) else perm,
                     features, math.prod(sizes), math.prod(features), tuple(batch),
                     None if out_perm == tuple(range(len(os))) else out_perm)


def dense_general_plan(axis, in_shape, features, batch_dims=()) -> Contraction | str:
  """``nn.DenseGeneral`` / ``nnx.LinearGeneral``'s contraction of the input axes ``axis`` of an
  input of shape ``in_shape`` with a kernel [*contracted sizes, *features] as a
  ``Contraction``, or the reason it does not map."""
  if batch_dims is not None and len(batch_dims):
    return "it has batch dims (a batched contraction)"
  axis = np.atleast_1d(axis).tolist()
  ndim = len(in_shape)
  if any(not -ndim <= a < ndim for a in axis):
    return f"axis {tuple(axis)} is out of range for an input of rank {ndim}"
  norm = sorted(a % ndim for a in axis)
  if len(set(norm)) != len(norm) or norm != list(range(ndim - len(norm), ndim)):
    return f"axis {tuple(axis)} is not the input's trailing axes"
  features = tuple(np.atleast_1d(features).tolist())
  sizes = tuple(int(in_shape[a]) for a in norm)
  return Contraction(len(norm), sizes, None, features, math.prod(sizes), math.prod(features))


def gemm_kernel(kernel, plan: Contraction):
  """The kernel as the GEMM's [K, N] (an ``Fp8Weight``, already [K, N], as it is; ValueError
  where the layer's kernel needs a transpose, which a quantized one cannot take; TypeError for
  a ``CastKernel`` but of a [K, N] kernel in the GEMM's order, which ``cast_kernels`` makes for
  [K, N] kernels only)."""
  if isinstance(kernel, CastKernel) and (plan.kernel_perm is not None
                                         or jnp.ndim(kernel.kernel) != 2):
    raise TypeError("the layer's kernel is a CastKernel, which cast_kernels makes for [K, N] "
                    "kernels (Linear, MultiLinear, Mlp): leave LinearGeneral / Einsum kernels "
                    "out of cast_kernels with its select")
  if isinstance(kernel, (Fp8Weight, CastKernel)):
    if plan.kernel_perm is not None:
      raise ValueError("the layer's kernel is an Fp8Weight, but its einsum takes the kernel's "
                       "axes in another order than [K, N]: quantize_weights serves kernels "
                       "stored as [K, N]")
    return kernel
  if plan.kernel_perm is not None:
    kernel = jnp.transpose(kernel, plan.kernel_perm)
  return kernel.reshape(plan.k, plan.n)


def contract(inputs, kernel, bias, plan: Contraction, state, recipe, dtype, amax_axis_name,
             key=None, out_sharding=None):
  """The layer's output: the input reshaped to [B..., K], the kernel to [K, N] and the bias
  (any shape of N elements, flattened in the output's order) to [N], through ``call_layer``
  (``jax_fp8.linear`` in the compute dtype), reshaped to [B..., F...], transposed to the
  output's order (``plan.out_perm``), and constrained to ``out_sharding`` (``constrain``).
  ValueError where the input's trailing axes are not the contracted sizes."""
  shape = jnp.shape(inputs)
  lead = shape[:len(shape) - plan.n_contract]
  if len(shape) < plan.n_contract or tuple(shape[len(lead):]) != plan.contracted:
    raise ValueError(f"the layer's inputs must be [..., {', '.join(map(str, plan.contracted))}] "
                     f"(the contracted axes), got shape {tuple(shape)}")
  if plan.batch and ELLIPSIS not in plan.batch and len(lead) != len(plan.batch):
    raise ValueError(f"the layer's inputs must have {len(plan.batch) + plan.n_contract} axes "
                     f"(its einsum names {''.join(plan.batch)} and the contracted ones), got "
                     f"shape {tuple(shape)}")
  y, = call_layer(jnp.reshape(inputs, (*lead, plan.k)), (gemm_kernel(kernel, plan),),
                  (None if bias is None else jnp.reshape(bias, (plan.n,)),), state, recipe,
                  dtype, amax_axis_name, False, key=key)
  y = y.reshape(*lead, *plan.features)
  if plan.out_perm is not None:
    y = jnp.transpose(y, _output_axes(plan, len(lead)))
  return constrain(y, out_sharding)


def _output_axes(plan: Contraction, n_lead: int) -> list[int]:
  """The axes of [B..., F...] (``n_lead`` B axes) in the output's order: each label of
  ``plan.batch`` one axis, "..." those left over, each feature one axis."""
  groups, axis = [], 0
  for label in plan.batch:
    width = n_lead - len(plan.batch) + 1 if label == ELLIPSIS else 1
    groups.append(list(range(axis, axis + width)))
    axis += width
  groups += [[n_lead + i] for i in range(len(plan.features))]
  return [a for p in plan.out_perm for a in groups[p]]


def constrain(y, out_sharding):
  """``y`` with the sharding ``out_sharding`` (None: as it is; a ``jax.sharding.Sharding``, or a
  ``PartitionSpec`` of the mesh ``jax.set_mesh`` made current), as Flax layers' ``out_sharding``
  asks of their ``dot_general``: a sharding constraint, since jax_fp8's ops run on meshes of
  Auto axes."""
  return y if out_sharding is None else jax.lax.with_sharding_constraint(y, out_sharding)
