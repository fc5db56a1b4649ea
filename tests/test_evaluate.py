"""Held-out scores at the trainer's weights: accuracy and reward from the same samples."""

from __future__ import annotations

import pytest

from tether.evaluate import greedy_accuracy, heldout_scores
from tether.models import load_model
from tether.rollout.types import SamplingParams
from tether.tasks import CountdownTask, Reward, is_correct


def test_reward_is_scored_on_the_accuracy_samples(warm_model_dir):
    model, tokenizer = load_model(warm_model_dir)
    task = CountdownTask(eval_size=16, format_weight=0.1)
    sampling = SamplingParams(n=4, temperature=1.0, max_new_tokens=12)
    seen: list[tuple[str, str]] = []

    def recording(problem, text):  # the run's reward.fn: here the task's, recording its calls
        seen.append((problem.id, text))
        return task.reward(problem, text)

    scores = heldout_scores(model, tokenizer, task, sampling, seed=5, reward_fn=recording)
    # One reward per (problem, sample), problem by problem: 16 x 4.
    assert [pid for pid, _ in seen] == [p.id for p in task.eval_problems() for _ in range(4)]
    problems = {p.id: p for p in task.eval_problems()}
    rewards = [task.reward(problems[pid], text) for pid, text in seen]
    assert scores.accuracy == sum(is_correct(r.parts, r.total) for r in rewards) / 64
    assert scores.reward == pytest.approx(sum(r.total for r in rewards) / 64, abs=1e-12)
    # format_weight 0.1: the reward sits above the accuracy by 0.1 x the well-formed misses.
    misses = sum(r.parts["format"] > r.parts["correct"] for r in rewards)
    # Measured: 5 correct and 37 well-formed misses of 64 on AVX-512, 4 and 39 on AVX2 (the
    # samples follow the CPU's vector kernels); both kinds of answer occur, so both terms count.
    assert scores.accuracy > 0 and misses > 0
    assert scores.reward == pytest.approx(scores.accuracy + 0.1 * misses / 64, abs=1e-12)
    # The same seed without a reward.fn: the same samples, so the same accuracy and reward.
    assert heldout_scores(model, tokenizer, task, sampling, seed=5) == scores


def test_reward_fn_changes_the_reward_not_the_accuracy(warm_model_dir):
    model, tokenizer = load_model(warm_model_dir)
    task = CountdownTask(eval_size=8)
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=12)
    lengths = heldout_scores(model, tokenizer, task, sampling, seed=1,
                             reward_fn=lambda p, text: Reward(float(len(text)), {}))
    own = heldout_scores(model, tokenizer, task, sampling, seed=1)
    assert lengths.accuracy == own.accuracy and lengths.reward > 1.0  # responses of > 1 character
    greedy = heldout_scores(model, tokenizer, task, SamplingParams(n=4, temperature=0.0,
                                                                   max_new_tokens=12))
    assert greedy.accuracy == greedy_accuracy(model, tokenizer, task, max_new_tokens=12)


def test_eval_seed_gives_runs_of_every_seed_the_same_draws(warm_model_dir, tmp_path):
    from tether.config import load_config
    from tether.run import build_run

    def sampled(seed: int, *extra: str) -> float:
        cfg = load_config(None, [f"model.path={warm_model_dir}", "task.eval_size=32",
                                 f"run.seed={seed}", f"run.dir={tmp_path / f'{seed}{extra}'}",
                                 *extra])
        return build_run(cfg).evaluate()["eval/accuracy_sampled"]

    # Equal weights: each run's own draws differ; shared draws score them equally.
    assert sampled(0) != sampled(1)
    assert sampled(0, "eval.seed=11") == sampled(1, "eval.seed=11") != sampled(0, "eval.seed=12")
