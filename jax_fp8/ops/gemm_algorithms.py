"""Which cuBLASLt algorithm each CUDA GEMM runs: cuBLASLt's candidates for a GEMM problem timed
once, the fastest kept for the process and recorded in a file that later runs read, so that a
problem runs the same algorithm, and gives the same bits, run after run (XLA's autotuning of
its own GEMMs, with its results file, is the model).

A problem is what fixes the choice: M, N, K, the operand and output dtypes, the bias, fast
accumulation and the scale mode, on a kind of device (name, compute capability, SM count,
cuBLASLt version, workspace size). ``jax_fp8.gemm`` calls :func:`select` while it traces a CUDA
GEMM (also when the jit is placed on a CPU of a machine with GPUs: tracing cannot tell); the
timing (``csrc/ffi/gemm_tuning.cc``) runs then, outside any XLA computation, on buffers and a
stream of its own, on the first of JAX's GPUs of each kind, at most once per problem in a
process. The FFI handler only looks the choice up, so an execution never times, allocates or
synchronizes. An executable that is deserialized rather than traced runs the choices this
process made, else cuBLASLt's first heuristic choice.

Environment (read at each trace):
  ``JAX_FP8_GEMM_AUTOTUNE``: ``1`` (default) times the candidates; ``0`` takes cuBLASLt's
  first heuristic choice, untimed, for problems not chosen yet in this process, and neither
  reads nor writes the file.
  ``JAX_FP8_GEMM_CACHE``: the file of choices (JSON lines with every candidate's time, appended
  under a file lock; the first record of a problem wins, also for processes that timed it at
  the same time); default ``$XDG_CACHE_HOME/jax_fp8/gemm_algorithms.jsonl`` (``~/.cache``
  when unset); empty: no file, so each process times again and may choose differently.

Where the timing cannot run (no free device memory for its buffers), a warning says so and the
GEMM takes cuBLASLt's first heuristic choice, not recorded; a file that cannot be read or
written, or lines that are not records, are skipped with a warning.
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import threading
import warnings

import jax

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
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(home) / "jax_fp8" / "gemm_algorithms.jsonl"
  return pathlib.Path(value) if value else None


ALGORITHM_BYTES = _ffi.CONSTANTS["gemm_algorithm_bytes"]  # sizeof(cublasLtMatmulAlgo_t)


def _parse(path: pathlib.Path, text: str, warn: bool = True) -> dict:
  """{(device, problem): algorithm bytes} of a file's text, the first record of each key kept;
  lines that are not a record are skipped (with a warning if ``warn``)."""
  found = {}
  for number, line in enumerate(text.splitlines(), 1):
    try:
      r = json.loads(line)
      key, algorithm = (r["device"], tuple(r["problem"])), bytes.fromhex(r["algorithm"])
      if len(algorithm) != ALGORITHM_BYTES:
        raise ValueError(f"an algorithm of {len(algorithm)} bytes, not {ALGORITHM_BYTES}")
      found.setdefault(key, algorithm)
    except (ValueError, KeyError, TypeError) as e:
      if warn:
        warnings.warn(f"{path}:{number} is not a GEMM algorithm record ({e!r}); skipped",
                      stacklevel=5)
  return found


def _read(path: pathlib.Path | None) -> dict:
  """The file's choices, read once per process; a file that cannot be read is no file (with a
  warning)."""
  if path is None:
    return {}
  if path not in _recorded:
    try:
      text = path.read_text() if path.exists() else ""
    except (OSError, UnicodeDecodeError) as e:
      warnings.warn(f"cannot read the GEMM algorithm file {path} ({e!r}); ignored", stacklevel=4)
      text = ""
    _recorded[path] = _parse(path, text)
  return _recorded[path]


def _record(path: pathlib.Path | None, key, algorithm: bytes, candidates_us) -> bytes:
  """The problem's algorithm from now on: the file's first record of it, re-read under an
  exclusive lock (another process may have timed it meanwhile), else ours, appended. A file
  that cannot be written is skipped with a warning."""
  if path is None:
    return algorithm
  line = json.dumps({"device": key[0], "problem": list(key[1]), "algorithm": algorithm.hex(),
                     "candidates_us": candidates_us}) + "\n"
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
      fcntl.flock(f, fcntl.LOCK_EX)
      f.seek(0)
      now = _parse(path, f.read(), warn=False)  # warned when first read
      if key not in now:
        f.write(line)
        now[key] = algorithm
  except (OSError, UnicodeDecodeError) as e:
    warnings.warn(f"cannot record a GEMM algorithm in {path} ({e!r}); later runs time it "
                  f"again", stacklevel=4)
    return algorithm
  _recorded[path] = now
  return now[key]


def _gpu_ordinals() -> list[int]:
  """The CUDA ordinals of the GPUs this process's JAX uses."""
  return [d.local_hardware_id for d in jax.local_devices(backend="gpu")]


def _devices() -> list[tuple[int, str]]:
  """(CUDA ordinal, identity) of the first of JAX's GPUs of each kind."""
  first = {}
  for ordinal in _gpu_ordinals():
    first.setdefault(_ffi._jax_fp8_cuda.gemm_device(ordinal), ordinal)
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
        algorithm = _record(path, key, candidates[best], us)
      _ffi._jax_fp8_cuda.gemm_choose(device, *problem, algorithm)
      _installed.add(key)
