"""What every task gives the RL loop: problems to sample and a reward that parses.

A task is a deterministic source of training problems (index -> problem, so a resumed
run sees the same stream), a fixed held-out set disjoint from it, and a reward
function. The reward only ever *parses* the model's text; it never executes it and
never raises, whatever string the model produced.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tether.errors import InputError

MAX_DRAWS = 1000
"""Draws a generated task tries before it gives up on a problem (or, beyond 20 per wanted
one, on the held-out set)."""


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


class DrawnTask:
    """The held-out set and the training streams of a task that draws its problems from a
    seeded generator (countdown, chain). The held-out set comes from its own stream and
    holds `eval_size` problems distinct by `_key`; training problem i is drawn from a stream
    seeded by (seed, i) alone and skips held-out problems; `rl_share` splits the problem
    space by a stable hash of the key (`_hash`) between RL (`train_problem`) and the warm
    start (`warmstart_problem`).

    A subclass sets `name`, `seed`, `train_size`, `rl_share` and RANGES (what to widen when
    draws run out, for the error) and defines `_draw(rng, problem_id)` and `_key(problem)`;
    its __init__ calls `_build_eval(eval_size)`."""

    name: str
    seed: int
    train_size: int
    rl_share: float
    RANGES = "the ranges"

    def _draw(self, rng: random.Random, problem_id: str) -> Problem:
        raise NotImplementedError

    def _key(self, problem: Problem) -> Hashable:
        """Identity of a problem for held-out de-duplication."""
        raise NotImplementedError

    def _hash(self, key: Hashable) -> int:
        """A stable 32-bit hash of a key (not Python's), for the RL share."""
        return zlib.crc32(repr(key).encode())

    def _build_eval(self, eval_size: int) -> None:
        rng = random.Random(f"{self.name}/{self.seed}/eval")
        problems: list[Problem] = []
        keys: set[Hashable] = set()
        draws = 0
        while len(problems) < eval_size:
            draws += 1
            if draws > 20 * eval_size + MAX_DRAWS:
                raise InputError(
                    f"eval_size={eval_size}: only {len(problems)} distinct problems found in "
                    f"{draws - 1} draws; lower eval_size or widen {self.RANGES}"
                )
            problem = self._draw(rng, f"{self.name}-eval-{len(problems)}")
            if self._key(problem) not in keys:
                keys.add(self._key(problem))
                problems.append(problem)
        self._eval, self._eval_keys = problems, frozenset(keys)

    def train_problem(self, index: int) -> Problem:
        """The index-th RL training problem: drawn from a stream seeded by (seed, index) only,
        from the RL share of problems (`rl_share`), never a held-out one."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        if self.train_size:
            index %= self.train_size
        return self._draw_outside_eval(f"{self.name}/{self.seed}/train/{index}",
                                       f"{self.name}-train-{index}", rl=True)

    def warmstart_problem(self, index: int) -> Problem:
        """The index-th problem of the warm start's solutions: the share RL never draws."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        return self._draw_outside_eval(f"{self.name}/{self.seed}/warmstart/{index}",
                                       f"{self.name}-warmstart-{index}", rl=False)

    def _draw_outside_eval(self, stream: str, problem_id: str, rl: bool) -> Problem:
        rng = random.Random(stream)
        for _ in range(MAX_DRAWS):
            problem = self._draw(rng, problem_id)
            key = self._key(problem)
            in_rl = self._hash(key) < self.rl_share * 2**32
            if key not in self._eval_keys and (not self.rl_share or in_rl == rl):
                return problem
        raise InputError(
            f"draws keep landing in the held-out set ({len(self._eval_keys)} problems) or outside "
            f"their share of problems (rl_share={self.rl_share}); lower eval_size or widen "
            f"{self.RANGES}"
        )

    def eval_problems(self) -> list[Problem]:
        """The held-out problems (a fresh list; the problems themselves are shared)."""
        return list(self._eval)
