"""A bounded, exact parser-evaluator for the arithmetic a model writes as an answer.

Model output is never executed (no eval, exec, compile or literal_eval): this module
reads it with a recursive-descent parser over the grammar

    expr   := term (("+" | "-") term)*
    term   := factor (("*" | "/") factor)*
    factor := NUMBER | "(" expr ")"
    NUMBER := "0" | [1-9][0-9]*          (ASCII digits only)

and evaluates with fractions.Fraction, so 7/2*2 is exactly 7 and nothing rounds.

Choices, stated here because a reward depends on them:
- No unary minus: "-3+7" is malformed. Countdown numbers are non-negative, and a
  unary minus can only negate a whole value, so it reaches no positive target that
  binary subtraction cannot (push each negation into the nearest subtraction).
- No whitespace inside the text and no leading zeros ("07"): a literal must be
  written the way the prompt writes a number. Callers strip surrounding whitespace.
- Every bound is checked before work that it guards, so a hostile string costs
  O(max_length) at most: total length first, then parenthesis depth (which also
  bounds recursion), literal digits (before int() conversion), and the numerator and
  denominator of every literal and intermediate value.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

_DIGITS = frozenset("0123456789")

MAX_DEPTH_LIMIT = 200
"""Cap on ExprLimits.max_depth: each parenthesis level costs three Python frames, and
200 levels stay well inside the default recursion limit of 1000."""


@dataclass(frozen=True)
class ExprLimits:
    """Bounds that keep parsing cheap on any input; the defaults suit Countdown."""

    max_length: int = 64
    """Longest accepted text, in characters."""
    max_depth: int = 16
    """Deepest parenthesis nesting; also bounds the parser's recursion."""
    max_literal_digits: int = 6
    """Longest integer literal, in digits."""
    max_magnitude: int = 10**12
    """Largest |numerator| and denominator allowed for any literal or intermediate value."""

    def __post_init__(self) -> None:
        for name in ("max_length", "max_depth", "max_literal_digits", "max_magnitude"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ExprLimits.{name} must be a positive int, got {value!r}")
        if self.max_depth > MAX_DEPTH_LIMIT:
            raise ValueError(
                f"ExprLimits.max_depth must be <= {MAX_DEPTH_LIMIT} (deeper nesting would risk "
                f"RecursionError), got {self.max_depth}"
            )


@dataclass(frozen=True)
class ExprValue:
    """A successful parse: the exact value and the integer literals in reading order."""

    value: Fraction
    literals: tuple[int, ...]


@dataclass(frozen=True)
class ExprFailure:
    """Why the text is not an accepted expression, and the character index where it failed."""

    reason: str
    position: int


class _Fail(Exception):
    """Internal: unwinds the parser to evaluate_expr(), which turns it into an ExprFailure."""

    def __init__(self, reason: str, position: int) -> None:
        super().__init__(reason)
        self.reason = reason
        self.position = position


def evaluate_expr(text: str, limits: ExprLimits = ExprLimits()) -> ExprValue | ExprFailure:
    """Parse and evaluate `text` exactly; return its value and literals, or why it failed.

    Never raises for any str input: malformed syntax, division by zero and every
    exceeded limit come back as an ExprFailure.
    """
    if len(text) > limits.max_length:
        return ExprFailure(f"longer than {limits.max_length} characters", limits.max_length)
    parser = _Parser(text, limits)
    try:
        value = parser.expr()
        if parser.pos != len(text):
            raise _Fail(f"unexpected {text[parser.pos]!r} after the expression", parser.pos)
    except _Fail as failure:
        return ExprFailure(failure.reason, failure.position)
    return ExprValue(value, tuple(parser.literals))


class _Parser:
    """Recursive descent over `text`; one method per grammar rule, `pos` is the cursor."""

    def __init__(self, text: str, limits: ExprLimits) -> None:
        self.text = text
        self.limits = limits
        self.pos = 0
        self.depth = 0
        self.literals: list[int] = []

    def _peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def _bounded(self, value: Fraction, start: int) -> Fraction:
        bound = self.limits.max_magnitude
        if abs(value.numerator) > bound or value.denominator > bound:
            raise _Fail(f"a value exceeds the magnitude limit {bound}", start)
        return value

    def expr(self) -> Fraction:
        start = self.pos
        value = self.term()
        while (op := self._peek()) in ("+", "-"):
            self.pos += 1
            right = self.term()
            value = self._bounded(value + right if op == "+" else value - right, start)
        return value

    def term(self) -> Fraction:
        start = self.pos
        value = self.factor()
        while (op := self._peek()) in ("*", "/"):
            self.pos += 1
            divisor_at = self.pos
            right = self.factor()
            if op == "*":
                value = value * right
            elif right == 0:
                raise _Fail("division by zero", divisor_at)
            else:
                value = value / right
            value = self._bounded(value, start)
        return value

    def factor(self) -> Fraction:
        char = self._peek()
        if char == "(":
            if self.depth == self.limits.max_depth:
                raise _Fail(f"parentheses nested deeper than {self.limits.max_depth}", self.pos)
            self.depth += 1
            self.pos += 1
            value = self.expr()
            if self._peek() != ")":
                raise _Fail("expected ')'", self.pos)
            self.pos += 1
            self.depth -= 1
            return value
        if char in _DIGITS:
            return self._number()
        found = repr(char) if char else "end of text"
        raise _Fail(f"expected a number or '(', found {found}", self.pos)

    def _number(self) -> Fraction:
        start = self.pos
        end = start
        while end < len(self.text) and self.text[end] in _DIGITS:
            end += 1
            if end - start > self.limits.max_literal_digits:
                raise _Fail(f"literal longer than {self.limits.max_literal_digits} digits", start)
        digits = self.text[start:end]
        if len(digits) > 1 and digits[0] == "0":
            raise _Fail("literal with a leading zero", start)
        self.pos = end
        literal = int(digits)
        self.literals.append(literal)
        return self._bounded(Fraction(literal), start)
