"""Building a run: everything both loops need before the first step, and what ends it.

`build_run` reads the input first (task, reward, prompts), so a bad dataset row, reward.fn
or prompt fails before any compute is spent; then the model, the sampling parameters and
the trainer. The rollout engine and the weight bookkeeping differ between the synchronous
loop (one engine in this process) and the asynchronous one (engines in worker processes),
so each loop builds its own (tether.loops).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.checkpoint import RunState, check_fresh_run_dir, load_checkpoint
from tether.config import Config, dump_config, resolve_logprobs_topk
from tether.errors import InputError
from tether.evaluate import greedy_accuracy, heldout_scores
from tether.guards import check_prompts
from tether.logger import RunLogger, open_logger
from tether.models import ensure_default_model, load_model
from tether.models.routing import is_moe, routers
from tether.models.tokenizer import encode_exact
from tether.rewards import build_reward_fn
from tether.rollout.hf import HFGenerator
from tether.rollout.types import Generator, SamplingParams
from tether.tasks import task_from_config
from tether.tasks.base import Task
from tether.trainer import Trainer


@dataclass
class RunResult:
    run_dir: Path
    accuracy_before: float  # greedy, held-out
    accuracy_after: float
    sampled_before: float | None  # sampled like the rollouts, held-out (eval.samples per problem)
    sampled_after: float | None
    rewards: list[float]  # mean reward per step


@dataclass
class Run:
    """The parts of a run shared by both loops."""

    cfg: Config
    run_dir: Path
    task: Task
    reward_fn: Any  # (problem, response text) -> Reward
    model_path: Path
    model: PreTrainedModel  # the trainer's (fp32, current weights)
    tokenizer: PreTrainedTokenizerBase
    sampling: SamplingParams
    trainer: Trainer
    probe: list[list[int]]  # the current-model monitor's prompts (held-out)

    def sampling_seed(self, index: int) -> int:
        """The generator's seed for the `index`-th rollout batch (a step, or an async slot)."""
        return sampling_seed(self.cfg, index)

    def start(self, state: RunState, resume: bool) -> tuple[int, RunLogger]:
        """Restore the last checkpoint (when resuming) and open the metric log; the start step."""
        start = load_checkpoint(self.run_dir, state) if resume else 0  # also trims later rows
        cfg = self.cfg
        log = open_logger(self.run_dir, cfg.log.tensorboard, cfg.log.wandb, cfg.log.wandb_project,
                          cfg.log.wandb_mode, cfg.model_dump(mode="json"))
        return start, log

    def evaluate(self) -> dict[str, float]:
        """Held-out accuracy at the trainer's weights, greedy and sampled like the rollouts,
        and the sampled responses' mean reward: the trainer-side counterpart of the batch's
        reward/mean, which is the generator's (weights possibly versions old)."""
        cfg, r = self.cfg, self.cfg.rollout
        out = {"eval/accuracy": greedy_accuracy(self.model, self.tokenizer, self.task,
                                                r.max_new_tokens, cfg.eval.batch_size)}
        if cfg.eval.samples:
            sampled = heldout_scores(
                self.model, self.tokenizer, self.task,
                replace(self.sampling, n=cfg.eval.samples, logprobs_topk=0),
                seed=cfg.run.seed + 7919 if cfg.eval.seed is None else cfg.eval.seed,
                batch_size=cfg.eval.batch_size, reward_fn=self.reward_fn)
            out |= {"eval/accuracy_sampled": sampled.accuracy, "eval/reward_sampled": sampled.reward}
        return out

    def eval_due(self, step: int) -> bool:
        """After `step` steps: every eval.every steps and after the last one."""
        every = self.cfg.eval.every
        return step == self.cfg.train.steps or (every > 0 and step % every == 0)

    def finish(self, before: dict[str, Any], after: dict[str, Any],
               rewards: list[float]) -> RunResult:
        """Save the trained model (safetensors, loads with from_pretrained); the result."""
        self.model.save_pretrained(self.run_dir / "final")
        self.tokenizer.save_pretrained(self.run_dir / "final")
        return RunResult(self.run_dir, before["eval/accuracy"], after["eval/accuracy"],
                         before.get("eval/accuracy_sampled"), after.get("eval/accuracy_sampled"),
                         rewards)


def sampling_seed(cfg: Config, index: int) -> int:
    """The generator's seed for the `index`-th rollout batch of a run (or of `tether probe`)."""
    return cfg.run.seed * 1_000_003 + index


