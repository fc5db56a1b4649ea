"""Weights between trainer and generator: what to do (policy), what to keep (snapshots),
how versions reach engines (publisher), and the synchronous loop's use of all three.

- `policy`: pure sync policies: given versions and ESS, whether to deliver weights.
- `snapshots`: fp32 copies of every weight version a `logp_old` still needs.
- `publisher`: version v is published; engines load it (in process, or shared memory
  for rollout worker processes). A published version is immutable.
- `synchronizer`: the synchronous loop's bookkeeping over the three (lag, ESS trips).
"""

from tether.weights.policy import (
    BoundedK,
    EssTrigger,
    EveryK,
    SyncPolicy,
    parse_sync_policy,
    resolve_policy_spec,
)
from tether.weights.publisher import InProcessPublisher, SharedMemoryPublisher, WeightSubscriber
from tether.weights.snapshots import SnapshotStore
from tether.weights.synchronizer import Synchronizer

__all__ = [
    "BoundedK", "EssTrigger", "EveryK", "InProcessPublisher",
    "SharedMemoryPublisher", "SnapshotStore", "SyncPolicy", "Synchronizer", "WeightSubscriber",
    "parse_sync_policy", "resolve_policy_spec",
]
