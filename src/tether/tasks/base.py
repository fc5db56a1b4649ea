"""What every task gives the RL loop: problems to sample and a reward that parses.

A task is a deterministic source of training problems (index -> problem, so a resumed
run sees the same stream), a fixed held-out set disjoint from it, and a reward
function. The reward only ever *parses* the model's text; it never executes it and
never raises, whatever string the model produced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Problem:
    """One prompt for the model, with the data its reward needs."""

    id: str
    """Stable id, unique within the task: "countdown-train-17", "countdown-eval-3"."""
    prompt: str
    """The text fed to the model."""
    solution: str | None = None
    """One reference response (the target of a supervised warm-start), or None."""
    meta: dict[str, Any] = field(default_factory=dict)
    """Task data the reward reads: numbers and target, reference answer, ..."""


@dataclass(frozen=True)
class Reward:
    """A scalar reward and the named components it was built from (for logging)."""

    total: float
    parts: dict[str, float]


@runtime_checkable
class Task(Protocol):
    """The interface the rollout loop uses; see CountdownTask for the reference one."""

    name: str

    def train_problem(self, index: int) -> Problem:
        """The index-th training problem; a pure function of (task seed, index)."""
        ...

    def eval_problems(self) -> list[Problem]:
        """The fixed held-out set, disjoint from every training problem."""
        ...

    def reward(self, problem: Problem, response: str) -> Reward:
        """Score one decoded response (without eos); never raises on any string."""
        ...


def is_correct(parts: dict[str, float], total: float) -> bool:
    """Held-out accuracy's test of one response: its reward's `correct` part when the task
    reports one (>= 1), else the full reward (total >= 1)."""
    return parts.get("correct", total) >= 1.0
