#!/usr/bin/env bash
# The per-version token k3 of E-VESPO's testbed at each learning rate given (issue 13 asks
# for about 1e-3; experiments/vespo.py LR records the result, CHAIN_LR on chains).
#
#   bash scripts/vespo-calibrate-lr.sh 1e-4 5e-5      (about 40 s per rate; runs/vespo_calib/)
#   VESPO_PROTOCOL=SWEEP bash scripts/vespo-calibrate-lr.sh 2e-4   (the sweep's 32 x 8 mini-batch)
#   VESPO_PROTOCOL=CHAIN bash scripts/vespo-calibrate-lr.sh 4e-5   (chains: about 200 s per rate)
#
# Each rate trains vespo for 8 rollout batches of two of the experiment's optimizer
# mini-batches (N = 2) on its task keys and its cached warm start (built on first use,
# about 20 minutes). The logged `staleness/k3_kl/mean` averages mini-batch 0 (k3 = 0) and
# mini-batch 1 (one version stale): per version it is twice that.
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the comment above is the help
  sed -n '2,/^set /p' "$0" | sed -n 's/^# \{0,1\}//p'; exit 0
fi
cd "$(dirname "$0")/.."
# The protocol's own task keys and mini-batch (experiments/vespo.py), not a copy of them.
TASK=$(VESPO_PROTOCOL="${VESPO_PROTOCOL:-DEFAULT}" .venv/bin/python -c "import os
from tether.experiments import vespo
p = getattr(vespo, os.environ['VESPO_PROTOCOL'])
print(' '.join(vespo.TASKS[p.task] + ['sync.policy=every:1', f'rollout.group_size={p.group}',
                                     f'rollout.prompts_per_step={2 * p.prompts}']))")
for lr in "$@"; do
  d=runs/vespo_calib/${VESPO_PROTOCOL:-DEFAULT}-lr$lr
  rm -rf "$d"; mkdir -p runs/vespo_calib
  # shellcheck disable=SC2086
  .venv/bin/tether train $TASK train.lr="$lr" train.estimator=vespo \
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
