"""Rewards see arbitrary model text: throw 10,000 random strings at them.

A quarter are any unicode text, a quarter are drawn from the arithmetic alphabet (plus
the few characters a model might add), and half are grammar-shaped, some with one
character edited, so the parser's deep paths are hit. While a reward runs, eval/exec/compile/open and
process spawning are replaced by tripwires, so "nothing is executed" is checked, not
assumed; a static scan checks the task modules never call them at all.
"""

import ast
import builtins
import os
import subprocess
from contextlib import contextmanager
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tether.tasks
from tests.hypothesis_budget import examples
from tether.tasks import ChainTask, CountdownTask, NumericAnswerTask, Problem, Reward

COUNTDOWN = CountdownTask(eval_size=1, format_weight=0.25)
COUNTDOWN_PROBLEM = Problem(id="t", prompt="3,7,9:42=", meta={"numbers": (3, 7, 9), "target": 42})
CHAIN = ChainTask(eval_size=1, format_weight=0.25)
CHAIN_PROBLEM = Problem(id="c", prompt="7+3*2=", meta={"start": 7, "ops": (("+", 3), ("*", 2))})
NUMERIC_PROBLEM = Problem(id="n", prompt="q", meta={"answer": "#### 42", "target": "42"})

_ARITHMETIC = "0123456789+-*/()" * 3 + "=,: .\n"  # repeats weight the expression characters

# Grammar-shaped strings reach what random characters rarely do: deep nesting, long
# operator chains, division by zero, the magnitude limit. A one-character edit then
# breaks them in every place.
_literals = st.sampled_from(["3", "7", "9", "0", "42", "99999", "1234567", "07"])
_expressions = st.recursive(
    _literals,
    lambda inner: st.one_of(
        st.tuples(inner, st.sampled_from("+-*/"), inner).map("".join),
        inner.map(lambda text: f"({text})"),
    ),
    max_leaves=40,
)
_edited = st.tuples(
    _expressions, st.integers(0, 80), st.sampled_from([*"0123456789+-*/()= ", ""])
).map(lambda edit: edit[0][: edit[1]] + edit[2] + edit[0][edit[1] + 1 :])
_responses = st.one_of(st.text(), st.text(alphabet=_ARITHMETIC, max_size=80), _expressions, _edited)


class _Executed(AssertionError):
    pass


def _tripwire(*args, **kwargs):
    raise _Executed(f"reward tried to execute something: {args!r:.200}")


@contextmanager
def _nothing_may_execute():
    targets = [
        (builtins, "eval"),
        (builtins, "exec"),
        (builtins, "compile"),
        (builtins, "open"),
        (os, "system"),
        (os, "popen"),
        (subprocess, "Popen"),
    ]
    saved = [(module, name, getattr(module, name)) for module, name in targets]
    for module, name in targets:
        setattr(module, name, _tripwire)
    try:
        yield
    finally:
        for module, name, original in saved:
            setattr(module, name, original)


@pytest.fixture(scope="module")
def numeric_task(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "fuzz.jsonl"
    path.write_text('{"prompt": "a", "answer": "#### 1"}\n{"prompt": "b", "answer": "#### 2"}\n')
    return NumericAnswerTask(path)


@examples(10_000)
@given(_responses)
def test_rewards_never_raise_or_execute(numeric_task, response):
    with _nothing_may_execute():
        countdown_reward = COUNTDOWN.reward(COUNTDOWN_PROBLEM, response)
        numeric_reward = numeric_task.reward(NUMERIC_PROBLEM, response)
        chain_reward = CHAIN.reward(CHAIN_PROBLEM, response)
    assert countdown_reward in (
        Reward(1.0, {"correct": 1.0, "format": 1.0}),
        Reward(0.25, {"correct": 0.0, "format": 1.0}),
        Reward(0.0, {"correct": 0.0, "format": 0.0}),
    )
    assert numeric_reward.total == numeric_reward.parts["correct"] in (0.0, 1.0)
    assert chain_reward.total in (0.0, 0.25) and chain_reward.parts["steps"] in (0.0, 0.5)


def test_task_modules_call_no_code_execution_builtins():
    forbidden_names = {"eval", "exec", "compile", "__import__"}
    forbidden_attributes = {"literal_eval", "system", "popen"}
    package = Path(tether.tasks.__file__).parent
    for source in sorted(package.glob("*.py")):
        for node in ast.walk(ast.parse(source.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            assert not (isinstance(func, ast.Name) and func.id in forbidden_names), source
            assert not (isinstance(func, ast.Attribute) and func.attr in forbidden_attributes), (
                source
            )
