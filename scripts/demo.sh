#!/usr/bin/env bash
# Sets everything up, then trains the demo model in FP8 and BF16 on this machine's device.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m jax_fp8.demo "$@"
