import json
import sys
from fractions import Fraction

import pytest

from tether.tasks import NumericAnswerTask, Problem, Reward, Task, final_number, reference_number

CORRECT = Reward(total=1.0, parts={"correct": 1.0, "format": 1.0})
WRONG = Reward(total=0.0, parts={"correct": 0.0, "format": 1.0})
NO_NUMBER = Reward(total=0.0, parts={"correct": 0.0, "format": 0.0})


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _rows(n):
    return [
        {"prompt": f"What is {i} + {i}?", "answer": f"{i}+{i}={2 * i} #### {2 * i}"}
        for i in range(n)
    ]


@pytest.mark.parametrize(
    ("text", "number"),
    [
        ("The answer is 42.", Fraction(42)),
        ("1,234", Fraction(1234)),
        ("12,345,678 apples", Fraction(12345678)),
        ("-7", Fraction(-7)),
        ("it fell to -7.25", Fraction(-29, 4)),
        ("3.50", Fraction(7, 2)),
        ("$1,234.50 in total", Fraction(246900, 200)),
        ("5-3=2", Fraction(2)),  # "-" after a digit is subtraction
        ("5-3", Fraction(3)),
        ("1,2,3", Fraction(3)),  # not thousands groups: three numbers
        ("first 1 then 2", Fraction(2)),
        ("no digits here", None),
        ("", None),
        ("\u0664\u0662", None),  # Arabic-Indic 42 is not read as a number
        ("9" * 65, None),  # longer than MAX_NUMBER_CHARS
        ("9" * 10**6, None),
    ],
)
def test_final_number(text, number):
    assert final_number(text) == number


@pytest.mark.parametrize(
    ("answer", "number"),
    [
        ("48/2 = 24 clips in May. 48+24 = 72.\n#### 72", Fraction(72)),
        ("#### 1,234", Fraction(1234)),
        ("#### -3.50", Fraction(-7, 2)),
        ("#### 5 #### 6 apples", Fraction(6)),  # the last marker wins
        ("so she pays 18 dollars", Fraction(18)),  # no marker: the last number
        ("3 #### none", None),  # a marker with no number after it
    ],
)
def test_reference_number(answer, number):
    assert reference_number(answer) == number


def test_split_reward_and_cycling(tmp_path):
    task = NumericAnswerTask(_write_jsonl(tmp_path / "d.jsonl", _rows(8)), eval_fraction=0.25)
    eval_problems = task.eval_problems()
    train = [task.train_problem(i) for i in range(6)]
    assert len(eval_problems) == 2  # round(0.25 * 8)
    assert [p.id for p in train] == [f"numeric-train-{i}" for i in range(6)]
    assert [p.id for p in eval_problems] == ["numeric-eval-0", "numeric-eval-1"]
    all_prompts = {p.prompt for p in train} | {p.prompt for p in eval_problems}
    assert all_prompts == {row["prompt"] for row in _rows(8)}  # a partition of the rows
    assert task.train_problem(6) == train[0]  # cycles with period 6
    assert task.train_problem(13) == train[1]

    problem = task.train_problem(0)
    doubled = problem.meta["target"]  # e.g. "10" for "What is 5 + 5?"
    assert problem.solution == problem.meta["answer"]
    assert problem.solution.endswith(f"#### {doubled}")
    assert task.reward(problem, f"The answer is {doubled}.") == CORRECT
    assert task.reward(problem, f"{doubled}.000") == CORRECT
    assert task.reward(problem, f"{doubled} or maybe 999") == WRONG  # the last number counts
    assert task.reward(problem, "I don't know") == NO_NUMBER


def test_same_seed_same_split_and_order(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(20))
    first, second, other = (NumericAnswerTask(path, seed=s) for s in (0, 0, 1))
    assert first.eval_problems() == second.eval_problems()
    assert [first.train_problem(i) for i in range(18)] == [
        second.train_problem(i) for i in range(18)
    ]
    assert [first.train_problem(i) for i in range(18)] != [
        other.train_problem(i) for i in range(18)
    ]


def test_reward_formats(tmp_path):
    task = NumericAnswerTask(_write_jsonl(tmp_path / "d.jsonl", _rows(2)))
    thousands = Problem(id="p", prompt="q", meta={"answer": "#### 1234", "target": "1234"})
    decimal = Problem(id="p", prompt="q", meta={"answer": "#### 3.50", "target": "7/2"})
    negative = Problem(id="p", prompt="q", meta={"answer": "#### -5", "target": "-5"})
    assert task.reward(thousands, "It costs $1,234.") == CORRECT
    assert task.reward(thousands, "1234") == CORRECT
    assert task.reward(thousands, "1,235") == WRONG
    assert task.reward(decimal, "3.5") == CORRECT
    assert task.reward(decimal, "#### 3.50") == CORRECT
    assert task.reward(decimal, "3.51") == WRONG
    assert task.reward(negative, "it drops to -5") == CORRECT
    assert task.reward(negative, "10-5") == WRONG  # that is 5, not -5


