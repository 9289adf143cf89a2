#!/usr/bin/env bash
# The GPU path in one short run (NCCL training, save, SIGKILL, resume, rollback, eval), for a
# machine with a GPU; without one it prepares the data and says where CUDA is required.
# Stages and flags: bench/gpu_check.py (--cpu runs the same stages on gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
exec "${PYTHON:-python}" bench/gpu_check.py "$@"
