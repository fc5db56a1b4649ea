"""Chain: evaluate an arithmetic chain left to right, writing every step (long responses).

Prompt and response use Countdown's alphabet, so the same character tokenizer serves both:

    prompt   "7+3*2-5="                       a start and K operations, no precedence
    response "7+3=10,10*2=20,20-5=15"        K steps "a op b=c", in the prompt's order

The answer is as long as the chain: K in [steps_min, steps_max] steps of 4-8 characters,
so the default 10 to 14 steps write 60-111 tokens with eos (90.5 on average over 500
held-out problems), against Countdown's 5-30. Every
intermediate lies in [0, value_max] by construction (a step writes a non-negative result).

Generation. The start is drawn from [1, operand_max]; each operation picks its operator
uniformly among + - * that have an operand in [1, operand_max] keeping the value in
[0, value_max], then the operand uniformly among those. The reference solution is the one
chain that follows the prompt, so a problem is a pure function of its prompt.

Streams, as Countdown's: the held-out set comes from its own stream and holds `eval_size`
distinct prompts; training problem i is drawn from a stream seeded by (seed, i) alone and
skips held-out prompts; `rl_share` splits the problem space by a hash of the prompt
between RL (`train_problem`) and the warm start (`warmstart_problem`).

Reward: parsed, never executed. The stripped response splits at ","; each piece must
match `a op b=c` (ASCII digits, no leading zeros, no spaces). The response is correct
(reward 1) when it has exactly K steps and step i reads (result of step i-1, or the
start) op_i operand_i = its exact value. A response whose every piece is a well-formed
step, K of them, that is not correct scores `format_weight`; anything else 0. The parts
also report `steps`: the share of the K steps right before the first wrong one (a
diagnostic; the reward does not pay it).
"""

from __future__ import annotations

import random
import re
import zlib

from tether.defaults import RL_SHARE
from tether.errors import InputError
from tether.tasks.base import DrawnTask, Problem, Reward

OPS = "+-*"
# [0-9], not \d: \d also matches non-ASCII digits, which int() would accept.
_NUMBER = r"(0|[1-9][0-9]*)"
_STEP = re.compile(rf"{_NUMBER}([-+*]){_NUMBER}={_NUMBER}")
MAX_STEPS = 24
"""Largest steps_max: 24 steps of up to 8 characters is about the tiny model's 256 positions."""


def apply(value: int, op: str, operand: int) -> int:
    """`value op operand`, exactly."""
    return value + operand if op == "+" else value - operand if op == "-" else value * operand


def chain_solution(start: int, ops: tuple[tuple[str, int], ...]) -> str:
    """The one correct response: every step of the chain, in order."""
    steps, value = [], start
    for op, operand in ops:
        result = apply(value, op, operand)
        steps.append(f"{value}{op}{operand}={result}")
        value = result
    return ",".join(steps)


def steps_right(text: str, start: int, ops: tuple[tuple[str, int], ...],
                max_length: int) -> tuple[int, bool]:
    """(steps right before the first wrong one, whether every piece is a well-formed step
    and there are len(ops) of them). Never raises for any str; the length bound is checked
    first, so a hostile string costs O(max_length) at most."""
    if len(text) > max_length:
        return 0, False
    pieces = text.split(",")
    matches = [_STEP.fullmatch(p) for p in pieces]
    well_formed = len(pieces) == len(ops) and all(matches)
    right, value = 0, start
    for match, (op, operand) in zip(matches, ops):
        if match is None:
            break
        result = apply(value, op, operand)
        if (int(match[1]), match[2], int(match[3]), int(match[4])) != (value, op, operand, result):
            break
        right, value = right + 1, result
    return right, well_formed


