"""Rollouts with their rewards, made where the engine runs.

`rewarded_rollouts` samples G responses per problem and scores each with the reward
function, so whoever holds an engine (the synchronous loop, or a rollout worker process
in the asynchronous loop, tether.loops.async_loop) hands the trainer rewarded rollouts.
"""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedTokenizerBase

from tether.models.tokenizer import encode_exact
from tether.rollout.types import Generator, Rollout, SamplingParams
from tether.tasks.base import Task


def rewarded_rollouts(generator: Generator, tokenizer: PreTrainedTokenizerBase, task: Task,
                      reward_fn: Any, problem_indices: list[int], sampling: SamplingParams,
                      seed: int, **generate_kwargs: Any) -> list[Rollout]:
    """`sampling.n` rewarded responses per training problem, grouped problem by problem."""
    problems = [task.train_problem(i) for i in problem_indices]
    prompts = [encode_exact(tokenizer, p.prompt) for p in problems]
    rollouts = generator.generate(prompts, [p.id for p in problems], sampling, seed=seed,
                                  **generate_kwargs)
    for ro in rollouts:
        text = tokenizer.decode(ro.response_ids, skip_special_tokens=True)
        reward = reward_fn(problems[ro.group_id], text)  # parses; a user's fn is guarded
        ro.reward, ro.reward_parts = reward.total, reward.parts
    return rollouts
