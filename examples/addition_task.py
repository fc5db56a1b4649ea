"""A task of your own, plugged in by import path (docs/tasks.md):

    tether train --config configs/addition.yaml
    tether train --config configs/countdown.yaml ~task task.name=examples/addition_task.py:Addition

Prompts like "3+4=" ask for the sum. The constructor's keyword arguments are the task's
config keys (`task.max_operand=20`), checked against their annotations when the config
loads. The reward only parses the answer; `parts["correct"]` is what held-out accuracy
counts (without it, a response counts as correct when its reward total is >= 1).
"""

from __future__ import annotations

import random

from tether.tasks import Problem, Reward


class Addition:
    name = "addition"

    def __init__(self, max_operand: int = 9, eval_size: int = 100, seed: int = 0):
        if max_operand < 1:
            raise ValueError("task.max_operand must be >= 1")
        self.max_operand, self.eval_size, self.seed = max_operand, eval_size, seed

    def _problem(self, split: str, index: int) -> Problem:
        rng = random.Random(f"{self.seed}-{split}-{index}")  # a pure function of (seed, index)
        a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
        return Problem(f"addition-{split}-{index}", f"{a}+{b}=", solution=str(a + b),
                       meta={"answer": a + b})

    def train_problem(self, index: int) -> Problem:
        return self._problem("train", index)

    def eval_problems(self) -> list[Problem]:
        # A different split of the same space; overlap with training is possible for a
        # small max_operand, as it is for any task this small.
        return [self._problem("eval", i) for i in range(self.eval_size)]

    def reward(self, problem: Problem, response: str) -> Reward:
        text = response.strip()
        correct = text.isdigit() and int(text) == problem.meta["answer"]
        return Reward(total=float(correct), parts={"correct": float(correct)})
