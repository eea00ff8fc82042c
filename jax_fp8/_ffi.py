"""The one module that touches the compiled extensions: registers every FFI target and reads
the constants Python and C++ share (``CONSTANTS``).

`_jax_fp8_cpu` is always built and registered for "cpu". `_jax_fp8_cuda` is built when nvcc was
present at install time and is registered for "CUDA" only when it imports (it needs cuBLASLt);
`import jax_fp8` works on a machine without a GPU or CUDA libraries.
"""

from __future__ import annotations

import functools

import jax

from . import _jax_fp8_cpu

try:
  from . import _jax_fp8_cuda
except ImportError as e:  # no CUDA extension built, or cuBLASLt missing
  _jax_fp8_cuda = None
  CUDA_IMPORT_ERROR: str | None = str(e)
else:
  CUDA_IMPORT_ERROR = None

# The numbers and ids written once in csrc/constants.h (scratch and workspace sizes, tiles,
# attribute ids); the CUDA module must agree (else it is a stale build and is not used).
CONSTANTS: dict = dict(_jax_fp8_cpu.constants())
if _jax_fp8_cuda is not None and dict(_jax_fp8_cuda.constants()) != CONSTANTS:
  CUDA_IMPORT_ERROR = "the CUDA and CPU extensions were built from different sources: reinstall"
  _jax_fp8_cuda = None

for _name, _capsule in _jax_fp8_cpu.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
if _jax_fp8_cuda is not None:
  for _name, _capsule in _jax_fp8_cuda.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


MIN_COMPUTE_CAPABILITY = (8, 9)  # FP8 conversions and tensor cores: Ada, Hopper and newer


@functools.cache
def cuda_problem() -> str | None:
  """Why the CUDA targets cannot serve this machine's GPUs, or None when they can (or when
  there is no CUDA GPU, where nothing is asked of them)."""
  try:
    gpus = jax.devices("cuda")
  except RuntimeError:
    return None
  if _jax_fp8_cuda is None:
    return (f"JAX runs on CUDA GPUs but jax_fp8's CUDA extension did not load "
            f"({CUDA_IMPORT_ERROR}); reinstall jax_fp8 with nvcc on the PATH")
  for d in gpus:
    cc = tuple(int(v) for v in str(d.compute_capability).split("."))
    if cc < MIN_COMPUTE_CAPABILITY:
      return (f"{d.device_kind} (compute capability {d.compute_capability}) has no FP8 "
              f"support; jax_fp8 needs compute capability 8.9 or newer")
  return None


def cuda_available() -> bool:
  """True when JAX sees CUDA GPUs and jax_fp8's CUDA targets can run on all of them."""
  try:
    return len(jax.devices("cuda")) > 0 and cuda_problem() is None
  except RuntimeError:
    return False


def check_backend() -> None:
  """Raise RuntimeError at trace time when ops would lower for a GPU they cannot run on."""
  problem = cuda_problem() if jax.default_backend() == "gpu" else None
  if problem:
    raise RuntimeError(problem)
