"""Sharding rules for the FFI ops under a plain sharded ``jit``.

An FFI call carries no sharding rule of its own, so XLA would gather every operand onto each
device before it. Each op here is wrapped in ``jax.experimental.custom_partitioning`` (with a
Shardy rule for propagation) whose partition callback keeps the operands' sharding where the
kernel can run on the local pieces, replicates a dimension where it cannot (the partitioner
then gathers that dimension), and adds the collectives the op needs:

- ``quantize``: elementwise; the amax is max-reduced over every sharded axis.
- ``quantize_delayed`` / ``cast_transpose_delayed``: the ring is replicated. Every device
  quantizes with the same scale: the ring's, or on a fresh ring the one from the global amax
  (max-reduced before the kernel runs, on that step only). The amax is max-reduced and the
  next ring (or the observation) computed by ``jax_fp8.state``, identically on every device.
  ``qt`` is sharded like x transposed, which needs local rows a multiple of 16 (its padding);
  dbias is summed over the row shards.
- ``gemm``: M and N stay sharded as a's rows and b's rows; a contraction dimension K sharded
  the same way in a and b (16/32-bit output; block scales split with it, whole 128-groups on
  each device) gives local products summed over those axes, as XLA does for its own dots
  (data-parallel wgrad, row-parallel forward), in f32 before the output's one cast;
  otherwise K is gathered.
- ``group_quantize``, ``block_quantize``, ``group_cast_transpose``, ``mxfp8_quantize``:
  stateless, so no collective; a dimension stays split where every device holds whole groups /
  128 x 128 blocks / 32-element MX blocks (and, for the transposed outputs, the global zero
  padding).

Inside ``shard_map`` (each device's body is already local) and under ``vmap`` (which
``custom_partitioning`` cannot batch) the ops run their kernels directly. Meshes must have
Auto axes (``jax.sharding.Mesh``'s default; ``jax.make_mesh`` makes Explicit ones unless told):
Explicit axes raise a ValueError at trace time. The Shardy rules tie a grouped dimension to its
scales' dimension through compound factors, so propagation shards both alike (a dimension of
exactly one group takes a plain factor: ``call`` rewrites the rule, as Shardy asks).
"""

from __future__ import annotations

import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_batching import custom_vmap
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P


def varying_axes(*values) -> set:
  """The shard_map mesh axes any of ``values`` varies over (empty outside shard_map)."""
  out = set()
  for v in jax.tree.leaves(values):
    aval = jax.typeof(v)
    mat = getattr(aval, "manual_axis_type", None)  # jax 0.10; older releases call it vma
    out |= set(mat.varying) if mat is not None else set(getattr(aval, "vma", ()))
  return out


def vary_like(outs, *ins):
  """``outs`` (a pytree) made varying over every shard_map axis any of ``ins`` varies over:
  FFI results are typed as invariant although each device computes its own, and an input
  replicated over an axis that another input varies over must vary too, so that its gradient
  is summed over that axis as JAX does for any op. Outside shard_map: ``outs`` as they are."""
  axes = varying_axes(*ins)
  if not axes:
    return outs

  def vary(o):
    missing = tuple(sorted(axes - varying_axes(o)))
    return jax.lax.pcast(o, missing, to="varying") if missing else o
  return jax.tree.map(vary, outs)


def manual_axes() -> tuple:
  """The mesh axes of the enclosing shard_map (empty outside one, or where this jax cannot
  say)."""
  get_mesh = getattr(jax.sharding, "get_abstract_mesh", None)
  return tuple(getattr(get_mesh(), "manual_axes", ())) if get_mesh else ()


