#!/usr/bin/env bash
# Sets everything up, then runs the test suite (CUDA cases run only where a GPU is present).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m pytest tests -q -p no:cacheprovider "$@"
