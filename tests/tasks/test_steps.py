"""Countdown with answer=steps: the chain parser, the chain enumeration and the reward."""

import pytest

from tether.tasks import CountdownTask, Problem, Reward, reachable, reachable_steps
from tether.tasks.steps import Chain, evaluate_steps

TASK = CountdownTask(answer="steps", eval_size=20)
# 3, 7, 9 -> 42: 9-3=6, then 6*7=42
PROBLEM = Problem(id="t", prompt="3,7,9:42=", meta={"numbers": (3, 7, 9), "target": 42})

CORRECT = Reward(total=1.0, parts={"correct": 1.0, "format": 1.0})
VALID_MISS = Reward(total=0.0, parts={"correct": 0.0, "format": 1.0})
ZERO = Reward(total=0.0, parts={"correct": 0.0, "format": 0.0})


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("9-3=6,6*7=42", CORRECT),
        ("9-3=6,7*6=42", CORRECT),  # operand order is free
        (" 9-3=6,6*7=42\n", CORRECT),  # surrounding whitespace is stripped
        ("7*9=63,63-3=60,60/3=20", ZERO),  # 3 given once, used twice
        ("9-3=6,6*7=42,42+0=42", ZERO),  # 0 is not given
        ("7*3=21,21+9=30", VALID_MISS),  # valid chain, last result 30
        ("9-3=6,6*7=42,42-7=35", ZERO),  # 7 already used
        ("9-3=6,6*7=43", ZERO),  # wrong arithmetic in the last step
        ("9-3=5,5*7=35", ZERO),  # wrong arithmetic, then consistent with it
        ("9-3=6,6*7=42,", ZERO),  # trailing comma: an empty step
        ("9-3=6;6*7=42", ZERO),
        ("(9-3)*7", ZERO),  # an expression is not a chain
        ("9 - 3=6,6*7=42", ZERO),
        ("9-3=06,6*7=42", ZERO),  # leading zero
        ("3-9=-6", ZERO),  # no signed results
        ("9-3=6,6*7=42=42", ZERO),
        ("9", VALID_MISS),  # a bare given number: a chain of no steps
        ("42", ZERO),  # the target, but not a given number
        ("", ZERO),
        ("9-3=6,6*7=4\u0662", ZERO),  # a non-ASCII digit
    ],
)
def test_reward(response, expected):
    assert TASK.reward(PROBLEM, response) == expected


def test_division_must_be_exact():
    # 9/3=3 exact; 7/3 is not a whole number; x/0 never.
    assert evaluate_steps("9/3=3,3*7=21", (3, 7, 9), 64) == Chain(21, 2)
    assert isinstance(evaluate_steps("7/3=2", (3, 7), 64), str)
    assert isinstance(evaluate_steps("7/0=0", (0, 7), 64), str)


def test_intermediate_equal_to_a_given_number():
    # 3,3,6: 6-3=3 makes a second 3 (one given 3 left + the new one); both then usable once.
    assert evaluate_steps("6-3=3,3*3=9", (3, 3, 6), 64) == Chain(9, 2)
    assert isinstance(evaluate_steps("6-3=3,3*3=9,9-3=6", (3, 3, 6), 64), str)


def test_length_bound_checked_first():
    long_chain = ",".join(["1+1=2"] * 20)  # 119 characters
    assert evaluate_steps(long_chain, (1,) * 40, 118) == "longer than 118 characters"


def test_reachable_steps_by_hand():
    # 2 and 3 with use_all: 3+2=5, 3-2=1, 3*2=6 (no negative result).
    assert reachable_steps((2, 3), use_all=True) == {5: "3+2=5", 1: "3-2=1", 6: "3*2=6"}
    # Subsets too: the given numbers themselves, as bare numbers.
    assert reachable_steps((2, 3)) == {2: "2", 3: "3", 5: "3+2=5", 1: "3-2=1", 6: "3*2=6"}


@pytest.mark.parametrize("numbers", [(1, 2, 3, 4), (2, 2, 5, 9), (3, 5, 7, 8, 9)])
def test_chains_reach_what_expressions_reach(numbers):
    # The same non-negative targets as the expression enumeration, and each chain is valid.
    chains = reachable_steps(numbers, use_all=True)
    assert set(chains) == {v for v in reachable(numbers, use_all=True) if v >= 0}
    for value, chain in chains.items():
        assert evaluate_steps(chain, numbers, 200) == Chain(value, len(numbers) - 1)


def test_same_problems_as_expr_answers():
    # For target_min >= 0 the two formats draw the same problems; only the solution differs.
    expr = CountdownTask(num_numbers=4, eval_size=20)
    steps = CountdownTask(num_numbers=4, eval_size=20, answer="steps")
    for a, b in zip(expr.eval_problems() + [expr.train_problem(i) for i in range(30)],
                    steps.eval_problems() + [steps.train_problem(i) for i in range(30)]):
        assert (a.prompt, a.meta) == (b.prompt, b.meta)
        assert steps.reward(b, b.solution) == CORRECT
        assert b.solution.count("=") == 3  # use_all: one step per number after the first


def test_solution_lengths_five_numbers():
    # 5 numbers in 1..9, targets 1..100: 4 steps of at least "a+b=c", so >= 4*5+3 = 23
    # characters; over these 100 problems 23-30, mean 25.76 (then eos: 26.76 tokens).
    task = CountdownTask(num_numbers=5, eval_size=1, answer="steps")
    lengths = [len(task.train_problem(i).solution) for i in range(100)]
    assert (min(lengths), max(lengths)) == (23, 30)
    assert sum(lengths) / len(lengths) == pytest.approx(25.76)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"answer": "words"}, "answer"), ({"target_min": -9, "target_max": -1}, "target_max"),
     ({"num_numbers": 5, "max_response_chars": 70}, "max_response_chars")],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        CountdownTask(answer=kwargs.pop("answer", "steps"), **kwargs)
