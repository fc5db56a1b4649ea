"""The current-model monitor (DESIGN.md section 6): what the generator thinks of pi_theta's own samples.

Every `diagnostics.monitor_every` steps, a small batch is sampled from the trainer's
current weights (fp32) on a fixed probe set of prompts and scored by the generator as
it stands (its weights version and its numerics). With delta = log mu - log pi_theta on
tokens y ~ pi_theta:
    monitor/k1_kl/mean        mean(-delta)                  KL(pi_theta || mu), k1
    monitor/k3_kl/mean        mean(exp(delta) - 1 - delta)  the same, k3 (>= 0 per token)
    monitor/kl_share/rare     sum of k3 on tokens with mu(y) < rare_prob / sum of k3
    monitor/token_frac/rare   share of tokens with mu(y) < rare_prob
The metrics computed on the generator's own samples cannot see this: pi_theta putting
mass where mu almost never samples (DLC saw up to 90% of the divergence on mu < 0.05
tokens at collapse). Sampling uses its own torch.Generator, so the run's RNG stream,
and with it the trajectory, does not depend on whether the monitor is on.
`current_model_monitor` samples and scores; `monitor_metrics` is the arithmetic above,
a pure function of the two log-probs and the mask.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tether.defaults import RARE_PROB
from tether.estimators.base import SAFETY_BOUND
from tether.rollout.hf import sample_tokens
from tether.rollout.types import Rollout, SamplingParams
from tether.scoring import collate, token_logprobs


@torch.no_grad()
def current_model_monitor(
    model: nn.Module,
    generator_model: nn.Module,
    prompts: list[list[int]],
    sampling: SamplingParams,
    seed: int,
    eos_id: int,
    pad_id: int,
    rare_prob: float = RARE_PROB,
) -> dict[str, float]:
    """Sample `sampling.n` responses per prompt from `model`, score them with `generator_model`."""
    was_training = model.training
    model.eval()
    rows = [p for p in prompts for _ in range(sampling.n)]
    g = torch.Generator(model.device).manual_seed(seed)
    out = sample_tokens(model, rows, sampling, g, eos_id, pad_id)
    model.train(was_training)
    rollouts = [
        Rollout(prompt_id=str(i), group_id=i, prompt_ids=list(rows[i]), response_ids=ids,
                logp_rollout=lps, version=-1, engine="monitor", precision="fp32",
                finish_reason=finish)
        for i, (ids, lps, _tk, _tl, finish) in enumerate(out)
    ]
    batch = collate(rollouts, pad_id, model.device)
    plain = SamplingParams(n=1, temperature=sampling.temperature, top_k=sampling.top_k,
                           top_p=sampling.top_p, max_new_tokens=sampling.max_new_tokens)
    logp_gen, _ = token_logprobs(generator_model, batch, plain)  # (B, T) log mu(y), y ~ pi_theta
    return monitor_metrics(logp_gen, batch.logp_rollout, batch.response_mask, rare_prob)


def monitor_metrics(
    logp_gen: torch.Tensor,
    logp_sampler: torch.Tensor,
    mask: torch.Tensor,
    rare_prob: float = RARE_PROB,
) -> dict[str, float]:
    """The four `monitor/*` metrics of tokens y ~ pi_theta; inputs (B, T).

    `logp_gen` is log mu(y) (the generator's score), `logp_sampler` log pi_theta(y) (the
    sampling policy's own), `mask` the valid tokens.
    """
    keep = mask.bool()
    delta = (logp_gen.double() - logp_sampler.double()).clamp(-SAFETY_BOUND, SAFETY_BOUND)
    delta = torch.where(keep, delta, 0.0)
    n = keep.sum().clamp(min=1)
    k3 = torch.where(keep, torch.expm1(delta) - delta, 0.0)  # (B, T), >= 0
    rare = keep & (logp_gen < math.log(rare_prob))
    total = k3.sum()
    return {
        "monitor/k1_kl/mean": float((-delta).sum() / n),
        "monitor/k3_kl/mean": float(total / n),
        "monitor/kl_share/rare": float(k3[rare].sum() / total) if total > 0 else 0.0,
        "monitor/token_frac/rare": float(rare.sum() / n),
    }