class ChainTask(DrawnTask):
    """Left-to-right arithmetic chains from a seed, with an exact parse-only reward (module
    docstring)."""

    name = "chain"
    RANGES = "the steps/operand/value ranges"
    # The knobs that shape the warm-start data (tether.models), hence the cached default model.
    WARMSTART_KNOBS = ("steps_min", "steps_max", "operand_max", "value_max", "rl_share")

    def __init__(
        self,
        steps_min: int = 10,
        steps_max: int = 14,
        operand_max: int = 9,
        value_max: int = 99,
        seed: int = 0,
        eval_size: int = 200,
        format_weight: float = 0.0,
        train_size: int = 0,
        rl_share: float = RL_SHARE,
    ) -> None:
        """Check the knobs, then build the held-out set.

        Args:
            steps_min, steps_max: inclusive range of the operations per problem (the
                response's steps), 1 <= steps_min <= steps_max <= MAX_STEPS.
            operand_max: operands and the start are drawn from [1, operand_max], 1..9
                (one digit, so a prompt is one character per operand).
            value_max: every intermediate stays in [0, value_max], >= operand_max.
            seed: picks the held-out set and the training stream.
            eval_size: number of distinct held-out problems (0 for none).
            format_weight: reward in [0, 1) for K well-formed steps that are not the chain.
            train_size: cycle through only the first N training problems (0: endless).
            rl_share: the share of problems RL draws (`train_problem`); the warm start draws
                only from the rest (`warmstart_problem`), split by a hash of the prompt.
                0: one stream for both.
        """
        if not (isinstance(steps_min, int) and isinstance(steps_max, int)
                and 1 <= steps_min <= steps_max <= MAX_STEPS):
            raise InputError(f"steps_min and steps_max must be ints with 1 <= steps_min <= "
                             f"steps_max <= {MAX_STEPS}, got {steps_min!r} and {steps_max!r}")
        if not isinstance(operand_max, int) or not 1 <= operand_max <= 9:
            raise InputError(f"operand_max must be an int in [1, 9] (one digit), got {operand_max!r}")
        if not isinstance(value_max, int) or value_max < operand_max:
            raise InputError(f"value_max must be an int >= operand_max ({operand_max}), got {value_max!r}")
        if eval_size < 0:
            raise InputError(f"eval_size must be >= 0, got {eval_size}")
        if not 0.0 <= format_weight < 1.0:
            raise InputError(f"format_weight must be in [0, 1) so a correct answer always scores "
                             f"more, got {format_weight}")
        if train_size < 0:
            raise InputError(f"train_size must be >= 0 (0: endless stream), got {train_size}")
        if not 0.0 <= rl_share < 1.0:
            raise InputError(f"rl_share must be in [0, 1), got {rl_share}")
        self.steps_min, self.steps_max = steps_min, steps_max
        self.operand_max, self.value_max = operand_max, value_max
        self.seed, self.format_weight = seed, format_weight
        self.train_size, self.rl_share = train_size, rl_share
        width = len(str(value_max))
        # K steps "a op b=c" at full width, K - 1 commas.
        self.max_response_chars = steps_max * (2 * width + 3) + steps_max - 1
        self.context = 2 * steps_max + 2 + self.max_response_chars + 1  # prompt, response, eos
        self._build_eval(eval_size)

    def _draw(self, rng: random.Random, problem_id: str) -> Problem:
        value = start = rng.randint(1, self.operand_max)
        ops = []
        for _ in range(rng.randint(self.steps_min, self.steps_max)):
            choices = {op: [b for b in range(1, self.operand_max + 1)
                            if 0 <= apply(value, op, b) <= self.value_max] for op in OPS}
            op = rng.choice([o for o in OPS if choices[o]])  # "+1" or "-1" always fits
            operand = rng.choice(choices[op])
            ops.append((op, operand))
            value = apply(value, op, operand)
        ops = tuple(ops)
        prompt = f"{start}{''.join(f'{op}{b}' for op, b in ops)}="
        return Problem(id=problem_id, prompt=prompt, solution=chain_solution(start, ops),
                       meta={"start": start, "ops": ops})

    def _key(self, problem: Problem) -> str:
        """The prompt: it determines the problem."""
        return problem.prompt

    def _hash(self, key: str) -> int:
        return zlib.crc32(key.encode())

    def reward(self, problem: Problem, response: str) -> Reward:
        """1 for the chain, `format_weight` for K well-formed steps that are not it, else 0."""
        ops = problem.meta["ops"]
        right, well_formed = steps_right(response.strip(), problem.meta["start"], ops,
                                         self.max_response_chars)
        correct = well_formed and right == len(ops)
        total = 1.0 if correct else (self.format_weight if well_formed else 0.0)
        return Reward(total=total, parts={"correct": float(correct), "format": float(well_formed),
                                          "steps": right / len(ops)})
