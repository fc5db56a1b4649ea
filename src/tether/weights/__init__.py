"""Weights between trainer and generator: what to do (policy), what to keep (snapshots),
how versions reach engines (publisher), and the synchronous loop's use of all three.

- `policy`: pure sync policies: given versions and ESS, whether to deliver weights.
- `snapshots`: fp32 copies of every weight version a `logp_old` still needs.
- `publisher`: version v is published; engines load it (in process, or shared memory
  for rollout worker processes). A published version is immutable.
- `synchronizer`: the synchronous loop's bookkeeping over the three (lag, ESS trips).
- `window`: the asynchronous loop's admission window, fixed or governed by the ESS.

The package spans two layers (docs/architecture.md): `policy`, `gate`, `window` and `delta`
are pure and sit below tether.config, which parses sync policies without torch;
`publisher`, `snapshots` and `synchronizer` hold tensors, `snapshots` scores with
tether.scoring, so they sit above it. This module exports only the pure part; import the
others from their modules.
"""

from tether.weights.policy import (
    BoundedK,
    EssTrigger,
    EveryK,
    ResyncK,
    SyncPolicy,
    parse_sync_policy,
    resolve_policy_spec,
)

__all__ = ["BoundedK", "EssTrigger", "EveryK", "ResyncK", "SyncPolicy", "parse_sync_policy",
           "resolve_policy_spec"]
