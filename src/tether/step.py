"""One training step on a rewarded batch: the part both loops share.

    score_old   pi_old per token, at the weight version that sampled it
    train_step  advantages, loss and optimizer step(s), the mismatch by cause, batch metrics

Everything about where the batch came from (a generator in this process, a lagged one,
worker processes racing the trainer) stays in the loops (tether.loops); everything about
what to learn from it is here.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import nn

from tether.config import DiagnosticsConfig
from tether.diagnostics import decompose, is_moe, mismatch_metrics, routing_disagreement
from tether.monitor import current_model_monitor
from tether.rollout.types import Rollout, SamplingParams
from tether.tasks.base import is_correct
from tether.trainer import RolloutTensors, Trainer, group_advantages, mean_metrics

log = logging.getLogger("tether.diagnostics")

ModelAt = Callable[[int], nn.Module]  # weight version -> a model holding it


def score_old(trainer: Trainer, batch: RolloutTensors,
              model_at: ModelAt) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`logp_old` (B, T) and top-K (B, T, K): each token at the version that sampled it.

    One no-grad forward per distinct version, over the rows holding a token of it (a row
    of one version is scored once; a partial rollout's row once per version it spans).
    The usual batch, sampled at one version, is one forward over the whole batch.
    """
    valid = batch.response_mask.bool()
    distinct = batch.token_versions[valid].unique().tolist() or [int(batch.versions[0])]
    if len(distinct) == 1:
        return trainer.score_old(batch, model_at(int(distinct[0])))
    logp = torch.zeros_like(batch.logp_rollout)
    topk = None if batch.topk_ids is None else torch.zeros(batch.topk_ids.shape)
    for v in distinct:
        at_v = (batch.token_versions == v) & valid  # (B, T)
        rows = at_v.any(dim=1).nonzero().squeeze(1)
        lp, tk = trainer.score_old(batch.select(rows), model_at(int(v)))
        sel = at_v[rows]
        logp[rows] = torch.where(sel, lp, logp[rows])
        if topk is not None:
            topk[rows] = torch.where(sel[..., None], tk, topk[rows])
    return logp, topk


@dataclass
class StepOutput:
    metrics: dict[str, float]  # losses, estimator metrics, mismatch by cause, batch, time/*
    logp: torch.Tensor | None  # (B, T) the training forward's logp (None: a step was cut short)


class Diagnostics:
    """The mismatch by cause (docs/metrics.md), MoE routing, and the current-model monitor.

    `generator_at(v)`: an in-process model with the generator's numerics holding version v
    (None where the engine's weights cannot be read, e.g. vLLM): routing disagreement is
    measured at the batch's version, the monitor at the version the generator holds now.
    """

    def __init__(self, cfg: DiagnosticsConfig, model: nn.Module, sampling: SamplingParams,
                 probe: list[list[int]], eos_id: int, pad_id: int, micro_batch: int):
        self.cfg, self.model, self.sampling, self.probe = cfg, model, sampling, probe
        self.eos_id, self.pad_id, self.micro_batch = eos_id, pad_id, micro_batch
        self._off: set[str] = set()  # settings already reported as off (engine without weights)

    def __call__(self, step: int, seed: int, batch: RolloutTensors, logp_old: torch.Tensor,
                 logp: torch.Tensor | None, trainer_at: ModelAt,
                 generator_at: Callable[[int], nn.Module | None],
                 generator_version: int) -> dict[str, float]:
        d = self.cfg
        out = mismatch_metrics(decompose(batch.logp_rollout, logp_old, logp, batch.response_mask))
        version = int(batch.versions[0])
        if d.routing and is_moe(self.model) and \
                (gen := self._generator(generator_at, version, "diagnostics.routing")) is not None:
            out |= routing_disagreement(trainer_at(version), gen, batch, self.micro_batch)
        if d.monitor_every and (step + 1) % d.monitor_every == 0 and (gen := self._generator(
                generator_at, generator_version, "diagnostics.monitor_every")) is not None:
            out |= current_model_monitor(
                self.model, gen, self.probe,
                replace(self.sampling, n=d.monitor_samples, logprobs_topk=0),
                seed + 500_009, self.eos_id, self.pad_id, d.rare_prob)
        return out


    def _generator(self, generator_at: Callable[[int], nn.Module | None], version: int,
                   setting: str) -> nn.Module | None:
        """The generator's model at `version`, or None; says once per setting why it is off."""
        gen = generator_at(version)
        if gen is None and setting not in self._off:
            self._off.add(setting)
            log.warning("tether: %s is off for this run: it needs the generator's weights in this "
                        "process, and this engine (vllm) keeps them inside itself; set %s to "
                        "silence this", setting,
                        "diagnostics.routing=false" if setting.endswith("routing")
                        else "diagnostics.monitor_every=0")
        return gen


def train_step(trainer: Trainer, batch: RolloutTensors, rollouts: list[Rollout],
               logp_old: torch.Tensor, topk_logp_old: torch.Tensor | None,
               adv_std_norm: bool) -> StepOutput:
    """Group advantages, then the loss and `train.minibatches` optimizer steps."""
    t0 = time.perf_counter()
    advantages = group_advantages(batch.rewards, batch.group_ids, adv_std_norm)
    rows, logp = trainer.train_on(batch, advantages, logp_old, topk_logp_old)
    metrics = {**mean_metrics(rows), **batch_metrics(batch, rollouts),
               "time/train": time.perf_counter() - t0}
    return StepOutput(metrics, logp)


def batch_metrics(batch: RolloutTensors, rollouts: list[Rollout]) -> dict[str, float]:
    """Rewards and response lengths of the batch (the generator's samples)."""
    n = len(rollouts)
    return {
        "reward/mean": batch.rewards.mean().item(),
        "reward/correct": sum(is_correct(ro.reward_parts, ro.reward) for ro in rollouts) / n,
        "reward/errors": sum(ro.reward_parts.get("error", 0.0) for ro in rollouts),
        "response/length_mean": batch.response_mask.sum(1).mean().item(),
        "response/truncated_frac": sum(ro.finish_reason == "length" for ro in rollouts) / n,
    }
