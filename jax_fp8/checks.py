"""Argument checks at trace time, in one voice: each raises ``TypeError`` (wrong kind of value)
or ``ValueError`` (right kind, out of range) naming the argument, the rule and what came."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import _ffi
from .formats import FLOAT_DTYPES, FP8_DTYPES, fp8_max


def describe(v) -> str:
  """How an error message names the value a caller gave: type and value (its repr on one
  line, cut to 80 characters: a state's would spell out its arrays), or dtype and shape."""
  if hasattr(v, "dtype"):
    return f"{v.dtype}{list(np.shape(v))}"
  text = " ".join(repr(v).split())
  return f"{type(v).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def array(v, name: str) -> jax.Array:
  """``v`` as a jax array; a TypeError naming ``name`` for None, strings, lists of non-numbers
  and other values jnp cannot take."""
  if v is None or isinstance(v, (str, bytes)):
    raise TypeError(f"{name} must be an array, got {describe(v)}")
  try:
    return jnp.asarray(v)
  except (TypeError, ValueError) as e:
    raise TypeError(f"{name} must be an array, got {type(v).__name__}: {e}") from None


def float_input(x, name: str = "x") -> jax.Array:
  """A float32 / bfloat16 / float16 array for a quantizer; checks that the backend can run the
  kernels (RuntimeError otherwise)."""
  _ffi.check_backend()
  x = array(x, name)
  if x.dtype not in FLOAT_DTYPES:
    raise TypeError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
  return x


def fp8_array(v, name: str) -> jax.Array:
  v = array(v, name)
  if v.dtype not in FP8_DTYPES:
    raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {v.dtype}")
  return v


def python_number(v) -> bool:
  """Whether ``v`` is a Python int or float (not a bool), which a float32 argument takes as
  float32 with or without x64."""
  return isinstance(v, (int, float)) and not isinstance(v, bool)


def scalar_f32(v, name: str) -> jax.Array:
  """A float32 scalar array (read on the device); a Python number is taken as one."""
  v = array(np.float32(v) if python_number(v) else v, name)
  if v.shape != () or v.dtype != jnp.float32:
    raise TypeError(f"{name} must be a float32 scalar, got {describe(v)}")
  return v


def scale_f32(v, name: str) -> jax.Array:
  """A float32 scalar dequantization step (``scalar_f32``). One given on the host (a Python or
  NumPy number) must be a positive normal finite f32 (the kernels flush a subnormal scale to
  zero), a ValueError otherwise; a device array is not read back to check it."""
  out = scalar_f32(v, name)
  host_scales(v, name)
  return out


def host_scales(v, name: str) -> None:
  """Dequantization steps given on the host (a Python or NumPy number or array, a list or a
  tuple of numbers): each a positive normal finite float32 (the kernels flush a subnormal scale
  to zero), a ValueError otherwise. A device array is not read back to check it."""
  if python_number(v) or isinstance(v, (np.number, np.ndarray, list, tuple)):
    s = np.asarray(v, np.float32)
    if not np.all(np.isfinite(s) & (s >= np.finfo(np.float32).tiny)):
      each = " in every element" if s.ndim else ""
      raise ValueError(f"{name} must be a positive normal finite float32 (a dequantization "
                       f"step){each}, got {v!r}")


def dtype(v, name: str, allowed) -> jnp.dtype:
  """A dtype among ``allowed`` (None is not float64 here)."""
  names = ", ".join(jnp.dtype(d).name for d in allowed)
  try:
    d = jnp.dtype(v) if v is not None else None
  except TypeError:
    d = None
  if d not in allowed:
    raise TypeError(f"{name} must be one of {names}, got {d.name if d is not None else repr(v)}")
  return d


def selected(select, path: str, kernel) -> bool:
  """``select(path, kernel)``, the user's choice of a kernel, which must be a Python or NumPy
  bool (a TypeError naming the path otherwise)."""
  chosen = select(path, kernel)
  if not isinstance(chosen, (bool, np.bool_)):
    kind = type(chosen)
    kind = kind.__name__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__name__}"
    raise TypeError(f"select must return a bool, got {kind} for {path}")
  return bool(chosen)


def boolean(v, name: str) -> bool:
  """A Python or NumPy bool (not any truthy value: ``"no"`` is not False)."""
  if not isinstance(v, (bool, np.bool_)):
    raise TypeError(f"{name} must be a bool, got {describe(v)}")
  return bool(v)


def integer(v, name: str, lo: int | None = None, hi: int | None = None) -> int:
  """A static Python or NumPy int (not a bool, float or traced value) in [lo, hi]."""
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, np.integer)):
    raise TypeError(f"{name} must be a Python int (static, not traced), got {describe(v)}")
  if (lo is not None and v < lo) or (hi is not None and v > hi):
    bounds = f"in [{lo}, {hi}]" if lo is not None and hi is not None else (
        f">= {lo}" if lo is not None else f"<= {hi}")
    raise ValueError(f"{name} must be an int {bounds}, got {v}")
  return int(v)


def number(v, name: str, lo: float = -math.inf, finite: bool = True) -> float:
  """A static real number (int or float, not a bool or array), finite if asked, >= lo."""
  if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
    raise TypeError(f"{name} must be a number, got {describe(v)}")
  try:
    out = float(v)
  except OverflowError:
    raise ValueError(f"{name} must be representable as a float, got {v!r}") from None
  if (finite and not math.isfinite(out)) or (lo > -math.inf and not out >= lo):
    rule = " and ".join(r for r, on in (("finite", finite), (f">= {lo}", lo > -math.inf)) if on)
    raise ValueError(f"{name} must be {rule}, got {v!r}")
  return out


def one_of(v, name: str, choices) -> str:
  """One of the string ``choices`` (TypeError for a non-string)."""
  if not isinstance(v, str):
    raise TypeError(f"{name} must be one of {tuple(choices)}, got {describe(v)}")
  if v not in choices:
    raise ValueError(f"{name} must be one of {tuple(choices)}, got {v!r}")
  return v


def group_eps(eps, fmt: str, name: str = "eps") -> np.float32:
  """The floor of a group's amax (block scaling): finite in f32 with ``eps / fmt_max`` a normal
  f32, so every scale is normal and its reciprocal finite."""
  eps = number(eps, name, finite=False)
  with np.errstate(over="ignore"):
    eps32 = np.float32(eps)
  if not np.isfinite(eps32) or eps32 * (np.float32(1) / np.float32(fp8_max(fmt))) < \
      np.finfo(np.float32).tiny:
    raise ValueError(f"{name} must be finite and at least fmt_max * FLT_MIN "
                     f"({fp8_max(fmt) * np.finfo(np.float32).tiny:.3g} for {fmt}) and finite in "
                     f"f32, so every scale is a normal f32, got {eps}")
  return eps32
