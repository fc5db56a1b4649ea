"""Rollouts with their rewards, made where the engine runs.

`rewarded_rollouts` samples G responses per problem and scores each with the reward
function, so whoever holds an engine (the synchronous loop, or a rollout worker process
in the asynchronous loop, tether.loops.async_loop) hands the trainer rewarded rollouts.

`RolloutEngine` is what a rollout worker holds: its own engine (hf or vllm) and reward
function. `worker_main` runs one in a process (the local backend): work items from the
trainer's queue, weights from its `WeightSubscriber`, rewarded batches back on the
results queue, stamped with the version(s) that sampled them. The Ray backend
(tether.rollout.ray_backend) runs one in an actor.
"""

from __future__ import annotations

import os
import queue as queue_lib
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from tether.config import Config
from tether.models.tokenizer import encode_exact
from tether.rollout.types import Generator, Rollout, SamplingParams
from tether.setup import build_generator, build_task_and_reward, load_policy, sampling_params
from tether.tasks.base import Task
from tether.weights.publisher import WeightSubscriber


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


# -- a rollout worker process (asynchronous loop) ----------------------------------------------


@dataclass(frozen=True)
class WorkItem:
    """One rollout batch to make: these training problems, at version >= min_version."""

    slot: int  # position in the trainer's order
    prompts: tuple[int, ...]  # training problem indices
    attempts: tuple[int, ...]  # each prompt's attempt number (ledger)
    min_version: int  # the published version when issued: the oldest weights allowed
    seed: int


@dataclass
class BatchResult:
    item: WorkItem
    rollouts: list[Rollout]
    worker: int
    idle_s: float  # time the worker waited for this item (admission or weights)
    generate_s: float
    error: str | None = None  # a worker's traceback: the run stops with it


class RolloutEngine:
    """What a rollout worker holds: its engine (hf or vllm, built from the run's model
    directory), the task and the reward. A worker process (`worker_main`) and a Ray actor
    (tether.rollout.ray_backend) both wrap one."""

    def __init__(self, index: int, cfg: Config, model_path: str):
        torch.set_num_threads(cfg.loop.worker_threads)
        self.index, self.partial = index, cfg.loop.partial
        self.task, self.reward_fn = build_task_and_reward(cfg)
        # On `run.device`: a Ray actor's is the GPU it was given.
        path, model, self.tokenizer = load_policy(cfg, model_path)
        self.generator = build_generator(cfg, model, path, self.tokenizer)
        self.sampling = sampling_params(cfg, model.config.vocab_size)

    def make(self, item: WorkItem, idle_s: float, refresh: Any = None) -> BatchResult:
        """The item's rewarded batch; `refresh` (partial rollouts) may load newer weights
        between decode steps."""
        t0 = time.perf_counter()
        extra = {"refresh": refresh} if self.partial and refresh is not None else {}
        rollouts = rewarded_rollouts(self.generator, self.tokenizer, self.task, self.reward_fn,
                                     list(item.prompts), self.sampling, item.seed, **extra)
        return BatchResult(item, rollouts, self.index, idle_s, time.perf_counter() - t0)


def worker_main(index: int, cfg: Config, model_path: str, parent_pid: int, tasks: Any,
                results: Any, weights: Any) -> None:
    """Build an engine and the reward, then make rewarded batches until told to stop (None)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the trainer stops the run in order
    item = None
    try:
        engine = RolloutEngine(index, cfg, model_path)
        subscriber = WeightSubscriber(weights, engine.generator)
        while True:
            t0 = time.perf_counter()
            item = next_or_orphaned(tasks, parent_pid)
            if item is None:
                break
            subscriber.wait_for(item.min_version)
            results.put(engine.make(item, time.perf_counter() - t0, subscriber.poll))
        engine.generator.close()
    except Exception:  # noqa: BLE001 - any failure goes to the trainer, which stops the run
        results.put(BatchResult(item, [], index, 0.0, 0.0, error=traceback.format_exc()))


def next_or_orphaned(tasks: Any, parent_pid: int) -> Any:
    """The next item on a child process's queue (None: stop), or None once the parent
    process is gone (a child blocked on its queue would otherwise outlive a killed parent)."""
    while True:
        try:
            return tasks.get(timeout=1.0)
        except queue_lib.Empty:
            if os.getppid() != parent_pid:
                return None
