import pytest

import tether.tasks
from tether.tasks import CountdownTask, NumericAnswerTask, build_task, register_task, task_names


def test_build_builtin_tasks(tmp_path):
    countdown = build_task("countdown", eval_size=5, seed=3)
    assert isinstance(countdown, CountdownTask)
    assert countdown.eval_problems() == CountdownTask(eval_size=5, seed=3).eval_problems()
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    assert isinstance(build_task("numeric", path=path), NumericAnswerTask)


def test_unknown_name_lists_valid_ones():
    with pytest.raises(
        ValueError, match=r"unknown task 'countdwon'; valid names: chain, countdown, numeric"
    ):
        build_task("countdwon")


def test_bad_kwargs_reach_the_task():
    with pytest.raises(ValueError, match="num_numbers"):
        build_task("countdown", num_numbers=1)


def test_register_user_task_and_refuse_duplicates(monkeypatch):
    monkeypatch.setattr(tether.tasks, "_TASKS", dict(tether.tasks._TASKS))

    @register_task("tiny")
    class TinyCountdown(CountdownTask):
        name = "tiny"

    assert task_names() == ["chain", "countdown", "numeric", "tiny"]
    assert isinstance(build_task("tiny", eval_size=1), TinyCountdown)
    with pytest.raises(ValueError, match="'countdown' is already registered"):
        register_task("countdown")(TinyCountdown)
