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
import sys
import time
import traceback
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.config import Config
from tether.models import quiet_transformers
from tether.models.tokenizer import encode_exact
from tether.rollout.types import Generator, Rollout, SamplingParams
from tether.scoring import TokenScorer, collate, score_at_versions
from tether.setup import (
    build_generator,
    build_task_and_reward,
    load_policy,
    sampling_params,
    scores_old_in_worker,
)
from tether.tasks.base import Problem, Task
from tether.weights.publisher import WeightSubscriber


def rewarded_rollouts(generator: Generator, tokenizer: PreTrainedTokenizerBase, task: Task,
                      reward_fn: Any, problem_indices: list[int], sampling: SamplingParams,
                      seed: int, **generate_kwargs: Any) -> list[Rollout]:
    """`sampling.n` rewarded responses per training problem, grouped problem by problem."""
    problems, rollouts = sample(generator, tokenizer, task, problem_indices, sampling, seed,
                                **generate_kwargs)
    add_rewards(tokenizer, reward_fn, problems, rollouts)
    return rollouts


def sample(generator: Generator, tokenizer: PreTrainedTokenizerBase, task: Task,
           problem_indices: list[int], sampling: SamplingParams, seed: int,
           **generate_kwargs: Any) -> tuple[list[Problem], list[Rollout]]:
    """The training problems and `sampling.n` responses to each, grouped problem by problem."""
    problems = [task.train_problem(i) for i in problem_indices]
    prompts = [encode_exact(tokenizer, p.prompt) for p in problems]
    return problems, generator.generate(prompts, [p.id for p in problems], sampling, seed=seed,
                                        **generate_kwargs)


def add_rewards(tokenizer: PreTrainedTokenizerBase, reward_fn: Any, problems: list[Problem],
                rollouts: list[Rollout]) -> None:
    for ro in rollouts:
        text = tokenizer.decode(ro.response_ids, skip_special_tokens=True)
        reward = reward_fn(problems[ro.group_id], text)  # parses; a user's fn is guarded
        ro.reward, ro.reward_parts = reward.total, reward.parts


# -- a rollout worker process (asynchronous loop) ----------------------------------------------


@dataclass(frozen=True)
class WorkItem:
    """One rollout batch to make: these training problems, at version >= min_version."""

    slot: int  # position in the trainer's order
    prompts: tuple[int, ...]  # training problem indices
    attempts: tuple[int, ...]  # each prompt's attempt number (ledger)
    min_version: int  # the published version when issued: the oldest weights allowed
    seed: int
    topk: int | None = None  # top-K log-probs to record (train.correction=auto); None: config's


@dataclass
class BatchResult:
    item: WorkItem
    rollouts: list[Rollout]
    worker: int
    idle_s: float  # time the worker waited for this item and its weights (loads excluded)
    generate_s: float  # sampling (under partial rollouts, with the loads between decode steps)
    reward_s: float = 0.0
    old_logprob_s: float = 0.0  # scoring pi_old (`loop.score_old=worker`)
    load_s: float = 0.0  # copying published weights into the engine (and the pi_old scorer)
    error: str | None = None  # a worker's traceback: the run stops with it


