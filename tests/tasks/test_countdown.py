import re

import pytest

from tether.tasks import (
    ALPHABET,
    CountdownTask,
    Problem,
    Reward,
    Task,
    evaluate_expr,
    reachable,
    solve,
)

TASK = CountdownTask()
# 3, 7, 9 -> 42: (9-3)*7
PROBLEM = Problem(id="t", prompt="3,7,9:42=", meta={"numbers": (3, 7, 9), "target": 42})

CORRECT = Reward(total=1.0, parts={"correct": 1.0, "format": 1.0})
WELL_FORMED_MISS = Reward(total=0.0, parts={"correct": 0.0, "format": 1.0})
ZERO = Reward(total=0.0, parts={"correct": 0.0, "format": 0.0})


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("(9-3)*7", CORRECT),
        ("7*(9-3)", CORRECT),
        (" (9-3)*7\n", CORRECT),  # surrounding whitespace is stripped
        ("7*9-3*7", ZERO),  # = 42 but uses 7 twice
        ("9*3+7", WELL_FORMED_MISS),  # 34
        ("9", WELL_FORMED_MISS),  # a subset of the numbers is fine; 9 != 42
        ("7*7-7", ZERO),  # = 42, 7 used three times
        ("6*7", ZERO),  # = 42, 6 not given
        ("42", ZERO),  # the target itself is not a given number
        ("(9-3)*7=", ZERO),  # trailing "=" is malformed
        ("(9-3)*7=42", ZERO),
        ("(9-3)*7 is the answer", ZERO),
        ("(3+", ZERO),
        ("", ZERO),
        ("   ", ZERO),
        ("(9 - 3) * 7", ZERO),  # no spaces inside
        ("-3+9", ZERO),  # no unary minus
        ("(9-3)*7/0", ZERO),
        ("9/(3-3)", ZERO),
        ("9" * 5000, ZERO),
        ("*".join(["9"] * 30), ZERO),  # 59 characters; 9^30 exceeds the magnitude limit
        ("*".join(["9"] * 2500), ZERO),
        ("99999999999999999999999", ZERO),
        ("open('/etc/passwd').read()", ZERO),
        ("lambda: 42", ZERO),
        ("0x2A", ZERO),
        ("4\u0662", ZERO),  # Arabic-Indic digit two
        ("x" * 10**6, ZERO),
        ("(" * 10**6, ZERO),
        ("1+" * 500_000 + "1", ZERO),
    ],
)
def test_reward(response, expected):
    assert TASK.reward(PROBLEM, response) == expected


def test_injection_is_parsed_never_executed(tmp_path):
    sentinel = tmp_path / "x"
    attacks = [
        f"__import__('os').system('touch {sentinel}')",
        f"exec(\"open('{sentinel}','w')\")",
        f"eval(\"__import__('pathlib').Path('{sentinel}').touch()\")",
        f"(9-3)*7;__import__('os').system('touch {sentinel}')",
        f"(9-3)*7\n__import__('os').system('touch {sentinel}')",
    ]
    for attack in attacks:
        assert TASK.reward(PROBLEM, attack) == ZERO
    assert not sentinel.exists()


def test_numbers_given_twice_may_be_used_twice():
    problem = Problem(id="t", prompt="3,3,7:6=", meta={"numbers": (3, 3, 7), "target": 6})
    assert TASK.reward(problem, "3+3") == CORRECT
    assert TASK.reward(problem, "3+3+3-3") == ZERO  # four 3s, two given


def test_division_is_accepted_with_exact_fractions():
    problem = Problem(id="t", prompt="1,4,6:24=", meta={"numbers": (1, 4, 6), "target": 24})
    assert TASK.reward(problem, "6/(1/4)") == CORRECT  # 6 / 0.25
    assert TASK.reward(problem, "6/4") == WELL_FORMED_MISS  # 3/2


def test_format_weight_only_for_well_formed_misses():
    task = CountdownTask(format_weight=0.1, eval_size=1)
    assert task.reward(PROBLEM, "(9-3)*7") == CORRECT
    assert task.reward(PROBLEM, "9*3+7") == Reward(0.1, {"correct": 0.0, "format": 1.0})
    assert task.reward(PROBLEM, "6*7") == ZERO
    assert task.reward(PROBLEM, "(3+") == ZERO


