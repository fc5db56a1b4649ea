"""The prompt ledger: every prompt issued is trained exactly once or dropped with a reason.

RUN_DIR/ledger.jsonl, one JSON object per prompt and event (asynchronous loop):

    {"event": "issued",  "prompt": 17, "attempt": 0, "slot": 2, "version": 1, ...}
    {"event": "trained", "prompt": 17, "attempt": 0, "slot": 2, "version": 3,
     "staleness_mean": 1.6, "staleness_max": 2, ...}
    {"event": "dropped", "prompt": 17, "attempt": 0, "slot": 2, "reason": "in_flight_at_stop"}

`prompt` is the training problem's index (task.train_problem), `attempt` counts its
issues (a dropped prompt is issued again as the next attempt), `slot` the rollout batch
it travelled in, `version` the weights published when it was issued (the oldest a worker
may sample it with) and, for `trained`, the trainer's version when its training started;
`staleness_*` are versions between that and the versions that sampled its tokens.

Drop reasons: `in_flight_at_stop` (issued or generated but not trained when the run
stopped; re-issued on resume), `ess_trip_regenerated` (its batch tripped the ESS re-sync
with sync.on_trip=regenerate; re-issued at once), `over_staleness_bound` (would be
trained more than loop.max_staleness versions after its weights; re-issued),
`outside_window` (its turn came with its staleness beyond the window in force, shrunk by
an ESS trip; re-issued at once), `sampled_before_resync` (sampled before an ESS re-sync,
loop.after_trip=regenerate; re-issued at once at the new weights), `worker_died` (its
rollout worker died before returning it, loop.backend=ray; the worker is replaced and
the prompts re-issued at once).

A checkpoint stores the ledger's length; resuming truncates the file to it, so the ledger
always agrees with the weights it is resumed with. `audit` checks the whole history.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DROP_REASONS = ("in_flight_at_stop", "ess_trip_regenerated", "over_staleness_bound",
                "outside_window", "sampled_before_resync", "worker_died")


class Ledger:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a")  # noqa: SIM115 - held for the run, closed by close()

    def issued(self, slot: int, attempts: list[tuple[int, int]], version: int) -> None:
        self._write([{"event": "issued", "prompt": p, "attempt": a, "slot": slot,
                      "version": version} for p, a in attempts])

    def trained(self, slot: int, attempts: list[tuple[int, int]], version: int,
                staleness: list[tuple[float, int]]) -> None:
        """`staleness`: per prompt, the mean and max versions behind over its tokens."""
        self._write([{"event": "trained", "prompt": p, "attempt": a, "slot": slot,
                      "version": version, "staleness_mean": round(m, 4), "staleness_max": x}
                     for (p, a), (m, x) in zip(attempts, staleness)])

    def dropped(self, slot: int, attempts: list[tuple[int, int]], reason: str) -> None:
        assert reason in DROP_REASONS, reason
        self._write([{"event": "dropped", "prompt": p, "attempt": a, "slot": slot,
                      "reason": reason} for p, a in attempts])

    def offset(self) -> int:
        """Bytes written so far (what a checkpoint stores)."""
        self._f.flush()
        return self._f.tell()

    def truncate(self, offset: int) -> None:
        """Forget events after `offset` (resuming from a checkpoint taken there)."""
        self._f.flush()
        self._f.truncate(offset)
        self._f.seek(offset)

    def close(self) -> None:
        self._f.close()

    def _write(self, events: list[dict[str, Any]]) -> None:
        now = round(time.time(), 3)
        self._f.write("".join(json.dumps({**e, "time": now}) + "\n" for e in events))
        self._f.flush()
        os.fsync(self._f.fileno())


@dataclass
class Audit:
    issued: int  # prompt attempts issued
    trained: int  # prompts trained
    dropped: Counter  # reason -> prompt attempts dropped
    open: list[tuple[int, int]]  # attempts issued with no outcome yet (in flight)
    problems: list[str]  # violations: trained twice, an outcome without an issue, ...
    max_staleness: int  # over trained prompts' tokens
    awaiting_reissue: list[tuple[int, int]]  # dropped attempts whose next was never issued

    @property
    def ok(self) -> bool:
        return not self.problems


def audit(path: str | Path) -> Audit:
    """Check a ledger: each attempt issued once and ended at most once, attempt k issued only
    after attempt k-1 was dropped, each prompt trained at most once, every drop with a known
    reason; list attempts still open and drops not yet issued again (after a completed run,
    both empty; after a stop, the drops wait for --resume)."""
    events = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    issued: Counter = Counter()
    ended: dict[tuple[int, int], str] = {}
    trained: Counter = Counter()
    dropped: Counter = Counter()
    problems: list[str] = []
    max_stale = 0
    for e in events:
        key = (e["prompt"], e["attempt"])
        if e["event"] == "issued":
            issued[key] += 1
            if issued[key] > 1:
                problems.append(f"prompt {key[0]} attempt {key[1]} issued twice")
            if key[1] > 0 and ended.get((key[0], key[1] - 1)) != "dropped":
                problems.append(f"prompt {key[0]} attempt {key[1]} issued before attempt "
                                f"{key[1] - 1} was dropped")
            continue
        if key not in issued:
            problems.append(f"prompt {key[0]} attempt {key[1]} {e['event']} but never issued")
        if key in ended:
            problems.append(f"prompt {key[0]} attempt {key[1]} {e['event']} after {ended[key]}")
        ended[key] = e["event"]
        if e["event"] == "trained":
            trained[key[0]] += 1
            max_stale = max(max_stale, e["staleness_max"])
        elif e.get("reason") not in DROP_REASONS:
            problems.append(f"prompt {key[0]} attempt {key[1]} dropped without a known reason")
        else:
            dropped[e["reason"]] += 1
    problems += [f"prompt {p} trained {n} times" for p, n in trained.items() if n > 1]
    still_open = sorted(k for k in issued if k not in ended)
    awaiting = sorted((p, a) for (p, a), how in ended.items()
                      if how == "dropped" and (p, a + 1) not in issued)
    return Audit(sum(issued.values()), sum(trained.values()), dropped, still_open, problems,
                 max_stale, awaiting)
