"""Countdown: reach a target with + - * / and parentheses, using each given number at most once.

Prompt and response use only the character tokenizer's alphabet (`ALPHABET`):

    prompt   "3,7,9:42="      numbers, a colon, the target, "="
    response "(9-3)*7"        an expression (answer="expr"); the model then emits eos
    response "9-3=6,7*6=42"   or its steps (answer="steps", see `tether.tasks.steps`)

Generation. Numbers are drawn uniformly (with repetition) from [num_min, num_max].
Every integer value reachable by + - * over any sub-multiset of them is enumerated
(exact: intermediates may be negative or large); the target is drawn uniformly among
those in [target_min, target_max], so every problem is solvable, and the draw is
repeated when none is. The reference solution is a short expression for the target
(each sub-result keeps its shortest spelling; ties go alphabetically), printed with the
fewest parentheses, so it is a pure function of (numbers, target). Solutions never use "/", but the
reward accepts it (exact fractions: "7/2*2" is 7). With answer="steps" the reference is the
shortest step chain instead (`reachable_steps`); for target_min >= 0 its targets, and so
the problems, are the same as with answer="expr".

Streams. The held-out set comes from its own random stream and holds `eval_size`
distinct (sorted numbers, target) keys. Training problem i is drawn from a stream
seeded by (seed, i) alone, so it can be produced in any order, and a draw whose key
is in the held-out set is skipped.

Reward. 1 if the stripped response parses (see `tether.tasks.expr`: no spaces, no
unary minus, no trailing "="), uses only given numbers, each at most as often as
given, and equals the target. Otherwise `format_weight` if it parses and uses only
given numbers, else 0; so the total never exceeds 1. With answer="steps": 1 if the chain
is valid (exact arithmetic in every step, every number, given or intermediate, used at
most once) and its last result is the target; `format_weight` for a valid chain that
misses; else 0.
"""

from __future__ import annotations

import functools
import random
from collections import Counter
from collections.abc import Callable, Iterable
from typing import TypeVar

from tether.defaults import RL_SHARE
from tether.errors import InputError
from tether.tasks.base import MAX_DRAWS, DrawnTask, Problem, Reward
from tether.tasks.expr import ExprFailure, ExprLimits, evaluate_expr
from tether.tasks.steps import Chain, evaluate_steps

Entry = TypeVar("Entry")  # what the subset enumeration keeps per value

ALPHABET = "0123456789+-*/()=,:"
"""Every character a Countdown prompt or solution may contain (plus the tokenizer's pad, eos)."""

MAX_NUMBERS = 5
"""Largest num_numbers: the reachable-value enumeration grows super-exponentially
(per multiset of numbers, cached: 0.07 ms at 3 numbers, 0.5 ms at 4, 8 ms at 5, 0.1-0.5 s at 6)."""

ANSWERS = ("expr", "steps")
"""How a response writes its answer: one expression, or a chain of steps."""


# Precedence of an expression's top operator, for printing with minimal parentheses.
_ATOM, _PRODUCT, _SUM = 3, 2, 1


def _join(left: tuple[str, int], op: str, right: tuple[str, int]) -> tuple[str, int]:
    """Print `left op right` for op in + - *, adding only the parentheses needed.

    A sum needs parentheses as either operand of "*" and as the right operand of "-";
    products and atoms never do ("a*(b*c)" prints as "a*b*c").
    """
    left_text, left_prec = left
    right_text, right_prec = right
    if op == "*":
        if left_prec == _SUM:
            left_text = f"({left_text})"
        if right_prec == _SUM:
            right_text = f"({right_text})"
        return f"{left_text}*{right_text}", _PRODUCT
    if op == "-" and right_prec == _SUM:
        right_text = f"({right_text})"
    return f"{left_text}{op}{right_text}", _SUM