def test_reachable_two_numbers_by_hand():
    # singles 2, 3; then 2+3, 2-3, 3-2, 2*3
    assert reachable((2, 3)) == {2: "2", 3: "3", 5: "2+3", -1: "2-3", 1: "3-2", 6: "2*3"}


def test_solve():
    assert solve((3, 7, 9), 42) == "7*(9-3)"
    assert solve([9, 7, 3], 42) == "7*(9-3)"  # order of the numbers does not matter
    assert solve((8, 3, 8, 3), 24) == "3*8"  # shortest, may leave numbers unused
    assert solve((2, 3, 4), 20) == "(2+3)*4"  # ties go alphabetically: "(" < "4"
    assert solve((2, 3, 4), 2) == "2"
    assert solve((1, 1, 1), 100) is None
    assert solve((3, 6), 2) is None  # 6/3: reachable only with "/", which solve does not use


def test_shortest_spelling_and_parentheses():
    assert solve((1, 2, 3), -4) == "1-2-3"  # (1-2)-3 needs none
    assert solve((2, 3, 4), -10) == "2-3*4"
    assert solve((5, 6, 9), 8) == "5+9-6"  # ties go alphabetically: "+" < "-"
    assert solve((5, 6, 9), -10) == "5-6-9"  # shorter than 5-(6+9)


def _parenthesis_pairs(text):
    stack, pairs = [], []
    for i, char in enumerate(text):
        if char == "(":
            stack.append(i)
        elif char == ")":
            pairs.append((stack.pop(), i))
    return pairs


def test_solutions_have_no_removable_parentheses():
    for problem in TASK.eval_problems():
        value = evaluate_expr(problem.solution).value
        for left, right in _parenthesis_pairs(problem.solution):
            text = problem.solution
            without = text[:left] + text[left + 1 : right] + text[right + 1 :]
            assert evaluate_expr(without).value != value, problem.solution


def test_same_seed_same_problems_and_order_free():
    other = CountdownTask()
    assert other.eval_problems() == TASK.eval_problems()
    later = [other.train_problem(i) for i in (50, 3, 0)]
    assert later == [TASK.train_problem(i) for i in (50, 3, 0)]


def test_different_seed_different_problems():
    other = CountdownTask(seed=1)
    assert [p.prompt for p in other.eval_problems()] != [p.prompt for p in TASK.eval_problems()]
    assert [other.train_problem(i).prompt for i in range(20)] != [
        TASK.train_problem(i).prompt for i in range(20)
    ]


def _key(problem):
    return tuple(sorted(problem.meta["numbers"])), problem.meta["target"]


def _check_problem(task, problem):
    numbers, target = problem.meta["numbers"], problem.meta["target"]
    assert len(numbers) == task.num_numbers
    assert all(task.num_min <= n <= task.num_max for n in numbers)
    assert task.target_min <= target <= task.target_max
    assert problem.prompt == f"{','.join(map(str, numbers))}:{target}="
    assert set(problem.prompt) <= set(ALPHABET)
    assert re.fullmatch(r"[0-9+\-*()]+", problem.solution)
    assert len(problem.solution) <= task.limits.max_length
    assert task.reward(problem, problem.solution) == CORRECT


def test_eval_set_is_fixed_distinct_and_solvable():
    problems = TASK.eval_problems()
    assert [p.id for p in problems] == [f"countdown-eval-{i}" for i in range(200)]
    assert len({_key(p) for p in problems}) == 200
    for problem in problems:
        _check_problem(TASK, problem)


