"""``convert``'s mixture-of-experts calls: while a converted linen model's call runs,
``jax.lax.ragged_dot`` and ``jax.lax.ragged_dot_general`` are replaced on the ``jax.lax`` module
by functions that run a call made inside one of the model's modules through
``jax_fp8.grouped_linear`` where convert's rules select it (its rhs, the module's expert weights,
as the kernels; its rings in the module's "fp8_state" as "ragged_dot_<i>"), and every other call
as it was. Each call is noted for the report. See ``jax_fp8.convert``'s docstring for the
contract."""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import threading

import jax
import jax.numpy as jnp
from flax.core import tracers

from . import convert_report as cr
from ._convert_rules import _status
from .convert_report import LayerReport
from .flax import fp8_state_variable
from .formats import FLOAT_DTYPES
from .grouped_linear import grouped_linear
from .layer_checks import ungrouped_reason
from .layer_state import GroupedLinearState
from .ops.grouped_gemm import MAX_GROUPS

# ragged_dot's own dimension numbers, the one form grouped_linear computes: lhs [M, K] ragged
# in M, rhs [G, K, N] grouped in G, K contracted.
PLAIN = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                                          lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])
# The arguments whose meaning grouped_linear has; a call given any other (group_offset,
# out_sharding, ...) runs as it was.
_TAKEN = ("lhs", "rhs", "group_sizes", "precision", "preferred_element_type",
          "ragged_dot_dimension_numbers")
_NAMES = ("ragged_dot", "ragged_dot_general")


class RaggedCalls:
  """The ragged dots of one converted call: convert's recipe and filter, ``note`` (called with
  each call's ``LayerReport``), and the modules whose methods run, innermost last, each with
  its count of ragged dots so far in this call of it (a module re-entered by a method of its
  own while it runs counts on; a module called again later counts from 0, so its call sites
  keep their names and rings).

  ``leave``: None to convert what the rules select, or a reason (str) to leave every call as it
  was, noted with that reason (the NNX report's trace).
  """

  def __init__(self, recipe, include, exclude, note, leave: str | None = None):
    self.recipe, self.include, self.exclude, self.note, self.leave = (recipe, include, exclude,
                                                                      note, leave)
    self._frames = []  # (path: tuple of names, linen module or None, [ragged dots so far])

  def within(self, path: tuple, module, fun, *args, **kwargs):
    """``fun(*args, **kwargs)``, a method of the module at ``path`` (a linen ``module``, or None
    where it has none), run as the innermost module."""
    counter = next((c for p, _, c in self._frames if p == path), [0])
    self._frames.append((path, module, counter))
    try:
      return fun(*args, **kwargs)
    finally:
      self._frames.pop()

  def intercept(self, next_fun, args, kwargs, context):
    """A linen method interceptor (``nn.intercept_methods``): each method of the model's
    modules runs within its module."""
    m = context.module
    return self.within(tuple(m.scope.path), m, next_fun, *args, **kwargs)

  def call(self, name: str, original, args, kwargs):
    """A ``jax.lax.<name>`` call made in this converted call: through ``grouped_linear`` where
    it maps and the rules select it, else by ``original``; noted either way (a call outside
    every module of the model runs as it was, unnoted)."""
    if not self._frames:
      return original(*args, **kwargs)
    path, module, counter = self._frames[-1]
    site = f"ragged_dot_{counter[0]}"
    counter[0] += 1
    out = jax.eval_shape(functools.partial(original, *args, **kwargs))  # the call's own checks
    given = inspect.signature(original).bind(*args, **kwargs).arguments
    (m, k, n, groups), why = _plan(given, out)
    where = "/".join([*map(str, path), site])
    status, why = (cr.UNSUPPORTED, why) if why is not None else self._status(where, k, n, module)
    self.note(LayerReport(where, f"lax.{name}", k, n, m, status, why, groups))
    if status != cr.CONVERTED:
      return original(*args, **kwargs)
    state = (fp8_state_variable(module, site, GroupedLinearState.create, groups, self.recipe)
             if self.recipe.stateful else None)
    return grouped_linear(given["lhs"], given["rhs"], jnp.asarray(given["group_sizes"], jnp.int32),
                          recipe=self.recipe, state=state, dtype=out.dtype)

  def _status(self, path: str, k: int, n: int, module) -> tuple[str, str]:
    """(status, reason) of a call that maps onto ``grouped_linear``, by convert's rules."""
    if self.leave is not None:
      return cr.UNSUPPORTED, self.leave
    if not self.recipe.grouped:
      return cr.UNSUPPORTED, ungrouped_reason(self.recipe)
    status, why = _status(path, k, n, self.recipe, self.include, self.exclude)
    homeless = _no_rings_here(module) if self.recipe.stateful else None
    if status == cr.CONVERTED and homeless is not None:
      return cr.UNSUPPORTED, (f"{type(self.recipe).__name__} keeps the call's rings in its "
                              f"module's \"fp8_state\", and {homeless} (a stateless recipe, "
                              f"CurrentScaling or BlockScaling, needs no rings)")
    return status, why


