"""The chain task: its exact step parser and reward, its streams and its bad-knob errors."""

import re

import pytest

from tether.tasks import ChainTask, Problem, Reward, Task, build_task
from tether.tasks.chain import chain_solution, steps_right

TASK = ChainTask(eval_size=20, format_weight=0.1)
# 7+3*2-5 left to right: 7+3=10, 10*2=20, 20-5=15
PROBLEM = Problem(id="t", prompt="7+3*2-5=", meta={"start": 7, "ops": (("+", 3), ("*", 2), ("-", 5))})


def reward(total: float, correct: bool, well_formed: bool, steps: int) -> Reward:
    return Reward(total=total, parts={"correct": float(correct), "format": float(well_formed),
                                      "steps": steps / 3})


@pytest.mark.parametrize(
    ("response", "expected"),
    [
        ("7+3=10,10*2=20,20-5=15", reward(1.0, True, True, 3)),
        (" 7+3=10,10*2=20,20-5=15\n", reward(1.0, True, True, 3)),  # ends stripped
        ("7+3=10,10*2=20,20-5=16", reward(0.1, False, True, 2)),  # wrong last result
        ("7+3=11,11*2=22,22-5=17", reward(0.1, False, True, 0)),  # wrong, then consistent with it
        ("3+7=10,10*2=20,20-5=15", reward(0.1, False, True, 0)),  # operands in the prompt's order
        ("7+3=10,2*10=20,20-5=15", reward(0.1, False, True, 1)),
        ("7+3=10,10*2=20,20+5=25", reward(0.1, False, True, 2)),  # the prompt's operator
        ("7+3=10,10*2=20", reward(0.0, False, False, 2)),  # a step short
        ("7+3=10,10*2=20,20-5=15,15+0=15", reward(0.0, False, False, 3)),  # a step too many
        ("7+3=10,10*2=20,20-5=15,", reward(0.0, False, False, 3)),  # trailing comma
        ("7+3=10;10*2=20;20-5=15", reward(0.0, False, False, 0)),
        ("7+3=10,10*2=20,20-5=015", reward(0.0, False, False, 2)),  # leading zero
        ("7+3=10,10*2=20,20 - 5=15", reward(0.0, False, False, 2)),
        ("7+3=10,10*2=20,20-5=1\u0665", reward(0.0, False, False, 2)),  # a non-ASCII digit
        ("15", reward(0.0, False, False, 0)),  # the answer alone is not the chain
        ("(7+3)*2-5", reward(0.0, False, False, 0)),
        ("", reward(0.0, False, False, 0)),
    ],
)
def test_reward(response, expected):
    assert TASK.reward(PROBLEM, response) == expected


def test_injection_is_parsed_never_executed(tmp_path):
    sentinel = tmp_path / "x"
    for attack in (f"__import__('os').system('touch {sentinel}')",
                   f"7+3=10,10*2=20,20-5=15;__import__('os').system('touch {sentinel}')"):
        assert TASK.reward(PROBLEM, attack).total == 0.0
    assert not sentinel.exists()


def test_length_bound_checked_first():
    long = "7+3=10,10*2=20,20-5=15" + " " * 10 + "x" * TASK.max_response_chars
    assert steps_right(long, 7, PROBLEM.meta["ops"], TASK.max_response_chars) == (0, False)


def test_problems_follow_their_prompt_and_stay_in_range():
    task = ChainTask(eval_size=100)
    problems = task.eval_problems() + [task.train_problem(i) for i in range(200)]
    for p in problems:
        start, ops = p.meta["start"], p.meta["ops"]
        assert p.prompt == f"{start}{''.join(f'{op}{b}' for op, b in ops)}="
        assert 10 <= len(ops) <= 14 and 1 <= start <= 9
        assert p.solution == chain_solution(start, ops)
        values = [int(step.rpartition("=")[2]) for step in p.solution.split(",")]
        assert all(0 <= v <= 99 for v in values)
        assert task.reward(p, p.solution).total == 1.0
        assert len(p.solution) <= task.max_response_chars
        assert len(p.prompt) + len(p.solution) + 1 <= task.context
    lengths = [len(p.solution) + 1 for p in problems]  # tokens with eos: one per character
    assert 60 <= min(lengths) and max(lengths) <= 150
    assert {op for p in problems for op, _ in p.meta["ops"]} == {"+", "-", "*"}


def test_streams_are_seeded_disjoint_and_split():
    task = ChainTask(eval_size=50)
    assert [p.prompt for p in task.eval_problems()] == [p.prompt for p in ChainTask(eval_size=50).eval_problems()]
    assert task.train_problem(7) == ChainTask(eval_size=50).train_problem(7)
    assert task.train_problem(7).prompt != ChainTask(eval_size=50, seed=1).train_problem(7).prompt
    held = {p.prompt for p in task.eval_problems()}
    assert len(held) == 50
    rl = {task.train_problem(i).prompt for i in range(300)}
    sft = {task.warmstart_problem(i).prompt for i in range(300)}
    assert not rl & held and not sft & held and not rl & sft
    assert ChainTask(eval_size=5, train_size=3).train_problem(4) == ChainTask(eval_size=5, train_size=3).train_problem(1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"steps_min": 0}, "steps_min"),
        ({"steps_min": 9, "steps_max": 8}, "steps_min"),
        ({"steps_max": 25}, "steps_max"),
        ({"operand_max": 10}, "operand_max"),
        ({"operand_max": 0}, "operand_max"),
        ({"value_max": 5, "operand_max": 9}, "value_max"),
        ({"eval_size": -1}, "eval_size"),
        ({"format_weight": 1.0}, "format_weight"),
        ({"train_size": -1}, "train_size"),
        ({"rl_share": 1.0}, "rl_share"),
        ({"steps_min": 1, "steps_max": 1, "operand_max": 1, "value_max": 1, "eval_size": 50}, "eval_size"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        ChainTask(**kwargs)


def test_negative_index_rejected():
    with pytest.raises(ValueError, match="index"):
        TASK.train_problem(-1)


def test_is_a_registered_task():
    assert isinstance(TASK, Task) and TASK.name == "chain"
    assert isinstance(build_task("chain", eval_size=3), ChainTask)


def test_config_selects_the_chain_and_names_a_bad_key():
    from tether.config import ConfigError, load_config

    cfg = load_config("configs/chain.yaml", [])
    assert cfg.task.name == "chain" and (cfg.task.steps_min, cfg.task.steps_max) == (10, 14)
    assert cfg.rollout.max_new_tokens >= 112  # 14 steps of up to 8 characters, with eos
    with pytest.raises(ConfigError, match=r"task\.steps_min"):
        load_config("configs/chain.yaml", ["task.steps_min=15"])
    with pytest.raises(ConfigError, match=r"task\.operand_max"):
        load_config("configs/chain.yaml", ["task.operand_max=10"])
