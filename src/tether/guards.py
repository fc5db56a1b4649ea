"""Guards: stop bad input before compute is spent, and bad numbers before they reach the weights.

Three kinds, all with a message a person can act on (docs/reliability.md):
- preflight checks at the start of a run (`check_prompts`): every prompt the run will see
  must tokenize exactly and fit the model's context with `rollout.max_new_tokens`;
- the step guard (`StepGuard`): a non-finite log-prob, advantage, loss or gradient norm
  skips that optimizer step, is counted and logged under `guard/*`, and after
  `train.max_bad_steps` skipped steps in a row the run stops with a checkpoint;
- a stop request (`STOP`): the CLI turns SIGINT/SIGTERM into "finish this step,
  checkpoint, exit", so a scheduler's kill loses nothing.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Mapping
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from tether.errors import InputError, StopRequested, TooManyBadSteps  # the CLI maps them
from tether.models.tokenizer import encode_exact
from tether.tasks.base import Task

PREFLIGHT_MAX_TRAIN_PROMPTS = 20_000
"""Training prompts checked up front (the first ones the run will use). Countdown prompts
are bounded by construction and datasets cycle, so this covers every built-in task; a
longer stream is checked only this far."""


def _resume_hint(run_dir: object) -> str:
    return f"a checkpoint was saved; continue with `tether train --resume {run_dir}`"


class _StopFlag:
    """Set by the CLI's signal handler, read by the loop once per step (thread-safe)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signum = 0

    def request(self, signum: int) -> None:
        self.signum = signum
        self._event.set()

    def clear(self) -> None:
        self._event.clear()
        self.signum = 0

    @property
    def requested(self) -> bool:
        return self._event.is_set()

    def stop_reason(self, step: int, run_dir: object) -> StopRequested | None:
        """The error to stop the run with after `step`, if a stop was requested."""
        if not self.requested:
            return None
        name = signal.Signals(self.signum).name if self.signum else "a stop request"
        return StopRequested(f"stopped by {name} after step {step}; {_resume_hint(run_dir)}",
                             self.signum)


STOP = _StopFlag()


def first_nonfinite(tensors: Mapping[str, torch.Tensor | None], mask: torch.Tensor) -> str | None:
    """Name of the first tensor holding NaN or +-inf where it matters, or None if all are finite.

    A tensor whose leading dims are `mask`'s shape (B, T) is checked at mask > 0 only
    (padding may hold anything); any other tensor (advantages (B,)) is checked whole.
    One host sync for all of them.
    """
    names, flags = [], []
    keep = mask > 0
    for name, t in tensors.items():
        if t is None:
            continue
        if t.shape[: mask.dim()] == mask.shape:  # padding set to 0, not indexed out (a sync)
            t = torch.where(keep.reshape(*keep.shape, *[1] * (t.dim() - keep.dim())), t, 0)
        names.append(name)
        flags.append(torch.isfinite(t.detach()).all())
    if not flags:
        return None
    ok = torch.stack(flags).tolist()
    return next((n for n, good in zip(names, ok) if not good), None)


class StepGuard:
    """Counts optimizer steps skipped for non-finite values; trips after `max_in_a_row`.

    The trainer calls `record(bad)` once per optimizer step with the name of the bad
    tensor (or None). Its counters are part of the checkpoint, so a resumed run trips
    exactly where the uninterrupted one would.
    """

    def __init__(self, max_in_a_row: int):
        self.max_in_a_row = max_in_a_row
        self.in_a_row = 0
        self.total = 0
        self.last_bad: str | None = None
        self.last_step_skipped = False

    def record(self, bad: str | None) -> dict[str, float]:
        """Count one optimizer step; return its guard metrics."""
        self.last_step_skipped = bad is not None
        if bad is None:
            self.in_a_row = 0
            return {"guard/skipped": 0.0}
        self.in_a_row += 1
        self.total += 1
        self.last_bad = bad
        return {"guard/skipped": 1.0, f"guard/bad/{bad}": 1.0}

    def counters(self) -> dict[str, float]:
        """Running counts, logged once per rollout step."""
        return {"guard/skipped_in_a_row": float(self.in_a_row), "guard/skipped_total": float(self.total)}

    @property
    def tripped(self) -> bool:
        return self.in_a_row >= self.max_in_a_row

    def stop_reason(self, step: int, run_dir: object) -> TooManyBadSteps | None:
        """The error to stop the run with after `step`, if tripped."""
        if not self.tripped:
            return None
        return TooManyBadSteps(
            f"stopped after step {step}: {self.in_a_row} optimizer steps in a row were skipped "
            f"because {self.last_bad} was not finite (NaN or inf; train.max_bad_steps="
            f"{self.max_in_a_row}). Likely causes: a learning rate too high (train.lr) or a "
            f"generator precision that overflows (rollout.precision). The weights were last "
            f"updated before those steps; a checkpoint is in {run_dir}/checkpoints"
        )

    def state_dict(self) -> dict[str, Any]:
        return {"in_a_row": self.in_a_row, "total": self.total, "last_bad": self.last_bad}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.in_a_row, self.total = int(state["in_a_row"]), int(state["total"])
        self.last_bad = state["last_bad"]


def check_prompts(
    task: Task,
    tokenizer: PreTrainedTokenizerBase,
    max_positions: int | None,
    max_new_tokens: int,
    n_train: int,
) -> None:
    """Refuse a run whose prompts do not tokenize exactly or do not fit the model's context.

    Checks the held-out set and the first `n_train` training problems (at most
    PREFLIGHT_MAX_TRAIN_PROMPTS). Raises ValueError naming the prompt id and the fix.
    """
    problems = task.eval_problems()
    problems += [task.train_problem(i) for i in range(min(n_train, PREFLIGHT_MAX_TRAIN_PROMPTS))]
    longest, longest_id = 0, ""
    for p in problems:
        n = len(encode_exact(tokenizer, p.prompt, what=f"prompt {p.id}"))
        if n > longest:
            longest, longest_id = n, p.id
    if max_positions is not None and longest + max_new_tokens > max_positions:
        room = max_positions - longest
        fix = (f"lower rollout.max_new_tokens to at most {room}" if room >= 1
               else "the prompt alone is too long: shorten or drop it")
        raise InputError(
            f"prompt {longest_id} is {longest} tokens; with rollout.max_new_tokens="
            f"{max_new_tokens} that is {longest + max_new_tokens} positions, more than the "
            f"model's context (max_position_embeddings={max_positions}): {fix}, or use a "
            f"model with a longer context"
        )
