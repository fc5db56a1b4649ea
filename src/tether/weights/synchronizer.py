"""The synchronous loop's weight bookkeeping: which version the generator holds.

Two independent choices make the data stale in the synchronous loop:
- `sync.lag` k (DLC's stale generator): a routine delivery hands the generator the
  weights of k versions ago, never the current ones, so in steady state it samples
  k versions behind (from step `sync.lag_from` on: a lag that starts mid-run, its first
  versions behind growing from 0 to k). `train.minibatches` N (VESPO's N) adds staleness inside a batch:
  its i-th mini-batch is trained i versions after it was sampled.
- `sync.policy` (tether.weights.policy), when deliveries happen. In this loop `bounded:K`
  delivers only when the next batch would otherwise start training more than K versions
  after the one that sampled it (needs lag <= K), and `ess:TAU` delivers every step,
  lagged, plus a re-sync to the trainer's *current* weights when the staleness gate
  (tether.weights.gate) trips on a batch; after a re-sync the lag resumes from the new
  version.

`Synchronizer` applies the policy, hands versions to the engine through a publisher,
keeps the `SnapshotStore` down to the versions still needed and reports what happened as
metrics (`sync/...`, `snapshots/...`). The loop passes the trainer's version and weights
in, and whether the gate tripped.
"""

from __future__ import annotations

from typing import Any

import torch

from tether.weights.policy import SyncPolicy
from tether.weights.publisher import Publisher
from tether.weights.snapshots import SnapshotStore


class Synchronizer:
    """Owns the generator's weight version for the synchronous loop: one `after_step` a
    step (and `resync` when the gate drops a batch). `publisher.version` is the version
    the generator holds."""

    def __init__(self, policy: SyncPolicy, publisher: Publisher, snapshots: SnapshotStore,
                 weights: dict[str, torch.Tensor], lag: int = 0, lag_from: int = 0):
        if lag < 0:
            raise ValueError(f"sync.lag must be >= 0, got {lag}")
        self.policy, self.publisher = policy, publisher
        self.snapshots, self.full_lag, self.lag_from = snapshots, lag, lag_from
        self.lag = lag if lag_from == 0 else 0  # the lag in force (sync.lag_from: 0 before)
        self.steps_since_resync = 0
        self._synced = False
        self.snapshots.put(publisher.version, weights)

    @property
    def generator_version(self) -> int:
        return self.publisher.version

    def resync(self, trainer_version: int, weights: dict[str, torch.Tensor]) -> None:
        """Deliver the trainer's current weights to the generator."""
        self._deliver(trainer_version, trainer_version, weights)
        self.steps_since_resync = 0

    def after_step(self, step: int, trainer_version: int, weights: dict[str, torch.Tensor],
                   tripped: bool = False) -> dict[str, float]:
        """After the optimizer step(s): deliver weights per policy and lag, free snapshots.

        `weights`: the trainer's state dict (not copied unless kept); `tripped`: the
        staleness gate asks for a re-sync to them. Returns this step's sync metrics.
        """
        V, g = trainer_version, self.publisher.version
        if step >= self.lag_from:  # a cause injected mid-run (sync.lag_from)
            self.lag = self.full_lag
        if self.lag > 0 and V > g:
            self.snapshots.put(V, weights)  # a later lagged delivery
        self.steps_since_resync += 1
        forced = not tripped and self.policy.overdue(self.steps_since_resync)
        if tripped or forced:
            self.resync(V, weights)
        elif self.policy.routine(step, V, g):
            target = self._lagged_target(V)
            if target is not None:
                self._deliver(target, V, weights)
                if target == V:
                    self.steps_since_resync = 0
        freed = self.snapshots.release(self._needed(V))
        out = {
            "sync/synced": float(self._synced),
            "sync/forced": float(forced),
            **self.snapshots.metrics(freed),
        }
        self._synced = False
        return out

    # -- internals ---------------------------------------------------------------------

    def _lagged_target(self, V: int) -> int | None:
        """The newest kept version <= V - lag that is newer than the generator's, if any."""
        if self.lag == 0:
            return V if V > self.publisher.version else None
        ready = [v for v in self.snapshots.versions if self.publisher.version < v <= V - self.lag]
        return max(ready) if ready else None

    def _deliver(self, version: int, trainer_version: int, weights: dict[str, torch.Tensor]) -> None:
        if version == trainer_version:  # the trainer's own weights, whatever the store keeps
            self.snapshots.put(version, weights)
            self.publisher.publish(version, weights)
        else:
            self.publisher.publish(version, self.snapshots.state(version))
        self._synced = True

    def _needed(self, V: int) -> set[int]:
        """Versions still needed: the generator's, and pending lagged deliveries."""
        g = self.publisher.version
        keep = {g}
        if self.lag > 0:
            newer = [v for v in self.snapshots.versions if v > g]
            ready = [v for v in newer if v <= V - self.lag]
            floor = max(ready) if ready else g + 1  # older ready ones are superseded by it
            keep |= {v for v in newer if v >= floor}
        return keep

    # -- checkpoint hooks (sync state) -----------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """JSON-able sync state; the weights are `snapshots.state(v)` for v in snapshot_versions."""
        return {"generator_version": self.publisher.version,
                "steps_since_resync": self.steps_since_resync,
                "snapshot_versions": self.snapshots.versions}

    def load_state_dict(self, state: dict[str, Any],
                        snapshots: dict[int, dict[str, torch.Tensor]]) -> None:
        """Restore from `state_dict()` and the kept weights; reloads the generator's version."""
        for v, sd in snapshots.items():
            self.snapshots.put(int(v), sd)
        self.snapshots.release({int(v) for v in state["snapshot_versions"]})
        g = int(state["generator_version"])
        self.publisher.publish(g, self.snapshots.state(g))
        self.steps_since_resync = int(state["steps_since_resync"])
