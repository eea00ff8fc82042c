"""The one module that touches the compiled extensions: registers every FFI target.

`_jax_fp8_cpu` is always built and registered for "cpu". `_jax_fp8_cuda` is built when nvcc was
present at install time and is registered for "CUDA" only when it imports (it needs cuBLASLt);
`import jax_fp8` works on a machine without a GPU or CUDA libraries.
"""

from __future__ import annotations

import jax

from . import _jax_fp8_cpu

try:
  from . import _jax_fp8_cuda
except ImportError as e:  # no CUDA extension built, or cuBLASLt missing
  _jax_fp8_cuda = None
  CUDA_IMPORT_ERROR: str | None = str(e)
else:
  CUDA_IMPORT_ERROR = None

for _name, _capsule in _jax_fp8_cpu.registrations().items():
  jax.ffi.register_ffi_target(_name, _capsule, platform="cpu")
if _jax_fp8_cuda is not None:
  for _name, _capsule in _jax_fp8_cuda.registrations().items():
    jax.ffi.register_ffi_target(_name, _capsule, platform="CUDA")


def cuda_available() -> bool:
  """True when the CUDA targets are registered and JAX sees a CUDA GPU."""
  if _jax_fp8_cuda is None:
    return False
  try:
    return len(jax.devices("cuda")) > 0
  except RuntimeError:
    return False
