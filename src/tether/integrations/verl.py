"""tether's losses in verl, through verl's own policy-loss registry (verl.trainer.ppo.core_algos).

    import tether.integrations.verl   # registers tether_dlc, tether_cis, tether_vespo

    actor_rollout_ref.actor.policy_loss.loss_mode=tether_cis
    algorithm.rollout_correction.rollout_is=token
    algorithm.rollout_correction.rollout_is_threshold=1e30

A verl policy loss receives pi_old, pi_theta, the advantages, the mask and verl's rollout
importance weights w = pi_old / mu (clamped to [e^-20, e^20] and to the threshold), not mu.
With token-level weights and a threshold that never binds, log mu = log pi_old - log w, and
the tether loss sees the same three log-probs as in `tether train`. Without the weights
(rollout correction off) mu is taken as pi_old: no numerical correction, staleness only.
tether_dlc is DLC's staleness half (stale_is+none): its centering needs the generator's top-K
log-probs, which verl does not pass to a policy loss. `register(name, estimator)` adds any
other preset or composition.

verl 0.9.1 pins transformers < 5.11 and tether's vLLM build needs >= 5.16.1, so this runs in
its own environment (`make install-verl`: .venv-verl); tests/test_verl.py runs there.
"""

from __future__ import annotations

from typing import Any

import torch
from verl.trainer.ppo.core_algos import register_policy_loss

from tether import api
from tether.estimators.base import AGGREGATIONS

PRESETS = {"tether_dlc": "stale_is+none", "tether_cis": "cis", "tether_vespo": "vespo"}


def policy_loss(estimator: str, **params: Any):
    """A verl PolicyLossFn computing tether's `estimator` (api.loss) on verl's tensors."""

    def fn(old_log_prob: torch.Tensor, log_prob: torch.Tensor, advantages: torch.Tensor,
           response_mask: torch.Tensor, loss_agg_mode: str = "token-mean", config: Any = None,
           rollout_is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, Any]]:
        if loss_agg_mode not in AGGREGATIONS:
            raise ValueError(f"tether's {estimator} aggregates by {', '.join(AGGREGATIONS)}; "
                             f"verl asked for {loss_agg_mode!r}")
        mu = old_log_prob if rollout_is_weights is None else \
            old_log_prob - torch.log(rollout_is_weights.clamp(min=1e-30))
        out = api.loss(estimator, logp=log_prob, logp_old=old_log_prob, logp_rollout=mu,
                       advantages=advantages, mask=response_mask, agg=loss_agg_mode, **params)
        return out.loss * _global_scale(response_mask, loss_agg_mode, config), \
            {f"tether/{k}": v for k, v in out.metrics.items()}

    return fn


def _global_scale(mask: torch.Tensor, agg: str, config: Any) -> float:
    """verl normalises a micro-batch's loss by the global batch (tokens or sequences) times
    the data-parallel size (core_algos.agg_loss); tether's by the micro-batch's own count."""
    info = getattr(config, "global_batch_info", None) or {}
    dp = info.get("dp_size", 1)
    if agg == "token-mean" and info.get("batch_num_tokens"):
        return float(mask.sum()) * dp / float(info["batch_num_tokens"])
    if agg != "token-mean" and info.get("global_batch_size"):
        return float((mask.sum(-1) > 0).sum()) * dp / float(info["global_batch_size"])
    return 1.0


def register(name: str, estimator: str, **params: Any) -> None:
    """Register tether's `estimator` (with its parameters) as verl loss_mode `name`."""
    register_policy_loss(name)(policy_loss(estimator, **params))


for _name, _estimator in PRESETS.items():
    register(_name, _estimator)
