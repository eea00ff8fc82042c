"""Which algorithm each CUDA GEMM runs: the candidates for a GEMM problem timed once, the fastest
kept for the process and recorded in a file that later runs read, so that a problem runs the
same algorithm, and gives the same bits, run after run (XLA's autotuning of its own GEMMs, with
its results file, is the model). The candidates are up to 8 of cuBLASLt's heuristic list and,
for a block-scaled GEMM (e4m3 operands, a bf16, f16 or f32 output) on sm_90, jax_fp8's own
kernels (``KERNELS``: ``csrc/kernels/block_gemm.cuh``, one per tile width and cluster size).

A problem is what fixes the choice: M, N, K, the operand and output dtypes, the bias, fast
accumulation and the scale mode, on a kind of device (name, compute capability, SM count,
cuBLASLt version, workspace size, the revision of jax_fp8's kernels). ``jax_fp8.gemm`` calls
:func:`select` while it traces a CUDA GEMM (also when the jit is placed on a CPU of a machine
with GPUs: tracing cannot tell); the timing (``csrc/ffi/gemm_tuning.cc``) runs then, outside
any XLA computation, on buffers and a stream of its own, on the first of JAX's GPUs of each
kind, at most once per problem in a process. Where one of jax_fp8's kernels wins, ``gemm``
emits a call of it by name (the FFI target ``jax_fp8_block_gemm``); else it emits cuBLASLt's
call, whose handler looks up cuBLASLt's fastest candidate, so an execution never times,
allocates or synchronizes. An executable that is deserialized rather than traced runs the
kernel it names, or the cuBLASLt choices this process made, else cuBLASLt's first heuristic
choice.

Environment (read at each trace):
  ``JAX_FP8_GEMM_AUTOTUNE``: ``1`` (default) times the candidates; ``0`` takes cuBLASLt's
  first heuristic choice, untimed, for problems not chosen yet in this process, and neither
  reads nor writes the file (jax_fp8's kernels then run only where ``gemm``'s ``algorithm``
  names one).
  ``JAX_FP8_GEMM_CACHE``: the file of choices (JSON lines with every candidate's time, appended
  under a file lock; the first record of a problem wins, also for processes that timed it at
  the same time); default ``$XDG_CACHE_HOME/jax_fp8/gemm_algorithms.jsonl`` (``~/.cache``
  when unset); empty: no file, so each process times again and may choose differently.

Where the timing cannot run (no free device memory for its buffers), a warning says so and the
GEMM takes cuBLASLt's first heuristic choice, not recorded; a file that cannot be read or
written, lines that are not records, and records of a kernel this build lacks are skipped with
a warning (the last are timed again).
"""

from __future__ import annotations

import fcntl
import json
import os
import pathlib
import threading
import warnings

import dataclasses

import jax

from .. import _ffi

AUTOTUNE_ENV = "JAX_FP8_GEMM_AUTOTUNE"
CACHE_ENV = "JAX_FP8_GEMM_CACHE"

# jax_fp8's block-scaled GEMM kernels (csrc/constants.h kBlockGemmKernels), by name:
# "sm90_128x<BLOCK_N>_c<cluster>", 128 x BLOCK_N output tiles, clusters of 1 or 2 CTAs along M.
KERNELS: tuple[str, ...] = _ffi.CONSTANTS["block_gemm_kernels"]


@dataclasses.dataclass(frozen=True)
class Choice:
  """A problem's choice: cuBLASLt's fastest candidate (its bytes; None where none ran) and,
  where one of jax_fp8's kernels was faster still, that kernel's name (else None)."""
  algorithm: bytes | None
  kernel: str | None


_lock = threading.Lock()
_installed: dict = {}  # (device, problem) -> the kernel chosen (or None) in this process
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
  """{(device, problem): Choice} of a file's text, the first record of each key kept; lines
  that are not a record are skipped (with a warning if ``warn``)."""
  found = {}
  for number, line in enumerate(text.splitlines(), 1):
    try:
      r = json.loads(line)
      key, kernel = (r["device"], tuple(r["problem"])), r.get("kernel")
      algorithm = None if r["algorithm"] is None else bytes.fromhex(r["algorithm"])
      if algorithm is not None and len(algorithm) != ALGORITHM_BYTES:
        raise ValueError(f"an algorithm of {len(algorithm)} bytes, not {ALGORITHM_BYTES}")
      if not (kernel is None or isinstance(kernel, str)):
        raise ValueError(f"a kernel name that is not a string: {kernel!r}")
      if algorithm is None and kernel is None:
        raise ValueError("neither an algorithm nor a kernel")
      found.setdefault(key, Choice(algorithm, kernel))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
      if warn:
        warnings.warn(f"{path}:{number} is not a GEMM algorithm record ({e!r}); skipped",
                      stacklevel=6)
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
      warnings.warn(f"cannot read the GEMM algorithm file {path} ({e!r}); ignored", stacklevel=5)
      text = ""
    _recorded[path] = _parse(path, text)
  return _recorded[path]