def build_run(cfg: Config, resume: bool = False) -> Run:
    r = cfg.rollout
    task, reward_fn = build_task_and_reward(cfg)
    run_dir = make_run_dir(cfg, resume)
    model_path, model, tokenizer, sampling = load_policy(cfg)
    check_routing_replay(cfg.train.routing_replay, model)
    check_prompts(task, tokenizer, getattr(model.config, "max_position_embeddings", None),
                  r.max_new_tokens, cfg.train.steps * r.prompts_per_step)
    trainer = Trainer(model, cfg.train, sampling)
    probe = [encode_exact(tokenizer, p.prompt)
             for p in task.eval_problems()[:cfg.diagnostics.monitor_prompts]]
    return Run(cfg, run_dir, task, reward_fn, model_path, model, tokenizer, sampling, trainer,
               probe)


def build_task_and_reward(cfg: Config) -> tuple[Task, Any]:
    """Seed torch, then the task and the reward function: the input, read before any compute."""
    torch.manual_seed(cfg.run.seed)
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    task = task_from_config(cfg.task)
    return task, build_reward_fn(cfg.reward.fn, cfg.reward.timeout, task)


def load_policy(cfg: Config) -> tuple[Path, PreTrainedModel, PreTrainedTokenizerBase, SamplingParams]:
    """The model directory, the trainer's fp32 model (on `run.device`), its tokenizer, and how
    to sample from it."""
    model_path = resolve_model_path(cfg)
    device = resolve_device(cfg.run.device)
    model, tokenizer = load_model(model_path)
    return model_path, model.to(device), tokenizer, sampling_params(cfg, model.config.vocab_size)


def resolve_device(name: str) -> torch.device:
    """`run.device`: auto is the first GPU torch sees, else the CPU; a GPU it cannot see fails."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not (torch.cuda.is_available()
                                      and (device.index or 0) < torch.cuda.device_count()):
        raise InputError(f"run.device={name}: torch sees {torch.cuda.device_count()} CUDA "
                         "device(s) here; set run.device=auto or cpu")
    return device


def check_routing_replay(replay: str, model: PreTrainedModel) -> None:
    """train.routing_replay needs a MoE model whose routers tether can patch."""
    if replay == "none":
        return
    if not is_moe(model):
        raise InputError(f"train.routing_replay={replay}: {type(model).__name__} is not a "
                         "mixture-of-experts model (no routers to replay); set "
                         "train.routing_replay=none, or model.moe=true for tether's own model")
    try:
        routers(model)
    except ValueError as e:
        raise InputError(f"train.routing_replay={replay}: {e}") from None


def sampling_params(cfg: Config, vocab_size: int) -> SamplingParams:
    """How the generator samples; `rollout.logprobs_topk` resolved for a vocabulary of `vocab_size`."""
    r = cfg.rollout
    return SamplingParams(n=r.group_size, temperature=r.temperature, top_k=r.top_k,
                          top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                          logprobs_topk=resolve_logprobs_topk(cfg, vocab_size))


def resolve_model_path(cfg: Config) -> Path:
    """`model.path`, or tether's own tiny model (built and cached on first use)."""
    if cfg.model.path:
        return Path(cfg.model.path).expanduser()
    return ensure_default_model(cfg.model.cache_dir, cfg.model.moe, cfg.model.seed,
                                cfg.model.warmstart_steps, cfg.task.model_dump(),
                                moe_experts=cfg.model.moe_experts,
                                moe_aux_loss=cfg.model.moe_aux_loss)


def build_generator(cfg: Config, model: PreTrainedModel, model_path: Path,
                    tokenizer: PreTrainedTokenizerBase) -> Generator:
    """The rollout engine `rollout.engine` names, holding `model`'s weights as version 0."""
    r = cfg.rollout
    record = cfg.train.routing_replay == "r3"  # R3 replays the generator's routing
    if r.engine == "vllm":
        from tether.rollout.vllm_engine import VLLMGenerator

        generator = VLLMGenerator(model_path, r.precision, eos_token_id=tokenizer.eos_token_id,
                                  max_logprobs=max(20, resolve_logprobs_topk(cfg, model.config.vocab_size)),
                                  record_routes=record)
        generator.load_weights(model.state_dict(), version=0)
        return generator
    return HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id, r.precision,
                       r.router_noise, record_routes=record,
                       logit_noise=logit_noise(r))


def logit_noise(r) -> tuple[float, int, float, float] | None:
    """HFGenerator's `logit_noise` from a RolloutConfig: (scale, dof, outlier share, outlier
    scale), or None when off."""
    if r.logit_noise == 0 and r.logit_noise_outliers == 0:
        return None
    return r.logit_noise, r.logit_noise_dof, r.logit_noise_outliers, r.logit_noise_outlier_scale


def make_run_dir(cfg: Config, resume: bool = False) -> Path:
    run_dir = Path(cfg.run.dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}-{cfg.train.estimator}")
    if not resume:
        check_fresh_run_dir(run_dir)  # never mix two runs' rows and checkpoints
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(dump_config(cfg))
    return run_dir