def _no_rings_here(module) -> str | None:
  """Why linen ``module`` cannot keep the rings of a ragged dot it calls now (None where it
  can). Flax makes variables only in setup or a method wrapped in @nn.compact (its own test,
  ``_initialization_allowed``, has no public name). Inside a JAX transform within the method
  (jax.checkpoint, jax.jit, lax.scan, shard_map) a ring would be made as a tracer that escapes,
  or observed once per transformed call with the gradients summed, not max-combined; Flax's
  lifted transforms (nn.remat, nn.scan) run the method at its scope's own trace."""
  if not module._initialization_allowed:
    return "Flax makes variables only in setup or a method wrapped in @nn.compact: this is neither"
  if module.scope.trace_level != tracers.current_trace():
    return ("the call runs inside a JAX transform within the module's method (jax.checkpoint, "
            "jax.jit, lax.scan, shard_map, ...), where a ring would be made or observed "
            "apart from the module (Flax's nn.remat / nn.scan lift the module and serve)")
  return None


def _plan(given: dict, out) -> tuple[tuple, str | None]:
  """((M, K, N, G), why) of a ragged dot call: its arguments by name ``given`` and its output
  ``out`` (a ``jax.ShapeDtypeStruct``); ``why`` None where ``grouped_linear`` computes it, else
  the reason convert leaves it (sizes None where the call is not lhs [M, K] by rhs [G, K, N]
  with ragged_dot's dimension numbers)."""
  lhs, rhs = jnp.shape(given["lhs"]), jnp.shape(given["rhs"])
  dims = given.get("ragged_dot_dimension_numbers", PLAIN)
  plain = dims == PLAIN and len(lhs) == 2 and len(rhs) == 3
  sizes = (lhs[0], lhs[1], rhs[2], rhs[0]) if plain else (None,) * 4
  if dims != PLAIN:
    return sizes, (f"dimension numbers {dims}: convert maps ragged_dot's own (lhs [M, K] "
                   f"ragged in M, rhs [G, K, N])")
  if not plain:
    return sizes, (f"lhs {list(lhs)} and rhs {list(rhs)}: convert maps lhs [M, K] and rhs "
                   f"[G, K, N]")
  precision = given.get("precision")
  if not _default_precision(precision):
    return sizes, (f"precision={precision}: the call asks for a precision of its own, which "
                   f"FP8 would lower")
  extra = [a for a, v in given.items() if a not in _TAKEN and v is not None]
  if extra:
    return sizes, f"{extra[0]} given: grouped_linear has no {extra[0]}"
  dtypes = (jnp.result_type(given["lhs"]), jnp.result_type(given["rhs"]), out.dtype)
  if any(d not in FLOAT_DTYPES for d in dtypes):
    return sizes, (f"lhs {dtypes[0]}, rhs {dtypes[1]} into {dtypes[2]}: grouped_linear takes "
                   f"float32, bfloat16 or float16")
  if sizes[3] > MAX_GROUPS:
    return sizes, f"G={sizes[3]} experts: grouped_linear takes 1 to {MAX_GROUPS}"
  return sizes, None


def _default_precision(precision) -> bool:
  """Whether a ragged dot's ``precision`` is the default (None or DEFAULT, for one operand or
  both)."""
  parts = precision if isinstance(precision, (tuple, list)) else (precision,)
  return all(p is None or (isinstance(p, (str, jax.lax.Precision))
                           and jax.lax.Precision(p) == jax.lax.Precision.DEFAULT) for p in parts)


# The converted call running in this context (thread, task): its RaggedCalls.
_ACTIVE = contextvars.ContextVar("jax_fp8_convert_ragged", default=None)


class _LaxPatch:
  """jax.lax's ragged dots replaced while any converted call runs, in any thread (a count of
  them), and restored in ``finally`` when the last one ends. A replacement serves the converted
  call of its caller's context and calls the original for any other caller (another thread's
  model, the model's own code outside a converted call, jax_fp8's own ragged dots)."""

  def __init__(self):
    self._lock = threading.Lock()
    self._users = 0
    self.originals = {}  # name -> the jax.lax function replaced (kept after: see _replacement)

  @contextlib.contextmanager
  def held(self):
    with self._lock:
      if not self._users:
        for name in _NAMES:  # (a replacement another library put back is no original)
          if getattr(jax.lax, name) is not _REPLACEMENTS[name]:
            self.originals[name] = getattr(jax.lax, name)
          setattr(jax.lax, name, _REPLACEMENTS[name])
      self._users += 1
    try:
      yield
    finally:
      with self._lock:
        self._users -= 1
        if not self._users:
          for name, fn in self.originals.items():
            setattr(jax.lax, name, fn)


def _replacement(name: str):
  """``jax.lax.<name>`` as convert replaces it (its signature and docstring kept). Bound by a
  caller while replaced, it stays the original for every call outside a converted one."""
  @functools.wraps(getattr(jax.lax, name))
  def replaced(*args, **kwargs):
    calls = _ACTIVE.get()
    original = _PATCH.originals[name]
    return original(*args, **kwargs) if calls is None else calls.call(name, original, args,
                                                                       kwargs)
  return replaced


_REPLACEMENTS = {name: _replacement(name) for name in _NAMES}
_PATCH = _LaxPatch()


@contextlib.contextmanager
def intercepted(calls: RaggedCalls):
  """Within: this context's ``jax.lax.ragged_dot`` / ``ragged_dot_general`` calls run as
  ``calls`` says (``calls.within`` tells it the module of each; linen: its ``intercept``)."""
  token = _ACTIVE.set(calls)
  try:
    with _PATCH.held():
      yield
  finally:
    _ACTIVE.reset(token)
