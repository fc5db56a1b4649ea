"""train.correction=auto applied to a run: tether.auto's choices, step by step, in

    the trainer's estimator   the user's objective with auto's correction or centering
    the sync policy           the gate's `Switched` (the synchronizer or scheduler holds the
                              same object): the configured schedule, or the ESS re-sync's;
                              its trigger at ESS 0.5 armed in both
    the async window          fixed at loop.max_staleness, or ESS-governed under dlc's handling
    the engine's top-K        requested only while centering is chosen (staleness handled)

Both loops: `sampling` before generating (sync), `before(batch)` before training it, and the
session's `after_step(step, row)` at the end of each step (tether.loops.skeleton), which logs
the choice that trained the step and switches for the next. A batch that arrives without
the top-K (async: sampled before centering was chosen) trains uncentered. Fixed
(train.correction=fixed), every method leaves the run as configured.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any

from tether.advice import batch_of
from tether.api import Auto
from tether.config import centering_topk
from tether.loops.scheduler import Scheduler
from tether.rollout.types import SamplingParams
from tether.run import Run
from tether.scoring import RolloutTensors
from tether.weights.gate import StalenessGate
from tether.weights.policy import Switched


def rule_of(cfg: Any) -> Auto:
    """The rule a train.correction=auto config runs: its objective, N and hysteresis."""
    t = cfg.train
    return Auto(t.estimator, batch=batch_of(cfg.model_dump()), on_after=t.auto_on_after,
                window=t.auto_window, pool=t.auto_pool, off_after=t.auto_off_after,
                **t.estimator_params)


class Correction:
    """The correction in force. `of(run, gate, scheduler)`; `auto` False: the configured one."""

    @classmethod
    def of(cls, run: Run, gate: StalenessGate, scheduler: Scheduler | None = None) -> Correction:
        rule = rule_of(run.cfg) if run.cfg.train.correction == "auto" else None
        return cls(run, rule, gate, scheduler)

    def __init__(self, run: Run, rule: Auto | None, gate: StalenessGate,
                 scheduler: Scheduler | None):
        self.run, self.rule, self.scheduler = run, rule, scheduler
        if rule is None:
            return
        assert isinstance(gate.policy, Switched)
        self.policy = gate.policy
        cfg = run.cfg
        # The top-K centering reads; requested per batch only when rollout.logprobs_topk is
        # left empty (set, the engine records what it says on every batch).
        self.topk = centering_topk(cfg, run.model.config.vocab_size)
        self.requests = cfg.rollout.logprobs_topk is None
        self.used, self.batch_topk = rule.codes(), 0  # what trained the last batch
        self.said: set[str] = set()
        self._apply()

    @property
    def auto(self) -> bool:
        """train.correction=auto (else every method leaves the run as configured)."""
        return self.rule is not None

    def sampling(self, base: SamplingParams) -> SamplingParams:
        """How the generator samples the next batch: with the top-K only while centering."""
        if self.rule is None or not self.requests:
            return base
        return replace(base, logprobs_topk=self.topk if self.rule.centers else 0)

    def before(self, batch: RolloutTensors) -> None:
        """The estimator in force for `batch`, set on the trainer (sent to every rank)."""
        if self.rule is None:
            return
        has_topk = batch.topk_ids is not None
        if self.rule.centers and not has_topk and self.topk == 0:
            self._say_once("topk", "tether: auto: staleness is material, and DLC centers the "
                           "score over the engine's top-K; rollout.logprobs_topk=0 gives none, "
                           f"so the numerical part stays {self.rule.numerical} (uncentered)")
        self.used = self.rule.codes(has_topk)
        self.batch_topk = int(batch.topk_ids.shape[-1]) if has_topk else 0
        self.run.trainer.estimator = self.rule.estimator(has_topk)

    def after_step(self, step: int, row: dict[str, Any]) -> dict[str, float]:
        """After step `step` (1-based): the choice that trained it, the evidence, and the
        switches that evidence completed (a line each), in force from the next step."""
        if self.rule is None:
            return {}
        lines = self.rule.observe(row, step)
        for line in lines:
            print(line, file=sys.stderr, flush=True)
        self._apply()
        return {**self.used, "auto/topk": float(self.batch_topk), **self.rule.evidence,
                "auto/switches": float(len(lines))}

    def state_dict(self) -> dict[str, Any]:
        assert self.rule is not None
        return {"controller": self.rule.state_dict(), "said": sorted(self.said)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self.rule is not None
        self.rule.load_state_dict(state["controller"])
        self.said = set(state["said"])
        self._apply()

    def _apply(self) -> None:
        """The staleness choice in the policy and the async window; the top-K in new work."""
        assert self.rule is not None
        self.policy.on = self.rule.handles_staleness
        if self.scheduler is None:
            return
        window = self.scheduler.window
        if window.adaptive and not self.rule.handles_staleness:
            window.size = window.ceiling  # back to the configured bound
        window.adaptive = self.rule.handles_staleness
        if self.requests:
            self.scheduler.topk = self.topk if self.rule.centers else 0

    def _say_once(self, key: str, line: str) -> None:
        if key not in self.said:
            self.said.add(key)
            print(line, file=sys.stderr, flush=True)
