"""Compose an objective, a mismatch correction and optional centering into a loss.

    loss = aggregate_t( w_mm[t] * l_obj[t] + center[t] )      (DESIGN.md section 3)

build_estimator takes a preset name ("tis"), a composition ("ppo+tis",
"stale_is+none+centering") or the keyword form (objective=, correction=, centering=),
plus the parameters of the parts it names; it validates everything once, up front.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from tether.estimators.base import AGGREGATIONS, LossOutput, TokenBatch, aggregate
from tether.estimators.centering import center_term
from tether.estimators.metrics import (
    applied_metrics,
    centering_metrics,
    ratio_metrics,
    to_floats,
)
from tether.estimators.presets import PRESETS
from tether.estimators.registry import CORRECTIONS, OBJECTIVES, Entry, OneOf, check_params
from tether.lazy import torch


@dataclass(frozen=True)
class Estimator:
    """A validated estimator: call it on a TokenBatch to get a LossOutput."""

    name: str
    objective: Entry
    correction: Entry
    centering: bool
    params: dict[str, Any]  # every parameter, resolved with defaults

    def __call__(self, batch: TokenBatch) -> LossOutput:
        if self.centering and not batch.has_topk:
            raise ValueError(
                f"estimator {self.name!r} centers scores: the TokenBatch needs topk_ids, "
                "topk_logp_rollout, topk_logp and topk_logp_old"
            )
        clean = _sanitize(batch)
        mask = clean.mask
        fields = {name: getattr(clean, name) for name in _FIELDS}
        obj = self.objective.fn(
            *(fields[n] for n in self.objective.inputs), **self._own(self.objective.defaults)
        )
        corr = self.correction.fn(
            *(fields[n] for n in self.correction.inputs), **self._own(self.correction.defaults)
        )
        per_token = corr.weight * obj.loss  # (B, T)
        center = None
        if self.centering:
            head_weight = self.objective.head_weight(
                *(fields[n] for n in self.objective.head_inputs), **self._head_params()
            )
            center, rho_tail, head_mu = center_term(
                clean.advantages,
                mask,
                clean.topk_logp,
                clean.topk_logp_old,
                clean.topk_logp_rollout,
                head_weight,
            )
            per_token = per_token + center
        agg = self.params["agg"]
        loss = aggregate(per_token, mask, agg)

        with torch.no_grad():
            weights = torch.where(mask, corr.weight * obj.coef, torch.zeros_like(obj.coef))
            log_rho = clean.logp_old - clean.logp_rollout
            metrics = ratio_metrics(log_rho, clean.logp.detach() - clean.logp_old, mask)
            metrics |= applied_metrics(log_rho, clean.advantages, mask, corr, obj)
            metrics["loss/total"] = loss.detach()
            metrics["loss/objective"] = aggregate((corr.weight * obj.loss).detach(), mask, agg)
            if center is not None:
                metrics["loss/centering"] = aggregate(center.detach(), mask, agg)
                metrics |= centering_metrics(rho_tail, head_mu, mask)
        return LossOutput(loss=loss, weights=weights, metrics=to_floats(metrics))

    def coefficients(self, batch: TokenBatch) -> torch.Tensor:
        """The objective's own weight on each token's score, (B, T) without grad (VESPO:
        phi(W); 1 for the policy gradient). pi_prox, when the batch lacks it, is pi_old."""
        clean = _sanitize(batch)
        fields = {name: getattr(clean, name) for name in _FIELDS}
        with torch.no_grad():
            obj = self.objective.fn(*(fields[n] for n in self.objective.inputs),
                                    **self._own(self.objective.defaults))
        return obj.coef.detach()

    @property
    def spec(self) -> tuple[str, str, bool, dict[str, Any]]:
        """(objective, correction, centering, params): plain data that `rebuild` turns back
        into this estimator (what a trainer rank is sent when the estimator changes)."""
        return self.objective.name, self.correction.name, self.centering, dict(self.params)

    @property
    def needs_prox(self) -> bool:
        """Whether the loss reads `logp_prox` (decoupled PPO): the trainer then scores it."""
        return "logp_prox" in self.objective.inputs + self.correction.inputs

    def __repr__(self) -> str:
        return (
            f"Estimator({self.name!r}, objective={self.objective.name!r}, "
            f"correction={self.correction.name!r}, centering={self.centering}, "
            f"params={self.params})"
        )

    def _own(self, defaults: dict[str, Any]) -> dict[str, Any]:
        return {k: self.params[k] for k in defaults}

    def _head_params(self) -> dict[str, Any]:
        return {k: self.params[k] for k in self.objective.head_params}


_FIELDS = (
    "logp", "logp_old", "logp_rollout", "logp_prox", "advantages", "mask", "topk_logp",
    "topk_logp_old",
)  # fmt: skip


def _sanitize(batch: TokenBatch) -> TokenBatch:
    """Bool mask, (B, T) advantages, >= fp32, zeros wherever mask == 0.

    Only logp and topk_logp keep their graph: advantages and the other policies'
    log-probs are data, so a stray requires_grad upstream cannot leak into the update.
    """
    mask = batch.mask if batch.mask.dtype == torch.bool else batch.mask != 0
    dtype = torch.promote_types(batch.logp.dtype, torch.float32)
    topk_mask = mask.unsqueeze(-1)

    def clean(x: torch.Tensor | None, grad: bool = False, m: torch.Tensor = mask):
        if x is None:
            return None
        x = x.to(dtype) if grad else x.detach().to(dtype)
        return torch.where(m, x, torch.zeros_like(x))

    advantages = batch.advantages
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(batch.logp)
    return replace(
        batch,
        logp=clean(batch.logp, grad=True),
        logp_old=clean(batch.logp_old),
        logp_rollout=clean(batch.logp_rollout),
        logp_prox=clean(batch.logp_prox if batch.logp_prox is not None else batch.logp_old),
        advantages=clean(advantages),
        mask=mask,
        topk_logp_rollout=clean(batch.topk_logp_rollout, m=topk_mask),
        topk_logp=clean(batch.topk_logp, grad=True, m=topk_mask),
        topk_logp_old=clean(batch.topk_logp_old, m=topk_mask),
    )


def _composition_help() -> str:
    return (
        f"valid presets: {', '.join(PRESETS)}; or compose 'objective+correction[+centering]' "
        f"with objectives {', '.join(OBJECTIVES.names())} and corrections "
        f"{', '.join(CORRECTIONS.names())}"
    )


def build_estimator(
    name: str | None = None,
    *,
    objective: str | None = None,
    correction: str = "none",
    centering: bool = False,
    **params: Any,
) -> Estimator:
    """Build a validated estimator from a preset or an objective/correction pair.

    build_estimator("tis", cap=3.0)                     preset, one default overridden
    build_estimator("ppo+cis", lam=1.0)                 composition by name
    build_estimator("stale_is+none+centering")          same as "dlc"
    build_estimator(objective="ppo", correction="tis")  keyword form

    Every estimator also takes agg ("token-mean", "seq-mean-token-mean",
    "seq-mean-token-sum"); its default is the objective's source's (seq-mean-token-mean
    for gspo and sapo, token-mean for the others; docs/estimators.md says why).

    Raises ValueError for unknown names (listing the valid ones), unknown parameters
    (listing this estimator's) and out-of-range values (naming the parameter).
    """
    if name is not None and objective is not None:
        raise ValueError("give either a name or objective=..., not both")
    if name is None and objective is None:
        raise ValueError(f"build_estimator needs a name or objective=...; {_composition_help()}")
    if name is not None:
        if name in PRESETS:
            preset = PRESETS[name]
            objective, correction, centering = preset.objective, preset.correction, preset.centering
            params = {**dict(preset.params), **params}  # the caller's values win
        else:
            parts = name.split("+")
            if len(parts) not in (2, 3) or (len(parts) == 3 and parts[2] != "centering"):
                raise ValueError(f"unknown estimator {name!r}; {_composition_help()}")
            if parts[0] not in OBJECTIVES.names() or parts[1] not in CORRECTIONS.names():
                raise ValueError(f"unknown estimator {name!r}; {_composition_help()}")
            objective, correction, centering = parts[0], parts[1], len(parts) == 3
    else:
        name = f"{objective}+{correction}" + ("+centering" if centering else "")
    obj, corr = OBJECTIVES.get(objective), CORRECTIONS.get(correction)

    flag = obj.mismatch_flag  # e.g. vespo's include_rho: weighs by pi/mu only when set
    flag_on = flag is not None and params.get(flag, obj.defaults[flag]) is True
    if (obj.includes_mismatch or flag_on) and corr.name != "none":
        how = f" with {flag}=true" if flag_on else ""
        raise ValueError(
            f"objective {obj.name!r}{how} already weighs by pi/mu (it corrects numerical "
            f"mismatch itself); use correction 'none', not {corr.name!r}"
        )
    if centering and obj.head_weight is None:
        with_head = [n for n in OBJECTIVES.names() if OBJECTIVES.get(n).head_weight is not None]
        raise ValueError(
            f"centering needs an objective whose gradient is -w A grad log pi with a known w(v) "
            f"on the head; {obj.name!r} has none: use one of {', '.join(with_head)}"
        )
    if centering and corr.name != "none":
        raise ValueError(
            "centering is itself the numerical-mismatch correction; use correction 'none', "
            f"not {corr.name!r}"
        )
    shared = set(obj.defaults) & set(corr.defaults)
    if shared:  # a guard for future registrations: one name, one meaning
        raise ValueError(f"{obj.name!r} and {corr.name!r} both take {sorted(shared)}")

    defaults = {**obj.defaults, **corr.defaults, "agg": obj.agg}
    unknown = sorted(set(params) - set(defaults))
    if unknown:
        raise ValueError(
            f"unknown parameter(s) {', '.join(map(repr, unknown))} for estimator {name!r}; "
            f"valid: {', '.join(sorted(defaults))}"
        )
    rules = {**obj.rules, **corr.rules, "agg": OneOf(AGGREGATIONS)}
    resolved = check_params({**defaults, **params}, rules)
    return Estimator(
        name=name, objective=obj, correction=corr, centering=centering, params=resolved
    )