class RolloutEngine:
    """What a rollout worker holds: its engine (hf or vllm, built from the run's model
    directory), the task and the reward, and with `loop.score_old=worker` the scorer of
    pi_old (`OldScorer`). A worker process (`worker_main`) and a Ray actor
    (tether.rollout.ray_backend) both wrap one; weights reach it through `load_weights`."""

    def __init__(self, index: int, cfg: Config, model_path: str):
        self.started = time.perf_counter()
        torch.set_num_threads(cfg.loop.worker_threads)
        self.cfg, self.index, self.partial = cfg, index, cfg.loop.partial
        self.task, self.reward_fn = build_task_and_reward(cfg)
        # On `run.device`: a Ray actor's is the GPU it was given.
        path, model, self.tokenizer = load_policy(cfg, model_path)
        self.device = model.device
        self.generator = build_generator(cfg, model, path, self.tokenizer)
        self.sampling = sampling_params(cfg, model.config.vocab_size)
        # The scorer's model starts as the engine does: the weights on disk, as version 0.
        self.scorer = OldScorer(cfg, model, self.sampling, self.tokenizer.pad_token_id,
                                self.generator.version) if scores_old_in_worker(cfg) else None
        self.sampling_now = False  # a load while sampling is a partial rollout's
        self.load_s = 0.0  # spent loading weights since the last batch was made

    def announce(self) -> None:
        """The worker's one line at start: its engine, device and start-up time."""
        r = self.cfg.rollout
        where = f" on {self.device}" if r.engine == "hf" else ""  # vLLM places itself
        print(f"tether: rollout worker {self.index} ready: {r.engine} engine ({r.precision})"
              f"{where}, {time.perf_counter() - self.started:.1f} s", file=sys.stderr, flush=True)

    @property
    def version(self) -> int:
        return self.generator.version

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """A published version (views into its buffer) into the engine, and the scorer's."""
        t0 = time.perf_counter()
        self.generator.load_weights(state_dict, version)
        if self.scorer is not None:
            self.scorer.load(state_dict, version, mid_batch=self.sampling_now)
        self.load_s += time.perf_counter() - t0

    def make(self, item: WorkItem, idle_s: float, refresh: Any = None) -> BatchResult:
        """The item's rewarded batch, with pi_old when this worker scores it; `refresh`
        (partial rollouts) may load newer weights between decode steps."""
        loaded, self.load_s = self.load_s, 0.0
        extra = {"refresh": refresh} if self.partial and refresh is not None else {}
        sampling = self.sampling if item.topk is None else \
            replace(self.sampling, logprobs_topk=item.topk)
        t0 = time.perf_counter()
        self.sampling_now = True
        try:
            problems, rollouts = sample(self.generator, self.tokenizer, self.task,
                                        list(item.prompts), sampling, item.seed, **extra)
        finally:
            self.sampling_now = False
        t1 = time.perf_counter()
        add_rewards(self.tokenizer, self.reward_fn, problems, rollouts)
        t2 = time.perf_counter()
        scored = 0.0
        if self.scorer is not None:
            self.scorer(rollouts)
            scored = time.perf_counter() - t2
        loaded += self.load_s
        self.load_s = 0.0
        return BatchResult(item, rollouts, self.index, max(0.0, idle_s - loaded), t1 - t0,
                           t2 - t1, scored, loaded)


class OldScorer:
    """pi_old of a batch, scored in the rollout worker that made it (`loop.score_old=worker`),
    so the trainer's critical path has no pi_old forward. It runs the trainer's own code
    (tether.scoring's `score_at_versions` with a `TokenScorer`: the same processed
    distribution, micro-batches and `train.precision`) on an fp32 copy of the published
    weights, each token at the version that sampled it: bit for bit the trainer's numbers
    with the same thread count (tests/test_worker_scoring.py).

    Memory: one fp32 model beside the engine. Under partial rollouts a version loaded
    between decode steps is kept as views into its published buffer until the batch is
    scored (the buffer stays alive that long)."""

    def __init__(self, cfg: Config, model: PreTrainedModel, sampling: SamplingParams,
                 pad_id: int, version: int):
        self.scorer = TokenScorer(cfg.train, sampling)
        self.model, self.pad_id = model.eval(), pad_id
        self.version = version  # the version `model` holds
        self.mid_batch: dict[int, dict[str, torch.Tensor]] = {}  # loaded while sampling

    def load(self, state_dict: dict[str, torch.Tensor], version: int, mid_batch: bool) -> None:
        if mid_batch:  # the model keeps the batch's first version until it is scored
            self.mid_batch[version] = state_dict
        else:
            self._hold(version, state_dict)

    def __call__(self, rollouts: list[Rollout]) -> None:
        """Each rollout's `logp_old` (and `topk_logp_old`), at its tokens' versions."""
        batch = collate(rollouts, self.pad_id, self.model.device)
        logp, topk, _ = score_at_versions(self.scorer, batch, self._at)
        for i, ro in enumerate(rollouts):
            n = len(ro.response_ids)
            ro.logp_old = logp[i, :n].tolist()
            ro.topk_logp_old = None if topk is None else topk[i, :n].tolist()
        if self.mid_batch:  # on to the newest, and let go of the buffers
            self._at(max(self.mid_batch))
            self.mid_batch.clear()

    def _at(self, version: int) -> PreTrainedModel:
        if version != self.version:
            self._hold(version, self.mid_batch[version])
        return self.model

    def _hold(self, version: int, state_dict: dict[str, torch.Tensor]) -> None:
        self.model.load_state_dict(state_dict)
        self.version = version


def worker_main(index: int, cfg: Config, model_path: str, parent_pid: int, tasks: Any,
                results: Any, weights: Any) -> None:
    """Build an engine and the reward, then make rewarded batches until told to stop (None)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the trainer stops the run in order
    quiet_transformers()
    item = None
    try:
        engine = RolloutEngine(index, cfg, model_path)
        engine.announce()
        subscriber = WeightSubscriber(weights, engine, cfg.loop.worker_threads)
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
