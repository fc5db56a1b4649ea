"""Held-out accuracy: greedy, and sampled at the rollout's temperature (mean over k samples).

RL optimises the sampled policy, so the sampled figure is the one RL moves first; greedy
accuracy is the mode's, which a short run can leave flat or even lower.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.defaults import EVAL_BATCH_SIZE, MAX_NEW_TOKENS
from tether.models.tokenizer import encode_exact
from tether.rollout.hf import sample_tokens
from tether.rollout.types import SamplingParams
from tether.tasks.base import Task, is_correct


@torch.no_grad()
def heldout_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    sampling: SamplingParams,
    seed: int = 0,
    batch_size: int = EVAL_BATCH_SIZE,
) -> float:
    """Share of (held-out problem, sample) pairs that earn the full reward.

    `sampling.temperature == 0` is greedy decoding (then one sample per problem is enough);
    otherwise `sampling.n` samples per problem, drawn with a fixed `seed`.
    """
    problems = task.eval_problems()
    n = 1 if sampling.temperature == 0 else sampling.n
    g = torch.Generator(model.device).manual_seed(seed)
    was_training = model.training
    model.eval()
    solved = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        prompts = [encode_exact(tokenizer, p.prompt) for p in chunk for _ in range(n)]
        outs = sample_tokens(model, prompts, sampling, g, tokenizer.eos_token_id,
                             tokenizer.pad_token_id)
        for j, (ids, *_rest) in enumerate(outs):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            reward = task.reward(chunk[j // n], text)
            solved += is_correct(reward.parts, reward.total)
    model.train(was_training)
    return solved / max(1, len(problems) * n)


def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    max_new_tokens: int = MAX_NEW_TOKENS,
    batch_size: int = EVAL_BATCH_SIZE,
) -> float:
    """Share of held-out problems whose greedy answer earns the full reward."""
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    return heldout_accuracy(model, tokenizer, task, greedy, batch_size=batch_size)
