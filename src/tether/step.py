"""One training step on a rewarded batch: the part both loops share.

    old_logprobs  pi_old per token, at the weight version that sampled it: picks its source
                  (the rollout worker's, the training forward's when that is the same, or
                  tether.scoring.versions.score_at_versions over the trainer's kept versions)
    train_step    advantages, loss and optimizer step(s) (with pi_prox, scored by the trainer
                  for an estimator that reads it), batch metrics
    Diagnostics   the mismatch by cause, MoE routing, the current-model monitor

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
from tether.diagnostics import (
    compare_routes,
    decompose,
    divergence_metrics,
    mismatch_metrics,
    routing_disagreement,
)
from tether.dump import DumpWriter, dump_batch
from tether.estimators.base import TokenBatch
from tether.estimators.metrics import sequence_weight_metrics, to_floats
from tether.models.routing import is_moe
from tether.monitor import current_model_monitor
from tether.rollout.types import Rollout, SamplingParams
from tether.scoring import RolloutTensors, score_batch
from tether.scoring.versions import ModelAt
from tether.tasks.base import is_correct
from tether.trainer import Trainer, group_advantages, mean_metrics
from tether.trainer.spmd import ShardedSnapshots
from tether.weights.snapshots import SnapshotStore

log = logging.getLogger("tether.diagnostics")


@dataclass
class OldLogprobs:
    """pi_old of a batch's tokens. `logp` None: every token was sampled at the trainer's
    current weights, so the training forward gives it (`reuses_training_forward`) and
    `train_step` returns it as `StepOutput.logp_old`."""

    logp: torch.Tensor | None  # (B, T)
    topk: torch.Tensor | None  # (B, T, K) at the batch's top-K ids, when it has them


def old_logprobs(trainer: Trainer, batch: RolloutTensors,
                 snapshots: SnapshotStore | ShardedSnapshots) -> tuple[OldLogprobs, RolloutTensors]:
    """pi_old of `batch` and the batch the training forwards are to score (`score_at_versions`):
    as the rollout worker scored it (`loop.score_old=worker`: the same code at the same
    versions, off the trainer's critical path), or left to the training forward when that
    gives the same numbers without a forward of its own, or scored here at the versions
    that sampled each token (the trainer's own weights for its current version, else the
    kept snapshot; sharded, on every rank)."""
    if batch.logp_old is not None:
        return OldLogprobs(batch.logp_old, batch.topk_logp_old), batch
    if reuses_training_forward(trainer, batch):
        return OldLogprobs(None, None), batch
    logp, topk, batch = snapshots.pi_old(trainer, batch)
    return OldLogprobs(logp, topk), batch


def reuses_training_forward(trainer: Trainer, batch: RolloutTensors) -> bool:
    """pi_old needs no forward of its own: every token was sampled at the trainer's current
    weights and the batch is trained in one optimizer step, so the training forward's logp,
    detached, is pi_old (the same function of the same weights on the same tokens). Such a
    batch also has pi_prox = pi_old (decoupled PPO), so the trainer scores no pi_prox. R2
    needs the experts of a no-grad forward, so it always scores; so does a model with
    dropout."""
    return (trainer.cfg.minibatches == 1 and trainer.cfg.routing_replay != "r2"
            and not has_dropout(trainer.model)  # train mode would then differ from eval
            and batch.sampled_at(trainer.version))


def has_dropout(model: nn.Module) -> bool:
    """Any active dropout (a Dropout module, or the attention's own rate in the config)."""
    attn = getattr(getattr(model, "config", None), "attention_dropout", 0.0) or 0.0
    return attn > 0 or any(isinstance(m, nn.Dropout) and m.p > 0 for m in model.modules())


@dataclass
class StepOutput:
    metrics: dict[str, float]  # losses, estimator metrics, mismatch by cause, batch, time/*
    logp: torch.Tensor | None  # (B, T) the training forward's logp (None: a step was cut short)
    logp_old: torch.Tensor  # (B, T) pi_old as the loss used it


class Diagnostics:
    """The mismatch by cause (docs/metrics.md), MoE routing, and the current-model monitor.

    `generator_at(v)`: an in-process model with the generator's numerics holding version v
    (None where the engine's weights cannot be read, e.g. vLLM): routing disagreement is
    measured at the batch's version, the monitor at the version the generator holds now.
    A batch that carries the generator's own routing (R3) is compared against it instead:
    one forward of the trainer at the batch's version without replay, which also gives the
    numerical mismatch replay removed (`numerical/replay_off/*`, every M steps).
    """

    def __init__(self, cfg: DiagnosticsConfig, model: nn.Module, sampling: SamplingParams,
                 probe: list[list[int]], eos_id: int, pad_id: int, micro_batch: int,
                 routing_replay: str = "none", precision: str = "fp32",
                 dump: DumpWriter | None = None):
        self.cfg, self.model, self.sampling, self.probe = cfg, model, sampling, probe
        self.dump = dump  # log.dump_logprobs: each batch's log-probs, as the split saw them
        self.eos_id, self.pad_id, self.micro_batch = eos_id, pad_id, micro_batch
        self._off: set[str] = set()  # settings already reported as off (engine without weights)
        self.r3 = routing_replay == "r3"
        self.precision = precision  # the trainer's (train.precision)

    def __call__(self, step: int, seed: int, batch: RolloutTensors, logp_old: torch.Tensor,
                 logp: torch.Tensor | None, trainer_at: ModelAt,
                 generator_at: Callable[[int], nn.Module | None],
                 generator_version: int) -> dict[str, float]:
        d = self.cfg
        out = mismatch_metrics(decompose(batch.logp_rollout, logp_old, logp, batch.response_mask))
        if self.dump is not None:
            dump_batch(self.dump, step + 1, batch, logp_old, logp)
        version = int(batch.versions[0])
        monitor_due = bool(d.monitor_every) and (step + 1) % d.monitor_every == 0
        if self.r3 and batch.routed_experts is not None and (d.routing or monitor_due):
            off = score_batch(trainer_at(version), replace(batch, routed_experts=None),
                              self.sampling, self.micro_batch, record=True,
                              precision=self.precision)
            if d.routing:
                out |= compare_routes(off.experts, batch.routed_experts, batch)
            if monitor_due:
                delta = off.logp.double() - batch.logp_rollout.double()
                out |= divergence_metrics(delta, batch.response_mask, "numerical/replay_off")
        elif d.routing and is_moe(self.model) and \
                (gen := self._generator(generator_at, version, "diagnostics.routing")) is not None:
            out |= routing_disagreement(trainer_at(version), gen, batch, self.micro_batch)
        if monitor_due and (gen := self._generator(
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
               old: OldLogprobs, adv_std_norm: bool, seq_weights: bool = False) -> StepOutput:
    """Group advantages, then the loss and `train.minibatches` optimizer steps.

    pi_old left to the training forward (`old.logp` None) is that forward's logp; a step
    skipped or cut short before scoring every row did not move the weights, so one no-grad
    forward at them gives it. pi_prox, when the estimator reads it, is `Trainer.train_on`'s
    (its forward counts in time/train). `seq_weights` (`diagnostics.seq_weights`): the
    quantiles of the sequence weights over the whole batch, each row at the weights its
    loss saw (`sequence_weight_metrics`)."""
    t0 = time.perf_counter()
    advantages = group_advantages(batch.rewards, batch.group_ids, adv_std_norm)
    rows, logp = trainer.train_on(batch, advantages, old.logp, old.topk)
    logp_old = old.logp
    if logp_old is None:
        logp_old = logp if logp is not None else trainer.score_now(batch)
    metrics = {**mean_metrics(rows), **batch_metrics(batch, rollouts),
               "time/train": time.perf_counter() - t0}
    if seq_weights and logp is not None:
        mask = batch.response_mask.bool()
        coef = trainer.estimator.coefficients(TokenBatch(logp, logp_old, batch.logp_rollout,
                                                         advantages, mask))
        metrics |= to_floats(sequence_weight_metrics(logp - logp_old, logp_old - batch.logp_rollout,
                                                     coef, mask))
    return StepOutput(metrics, logp, logp_old)


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