def test_numeric_answer_fields_and_custom_keys(tmp_path):
    rows = [
        {"question": "a?", "label": 42},
        {"question": "b?", "label": 0.1},
        {"question": "c?", "label": "7"},
    ]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    task = NumericAnswerTask(path, prompt_key="question", answer_key="label", eval_fraction=0.3)
    problems = {
        p.prompt: p for p in task.eval_problems() + [task.train_problem(i) for i in range(2)]
    }
    assert problems["a?"].meta["target"] == "42"
    assert problems["b?"].meta["target"] == "1/10"  # the float 0.1 read as 1/10 exactly
    assert task.reward(problems["b?"], "0.10") == CORRECT
    assert problems["b?"].solution == "0.1"


def test_eval_path_and_shared_prompts_are_dropped_from_training(tmp_path):
    train_path = _write_jsonl(tmp_path / "train.jsonl", _rows(5))
    eval_path = _write_jsonl(tmp_path / "test.jsonl", _rows(2))  # prompts 0 and 1 also in train
    task = NumericAnswerTask(train_path, eval_path=eval_path)
    assert [p.prompt for p in task.eval_problems()] == ["What is 0 + 0?", "What is 1 + 1?"]
    train_prompts = {task.train_problem(i).prompt for i in range(3)}
    assert train_prompts == {"What is 2 + 2?", "What is 3 + 3?", "What is 4 + 4?"}
    assert task.train_problem(3) == task.train_problem(0)  # three rows left to train on


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n\n  \n{"prompt": "b", "answer": "2"}\n')
    task = NumericAnswerTask(path, eval_fraction=0.5)
    assert {task.train_problem(0).prompt, task.eval_problems()[0].prompt} == {"a", "b"}


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "a", "answer": "1"}', "{not json"], ":line 2: invalid JSON"),
        (
            ['{"prompt": "a", "answer": "1"}', "", '{"prompt": "b"}'],
            ":line 3: missing field 'answer'",
        ),
        (['{"prompt": 5, "answer": "1"}'], ":line 1: field 'prompt' must be a non-empty string"),
        (['{"prompt": "", "answer": "1"}'], ":line 1: field 'prompt' must be a non-empty string"),
        (['{"prompt": "a", "answer": "none"}'], ":line 1: field 'answer' states no number"),
        (
            ['{"prompt": "a", "answer": true}'],
            ":line 1: field 'answer' must be a string or a finite",
        ),
        (
            ['{"prompt": "a", "answer": NaN}'],
            ":line 1: field 'answer' must be a string or a finite",
        ),
        (
            ['{"prompt": "a", "answer": [1]}'],
            ":line 1: field 'answer' must be a string or a finite",
        ),
        (['["a", "1"]'], ":line 1: expected a JSON object, got list"),
        (['{"prompt": "a", "answer": ' + "1" * 5000 + "}"], ":line 1: invalid JSON"),
        ([], ": no rows"),
    ],
)
def test_malformed_rows_name_file_line_and_field(tmp_path, lines, message):
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(ValueError) as error:
        NumericAnswerTask(path)
    assert str(error.value).startswith(str(path) + message)


def test_non_utf8_line_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"prompt": "a", "answer": "1"}\n{"prompt": "\xff", "answer": "1"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:line 2: not UTF-8"):
        NumericAnswerTask(path)


def test_bad_arguments(tmp_path):
    path = _write_jsonl(tmp_path / "d.jsonl", _rows(4))
    with pytest.raises(ValueError, match="eval_fraction"):
        NumericAnswerTask(path, eval_fraction=1.0)
    with pytest.raises(ValueError, match=r"unknown file type '\.csv'; use \.jsonl or \.parquet"):
        NumericAnswerTask(tmp_path / "d.csv")
    with pytest.raises(
        ValueError, match=r"unknown file type '\.json'"
    ):  # a JSON array is not JSONL
        NumericAnswerTask(tmp_path / "d.json")
    same = _write_jsonl(tmp_path / "same.jsonl", [{"prompt": "a", "answer": "1"}] * 3)
    with pytest.raises(ValueError, match="no training rows left"):
        NumericAnswerTask(same)
    with pytest.raises(ValueError, match="index"):
        NumericAnswerTask(path).train_problem(-1)


def test_parquet(tmp_path):
    pyarrow = pytest.importorskip("pyarrow", reason="pyarrow not installed; parquet is optional")
    from pyarrow import parquet

    path = tmp_path / "d.parquet"
    parquet.write_table(pyarrow.Table.from_pylist(_rows(4)), path)
    task = NumericAnswerTask(path, eval_fraction=0.25)
    problem = task.train_problem(0)
    assert task.reward(problem, problem.meta["target"]) == CORRECT

    bad = tmp_path / "bad.parquet"
    parquet.write_table(
        pyarrow.Table.from_pylist(
            [{"prompt": "a", "answer": "1"}, {"prompt": None, "answer": "2"}]
        ),
        bad,
    )
    with pytest.raises(ValueError, match=r"bad\.parquet:row 2: field 'prompt'"):
        NumericAnswerTask(bad)


def test_parquet_without_pyarrow_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow` fail
    (tmp_path / "d.parquet").write_bytes(b"")
    with pytest.raises(ImportError, match="pip install pyarrow"):
        NumericAnswerTask(tmp_path / "d.parquet")


def test_is_a_task(tmp_path):
    task = NumericAnswerTask(_write_jsonl(tmp_path / "d.jsonl", _rows(3)))
    assert isinstance(task, Task)
    assert task.name == "numeric"
