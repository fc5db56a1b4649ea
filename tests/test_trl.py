"""tether.integrations.trl on TRL's real GRPOTrainer and tether's tiny model: the loss equals
tether's own (loss and gradient), the split in TRL's logs, the re-sync, the dump."""

from __future__ import annotations

import copy
import re

import pytest

pytest.importorskip("trl")

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import GRPOConfig

from tether.cli import main
from tether.dump import dump_rows
from tether.estimators import TokenBatch, build_estimator
from tether.integrations.trl import TetherGRPOTrainer
from tether.rollout.types import Rollout, SamplingParams
from tether.scoring import collate, token_logprobs
from tether.tasks import CountdownTask

TASK = CountdownTask(format_weight=0.0)
PROBLEMS = [TASK.train_problem(i) for i in range(64)]
BY_PROMPT = {p.prompt: p for p in PROBLEMS}


def countdown(prompts, completions, **_):
    return [TASK.reward(BY_PROMPT[p], c).total for p, c in zip(prompts, completions, strict=True)]


class Recording(TetherGRPOTrainer):
    """Keeps each training micro-step's inputs, loss and gradient, and counts generations."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps: list[tuple[dict, torch.Tensor, list[torch.Tensor]]] = []
        self.generations = 0

    def _generate_and_score_completions(self, inputs):
        self.generations += 1
        return super()._generate_and_score_completions(inputs)

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, retain_graph=True)
        self.steps.append((dict(inputs), loss.detach(), [g.detach().clone() for g in grads]))
        return loss


def trainer(model_dir, tmp_path, steps=1, spg=1, lr=1e-3, cls=Recording, gc=True, **tether):
    torch.manual_seed(0)
    args = GRPOConfig(gradient_checkpointing=gc, bf16=False,
        output_dir=str(tmp_path / "out"), max_steps=steps, per_device_train_batch_size=16,
        num_generations=4, max_completion_length=10, temperature=1.0, top_k=0, top_p=1.0,
        learning_rate=lr, lr_scheduler_type="constant", beta=0.0, loss_type="dapo",
        steps_per_generation=spg, use_cpu=True, logging_steps=1, save_strategy="no",
        report_to=[], seed=0, disable_tqdm=True, shuffle_dataset=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return cls(model=model, reward_funcs=countdown, args=args,
               train_dataset=Dataset.from_dict({"prompt": [p.prompt for p in PROBLEMS]}),
               processing_class=AutoTokenizer.from_pretrained(model_dir), **tether)


def logged(t, key: str) -> list[float]:
    return [h[key] for h in t.state.log_history if key in h]


@pytest.mark.parametrize("estimator", ["dlc", "tis", "cis", "vespo"])
def test_a_trl_step_has_tethers_own_loss_and_gradient(warm_model_dir, tmp_path, estimator):
    # TRL's gradient checkpointing off: tether's trainer has none, and scores shared prompts
    # once (with it on the plug-in takes the plain forward, equal up to summation order).
    t = trainer(warm_model_dir, tmp_path, estimator=estimator, generator="bf16", gc=False)
    model0 = copy.deepcopy(t.model)  # the weights the step's loss is taken at
    model0.__dict__.pop("forward")  # TRL's patch, a closure over t.model: the class's own
    t.train()
    (inputs, trl_loss, trl_grads), = t.steps
    # tether's own: its collate, its scoring of pi_theta, its estimator, on the same rows.
    mask = inputs["completion_mask"].bool()
    rollouts = []
    for b in range(mask.shape[0]):
        n = int(mask[b].sum())
        topk = inputs.get("tether_topk_ids")
        rollouts.append(Rollout(
            prompt_id=str(b), group_id=b, engine="hf", precision="bf16", finish_reason="stop",
            prompt_ids=inputs["prompt_ids"][b][inputs["prompt_mask"][b].bool()].tolist(),
            response_ids=inputs["completion_ids"][b, :n].tolist(),
            logp_rollout=inputs["sampling_per_token_logps"][b, :n].tolist(), version=0,
            topk_ids=None if topk is None else topk[b, :n].tolist(),
            topk_logp=None if topk is None else inputs["tether_topk_logp_rollout"][b, :n].tolist()))
    batch = collate(rollouts, t.processing_class.pad_token_id)
    model0.train()
    logp, topk_logp = token_logprobs(model0, batch, SamplingParams(temperature=1.0))
    out = build_estimator(estimator)(TokenBatch(
        logp=logp, logp_old=logp.detach(), logp_rollout=batch.logp_rollout,
        advantages=inputs["advantages"], mask=batch.response_mask, topk_ids=batch.topk_ids,
        topk_logp_rollout=batch.topk_logp_rollout, topk_logp=topk_logp,
        topk_logp_old=None if topk_logp is None else topk_logp.detach()))
    grads = torch.autograd.grad(out.loss, [p for p in model0.parameters() if p.requires_grad])
    assert float(trl_loss) == pytest.approx(float(out.loss.detach()), abs=1e-6)
    assert max(float((a - b).abs().max()) for a, b in zip(trl_grads, grads, strict=True)) < 1e-6
    assert max(float(g.abs().max()) for g in grads) > 1e-3  # a gradient that can differ


def test_the_split_in_trls_logs_on_policy_and_with_a_bf16_generator(warm_model_dir, tmp_path):
    # On-policy (one optimizer step per generation): staleness 0. tether's engine samples
    # in fp32 (numerical at float rounding) and in bf16 (numerical material-sized, non-zero).
    k3 = {}
    for precision in ("fp32", "bf16"):
        t = trainer(warm_model_dir, tmp_path, steps=3, generator=precision)
        t.train()
        assert all(abs(x) < 1e-6 for x in logged(t, "staleness/k3_kl/mean"))
        assert all(x == pytest.approx(1.0, abs=1e-6) for x in logged(t, "staleness/ess/token"))
        k3[precision] = logged(t, "numerical/k3_kl/mean")
        assert len(k3[precision]) == 3
    assert max(k3["fp32"]) < 1e-9
    assert min(k3["bf16"]) > 1e-6  # tether's probe: 2.6-3.6e-5 for bf16 on this model


def test_staleness_grows_within_a_generation(warm_model_dir, tmp_path):
    # steps_per_generation=4 with TRL's own generation (no mu: staleness only): the first
    # step of a generation is at the sampling weights, each later one a version further.
    t = trainer(warm_model_dir, tmp_path, steps=8, spg=4, lr=2e-4)
    t.train()
    k3 = logged(t, "staleness/k3_kl/mean")
    assert len(k3) == 8 and not logged(t, "numerical/k3_kl/mean")
    assert logged(t, "staleness/versions/batch") == [0, 1, 2, 3, 0, 1, 2, 3]
    for g in (k3[:4], k3[4:]):  # each step trains on another quarter: compare 1 and 3 apart
        assert g[0] < 1e-9 < g[1] < g[3], k3


def test_ess_resync_regenerates_the_rest_of_a_generation(warm_model_dir, tmp_path):
    # tau 0.995: the first update already drops the ESS below it; each trip makes TRL
    # generate again instead of training on the generation's remaining batches.
    t = trainer(warm_model_dir, tmp_path, steps=4, spg=4, resync_tau=0.995)
    t.train()
    tripped = logged(t, "sync/tripped")
    assert tripped[0] == 0.0 and sum(tripped) >= 2
    assert t.generations == 1 + sum(tripped[:-1])
    untouched = trainer(warm_model_dir, tmp_path, steps=4, spg=4)
    untouched.train()
    assert untouched.generations == 1


def test_configurations_that_cannot_give_what_was_asked(warm_model_dir, tmp_path):
    with pytest.raises(ValueError, match="sampling log-probs"):
        trainer(warm_model_dir, tmp_path, estimator="tis")  # TRL's generation keeps no mu
    with pytest.raises(ValueError, match="top-K"):
        trainer(warm_model_dir, tmp_path, estimator="dlc")
    with pytest.raises(ValueError, match="cannot trip"):
        trainer(warm_model_dir, tmp_path, resync_tau=0.5)  # every generation trained once
    with pytest.raises(ValueError, match="pi_prox"):
        trainer(warm_model_dir, tmp_path, estimator="decoupled", generator="fp32")
    trainer(warm_model_dir, tmp_path, estimator="grpo")  # reads no mu: fine


def test_inspect_on_the_plugins_dump_gives_the_in_run_figures(warm_model_dir, tmp_path, capsys):
    dump = tmp_path / "logprobs.jsonl"
    t = trainer(warm_model_dir, tmp_path, steps=4, spg=2, lr=3e-3, generator="bf16",
                estimator="tis", dump=dump)
    t.train()
    rows, cfg = dump_rows(dump)
    history = [h for h in t.state.log_history if "numerical/k3_kl/mean" in h]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and len(history) == 4
    assert cfg["train"]["estimator"] == "tis" and cfg["rollout"]["precision"] == "bf16"
    for row, h in zip(rows, history, strict=True):
        keys = [k for k in h if k.split("/")[0] in ("numerical", "staleness", "total")]
        assert len(keys) > 30
        for k in keys:
            assert row[k] == pytest.approx(h[k], rel=1e-6, abs=1e-9), k
    assert [r["staleness/versions/batch"] for r in rows] == [0, 1, 0, 1]
    assert main(["inspect", str(dump), "--no-plots"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"over the run: staleness dominates", text)
    assert re.search(r"\n  staleness  k3 .*: material\nadvice: correct staleness", text)
    assert "advice: correct staleness" in t.advice()


def test_auto_chooses_the_correction_from_each_steps_split(warm_model_dir, tmp_path, capsys):
    t = trainer(warm_model_dir, tmp_path, steps=3, generator="bf16", correction="auto")
    # A bar every measured mismatch clears (N huge: 1/N ~ 0), switched after one step: the
    # bf16 engine's split makes the numerical part material from the first step on.
    t._auto.controller.batch, t._auto.controller.on_after = 10**9, 1
    t.train()
    assert logged(t, "auto/numerical") == [0.0, 1.0, 1.0]  # none, then cis from step 2
    assert logged(t, "auto/staleness") == [0.0, 0.0, 0.0]  # one optimizer step a generation
    assert "tether: auto: numerical none -> cis from step 2" in capsys.readouterr().err
    assert t._auto.estimator().spec[:2] == ("ppo", "cis")  # grpo's objective, cis's weight
    with pytest.raises(ValueError, match="arms the ESS re-sync"):
        trainer(warm_model_dir, tmp_path, correction="auto", resync_tau=0.5)
    with pytest.raises(ValueError, match="correction='bogus'"):
        trainer(warm_model_dir, tmp_path, correction="bogus")
    with pytest.raises(ValueError, match="chooses the correction itself"):
        trainer(warm_model_dir, tmp_path, correction="auto", estimator="tis", generator="fp32")
