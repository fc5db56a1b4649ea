"""The asynchronous loop's admission window: how many versions a trained token may lag.

`loop.window=fixed` keeps it at eta = `loop.max_staleness`, the bound every peer uses
(AReaL's max_head_offpolicyness, verl's staleness_threshold, prime-rl's
max_off_policy_steps). `loop.window=ess` lets the staleness ESS govern it between
`loop.window_min` and eta, additive increase and multiplicative decrease:

    a batch trips the ESS re-sync:   W <- max(W_min, floor(min(W, s) / 2))
    a batch trains without a trip:   W <- min(eta, W + 1)

where s is the tripping batch's max staleness in versions. The decrease halves what was
actually in flight, not the nominal window (TCP's rule, RFC 5681: half the flight size):
with a wide ceiling the ESS trips long before the window binds, and halving the ceiling
would leave the trip's own staleness admitted. The increase is one version per trained
batch, the rate at which a batch in the queue ages, so the window probes back toward the
staleness at which the ESS trips, and settles between half of it and all of it. Why the
shape: a trip is evidence the data is too stale now (act at once, geometrically); a good
batch is weak evidence that one more version is fine (probe slowly).

Pure: no tensors, no processes. The scheduler asks `size` at admission and at each
batch's turn, and reports each trained batch with `update`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StalenessWindow:
    ceiling: int  # loop.max_staleness
    floor: int = 1  # loop.window_min
    adaptive: bool = False  # loop.window=ess
    size: int = -1  # the window in force; starts at the ceiling

    def __post_init__(self) -> None:
        if not 0 <= self.floor <= self.ceiling:
            raise ValueError(f"window floor {self.floor} must be in [0, {self.ceiling}]")
        if self.size < 0:
            self.size = self.ceiling

    def update(self, tripped: bool, staleness: int) -> int:
        """After a trained (or, on_trip=regenerate, dropped) batch whose max staleness was
        `staleness`: the new window."""
        if self.adaptive:
            self.size = (max(self.floor, min(self.size, staleness) // 2) if tripped
                         else min(self.ceiling, self.size + 1))
        return self.size
