#!/usr/bin/env bash
# The GPU paths of tether in one run (benchmarks/gpu_check.py): under 8 minutes on one GPU;
# on a CPU-only machine it runs what it can and prints its skips. Exit status 1 when a
# section failed, 0 otherwise. Output for docs/performance.md.
#   bash benchmarks/gpu_check.sh [--only tiny,async]
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
command -v "$PYTHON" >/dev/null || PYTHON=python3
"$PYTHON" benchmarks/gpu_check.py "$@"