def test_train_problems_skip_eval_and_are_solvable():
    eval_keys = {_key(p) for p in TASK.eval_problems()}
    for index in range(2000):
        problem = TASK.train_problem(index)
        assert problem.id == f"countdown-train-{index}"
        assert _key(problem) not in eval_keys
        _check_problem(TASK, problem)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_numbers": 2},
        {"num_numbers": 4, "target_max": 1000},
        {"num_numbers": 5, "num_min": 1, "num_max": 25, "target_min": 100, "target_max": 999},
        {"num_numbers": 3, "num_min": 10, "num_max": 99, "target_min": 0, "target_max": 500},
        {"target_min": -20, "target_max": -1},  # negative targets: prompt "3,5:-2="
        {"format_weight": 0.5},
    ],
)
def test_other_settings_generate_solvable_problems(kwargs):
    task = CountdownTask(eval_size=20, **kwargs)
    for problem in task.eval_problems() + [task.train_problem(i) for i in range(50)]:
        _check_problem(task, problem)


def test_only_one_possible_problem():
    # 9,9,9 -> 729 = 9*9*9 is the only problem; it is held out, so training has none
    task = CountdownTask(num_min=9, num_max=9, target_min=729, target_max=729, eval_size=1)
    (problem,) = task.eval_problems()
    assert (problem.prompt, problem.solution) == ("9,9,9:729=", "9*9*9")
    with pytest.raises(ValueError, match="held-out set"):
        task.train_problem(0)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_numbers": 1}, "num_numbers"),
        ({"num_numbers": 6}, "num_numbers"),
        ({"num_min": -1}, "num_min"),
        ({"num_min": 5, "num_max": 4}, "num_max"),
        ({"target_min": 10, "target_max": 5}, "target_max"),
        (
            {"target_min": 730, "target_max": 800},
            "target range",
        ),  # 3 numbers <= 9 reach at most 9*9*9 = 729
        ({"target_max": -730, "target_min": -800}, "target range"),
        # 9,9 reach only 0, 9, 18, 81: nothing in [10, 17]
        ({"num_numbers": 2, "num_min": 9, "target_min": 10, "target_max": 17}, "target_min"),
        ({"num_numbers": 2, "num_max": 2, "eval_size": 100}, "eval_size"),
        ({"eval_size": -1}, "eval_size"),
        ({"format_weight": 1.0}, "format_weight"),
        ({"format_weight": -0.1}, "format_weight"),
        ({"max_response_chars": 8}, "max_response_chars"),  # 3 digits, 2 operators, 2 pairs of ()
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        CountdownTask(**kwargs)


def test_negative_index_rejected():
    with pytest.raises(ValueError, match="index"):
        TASK.train_problem(-1)


def test_is_a_task():
    assert isinstance(TASK, Task)
    assert TASK.name == "countdown"


def test_reachable_use_all_keeps_only_full_expressions():
    # 2 and 3: subsets give 2, 3; the full set gives 5, -1, 1, 6.
    assert set(reachable((2, 3))) == {2, 3, 5, -1, 1, 6}
    assert set(reachable((2, 3), use_all=True)) == {5, -1, 1, 6}


def test_use_all_solutions_use_every_number():
    task = CountdownTask(seed=0, eval_size=50, use_all=True)
    for problem in [task.train_problem(i) for i in range(100)] + task.eval_problems():
        literals = sorted(int(x) for x in re.findall(r"\d+", problem.solution))
        assert literals == sorted(problem.meta["numbers"]), problem
        assert task.reward(problem, problem.solution).total == 1.0


def test_rl_problems_are_none_the_warm_start_solved():
    """rl_share splits the problems: RL draws only its share, the warm start only the rest,
    neither a held-out one; rl_share=0 is the single stream of before."""
    task = CountdownTask(use_all=True, eval_size=50)
    key = lambda p: (tuple(sorted(p.meta["numbers"])), p.meta["target"])
    rl = {key(task.train_problem(i)) for i in range(2000)}
    sft = {key(task.warmstart_problem(i)) for i in range(8000)}
    held = {key(p) for p in task.eval_problems()}
    assert len(rl) > 100 and len(sft) > 3 * len(rl) // 2
    assert not rl & sft and not (rl | sft) & held
    one = CountdownTask(use_all=True, eval_size=50, rl_share=0.0)
    assert {key(one.train_problem(i)) for i in range(500)} & \
        {key(one.warmstart_problem(i)) for i in range(500)}
