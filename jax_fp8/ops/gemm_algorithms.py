"""Which cuBLASLt algorithm each CUDA GEMM runs: cuBLASLt's candidates for a GEMM problem timed
once, the fastest kept for the process and recorded in a file that later runs read, so that a
problem runs the same algorithm, and gives the same bits, run after run (XLA's autotuning of
its own GEMMs, with its results file, is the model).

A problem is what fixes the choice: M, N, K, the operand and output dtypes, the bias, fast
accumulation and the scale mode, on a kind of device (its name, compute capability and
cuBLASLt version). ``jax_fp8.gemm`` calls :func:`select` while it traces a CUDA GEMM; the timing
(``csrc/ffi/gemm_tuning.cc``) runs then, outside any XLA computation, on buffers and a stream
of its own, at most once per problem and kind of device in a process. The FFI handler only
looks the choice up, so an execution never times, allocates or synchronizes.

Environment:
  ``JAX_FP8_GEMM_AUTOTUNE``: ``1`` (default) times the candidates; ``0`` takes cuBLASLt's
  first heuristic choice, untimed, and neither reads nor writes the file.
  ``JAX_FP8_GEMM_CACHE``: the file of choices (JSON lines, appended to; the first line of a
  problem wins); default ``$XDG_CACHE_HOME/jax_fp8/gemm_algorithms.jsonl`` (``~/.cache`` when
  unset); empty: no file, so each process times again and may choose differently.

Where the timing cannot run (no free device memory for its buffers), a warning says so and the
GEMM takes cuBLASLt's first heuristic choice, not recorded.
"""

from __future__ import annotations

import json
import os
import pathlib
import threading
import warnings

from .. import _ffi

AUTOTUNE_ENV = "JAX_FP8_GEMM_AUTOTUNE"
CACHE_ENV = "JAX_FP8_GEMM_CACHE"

_lock = threading.Lock()
_installed: set = set()  # (device, problem) chosen in the CUDA extension in this process
_recorded: dict[pathlib.Path, dict] = {}  # each file's choices, read once


def autotune() -> bool:
  """Whether candidates are timed (``JAX_FP8_GEMM_AUTOTUNE``); ValueError unless 0 or 1."""
  value = os.environ.get(AUTOTUNE_ENV, "1")
  if value not in ("0", "1"):
    raise ValueError(f"{AUTOTUNE_ENV} must be 0 or 1, got {value!r}")
  return value == "1"


def cache_path() -> pathlib.Path | None:
  """The file of recorded choices (``JAX_FP8_GEMM_CACHE``), or None for no file."""
  value = os.environ.get(CACHE_ENV)
  if value is None:
    home = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(home) / "jax_fp8" / "gemm_algorithms.jsonl"
  return pathlib.Path(value) if value else None


def _read(path: pathlib.Path | None) -> dict:
  """{(device, problem): algorithm bytes} of a file, the first line of each key kept; lines
  that are not a record are skipped with a warning."""
  if path is None:
    return {}
  if path not in _recorded:
    found = {}
    lines = path.read_text().splitlines() if path.exists() else []
    for number, line in enumerate(lines, 1):
      try:
        r = json.loads(line)
        key = (r["device"], tuple(r["problem"]))
        found.setdefault(key, bytes.fromhex(r["algorithm"]))
      except (ValueError, KeyError, TypeError) as e:
        warnings.warn(f"{path}:{number} is not a GEMM algorithm record ({e!r}); skipped",
                      stacklevel=4)
    _recorded[path] = found
  return _recorded[path]


def _record(path: pathlib.Path | None, key, algorithm: bytes, candidates_us) -> None:
  """Appends one record (one write of one line, so concurrent processes do not interleave)."""
  if path is None:
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  line = json.dumps({"device": key[0], "problem": list(key[1]), "algorithm": algorithm.hex(),
                     "candidates_us": candidates_us}) + "\n"
  with open(path, "a") as f:
    f.write(line)
  _recorded.setdefault(path, {}).setdefault(key, algorithm)


def _devices() -> list[tuple[int, str]]:
  """(CUDA ordinal, identity) of the first visible device of each kind."""
  first = {}
  for ordinal, identity in enumerate(_ffi._jax_fp8_cuda.gemm_devices()):
    first.setdefault(identity, ordinal)
  return [(o, i) for i, o in first.items()]


def select(problem: tuple) -> None:
  """Chooses the algorithm of a CUDA GEMM problem on every kind of visible device, before the
  GEMM runs: the recorded choice, else the fastest candidate (timed now and recorded). A no-op
  without CUDA GPUs or with ``JAX_FP8_GEMM_AUTOTUNE=0``.

  Args:
    problem: ``(m, n, k, a_dtype, b_dtype, out_dtype, has_bias, fast_accum, scale_mode)`` as
      the handler sees it: per-device sizes, numpy dtype names, bools and the scale mode id.
  Raises:
    ValueError: ``JAX_FP8_GEMM_AUTOTUNE`` other than 0 or 1.
  """
  if not autotune() or not _ffi.cuda_available():
    return
  path = cache_path()
  with _lock:
    for ordinal, device in _devices():
      key = (device, problem)
      if key in _installed:
        continue
      algorithm = _read(path).get(key)
      if algorithm is None:
        try:
          candidates, us, best = _ffi._jax_fp8_cuda.gemm_tune(ordinal, *problem)
        except RuntimeError as e:
          warnings.warn(f"could not time cuBLASLt's algorithms for the GEMM {problem} on "
                        f"{device} ({e}); it runs cuBLASLt's first heuristic choice",
                        stacklevel=3)
          _installed.add(key)
          continue
        algorithm = candidates[best]
        _record(path, key, algorithm, us)
      _ffi._jax_fp8_cuda.gemm_choose(device, *problem, algorithm)
      _installed.add(key)
