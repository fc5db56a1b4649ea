"""The asynchronous loop's bookkeeping: admission, training order, publishing, the ledger.

Admission control (AReaL's rule, DESIGN.md section 4). Batches are trained in the order
they were issued (slots 0, 1, 2, ...), each taking `train.minibatches` N versions, so a
new slot's training starts at most at V + N * (slots issued and not yet trained), V the
trainer's version now. A worker samples it with the newest published version, never
older than the one published when it was issued (`WorkItem.min_version`). A slot is
issued only while that start minus the published version is <= W, the window in force
(tether.weights.window: eta = loop.max_staleness, or with loop.window=ess the window the
ESS governs, at most eta): no trained token is more than eta versions stale, and with a
fixed window no rollout is made only to be thrown away.

At its turn a batch is checked against the rules (`out_of_bounds`): staleness beyond the
window in force (an ESS trip shrank it after the batch was admitted) drops it as
`outside_window`; with loop.after_trip=regenerate, a batch sampled before the last ESS
re-sync drops as `sampled_before_resync`. Its prompts are issued again at once.

Publishing (`sync.policy` in async mode): `every:K` publishes after every K-th version;
`bounded:K` (K = eta) and `ess:TAU` publish lazily, only when the next slot could not be
admitted otherwise, so the generator runs up to eta versions behind (DLC's lagging
generator, made by the race); `ess:TAU` also publishes when an incoming batch's ESS
trips (after its step with on_trip=train; before re-issuing it with regenerate), and with
`max=M` after M versions without a publish.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from tether.config import Config
from tether.ledger import Ledger
from tether.rollout.backend import Lost, RolloutBackend
from tether.rollout.worker import BatchResult, WorkItem
from tether.weights.policy import SyncPolicy
from tether.weights.snapshots import SnapshotStore
from tether.weights.window import StalenessWindow

Attempts = tuple[tuple[int, ...], tuple[int, ...]]  # (prompts, attempt numbers)


class Scheduler:
    def __init__(self, cfg: Config, policy: SyncPolicy, backend: RolloutBackend,
                 snapshots: SnapshotStore, ledger: Ledger, seed_of: Callable[[int], int]):
        self.eta, self.N = cfg.loop.max_staleness, cfg.train.minibatches
        self.P, self.steps = cfg.rollout.prompts_per_step, cfg.train.steps
        self.policy, self.backend, self.snapshots = policy, backend, snapshots
        self.ledger, self.seed_of = ledger, seed_of
        loop = cfg.loop
        self.window = StalenessWindow(self.eta, loop.window_min, loop.window == "ess")
        self.after_trip = loop.after_trip
        self.topk: int | None = None  # top-K to record, per item (train.correction=auto)
        self.resync_version = -1  # the version the last ESS re-sync published (-1: none yet)
        self.received = 0  # batches that arrived from workers: generated, trained or not
        self.next_slot = 0  # the next slot number to issue
        self.next_prompt = 0  # the next fresh training problem
        self.train_slot = 0  # the next slot in training order
        self.trained = 0  # batches trained: the loop's step
        self.outstanding: dict[int, WorkItem] = {}  # issued, neither trained nor dropped
        self.ready: dict[int, BatchResult] = {}  # generated, waiting for their turn
        self.reissue: deque[Attempts] = deque()  # dropped prompts, issued first
        self.dropped_since_log = 0
        # Seconds since the last row: keeping and freeing snapshots, publishing (packing,
        # handing over); both count in the row's time/sync.
        self.timing = {"snapshots": 0.0, "publish": 0.0}
        self.published_bytes = 0  # sent to each worker since the last row

    # -- issuing -------------------------------------------------------------------------

    def admit(self, trainer_version: int) -> int:
        """Issue every slot the staleness bound admits; returns how many were issued."""
        issued = 0
        while self.trained + len(self.outstanding) < self.steps and self._admissible(trainer_version):
            if self.reissue:
                prompts, attempts = self.reissue.popleft()
            else:
                prompts = tuple(range(self.next_prompt, self.next_prompt + self.P))
                attempts, self.next_prompt = (0,) * self.P, self.next_prompt + self.P
            item = WorkItem(self.next_slot, prompts, attempts, self.backend.version,
                            self.seed_of(self.next_slot), self.topk)
            self.ledger.issued(item.slot, list(zip(prompts, attempts)), item.min_version)
            self.outstanding[item.slot] = item
            self.backend.submit(item)
            self.next_slot += 1
            issued += 1
        return issued

    def _admissible(self, trainer_version: int) -> bool:
        start = trainer_version + self.N * len(self.outstanding)  # latest its training can start
        return start - self.backend.version <= self.window.size

    # -- taking batches in order ---------------------------------------------------------

    def take(self, result: BatchResult | Lost, trainer_version: int) -> None:
        """A worker's batch arrived (any order); or its worker died with it, and its prompts
        are issued again at once."""
        if isinstance(result, Lost):
            self.drop(result.item, result.reason)
            self.admit(trainer_version)
            return
        if result.error is not None:
            raise RuntimeError(f"rollout worker {result.worker} failed:\n{result.error}")
        self.ready[result.item.slot] = result
        self.received += 1

    def next_ready(self) -> BatchResult | None:
        """The batch whose turn it is, if it has arrived."""
        while self.train_slot < self.next_slot and self.train_slot not in self.outstanding:
            self.train_slot += 1  # a dropped slot
        return self.ready.pop(self.train_slot, None)

    def bounds(self) -> dict[str, float]:
        """What a batch is checked against now, for its row: the window in force and the
        version of the last ESS re-sync (-1: none yet)."""
        return {"async/window": float(self.window.size),
                "async/resync_version": float(self.resync_version)}

    def out_of_bounds(self, oldest_version: int, staleness: int) -> str | None:
        """Why the batch whose turn it is may not be trained (a ledger drop reason), or None.
        `oldest_version`: the oldest version that sampled it; `staleness`: its max, in
        versions behind the trainer now."""
        if staleness > self.eta:  # a safety net: admission makes this impossible
            return "over_staleness_bound"
        if self.after_trip == "regenerate" and oldest_version < self.resync_version:
            return "sampled_before_resync"
        if staleness > self.window.size:  # admitted before an ESS trip shrank the window
            return "outside_window"
        return None

    def done(self, item: WorkItem, trainer_version: int, staleness: list[tuple[float, int]]) -> None:
        """`item`'s batch was trained, starting at `trainer_version`."""
        self.ledger.trained(item.slot, list(zip(item.prompts, item.attempts)), trainer_version,
                            staleness)
        del self.outstanding[item.slot]
        self.trained += 1

    def drop(self, item: WorkItem, reason: str) -> None:
        """Drop a batch (ledger: reason) and issue its prompts again, as the next attempt."""
        self.ledger.dropped(item.slot, list(zip(item.prompts, item.attempts)), reason)
        del self.outstanding[item.slot]
        self.ready.pop(item.slot, None)
        self.reissue.append((item.prompts, tuple(a + 1 for a in item.attempts)))
        self.dropped_since_log += 1

    def stop(self) -> None:
        """The run stops: everything issued and not trained is dropped, re-issued on resume."""
        for item in sorted(self.outstanding.values(), key=lambda it: it.slot):
            self.drop(item, "in_flight_at_stop")

    # -- publishing ----------------------------------------------------------------------

    def publish(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        self.snapshots.put(version, weights)  # pi_old of whatever it samples
        t1 = time.perf_counter()
        self.backend.publish(version, weights)
        self.published_bytes += self.backend.published_bytes
        self.timing["snapshots"] += t1 - t0
        self.timing["publish"] += time.perf_counter() - t1

    def resync(self, trainer_version: int, weights: dict[str, torch.Tensor],
               staleness: int) -> None:
        """An ESS trip on a batch `staleness` versions stale, before training it
        (on_trip=regenerate): shrink the window, publish the current weights now."""
        self.window.update(True, staleness)
        if trainer_version > self.backend.version:
            self.publish(trainer_version, weights)
        self.resync_version = trainer_version

    def after_step(self, trainer_version: int, weights: dict[str, torch.Tensor],
                   tripped: bool, staleness: int) -> dict[str, float]:
        """The window after the batch just trained (`staleness`: its max); publish per
        policy; free snapshots no batch can need; this step's metrics."""
        V, pub = trainer_version, self.backend.version
        behind = V - pub
        self.window.update(tripped, staleness)
        blocked = self.trained + len(self.outstanding) < self.steps and not self._admissible(V)
        due = self.policy.publishes(behind, blocked, tripped)
        if due and behind > 0:
            self.publish(V, weights)
        if tripped:  # the re-sync: what was sampled before it is what after_trip governs
            self.resync_version = self.backend.version
        oldest = min((it.min_version for it in self.outstanding.values()),
                     default=self.backend.version)
        t0 = time.perf_counter()
        freed = self.snapshots.release({v for v in self.snapshots.versions if v >= oldest})
        self.timing["snapshots"] += time.perf_counter() - t0
        out = {**{f"time/{k}": v for k, v in self.timing.items()},
               "sync/synced": float(due and behind > 0),
               "sync/published_version": float(self.backend.version),
               "sync/published_bytes": float(self.published_bytes),
               **self.snapshots.metrics(freed),
               "async/dropped": float(self.dropped_since_log),
               "async/trained_per_generated": self.trained / max(self.received, 1)}
        self.dropped_since_log, self.published_bytes = 0, 0
        self.timing = dict.fromkeys(self.timing, 0.0)
        return out

    # -- checkpoint hooks ----------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        in_flight = [[it.slot, list(it.prompts), list(it.attempts)]
                     for it in sorted(self.outstanding.values(), key=lambda it: it.slot)]
        return {"next_slot": self.next_slot, "next_prompt": self.next_prompt,
                "trained": self.trained, "ledger_offset": self.ledger.offset(),
                "reissue": [[list(p), list(a)] for p, a in self.reissue], "in_flight": in_flight,
                "snapshot_versions": self.snapshots.versions, "window": self.window.size,
                "resync_version": self.resync_version, "received": self.received}

    def load_state_dict(self, state: dict[str, Any],
                        snapshots: dict[int, dict[str, torch.Tensor]]) -> None:
        """Back to the checkpoint: the ledger is cut there, and what was in flight then is
        dropped (in_flight_at_stop) and issued again first."""
        for v, sd in snapshots.items():
            self.snapshots.put(int(v), sd)
        self.ledger.truncate(int(state["ledger_offset"]))
        self.next_slot = self.train_slot = int(state["next_slot"])
        self.next_prompt, self.trained = int(state["next_prompt"]), int(state["trained"])
        self.reissue = deque((tuple(p), tuple(a)) for p, a in state["reissue"])
        # Checkpoints from before the ESS window hold none of these: a fixed window, no re-sync.
        self.window.size = min(int(state.get("window", self.eta)), self.eta)
        self.resync_version = int(state.get("resync_version", -1))
        self.received = int(state.get("received", self.trained))
        for slot, prompts, attempts in state["in_flight"]:
            self.ledger.dropped(slot, list(zip(prompts, attempts)), "in_flight_at_stop")
            self.reissue.append((tuple(prompts), tuple(a + 1 for a in attempts)))