def _check_auto_axes(args) -> None:
  """Raise ValueError, naming the fix, for arrays on (or a context of) a mesh with Explicit
  axes, which custom_partitioning does not take (jax.make_mesh's default in jax 0.10)."""
  meshes = [jax.sharding.get_abstract_mesh()] + [
      getattr(getattr(jax.typeof(v), "sharding", None), "mesh", None)
      for v in jax.tree.leaves(args)]
  for mesh in meshes:
    if any(t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
      raise ValueError(
          f"jax_fp8's ops take meshes with Auto axes; got a mesh with Explicit axes "
          f"{dict(zip(mesh.axis_names, mesh.axis_types))}. Build it with jax.sharding.Mesh(...) "
          f"or jax.make_mesh(..., axis_types=(jax.sharding.AxisType.Auto,) * ndim)")


def call(op: str, impl, plan, rule: str, *args, reduction_factors=(), **factor_sizes):
  """``impl(*args)`` partitioned by ``plan(mesh, arg_shapes) -> (lower, arg_shardings,
  result_shardings)``, ``lower`` running on the local pieces; ``impl`` itself inside
  shard_map. ``rule``: the Shardy rule for propagation (``factor_sizes`` for its compound
  factors). Differentiating it raises a TypeError naming the op ``jax_fp8.<op>``. Called
  eagerly on values of one device, it is ``impl(*args)``: nothing to partition, and JAX
  caches impl's operations per shape, where a fresh wrapper would compile at every call."""
  if varying_axes(*args) or manual_axes():
    return _not_differentiable(op, impl)(*args)
  _check_auto_axes(args)
  if _eager_on_one_device(args):
    return impl(*args)
  rule, factor_sizes = _one_group_plain(rule, args, lambda: jax.eval_shape(impl, *args),
                                        factor_sizes)

  def partition(mesh, arg_shapes, result_shape):
    lower, arg_shardings, result_shardings = plan(mesh, _on_mesh(mesh, arg_shapes))
    return mesh, lower, result_shardings, arg_shardings

  def infer(mesh, arg_shapes, result_shape):
    return plan(mesh, _on_mesh(mesh, arg_shapes))[2]

  partitioned = custom_partitioning(impl)
  partitioned.def_partition(partition, infer_sharding_from_operands=infer,
                            propagate_user_sharding=None, decode_shardings=False,
                            sharding_rule=rule,
                            reduction_factors=_in_rule_order(reduction_factors, rule),
                            **factor_sizes)
  batched = custom_vmap(partitioned)

  @batched.def_vmap
  def _(axis_size, in_batched, *a):
    outs = jax.vmap(impl, in_axes=[0 if b else None for b in in_batched])(*a)
    return outs, jax.tree.map(lambda _: True, outs)
  return _not_differentiable(op, batched)(*args)


def _eager_on_one_device(args) -> bool:
  """Whether ``args`` are values, none a tracer, none spread over several devices."""
  for v in jax.tree.leaves(args):
    if isinstance(v, jax.core.Tracer):
      return False
    sharding = getattr(v, "sharding", None)
    if sharding is not None and len(sharding.device_set) > 1:
      return False
  return True


def _on_mesh(mesh, shapes):
  """The partitioner's operand ``shapes`` (ShapeDtypeStructs, shardings in XLA's own form) with
  NamedShardings over ``mesh``: each dimension split by the mesh axes whose coordinates number
  its pieces, major first, and replicated where no axes do. That is the case of a sub-axis,
  which no partition spec names: Shardy splits an axis of n devices where a dimension of m
  groups (a compound factor, ``grouped``) takes only gcd(m, n) of them, and JAX's own decoding
  raised an IndivisibleError there. The plans then gather such a dimension, as they do any
  split that leaves a device a partial group. Without a mesh (or a sharding) a shape stays as
  it is."""
  if mesh.empty:
    return shapes
  coords = {device: c for c, device in np.ndenumerate(mesh.devices)}
  sizes = mesh.devices.shape

  def numbering(starts):
    # the mesh axes (major first) whose coordinates give each device's piece of a dimension
    rank = {start: i for i, start in enumerate(sorted(set(starts.values())))}
    for k in range(1, len(sizes) + 1) if len(rank) > 1 else ():
      for combo in itertools.permutations(range(len(sizes)), k):
        if math.prod(sizes[a] for a in combo) != len(rank):
          continue
        if all(rank[start] == np.ravel_multi_index([coords[d][a] for a in combo],
                                                   [sizes[a] for a in combo])
               for d, start in starts.items()):
          names = tuple(mesh.axis_names[a] for a in combo)
          return names[0] if k == 1 else names
    return None

  def named(shape):
    if shape.sharding is None:
      return shape
    # pieces of a shape every tile count divides (the operand's own may not: a split that
    # leaves some devices a row more, which the plans gather)
    index = shape.sharding.devices_indices_map((mesh.devices.size,) * len(shape.shape))
    entries = [numbering({d: idx[dim].start or 0 for d, idx in index.items()})
               for dim in range(len(shape.shape))]
    return jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=NamedSharding(mesh, P(*entries)))
  return jax.tree.map(named, shapes)


