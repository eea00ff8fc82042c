"""The core library imports with jax, numpy and ml_dtypes only: no Flax until jax_fp8.flax."""

import subprocess
import sys


def test_core_import_needs_no_flax():
  code = ("import sys, jax_fp8; assert 'flax' not in sys.modules, 'flax imported'; "
          "import jax_fp8.flax; assert 'flax' in sys.modules")
  subprocess.run([sys.executable, "-c", code], check=True)