def _by_subset(
    numbers: tuple[int, ...],
    leaf: Callable[[int], Entry],
    combine: Callable[[int, Entry, int, Entry], Iterable[tuple[int, Entry]]],
    text: Callable[[Entry], str],
    use_all: bool,
) -> dict[int, Entry]:
    """Every value reachable over sub-multisets of `numbers`, each with the entry whose
    `text` is shortest (ties: alphabetical), so the result is a pure function of the multiset
    (pass it sorted). With `use_all`, only values of entries that use every number.

    Dynamic programming over bitmasks of positions: the values of a set are those that
    `combine` makes from every split into two non-empty halves.
    """

    def keep(found: dict[int, Entry], value: int, entry: Entry) -> None:
        old = found.get(value)
        if old is None or (len(text(entry)), text(entry)) < (len(text(old)), text(old)):
            found[value] = entry

    count = len(numbers)
    by_mask: list[dict[int, Entry]] = [{} for _ in range(1 << count)]
    for i, number in enumerate(numbers):
        by_mask[1 << i][number] = leaf(number)
    for mask in range(1, 1 << count):
        if mask & (mask - 1) == 0:
            continue  # a single number, seeded above
        found = by_mask[mask]
        part = (mask - 1) & mask
        while part:  # every non-empty proper subset of mask, each split seen once
            rest = mask ^ part
            if part < rest:
                for a, a_entry in by_mask[part].items():
                    for b, b_entry in by_mask[rest].items():
                        for value, entry in combine(a, a_entry, b, b_entry):
                            keep(found, value, entry)
            part = (part - 1) & mask
    best: dict[int, Entry] = {}
    for found in by_mask[-1:] if use_all else by_mask[1:]:
        for value, entry in found.items():
            keep(best, value, entry)
    return best


def reachable(numbers: tuple[int, ...], use_all: bool = False) -> dict[int, str]:
    """Every integer reachable by + - * over sub-multisets of `numbers`, with one expression each
    (the shortest; ties: alphabetical). With `use_all`, only values of expressions that use
    every number (the classic game)."""

    def combine(a: int, a_expr: tuple[str, int], b: int, b_expr: tuple[str, int]):
        return ((a + b, _join(a_expr, "+", b_expr)), (a - b, _join(a_expr, "-", b_expr)),
                (b - a, _join(b_expr, "-", a_expr)), (a * b, _join(a_expr, "*", b_expr)))

    found = _by_subset(numbers, lambda n: (str(n), _ATOM), combine, lambda e: e[0], use_all)
    return {value: expr[0] for value, expr in found.items()}


def reachable_steps(numbers: tuple[int, ...], use_all: bool = False) -> dict[int, str]:
    """Every non-negative integer reachable by + - * over sub-multisets of `numbers`, each
    with its shortest step chain (`tether.tasks.steps`; ties: alphabetical).

    Only non-negative intermediates, since a result is written without a sign; this loses
    no non-negative target: |x op y| is always one of |x|+|y|, ||x|-|y|| or |x|*|y|, so
    taking absolute values through any + - * tree gives a chain with the same leaves. Each
    step writes the larger operand first (`9-3=6`); a given number alone is its own answer.
    """

    def combine(a: int, a_steps: str, b: int, b_steps: str):
        hi, lo = max(a, b), min(a, b)
        before = ",".join(s for s in (a_steps, b_steps) if s)  # "" for a given number
        for op, value in (("+", hi + lo), ("-", hi - lo), ("*", hi * lo)):
            step = f"{hi}{op}{lo}={value}"
            yield value, f"{before},{step}" if before else step

    found = _by_subset(numbers, lambda n: "", combine, lambda steps: steps, use_all)
    return {value: steps or str(value) for value, steps in found.items()}


def solve(numbers: tuple[int, ...] | list[int], target: int) -> str | None:
    """A short + - * expression over `numbers` (each at most once) equal to `target`, or None.

    Searches + - * only, like the generator, so a target that needs "/" gives None.
    """
    return reachable(tuple(sorted(numbers))).get(target)


def uses_given_numbers(literals: tuple[int, ...], numbers: tuple[int, ...]) -> bool:
    """True if every literal is a given number, each used at most as often as given."""
    return not Counter(literals) - Counter(numbers)


