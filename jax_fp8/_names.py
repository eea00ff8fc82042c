"""The parameter names of jax_fp8's layers, linen and NNX alike: "kernel" and "bias" for
``Dense``; "kernel_<i>" and "bias_<i>" for output i of ``MultiDense``; "kernel_in" and
"kernel_out" (with their biases) for ``Mlp``."""

from __future__ import annotations


def suffixes(n: int, multi: bool) -> tuple[str, ...]:
  """The suffix of each of n kernels' (and biases') names: "" for ``Dense``'s one (``multi``
  False), "_<i>" for ``MultiDense``'s."""
  return tuple(f"_{i}" for i in range(n)) if multi else ("",)


def multi_index(name: str) -> int | None:
  """i where ``name`` is "kernel_<i>" (a ``MultiDense`` kernel), else None."""
  i = name[len("kernel_"):]
  return int(i) if name.startswith("kernel_") and i.isdecimal() else None


def is_kernel(name: str) -> bool:
  """Whether ``name`` is a kernel's: "kernel", "kernel_<i>", "kernel_in" or "kernel_out"."""
  return name in ("kernel", "kernel_in", "kernel_out") or multi_index(name) is not None


def path_keys(path) -> list[str]:
  """A pytree path's keys as strings (mapping keys, attribute names, sequence indices)."""
  return [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path]