def _one_group_plain(rule: str, args, outputs, factor_sizes: dict) -> tuple[str, dict]:
  """``rule`` and ``factor_sizes`` with each compound factor ``(nb n1)`` whose group count
  ``nb`` is 1 (a grouped dimension of exactly one group) replaced by its inner factor, in every
  operand (``(nb n8)`` too), since Shardy rejects a size-1 factor in a compound. ``nb`` stays
  as the scales' size-1 dimension; the inner factors, now whole dimensions, lose their given
  sizes. ``outputs()``: the results' shapes, asked for (a trace of the op) only where the rule
  has a compound factor."""
  if "(" not in rule:
    return rule, {}
  ins, outs = rule.split("->")
  shapes = [jnp.shape(a) for a in args] + [o.shape for o in jax.tree.leaves(outputs())]
  single = set()
  for operand, shape in zip(ins.split(",") + outs.split(","), shapes, strict=True):
    for dim, size in zip(re.findall(r"\([^)]*\)|\S+", operand), shape, strict=True):
      if dim.startswith("("):
        outer, *inner = dim[1:-1].split()
        if size == math.prod(factor_sizes[f] for f in inner):
          single.add(outer)
  for outer in single:
    rule = re.sub(rf"\({outer} (\w+)\)", r"\1", rule)
  compounded = set(" ".join(re.findall(r"\(([^)]*)\)", rule)).split())
  return rule, {f: n for f, n in factor_sizes.items() if f in compounded}


def _in_rule_order(factors, rule: str) -> tuple[str, ...]:
  """``factors`` in the order of their first use in ``rule`` (Shardy wants the special
  factors' indices sorted)."""
  order = list(dict.fromkeys(re.findall(r"\w+", rule)))
  return tuple(sorted(factors, key=order.index))


def _not_differentiable(op: str, fn):
  """``fn`` whose differentiation raises a TypeError that names the op and the way out, in
  place of JAX's message about a primitive (custom_partitioning, ffi_call) it cannot
  differentiate."""
  wrapped = jax.custom_jvp(fn)

  def jvp(primals, tangents):
    raise TypeError(f"jax_fp8.{op} is not differentiable (its outputs are FP8 bytes and "
                    f"scales); differentiate through jax_fp8.linear / mlp, whose custom_vjp runs "
                    f"FP8 GEMMs forward and backward, or wrap the op in jax.lax.stop_gradient. "
                    f"linear and mlp give first derivatives in reverse mode (grad, vjp) only: "
                    f"a second derivative (jax.hessian, grad of grad) differentiates their "
                    f"backward pass, whose quantization has no derivative")
  wrapped.defjvp(jvp)
  return wrapped


def grouped(name: str, size: int, group: int = 128) -> tuple[str, str]:
  """Shardy factors of a dimension of ``size`` cut into groups of ``group`` (each with one
  scale): ``("(nameb name1)", "nameb")`` for the dimension and its scales' dimension, so a
  sharding of one carries to the other; ``(name, name + "b")``, unlinked, where the last group
  is ragged."""
  return (f"({name}b {name}1)", f"{name}b") if size % group == 0 else (name, f"{name}b")


def factors(prefix: str, ndim: int) -> str:
  """Shardy factor names for the dimensions of an ndim array: "p0 p1 ..."."""
  return " ".join(f"{prefix}{i}" for i in range(ndim))


def spec(sharding, ndim: int) -> tuple:
  """The partition spec of ``sharding`` padded to ndim entries (None: replicated)."""
  s = tuple(sharding.spec) if isinstance(sharding, NamedSharding) else ()
  return s + (None,) * (ndim - len(s))


def axes(*entries) -> tuple[str, ...]:
  """The mesh axes named by partition-spec entries."""
  out = []
  for e in entries:
    out += [] if e is None else [e] if isinstance(e, str) else list(e)
  return tuple(out)


def even(mesh, entry, dim: int, multiple: int = 1):
  """``entry`` if it splits ``dim`` into equal pieces that are multiples of ``multiple``,
  else None (replicate that dimension)."""
  n = math.prod(mesh.shape[a] for a in axes(entry))
  return entry if n > 1 and dim % (n * multiple) == 0 else None


def named(mesh, *entries) -> NamedSharding:
  return NamedSharding(mesh, P(*entries))


def pmax_keep_nan(v: jax.Array, over: tuple[str, ...]) -> jax.Array:
  """Max over the devices of ``over`` that returns NaN where any device holds one (a max
  collective may drop NaNs), in one collective. Where v's type says it varies over some of
  ``over`` (a type-checked shard_map), only those: over the others every device holds the same
  v (and jax 0.12 refuses a collective over axes of both kinds)."""
  varying = varying_axes(v) & set(over)
  over = tuple(a for a in over if a in varying) if varying else over
  if not over:
    return v
  nan = jnp.isnan(v)
  both = jax.lax.pmax(jnp.stack([jnp.where(nan, -jnp.inf, v), nan.astype(v.dtype)]), over)
  return jnp.where(both[1] > 0, jnp.nan, both[0])