class CountdownTask(DrawnTask):
    """Countdown problems from a seed, with an exact parse-only reward (see module docstring)."""

    name = "countdown"
    RANGES = "the number/target ranges"
    # The knobs that shape the warm-start data (tether.models), hence the cached default model.
    WARMSTART_KNOBS = ("num_numbers", "num_min", "num_max", "target_min", "target_max", "use_all",
                       "answer", "rl_share")

    def __init__(
        self,
        num_numbers: int = 3,
        num_min: int = 1,
        num_max: int = 9,
        target_min: int = 1,
        target_max: int = 100,
        seed: int = 0,
        eval_size: int = 200,
        format_weight: float = 0.0,
        max_response_chars: int | None = None,
        use_all: bool = True,
        train_size: int = 0,
        answer: str = "expr",
        rl_share: float = RL_SHARE,
    ) -> None:
        """Check the knobs, then build the held-out set (so impossible ranges fail here).

        Args:
            num_numbers: how many numbers each problem gives, 2..MAX_NUMBERS.
            num_min, num_max: inclusive range the numbers are drawn from, num_min >= 0.
            target_min, target_max: inclusive range of targets.
            seed: picks the held-out set and the training stream.
            eval_size: number of distinct held-out problems (0 for none).
            format_weight: reward in [0, 1) for a parsing answer over the given numbers
                that misses the target.
            max_response_chars: longest response the reward parses (after stripping);
                longer ones score 0. None: 64, or the longest possible solution if longer.
            train_size: cycle through only the first N training problems (0: an endless
                stream); a small pool is the "can it fit?" sanity check.
            use_all: draw only targets whose reference solution uses every number. Without
                it, many targets are one given number or two, and RL learns "answer short".
            answer: "expr" (one expression) or "steps" (a chain like "9-3=6,7*6=42", whose
                responses are several times longer).
            rl_share: the share of problems kept for RL: `train_problem` draws only from
                them and the warm start (`warmstart_problem`) only from the rest, split by
                a hash of (numbers, target). The problem space is small (3 numbers in 1..9,
                targets 1..100, every number used: about 1,900 problems), so a warm start of
                100k solutions would otherwise have memorised every RL problem, leaving RL
                no signal. 0: one stream for both (as before the option existed).
        """
        if not isinstance(num_numbers, int) or not 2 <= num_numbers <= MAX_NUMBERS:
            raise InputError(
                f"num_numbers must be an int in [2, {MAX_NUMBERS}], got {num_numbers!r}"
            )
        if num_min < 0:
            raise InputError(
                f"num_min must be >= 0 (the parser has no negative literals), got {num_min}"
            )
        if num_max < num_min:
            raise InputError(f"num_max ({num_max}) must be >= num_min ({num_min})")
        if target_max < target_min:
            raise InputError(f"target_max ({target_max}) must be >= target_min ({target_min})")
        if eval_size < 0:
            raise InputError(f"eval_size must be >= 0, got {eval_size}")
        if not 0.0 <= format_weight < 1.0:
            raise InputError(
                f"format_weight must be in [0, 1) so a correct answer always scores more, "
                f"got {format_weight}"
            )
        if answer not in ANSWERS:
            raise InputError(f"answer must be one of {', '.join(ANSWERS)}, got {answer!r}")
        if answer == "steps" and target_max < 0:
            raise InputError(f"target_max ({target_max}) must be >= 0 with answer=steps: a "
                             "step writes its result as a non-negative number")
        largest = _largest_reachable(num_numbers, num_max)
        if target_min > largest or target_max < -largest:
            raise InputError(
                f"target range [{target_min}, {target_max}] is impossible: {num_numbers} numbers "
                f"in [{num_min}, {num_max}] reach at most |{largest}|"
            )
        digits = len(str(num_max))
        if answer == "steps":
            # n-1 steps "a op b=c" with every number as wide as the largest value, and commas.
            width = len(str(largest))
            longest_solution = (num_numbers - 1) * (3 * width + 2) + num_numbers - 2
        else:
            # Every number at full width, n-1 operators, at most one pair of () per operator.
            longest_solution = num_numbers * digits + 3 * (num_numbers - 1)
        if max_response_chars is None:
            max_response_chars = max(64, longest_solution)
        if max_response_chars < longest_solution:
            raise InputError(
                f"max_response_chars ({max_response_chars}) is below the longest possible "
                f"solution ({longest_solution} characters); raise it"
            )
        self.num_numbers = num_numbers
        self.num_min = num_min
        self.num_max = num_max
        self.target_min = target_min
        self.target_max = target_max
        self.seed = seed
        self.format_weight = format_weight
        self.use_all = use_all
        self.answer = answer
        if train_size < 0:
            raise InputError(f"train_size must be >= 0 (0: endless stream), got {train_size}")
        if not 0.0 <= rl_share < 1.0:
            raise InputError(f"rl_share must be in [0, 1), got {rl_share}")
        self.rl_share = rl_share
        self.train_size = train_size
        # No + - * value exceeds (num_max + 1)^n; squaring it leaves room for answers
        # through "/", whose numerators and denominators multiply.
        self.limits = ExprLimits(
            max_length=max_response_chars,
            max_literal_digits=digits,
            max_magnitude=max(10**12, (num_max + 1) ** (2 * num_numbers)),
        )
        self._build_eval(eval_size)

    def _draw(self, rng: random.Random, problem_id: str) -> Problem:
        """A problem with numbers and a reachable target in range, drawn from `rng`."""
        for _ in range(MAX_DRAWS):
            numbers = tuple(
                rng.randint(self.num_min, self.num_max) for _ in range(self.num_numbers)
            )
            solutions = _solutions(tuple(sorted(numbers)), self.use_all, self.answer,
                                   self.target_min, self.target_max)
            if solutions:
                target = rng.choice(sorted(solutions))
                return Problem(
                    id=problem_id,
                    prompt=f"{','.join(map(str, numbers))}:{target}=",
                    solution=solutions[target],
                    meta={"numbers": numbers, "target": target},
                )
        raise InputError(
            f"no draw of {self.num_numbers} numbers in [{self.num_min}, {self.num_max}] reached a "
            f"target in [target_min, target_max] = [{self.target_min}, {self.target_max}] "
            f"in {MAX_DRAWS} tries; widen the ranges"
        )

    def _key(self, problem: Problem) -> tuple[tuple[int, ...], int]:
        """(sorted numbers, target)."""
        return tuple(sorted(problem.meta["numbers"])), problem.meta["target"]

    def reward(self, problem: Problem, response: str) -> Reward:
        """1 for a correct answer, `format_weight` for a well-formed miss, else 0."""
        numbers, target = problem.meta["numbers"], problem.meta["target"]
        if self.answer == "steps":
            chain = evaluate_steps(response.strip(), numbers, self.limits.max_length)
            well_formed = isinstance(chain, Chain)
            correct = well_formed and chain.value == target
        else:
            parsed = evaluate_expr(response.strip(), self.limits)
            well_formed = not isinstance(parsed, ExprFailure) and uses_given_numbers(
                parsed.literals, numbers
            )
            correct = well_formed and parsed.value == target
        total = 1.0 if correct else (self.format_weight if well_formed else 0.0)
        return Reward(total=total, parts={"correct": float(correct), "format": float(well_formed)})


# Per multiset of numbers, not per draw: the enumeration costs ms at 5 numbers, and a warm
# start draws each multiset (1287 of 5 numbers in 1..9) hundreds of times.
@functools.lru_cache(maxsize=4096)
def _solutions(numbers: tuple[int, ...], use_all: bool, answer: str, target_min: int,
               target_max: int) -> dict[int, str]:
    """Target in [target_min, target_max] -> reference solution, for the sorted `numbers`."""
    find = reachable_steps if answer == "steps" else reachable
    return {v: s for v, s in find(numbers, use_all).items() if target_min <= v <= target_max}


def _largest_reachable(count: int, number: int) -> int:
    """Bound on |value| of any + - * expression over `count` numbers in [0, number].

    |a-b| <= a+b for a, b >= 0, so by induction no expression exceeds in magnitude its
    copy with every "-" turned into "+"; that copy is monotone in its numbers, so the
    bound is the best "+"/"*" tree over `count` copies of `number` (dynamic programming
    over the number of leaves).
    """
    best = [0, number]
    for leaves in range(2, count + 1):
        splits = [(best[k], best[leaves - k]) for k in range(1, leaves)]
        best.append(max(max(a + b, a * b) for a, b in splits))
    return best[count]
