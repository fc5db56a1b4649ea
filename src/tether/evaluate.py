"""Greedy held-out accuracy: the number the demo prints before and after RL."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.models.tokenizer import encode_exact
from tether.rollout.hf import sample_tokens
from tether.rollout.types import SamplingParams
from tether.tasks.base import Problem, Task


@torch.no_grad()
def greedy_accuracy(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    problems: list[Problem] | None = None,
    max_new_tokens: int = 16,
    batch_size: int = 200,
) -> float:
    """Share of held-out problems whose greedy answer earns the full reward."""
    problems = task.eval_problems() if problems is None else problems
    was_training = model.training
    model.eval()
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=max_new_tokens)
    solved = 0
    for i in range(0, len(problems), batch_size):
        chunk = problems[i : i + batch_size]
        prompts = [encode_exact(tokenizer, p.prompt) for p in chunk]
        outs = sample_tokens(model, prompts, greedy, None, tokenizer.eos_token_id, tokenizer.pad_token_id)
        for p, (ids, *_rest) in zip(chunk, outs):
            text = tokenizer.decode(ids, skip_special_tokens=True)
            solved += task.reward(p, text).parts.get("correct", 0.0) >= 1.0
    model.train(was_training)
    return solved / max(1, len(problems))
