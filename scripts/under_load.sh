#!/usr/bin/env bash
# Run a command ROUNDS times with every core held busy by another process, the way CI
# sometimes runs (docs/testing.md, "Under load"). Stops at the first failing round.
#   scripts/under_load.sh 5 .venv/bin/python -m pytest -q tests/test_ray.py
#   BUSY=1 scripts/under_load.sh 1 .venv/bin/tether train --config configs/ray.yaml train.steps=4
# BUSY: how many CPU-bound processes run beside the command (default: one per core).
set -euo pipefail
rounds=${1:?usage: under_load.sh ROUNDS COMMAND...}
shift
busy=${BUSY:-$(nproc)}
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for _ in $(seq "$busy"); do
    python3 -c 'while True: pass' &
    pids+=($!)
done
echo "under load: $busy busy process(es) beside the command, $rounds round(s)"
for round in $(seq "$rounds"); do
    start=$(date +%s)
    if "$@"; then
        echo "round $round/$rounds passed in $(( $(date +%s) - start )) s"
    else
        status=$?
        echo "round $round/$rounds FAILED (exit $status) after $(( $(date +%s) - start )) s"
        exit "$status"
    fi
done
echo "all $rounds round(s) passed under load"
