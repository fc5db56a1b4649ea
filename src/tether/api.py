"""tether on tensors, for any trainer (TRL, verl, your own loop): the split of the
generator/trainer disagreement, every estimator as a loss, the ESS re-sync decision, and
whether a cause is material. These are the functions `tether train` runs, not copies.
Shapes (B, T) for B responses of T tokens; mask 1 on the response tokens; no config objects.

    from tether import api
    metrics = api.split(mask, logp_rollout=mu, logp_old=old, logp=new)  # tether's metric names
    out = api.loss("tis", logp=new, logp_old=old, logp_rollout=mu, advantages=adv, mask=mask)
    out.loss.backward()                                 # out.metrics: the estimator's own
    ess, resync = api.resync(new, old, mask, tau=0.5)   # DLC's re-sync: ESS of pi_theta/pi_old
    print(api.advise(metrics, batch=B))                 # nothing to correct, or what to use

    auto = api.Auto("grpo", batch=B)                    # train.correction=auto, for any loop
    out = auto.loss(logp=new, logp_old=old, logp_rollout=mu, advantages=adv, mask=mask)
    lines = auto.observe(metrics, step)                 # after the step: the switches it made
    ess, resync = api.resync(new, old, mask, auto.tau)  # armed whatever auto chose

What the log-probs a framework has can tell apart (docs/integrations.md):
    mu, pi_old, pi_theta   numerical, staleness and total
    mu, pi_old             numerical only (before the step, or an on-policy step)
    pi_old, pi_theta       staleness only: the engine's sampling log-probs were not kept
    mu, pi_theta           total only: without pi_old, numerics and weight lag are one ratio
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from tether.advice import ESS_TAU, Recommendation, evidence_from_rows, format_advice, recommend
from tether.auto import NUMERICAL, OFF_AFTER, ON_AFTER, STALENESS, Base, Controller
from tether.diagnostics import decompose, mismatch_metrics
from tether.estimators import Estimator, LossOutput, TokenBatch, build_estimator
from tether.lazy import torch
from tether.weights.policy import EssTrigger, staleness_ess


def split(mask: torch.Tensor, *, logp_rollout: torch.Tensor | None = None,
          logp_old: torch.Tensor | None = None,
          logp: torch.Tensor | None = None) -> dict[str, float]:
    """The mismatch metrics of docs/metrics.md for each cause the given log-probs identify.

    logp_rollout is mu (the engine's log-prob of each sampled token), logp_old pi_old (the
    trainer at the sampling weights), logp pi_theta (the trainer now). Any two of the three
    suffice; a cause they cannot identify is left out, not reported as zero.
    """
    known = {n for n, t in (("mu", logp_rollout), ("old", logp_old), ("new", logp)) if t is not None}
    if len(known) < 2:
        raise ValueError("split needs two of logp_rollout, logp_old, logp: one log-prob has "
                         "nothing to be compared with")
    for name, t in (("logp_rollout", logp_rollout), ("logp_old", logp_old), ("logp", logp)):
        if t is not None and t.shape != mask.shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}, mask {tuple(mask.shape)}")
    if logp is None:  # mu, pi_old
        causes, d = ("numerical",), decompose(logp_rollout, logp_old, None, mask)
    elif logp_old is None:  # mu, pi_theta: only their ratio, the total
        causes, d = ("total",), decompose(logp_rollout, logp_rollout, logp, mask)
    elif logp_rollout is None:  # pi_old, pi_theta
        causes, d = ("staleness",), decompose(logp_old, logp_old, logp, mask)
    else:
        causes, d = ("numerical", "staleness", "total"), decompose(logp_rollout, logp_old, logp, mask)
    return {k: v for k, v in mismatch_metrics(d).items() if k.split("/", 1)[0] in causes}


def loss(estimator: str, *, logp: torch.Tensor, logp_old: torch.Tensor,
         logp_rollout: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
         **extra: Any) -> LossOutput:
    """A preset ("dlc", "cis", "vespo", ...; `tether estimators` lists them) or a composition
    ("ppo+tis") as a differentiable loss, with its metrics.

    `extra`: the estimator's parameters (cap=3.0), and the TokenBatch tensors it may read:
    logp_prox (decoupled PPO), topk_ids, topk_logp_rollout, topk_logp, topk_logp_old
    (centering: the generator's top-K ids, log mu, log pi_theta with grad, log pi_old).
    """
    tensors = {k: extra.pop(k) for k in ("logp_prox", "topk_ids", "topk_logp_rollout",
                                         "topk_logp", "topk_logp_old") if k in extra}
    batch = TokenBatch(logp=logp, logp_old=logp_old, logp_rollout=logp_rollout,
                       advantages=advantages, mask=mask, **tensors)
    return build_estimator(estimator, **extra)(batch)


def needs(estimator: str, **params: Any) -> set[str]:
    """What a preset or composition reads besides pi_theta and the advantages: any of
    "logp_rollout" (mu), "logp_old", "logp_prox" and "topk" (centering: the generator's
    top-K ids with their log mu). A framework without mu cannot run one that needs it."""
    e = build_estimator(estimator, **params)
    reads = set(e.objective.inputs + e.correction.inputs) & {"logp_rollout", "logp_old", "logp_prox"}
    return reads | ({"topk"} if e.centering else set())


def resync(logp: torch.Tensor, logp_old: torch.Tensor, mask: torch.Tensor,
           tau: float = 0.5) -> tuple[float, bool]:
    """DLC's re-sync test (`sync.policy=ess:TAU`): the token ESS of pi_theta/pi_old on the
    incoming batch, and whether it is below tau (re-sync the generator to current weights)."""
    ess = staleness_ess(logp, logp_old, mask)
    return ess, EssTrigger(tau).trips(ess)


def advise(metrics: dict[str, float], batch: int, estimator: str = "grpo",
           sync_policy: str = "every:1") -> tuple[Recommendation, str]:
    """Whether a cause in `split`'s metrics is material (docs/probe.md) and what to do: the
    recommendation and its printable lines. `batch`: responses per optimizer step (N)."""
    e = evidence_from_rows([metrics], batch)
    if e is None:
        raise ValueError("advise needs the numerical split: split() with logp_rollout and logp_old")
    e = replace(e, staleness_what="this batch")
    rec = recommend(e, estimator, sync_policy)
    return rec, format_advice(e, rec)


class Auto:
    """train.correction=auto for any loop (tether.auto): the correction each cause calls for,
    switched with hysteresis, applied to the user's objective.

    `estimator`: a preset or composition without a correction (grpo, naive, gspo, vespo, ...);
    `batch`: N, the responses in one optimizer step. After each step, `observe(split(...)
    metrics, step)` returns the switch lines that step's figures completed; `loss` trains with
    the choice in force (centered while staleness is handled and the top-K tensors are
    passed); `handles_staleness` says whether DLC's handling is on. Re-sync the generator
    whenever a batch's ESS falls below `tau` (`resync()`), whatever the choice: the trigger is
    armed in both, as dlc's. `on_after`, `window`, `off_after`: the hysteresis (k in a
    row, or of the last `window` steps, to switch on; m in a row to switch off); `pool`: judge
    each step on the last `pool` steps' figures pooled. `state_dict` / `load_state_dict` for
    checkpoints."""

    tau = ESS_TAU

    def __init__(self, estimator: str = "grpo", *, batch: int, on_after: int = ON_AFTER,
                 window: int | None = None, off_after: int = OFF_AFTER,
                 pool: int | None = None, **params: Any):
        self.base = Base.of(estimator, params)
        self.controller = Controller(batch, on_after, off_after, window, pool)
        self._built: dict[tuple[str, str], Estimator] = {}

    @property
    def numerical(self) -> str:
        """none, cis or icepop: the numerical correction in force (centered when `centers`)."""
        return self.controller.numerical

    @property
    def staleness(self) -> str:
        """plain or dlc (DLC's handling: centering, the re-sync's schedule, the ESS window)."""
        return self.controller.staleness

    @property
    def handles_staleness(self) -> bool:
        return self.staleness == "dlc"

    @property
    def centers(self) -> bool:
        """Staleness handled: DLC's centering over the generator's top-K, which also corrects
        the numerical part (pass the top-K tensors to `loss`; without them the loss uses
        `numerical`'s cap instead)."""
        return self.handles_staleness and self.base.can_center

    def choice(self, has_topk: bool = False) -> tuple[str, str]:
        """(numerical, staleness) in force for a batch with or without the top-K; numerical
        is "center" when `centers` and the batch has it (centering is then the numerical
        correction, DLC's)."""
        return "center" if self.centers and has_topk else self.numerical, self.staleness

    def estimator(self, has_topk: bool = False) -> Estimator:
        """The estimator in force, for a batch with or without the top-K."""
        key = self.choice(has_topk)
        if key not in self._built:
            self._built[key] = self.base.estimator(*key)
        return self._built[key]

    def codes(self, has_topk: bool = False) -> dict[str, float]:
        """The choice in force as tether's metrics auto/numerical and auto/staleness."""
        numerical, staleness = self.choice(has_topk)
        return {"auto/numerical": float(NUMERICAL.index(numerical)),
                "auto/staleness": float(STALENESS.index(staleness))}

    def loss(self, *, logp: torch.Tensor, logp_old: torch.Tensor, logp_rollout: torch.Tensor,
             advantages: torch.Tensor, mask: torch.Tensor, **tensors: torch.Tensor) -> LossOutput:
        """`loss(...)` with the estimator in force; `tensors` as there (topk_ids, ...)."""
        batch = TokenBatch(logp=logp, logp_old=logp_old, logp_rollout=logp_rollout,
                           advantages=advantages, mask=mask, **tensors)
        return self.estimator("topk_ids" in tensors)(batch)

    def observe(self, metrics: dict[str, float], step: int) -> list[str]:
        """One step's `split` metrics (1-based `step`); a line per switch they completed."""
        return [c.line for c in self.controller.observe(metrics, step)]

    @property
    def evidence(self) -> dict[str, float]:
        """The last observed step's figures behind the choice (auto/numerical/chi2_seq, ...)."""
        return self.controller.evidence

    def state_dict(self) -> dict[str, Any]:
        return self.controller.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.controller.load_state_dict(state)
