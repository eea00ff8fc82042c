"""A machine with a CUDA GPU must have jax_fp8's CUDA targets: where the extension failed to
build or load, every CUDA case would otherwise be skipped as on a machine without a GPU, and a
broken build would look green. This test fails there, with the extension's import error."""

import os
import shutil
import subprocess

import jax_fp8
from jax_fp8 import _ffi


def visible_gpus() -> list[str]:
  """The NVIDIA GPUs the system shows (``nvidia-smi -L``'s lines, or the device nodes), whatever
  JAX or jax_fp8 make of them."""
  if shutil.which("nvidia-smi"):
    try:
      out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
      gpus = [line for line in out.stdout.splitlines() if line.startswith("GPU ")]
      if gpus:
        return gpus
    except (OSError, subprocess.SubprocessError):
      pass
  return [f"/dev/{d}" for d in sorted(os.listdir("/dev"))
          if d.startswith("nvidia") and d[6:].isdigit()] if os.path.isdir("/dev") else []


def test_cuda_targets_load_where_a_gpu_is_visible():
  gpus = visible_gpus()
  if not gpus:
    # Nothing to check: no NVIDIA GPU is visible, so the CUDA cases skip for a true reason.
    assert not jax_fp8.cuda_available()
    print("no NVIDIA GPU visible (nvidia-smi -L lists none, no /dev/nvidiaN): CPU-only machine")
    return
  assert jax_fp8.cuda_available(), (
      f"{len(gpus)} NVIDIA GPU(s) visible ({gpus[0]}), but jax_fp8's CUDA targets are not "
      f"available, so every CUDA test would be skipped: "
      f"{_ffi.cuda_problem() or 'JAX sees no CUDA device (is jax[cuda] installed?)'}; "
      f"CUDA extension import error: {_ffi.CUDA_IMPORT_ERROR}")