def _record(path: pathlib.Path | None, key, choice: Choice, candidates_us: dict) -> Choice:
  """The problem's choice from now on: the file's first record of it, re-read under an
  exclusive lock (another process may have timed it meanwhile), else ours, appended. A file
  that cannot be written is skipped with a warning."""
  if path is None:
    return choice
  algorithm = None if choice.algorithm is None else choice.algorithm.hex()
  line = json.dumps({"device": key[0], "problem": list(key[1]), "algorithm": algorithm,
                     "kernel": choice.kernel, "candidates_us": candidates_us}) + "\n"
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
      fcntl.flock(f, fcntl.LOCK_EX)
      f.seek(0)
      now = _parse(path, f.read(), warn=False)  # warned when first read
      if key not in now:
        f.write(line)
        now[key] = choice
  except (OSError, UnicodeDecodeError) as e:
    warnings.warn(f"cannot record a GEMM algorithm in {path} ({e!r}); later runs time it "
                  f"again", stacklevel=5)
    return choice
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


def _fastest(algorithms, us, kernels, kernel_us) -> tuple[Choice, dict]:
  """The Choice of a timing (gemm_tune's four lists) and every candidate's time by name."""
  def best(times):
    ran = [i for i, t in enumerate(times) if t >= 0]
    return min(ran, key=lambda i: times[i]) if ran else None
  lt, ours = best(us), best(kernel_us)
  kernel = (kernels[ours] if ours is not None and (lt is None or kernel_us[ours] < us[lt])
            else None)
  times = {f"cublaslt_{i}": t for i, t in enumerate(us)} | dict(zip(kernels, kernel_us))
  return Choice(None if lt is None else algorithms[lt], kernel), times


def _choose(ordinal: int, device: str, problem: tuple, path) -> str | None:
  """The kernel chosen for a problem on one kind of device (None: cuBLASLt), cuBLASLt's
  fastest candidate installed in the CUDA extension: the recorded choice, else a timing's,
  recorded."""
  key = (device, problem)
  ext = _ffi._jax_fp8_cuda
  choice = _read(path).get(key)
  lacking = choice is not None and choice.kernel is not None and choice.kernel not in KERNELS
  if lacking:
    warnings.warn(f"{path} records for the GEMM {problem} on {device} the kernel "
                  f"{choice.kernel!r}, which this build lacks; timed again, not recorded",
                  stacklevel=4)
  if choice is None or lacking:
    try:
      timed, times = _fastest(*ext.gemm_tune(ordinal, *problem))
    except RuntimeError as e:
      warnings.warn(f"could not time the algorithms for the GEMM {problem} on {device} ({e}); "
                    f"it runs cuBLASLt's first heuristic choice", stacklevel=4)
      return None
    choice = timed if lacking else _record(path, key, timed, times)
  if choice.algorithm is not None:
    ext.gemm_choose(device, *problem, choice.algorithm)
  return choice.kernel


def select(problem: tuple) -> str | None:
  """Chooses the algorithm of a CUDA GEMM problem on every kind of visible device, before the
  GEMM runs: the recorded choice, else the fastest candidate (timed now and recorded). A no-op
  without CUDA GPUs or with ``JAX_FP8_GEMM_AUTOTUNE=0``.

  Args:
    problem: ``(m, n, k, a_dtype, b_dtype, out_dtype, has_bias, fast_accum, scale_mode)`` as
      the handler sees it: per-device sizes, numpy dtype names, bools and the scale mode id.
  Returns:
    The name of jax_fp8's kernel (one of ``KERNELS``) where every kind of device chose that
    one, else None: the GEMM runs cuBLASLt's choice.
  Raises:
    ValueError: ``JAX_FP8_GEMM_AUTOTUNE`` other than 0 or 1.
  """
  if not autotune() or not _ffi.cuda_available():
    return None
  path = cache_path()
  with _lock:
    kernels = set()
    for ordinal, device in _devices():
      key = (device, problem)
      if key not in _installed:
        _installed[key] = _choose(ordinal, device, problem, path)
      kernels.add(_installed[key])
  return kernels.pop() if len(kernels) == 1 else None
