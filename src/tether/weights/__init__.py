"""Weights between trainer and generator: what to do (policy), what to keep (snapshots),
how versions reach engines (publisher), and the synchronous loop's use of all three.

- `policy`: pure sync policies: given versions and ESS, whether to deliver weights.
- `snapshots`: fp32 copies of every weight version a `logp_old` still needs.
- `publisher`: version v is published; engines load it (in process, or shared memory
  for rollout worker processes). A published version is immutable.
- `synchronizer`: the synchronous loop's bookkeeping over the three (lag, ESS trips).
- `window`: the asynchronous loop's admission window, fixed or governed by the ESS.
"""

import importlib

from tether.weights.policy import (
    BoundedK,
    EssTrigger,
    EveryK,
    ResyncK,
    SyncPolicy,
    parse_sync_policy,
    resolve_policy_spec,
)

# The publisher, snapshots and synchronizer need torch; they load on first use, so that
# checking a config (which parses sync policies) does not import torch.
_LAZY = {
    "InProcessPublisher": "publisher", "SharedMemoryPublisher": "publisher",
    "WeightSubscriber": "publisher", "SnapshotStore": "snapshots", "Synchronizer": "synchronizer",
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'tether.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tether.weights.{_LAZY[name]}"), name)


__all__ = [
    "BoundedK", "EssTrigger", "EveryK", "InProcessPublisher", "ResyncK",
    "SharedMemoryPublisher", "SnapshotStore", "SyncPolicy", "Synchronizer", "WeightSubscriber",
    "parse_sync_policy", "resolve_policy_spec",
]
