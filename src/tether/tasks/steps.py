"""Countdown answers that write their steps: `9-3=6,6*7=42`, read by a parser, never executed.

Grammar (no spaces; the caller strips the ends):

    chain  := NUMBER | step ("," step)*
    step   := NUMBER OP NUMBER "=" NUMBER
    OP     := "+" | "-" | "*" | "/"
    NUMBER := "0" | [1-9][0-9]*          (ASCII digits only)

A chain is valid when every step's arithmetic is exact (a "/" step must divide evenly,
since a result is written as a non-negative integer) and every operand is available:
the pool starts as the given numbers (a multiset), each step consumes its two operands
and adds its result, so every number, given or intermediate, is used at most once. Its
result is the last step's (a bare NUMBER is a chain of no steps: one given number).
Reference chains come from `tether.tasks.countdown.reachable_steps`.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

# [0-9], not \d: \d also matches non-ASCII digits, which int() would accept.
_NUMBER = r"(0|[1-9][0-9]*)"
_STEP = re.compile(rf"{_NUMBER}([-+*/]){_NUMBER}={_NUMBER}")
_BARE = re.compile(_NUMBER)


@dataclass(frozen=True)
class Chain:
    """A valid chain: its result and how many steps it wrote."""

    value: int
    steps: int


def evaluate_steps(text: str, numbers: tuple[int, ...], max_length: int) -> Chain | str:
    """Check a step chain over the given `numbers`; the `Chain`, or why it is not valid.

    Never raises for any str input. The length bound is checked first, so a hostile
    string costs O(max_length) at most.
    """
    if len(text) > max_length:
        return f"longer than {max_length} characters"
    pool = Counter(numbers)
    if _BARE.fullmatch(text):
        value = int(text)
        return Chain(value, 0) if pool[value] else f"{value} is not a given number"
    value = None
    steps = text.split(",")
    for i, step in enumerate(steps):
        match = _STEP.fullmatch(step)
        if match is None:
            return f"step {i + 1} {step!r} is not 'a op b=c'"
        a, op, b, c = int(match[1]), match[2], int(match[3]), int(match[4])
        pool[a] -= 1
        pool[b] -= 1
        if pool[a] < 0 or pool[b] < 0:
            return f"step {i + 1} uses a number that is not available"
        if op == "/":
            if b == 0 or a % b:
                return f"step {i + 1}: {a}/{b} is not a whole number"
            exact = a // b
        else:
            exact = a + b if op == "+" else a - b if op == "-" else a * b
        if exact != c:
            return f"step {i + 1}: {a}{op}{b} is {exact}, not {c}"
        pool[c] += 1
        value = c
    return Chain(value, len(steps))
