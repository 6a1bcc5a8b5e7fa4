#!/bin/sh
# The GPU run (issue 64): every CUDA path of ringcheck in one go, from the source tree (no install).
#   benchmarks/gpu_run.sh [--budget-s 480] [--only STAGE ...] [--list]
# Results under $OUT (or reports/gpu/); see benchmarks/gpu_run.py.
cd "$(dirname "$0")/.." || exit 2
PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}" exec "${PYTHON:-python3}" -m benchmarks.gpu_run "$@"
