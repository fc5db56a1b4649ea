import operator
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.hypothesis_budget import examples
from tether.tasks.expr import MAX_DEPTH_LIMIT, ExprFailure, ExprLimits, ExprValue, evaluate_expr


@pytest.mark.parametrize(
    ("text", "value", "literals"),
    [
        ("(9-3)*7", Fraction(42), (9, 3, 7)),
        ("8-3-2", Fraction(3), (8, 3, 2)),  # left-associative: (8-3)-2
        ("8-(3-2)", Fraction(7), (8, 3, 2)),
        ("2*3+4*5", Fraction(26), (2, 3, 4, 5)),  # * binds tighter than +
        ("12/4/3", Fraction(1), (12, 4, 3)),  # (12/4)/3
        ("7/2*2", Fraction(7), (7, 2, 2)),  # exact: 7/2 is kept as a fraction
        ("1/3", Fraction(1, 3), (1, 3)),
        ("3-7", Fraction(-4), (3, 7)),
        ("0", Fraction(0), (0,)),
        ("((((5))))", Fraction(5), (5,)),
        ("999999", Fraction(999999), (999999,)),  # six digits, the default limit
    ],
)
def test_evaluates_exactly(text, value, literals):
    assert evaluate_expr(text) == ExprValue(value, literals)


@pytest.mark.parametrize(
    ("text", "reason", "position"),
    [
        ("", "expected a number or '(', found end of text", 0),
        ("(3+", "expected a number or '(', found end of text", 3),
        ("(3+4", "expected ')'", 4),
        ("3+4)", "unexpected ')' after the expression", 3),
        ("-3+7", "expected a number or '(', found '-'", 0),  # no unary minus
        ("3+-7", "expected a number or '(', found '-'", 2),
        ("3 + 4", "unexpected ' ' after the expression", 1),  # no inner whitespace
        ("42=", "unexpected '=' after the expression", 2),
        ("3,4", "unexpected ',' after the expression", 1),
        ("07", "literal with a leading zero", 0),
        ("3/0", "division by zero", 2),
        ("3/(2-2)", "division by zero", 2),
        ("1234567", "literal longer than 6 digits", 0),
        ("\u0663", "expected a number or '(', found '\u0663'", 0),  # Arabic-Indic 3
        ("3.5", "unexpected '.' after the expression", 1),
        ("x", "expected a number or '(', found 'x'", 0),
    ],
)
def test_rejects_with_reason_and_position(text, reason, position):
    assert evaluate_expr(text) == ExprFailure(reason, position)


def test_length_is_checked_before_parsing():
    assert evaluate_expr("1" * 65) == ExprFailure("longer than 64 characters", 64)
    assert evaluate_expr("(" * 10**6) == ExprFailure("longer than 64 characters", 64)


def test_nesting_depth_limit():
    limits = ExprLimits(max_depth=3)
    assert evaluate_expr("(((1)))", limits) == ExprValue(Fraction(1), (1,))
    assert evaluate_expr("((((1))))", limits) == ExprFailure("parentheses nested deeper than 3", 3)


def test_deepest_allowed_nesting_does_not_hit_the_recursion_limit():
    depth = MAX_DEPTH_LIMIT
    limits = ExprLimits(max_length=2 * depth + 1, max_depth=depth)
    assert evaluate_expr("(" * depth + "1" + ")" * depth, limits) == ExprValue(Fraction(1), (1,))
    with pytest.raises(ValueError, match="max_depth"):
        ExprLimits(max_depth=MAX_DEPTH_LIMIT + 1)


def test_magnitude_limit_applies_to_numerator_and_denominator():
    limits = ExprLimits(max_magnitude=100)
    assert evaluate_expr("10*10", limits) == ExprValue(Fraction(100), (10, 10))
    assert evaluate_expr("10*11", limits) == ExprFailure("a value exceeds the magnitude limit 100", 0)
    assert evaluate_expr("1/101", limits) == ExprFailure("a value exceeds the magnitude limit 100", 2)
    assert evaluate_expr("1/10/11", limits) == ExprFailure("a value exceeds the magnitude limit 100", 0)
    # 9^12 > 10^12 (the default): a long product chain stops at the limit
    assert evaluate_expr("*".join(["9"] * 13)) == ExprFailure(
        "a value exceeds the magnitude limit 1000000000000", 0
    )


def test_limits_validation_names_the_field():
    with pytest.raises(ValueError, match="max_length"):
        ExprLimits(max_length=0)
    with pytest.raises(ValueError, match="max_magnitude"):
        ExprLimits(max_magnitude=-5)


# Random expression trees: (value or None if it divides by zero, fully parenthesised text).
_leaves = st.integers(0, 999).map(lambda n: (Fraction(n), str(n)))


_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def _node(children):
    def combine(left, op, right):
        (a, a_text), (b, b_text) = left, right
        text = f"({a_text}{op}{b_text})"
        if a is None or b is None or (op == "/" and b == 0):
            return None, text
        return _OPS[op](a, b), text

    return st.builds(combine, children, st.sampled_from("+-*/"), children)


_trees = st.recursive(_leaves, _node, max_leaves=16)
_WIDE = ExprLimits(
    max_length=10_000, max_depth=MAX_DEPTH_LIMIT, max_literal_digits=3, max_magnitude=10**200
)


@examples(500)
@given(_trees)
def test_fully_parenthesised_trees_evaluate_to_their_value(tree):
    value, text = tree
    result = evaluate_expr(text, _WIDE)
    if value is None:
        assert result == ExprFailure("division by zero", result.position)
    else:
        assert isinstance(result, ExprValue)
        assert result.value == value
