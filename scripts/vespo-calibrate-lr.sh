#!/usr/bin/env bash
# The per-version token k3 of E-VESPO's testbed at each learning rate given (issue 13 asks
# for about 1e-3; experiments/vespo.py LR records the result).
#
#   bash scripts/vespo-calibrate-lr.sh 1e-4 5e-5      (about 25 s per rate; runs/vespo_calib/)
#
# Each rate trains vespo for 8 rollout batches of 8 prompts x 8 at N = 2 (two optimizer
# mini-batches per batch) on the experiment's task keys and its cached 900-step warm start
# (built on first use, about 21 minutes). The logged `staleness/k3_kl/mean` averages
# mini-batch 0 (k3 = 0) and mini-batch 1 (one version stale): per version it is twice that.
set -euo pipefail
cd "$(dirname "$0")/.."
# The experiment's own task keys (experiments/vespo.py TASK and GROUP), not a copy of them.
TASK=$(.venv/bin/python -c "from tether.experiments import vespo
print(' '.join(vespo.TASK + [f'rollout.group_size={vespo.GROUP}']))")
for lr in "$@"; do
  d=runs/vespo_calib/lr$lr
  rm -rf "$d"; mkdir -p runs/vespo_calib
  # shellcheck disable=SC2086
  .venv/bin/tether train $TASK train.lr="$lr" train.estimator=vespo rollout.prompts_per_step=8 \
    train.minibatches=2 train.steps=8 eval.every=0 eval.samples=0 diagnostics.monitor_every=0 \
    run.threads=1 run.checkpoint_every=0 run.dir="$d" > "$d.log" 2>&1 || { tail "$d.log"; exit 1; }
  .venv/bin/python - "$d" "$lr" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1] + "/metrics.jsonl")]
k = [2 * r["staleness/k3_kl/mean"] for r in rows if "staleness/k3_kl/mean" in r]
print(f"lr {sys.argv[2]}: per-version k3 median {statistics.median(k):.2e} "
      f"(range {min(k):.2e} to {max(k):.2e}, {len(k)} batches)")
PY
done
