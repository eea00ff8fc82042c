#!/usr/bin/env bash
# Sets everything up, then runs the test suite (CUDA cases run only where a GPU is present) in
# one pytest-xdist worker per core, four at most (TEST_WORKERS overrides: 0 runs in this process).
# Arguments go to pytest: `--quick` runs the quick tier for the edit-test loop (tests/conftest.py's
# QUICK: every op, linear per recipe, the layers, at small shapes); no flag runs everything (CI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
workers=${TEST_WORKERS:-auto}
exec "${PYTHON:-python3}" -m pytest tests -q -p no:cacheprovider -n "$workers" --maxprocesses 4 \
  --dist worksteal "$@"
