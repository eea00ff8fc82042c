#!/usr/bin/env bash
# Installs jax_fp8 and what it needs into the current Python environment (use a virtualenv if
# you like: PYTHON=.venv/bin/python). An installed JAX (e.g. jax[cuda13]) is kept as it is.
# When nvcc is on the PATH the CUDA extension is built too; if the CUDA toolkit has no cuBLAS
# headers, the nvidia-cublas wheel (the one jax[cuda] uses) provides them, and the
# nvidia-cutlass wheel CUTLASS's headers (its Python package's own needs are not installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
pip_install "jax>=0.10" "flax>=0.12.8" orbax-checkpoint optax numpy matplotlib tqdm pytest pytest-xdist hypothesis \
  "scikit-build-core>=0.10" "nanobind>=2.0"
if command -v nvcc >/dev/null; then
  cuda_inc="$(dirname "$(dirname "$(command -v nvcc)")")/include"
  [ -f "$cuda_inc/cublasLt.h" ] || pip_install nvidia-cublas
  pip_install --no-deps "nvidia-cutlass>=4.2,<5"
fi
pip_install --no-build-isolation --no-deps -e .
"$PY" -c "import jax, jax_fp8; print('jax', jax.__version__, 'on', jax.default_backend(), \
'| jax_fp8 CUDA kernels:', jax_fp8.cuda_available())"
