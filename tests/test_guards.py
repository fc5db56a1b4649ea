"""Guards: a non-finite log-prob skips exactly its step, is logged, and repeated ones stop the run.

NaN is injected by monkeypatching `tether.trainer.core.token_logprobs` in-process (no test-only
flag in the product): the trainer's grad-enabled scoring of one chosen step returns a
NaN at one response token.
"""

from __future__ import annotations

import pytest
import torch

import tether.trainer.core
from tether.checkpoint import list_checkpoints
from tether.cli import main
from tether.config import load_config
from tether.guards import StepGuard, first_nonfinite
from tether.logger import read_jsonl
from tether.loops import train

TINY = ["run.threads=1", "run.progress=false", "rollout.prompts_per_step=2",
        "rollout.group_size=4", "rollout.max_new_tokens=8", "task.name=countdown",
        "task.eval_size=8", "eval.every=0", "eval.batch_size=8", "diagnostics.monitor_every=0"]


def test_first_nonfinite_looks_where_the_mask_is():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    fine = torch.tensor([[-1.0, -2.0, float("nan")], [-0.5, float("inf"), float("nan")]])
    bad = fine.clone()
    bad[1, 0] = float("-inf")
    adv = torch.tensor([0.5, float("nan")])
    assert first_nonfinite({"logp_old": fine, "advantages": torch.zeros(2)}, mask) is None
    assert first_nonfinite({"logp_old": fine, "logp": bad}, mask) == "logp"
    assert first_nonfinite({"advantages": adv, "logp": bad}, mask) == "advantages"  # first bad
    topk = torch.zeros(2, 3, 4)
    topk[0, 2, 1] = float("nan")  # padding position: ignored
    assert first_nonfinite({"topk_logp": topk, "skip": None}, mask) is None


def test_step_guard_counts_and_trips():
    guard = StepGuard(max_in_a_row=2)
    assert guard.record(None) == {"guard/skipped": 0.0}
    assert guard.record("loss") == {"guard/skipped": 1.0, "guard/bad/loss": 1.0}
    guard.record(None)  # a good step resets the run of bad ones
    guard.record("logp")
    assert not guard.tripped
    guard.record("grad_norm")
    assert guard.tripped and guard.counters() == {"guard/skipped_in_a_row": 2.0,
                                                  "guard/skipped_total": 3.0}
    assert "grad_norm was not finite" in str(guard.stop_reason(7, "runs/x"))
    again = StepGuard(2)
    again.load_state_dict(guard.state_dict())
    assert again.tripped and again.total == 3


def _inject_nan(monkeypatch, steps: set[int]) -> None:
    """NaN in the trainer's log-prob of one token at each 1-based step in `steps`."""
    real = tether.trainer.core.token_logprobs
    calls = {"n": 0}

    def token_logprobs(model, batch, sampling, *args):
        logp, topk = real(model, batch, sampling, *args)
        if torch.is_grad_enabled():  # the trainer's scoring with grad: once per step here
            calls["n"] += 1
            if calls["n"] in steps:
                logp = logp.clone()
                logp[0, 0] = float("nan")
        return logp, topk

    monkeypatch.setattr(tether.trainer.core, "token_logprobs", token_logprobs)


def test_nan_logp_skips_exactly_that_step(warm_model_dir, tmp_path, monkeypatch):
    _inject_nan(monkeypatch, steps={3})
    cfg = load_config(None, [f"model.path={warm_model_dir}", f"run.dir={tmp_path}",
                             "train.steps=5", *TINY])
    train(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    assert [r["guard/skipped"] for r in rows] == [0, 0, 1, 0, 0]
    assert [r["version"] for r in rows] == [1, 2, 2, 3, 4]  # step 3 did not move the weights
    assert rows[2]["guard/bad/logp"] == 1.0 and "loss/total" not in rows[2]
    assert [r["guard/skipped_in_a_row"] for r in rows] == [0, 0, 1, 0, 0]
    assert rows[-1]["guard/skipped_total"] == 1
    assert all("guard/bad/logp" not in r for i, r in enumerate(rows) if i != 2)


def test_repeated_bad_steps_stop_with_a_checkpoint_and_exit_3(warm_model_dir, tmp_path,
                                                              monkeypatch, capsys):
    _inject_nan(monkeypatch, steps={2, 3, 4, 5})
    code = main(["train", f"model.path={warm_model_dir}", f"run.dir={tmp_path}",
                 "train.steps=6", "train.max_bad_steps=2", "run.checkpoint_every=0", *TINY])
    err = capsys.readouterr().err
    assert code == 3, err
    assert "stopped after step 3: 2 optimizer steps in a row were skipped because logp" in err
    assert "Traceback" not in err
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]
    assert len(read_jsonl(tmp_path / "metrics.jsonl")) == 4  # steps 0-3 logged


@pytest.mark.parametrize("bad", ["advantages", "logp_rollout"])
def test_bad_inputs_to_the_loss_are_named(random_model, bad):
    from tether.config import TrainConfig
    from tether.rollout.types import Rollout, SamplingParams
    from tether.scoring import collate
    from tether.trainer import Trainer

    trainer = Trainer(random_model, TrainConfig(), SamplingParams(n=2, max_new_tokens=3))
    rollouts = [Rollout("p", 0, [2, 3], [4, 5], [-1.0, -1.0], 0, "hf", "fp32", "stop", reward=r)
                for r in (0.0, 1.0)]
    batch = collate(rollouts, 0)
    adv = torch.tensor([-1.0, 1.0])
    if bad == "advantages":
        adv[1] = float("nan")
    else:
        batch.logp_rollout[0, 1] = float("inf")
    before = [p.detach().clone() for p in random_model.parameters()]
    logp_old, _ = trainer.score_old(batch, random_model)
    metrics = trainer.train_on(batch, adv, logp_old, None)[0][0]
    assert metrics[f"guard/bad/{bad}"] == 1.0 and trainer.version == 0
    assert all(torch.equal(a, b) for a, b in zip(before, random_model.parameters()))
