"""Held-out accuracy and reward: greedy, and sampled at the rollout's temperature (k samples).

RL optimises the sampled policy, so the sampled figures are the ones RL moves first; greedy
accuracy is the mode's, which a short run can leave flat or even lower. All of them are
measured at the weights passed in (the trainer's), unlike a batch's reward, which is the
generator's.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.config import Config
from tether.defaults import EVAL_BATCH_SIZE, MAX_NEW_TOKENS
from tether.models.tokenizer import encode_exact
from tether.rollout.hf import sample_tokens
from tether.rollout.types import SamplingParams
from tether.tasks.base import Problem, Reward, Task, is_correct


@dataclass(frozen=True)
class HeldOut:
    """Means over (held-out problem, sample) pairs."""

    accuracy: float  # share that the task counts correct (tether.tasks.is_correct)
    reward: float  # mean reward total


@torch.no_grad()
def heldout_scores(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    sampling: SamplingParams,
    seed: int = 0,
    batch_size: int = EVAL_BATCH_SIZE,
    reward_fn: Callable[[Problem, str], Reward] | None = None,
) -> HeldOut:
    """Accuracy and mean reward on the held-out set, from the same responses.

    `sampling.temperature == 0` is greedy decoding (then one sample per problem is enough);
    otherwise `sampling.n` samples per problem, drawn with a fixed `seed`. Accuracy is the
    task's; the reward is `reward_fn`'s (a run's `reward.fn`; default: the task's).
    """
    problems = task.eval_problems()
    n = 1 if sampling.temperature == 0 else sampling.n
    g = torch.Generator(model.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    solved, total = 0, 0.0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        prompts = [encode_exact(tokenizer, p.prompt) for p in chunk for _ in range(n)]
        outs = sample_tokens(model, prompts, sampling, g, tokenizer.eos_token_id,
                             tokenizer.pad_token_id)
        for j, (ids, *_rest) in enumerate(outs):
            problem, text = chunk[j // n], tokenizer.decode(ids, skip_special_tokens=True)
            reward = task.reward(problem, text)
            solved += is_correct(reward.parts, reward.total)
            total += (reward_fn(problem, text) if reward_fn else reward).total
    model.train(was_training)
    pairs = max(1, len(problems) * n)
    return HeldOut(solved / pairs, total / pairs)


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_size: int = EVAL_BATCH_SIZE,
) -> float:
    """Share of held-out problems whose greedy answer earns the full reward."""
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    return heldout_scores(model, tokenizer, task, greedy, batch_size=batch_size).accuracy


def heldout_metrics(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, task: Task,
                    reward_fn: Callable[[Problem, str], Reward] | None, sampling: SamplingParams,
                    cfg: Config) -> dict[str, float]:
    """A run's held-out evaluation at `model`'s weights (the trainer's): greedy accuracy, and
    with `eval.samples` the accuracy and mean reward sampled like the rollouts: the
    trainer-side counterpart of the batch's reward/mean, which is the generator's (weights
    possibly versions old)."""
    out = {"eval/accuracy": greedy_accuracy(model, tokenizer, task, cfg.rollout.max_new_tokens,
                                            cfg.eval.batch_size)}
    if cfg.eval.samples:
        sampled = heldout_scores(
            model, tokenizer, task, replace(sampling, n=cfg.eval.samples, logprobs_topk=0),
            seed=cfg.run.seed + 7919 if cfg.eval.seed is None else cfg.eval.seed,
            batch_size=cfg.eval.batch_size, reward_fn=reward_fn)
        out |= {"eval/accuracy_sampled": sampled.accuracy, "eval/reward_sampled": sampled.reward}
    return out
