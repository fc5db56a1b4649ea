"""Speed without changing the numbers: pi_old from the training forward when it is provably the
same, and log-probs that never hold a (tokens, vocabulary) logits tensor in full."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tether.scoring.logprobs
import tether.step
import tether.weights.snapshots
from tether.config import TrainConfig, load_config
from tether.logger import read_jsonl
from tether.loops import train
from tether.models import build_tiny_model
from tether.rollout.types import Rollout, SamplingParams
from tether.scoring import collate, score_batch
from tether.trainer import Trainer, group_advantages

SHORT = ["train.steps=3", "rollout.prompts_per_step=4", "rollout.group_size=4",
         "rollout.max_new_tokens=8", "eval.every=0", "eval.samples=0", "eval.batch_size=8",
         "task.eval_size=8", "diagnostics.monitor_every=0", "run.progress=false",
         "run.checkpoint_every=0", "train.lr=1e-3"]


def test_pi_old_from_the_training_forward_changes_nothing(warm_model_dir, tmp_path, monkeypatch):
    def run(name: str) -> tuple[list[dict], dict]:
        result_dir = tmp_path / name
        train(load_config(None, [f"model.path={warm_model_dir}", f"run.dir={result_dir}", *SHORT]))
        rows = read_jsonl(result_dir / "metrics.jsonl")[1:]
        from safetensors.torch import load_file

        return rows, load_file(result_dir / "final/model.safetensors")

    scored = []
    score_old = tether.weights.snapshots.score_at_versions
    monkeypatch.setattr(tether.weights.snapshots, "score_at_versions",
                        lambda *a: scored.append(1) or score_old(*a))
    fast_rows, fast_weights = run("reuse")
    assert not scored  # no old-logprob forward was run
    monkeypatch.setattr(tether.step, "reuses_training_forward", lambda *a: False)
    slow_rows, slow_weights = run("score")
    for fast, slow in zip(fast_rows, slow_rows, strict=True):
        assert fast["reward/mean"] == slow["reward/mean"]
        assert fast["loss/total"] == pytest.approx(slow["loss/total"], abs=1e-6)
        assert fast["numerical/k3_kl/mean"] == pytest.approx(slow["numerical/k3_kl/mean"], abs=1e-9)
    for name, w in fast_weights.items():
        torch.testing.assert_close(w, slow_weights[name], rtol=0, atol=1e-6)


def test_reuse_only_when_provably_the_same(random_model):
    sampling = SamplingParams(n=2, max_new_tokens=4)
    trainer = Trainer(random_model, TrainConfig(), sampling)
    batch = collate([_rollout(version=0), _rollout(version=0)], pad_id=0)
    assert tether.step.reuses_training_forward(trainer, batch)
    stale = collate([_rollout(version=0), _rollout(version=1)], pad_id=0)
    trainer.version = 1
    assert not tether.step.reuses_training_forward(trainer, stale)  # a token of an older version
    two = Trainer(random_model, TrainConfig(minibatches=2), sampling)
    assert not tether.step.reuses_training_forward(two, batch)  # mini-batch 2 trains later


class LogitRows(TorchDispatchMode):
    """The most rows of any floating-point tensor an op produces with last dimension `vocab`:
    logits or log-probs over the vocabulary (not the output embedding, (V, H) or (H, V))."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.vocab, self.hidden, self.rows = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2 \
                    and t.shape[-1] == self.vocab and tuple(t.shape) != (self.hidden, self.vocab):
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_tokens_by_vocabulary_logits_in_a_training_step(monkeypatch):
    V, B, T = 4096, 8, 12
    model = build_tiny_model(V, seed=0)
    sampling = SamplingParams(n=4, max_new_tokens=T, logprobs_topk=4)
    g = torch.Generator().manual_seed(0)
    rollouts = [_rollout(version=0, vocab=V, length=T, g=g, k=4, group=i // 4) for i in range(B)]
    batch = collate(rollouts, pad_id=0)
    trainer = Trainer(model, TrainConfig(estimator="dlc", micro_batch=B), sampling)
    adv = group_advantages(torch.randn(B), batch.group_ids, True)
    full = score_batch(model, batch, sampling, micro_batch=B)  # one chunk: every token
    monkeypatch.setitem(tether.scoring.logprobs.LOGIT_CHUNK_ELEMENTS, "cpu", 16 * V)  # 16 tokens a chunk
    chunked = score_batch(model, batch, sampling, micro_batch=B)
    torch.testing.assert_close(chunked.logp, full.logp, rtol=0, atol=1e-5)
    torch.testing.assert_close(chunked.topk, full.topk, rtol=0, atol=1e-5)
    with LogitRows(V, model.config.hidden_size) as probe:
        trainer.train_on(batch, adv, chunked.logp, chunked.topk)
    assert 0 < probe.rows <= 16, probe.rows  # one chunk; (B, T, V) would be B * T = 96 rows
    assert trainer.version == 1  # the step was taken (recomputed chunks in the backward)


def _rollout(version: int, vocab: int = 21, length: int = 3, g: torch.Generator | None = None,
             k: int = 0, group: int = 0) -> Rollout:
    ids = (torch.randint(2, vocab, (length,), generator=g) if g is not None
           else torch.tensor([3, 4, 1][:length])).tolist()
    return Rollout(prompt_id=f"p{group}", group_id=group, prompt_ids=[5, 6, 7], response_ids=ids,
                   logp_rollout=[-1.0] * len(ids), version=version, engine="hf", precision="fp32",
                   finish_reason="length",
                   topk_ids=[list(range(2, 2 + k))] * len(ids) if k else None,
                   topk_logp=[[-2.0] * k] * len(ids) if k else None)


def test_bf16_training_is_the_trainers_numerics_everywhere(warm_model_dir, tmp_path):
    """train.precision=bf16: pi_old and pi_theta are both the bf16-autocast trainer's, so
    staleness stays exact at equal weights, and the numerical part becomes the fp32
    generator against the bf16 trainer (zero with fp32 training)."""
    def run(precision: str) -> list[dict]:
        run_dir = tmp_path / precision
        # lag 1: pi_old is scored in a forward of its own, not taken from the training one
        train(load_config(None, [f"model.path={warm_model_dir}", f"run.dir={run_dir}", *SHORT,
                                 "sync.lag=1", f"train.precision={precision}"]))
        return read_jsonl(run_dir / "metrics.jsonl")[1:]

    fp32, bf16 = run("fp32"), run("bf16")
    assert all(r["numerical/k3_kl/mean"] < 1e-10 for r in fp32)  # float order only
    assert all(1e-7 < r["numerical/k3_kl/mean"] < 1e-2 for r in bf16)
    # Step 1 trains at the weights that sampled it: pi_theta = pi_old, in either precision.
    assert bf16[0]["staleness/k3_kl/mean"] == pytest.approx(0.0, abs=1e-9)
    assert bf16[1]["staleness/k3_kl/mean"] > 1e-9  # lag 1: one version behind


def test_bf16_scores_differ_from_fp32_and_the_training_forward_matches_pi_old(random_model):
    V, B, T = random_model.config.vocab_size, 8, 6
    g = torch.Generator().manual_seed(1)
    batch = collate([_rollout(0, V, T, g, group=i // 4) for i in range(B)], pad_id=0)
    sampling = SamplingParams(n=4, max_new_tokens=T)
    fp32 = score_batch(random_model, batch, sampling, B).logp
    bf16 = score_batch(random_model, batch, sampling, B, precision="bf16").logp
    gap = (bf16 - fp32).abs()[batch.response_mask.bool()]
    assert 1e-4 < gap.max() < 0.1  # bf16 products: close, not equal
    trainer = Trainer(random_model, TrainConfig(precision="bf16", micro_batch=B), sampling)
    adv = group_advantages(torch.randn(B, generator=g), batch.group_ids, True)
    _, trained = trainer.train_on(batch, adv, None, None)  # pi_old from this forward
    torch.testing.assert_close(trained, bf16, rtol=0, atol=1e-6)


def test_run_device(tmp_path):
    from tether.config import ConfigError
    from tether.errors import InputError
    from tether.setup import resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == torch.device("cpu")
        with pytest.raises(InputError, match="run.device=cuda:1"):
            resolve_device("cuda:1")
    with pytest.raises(ConfigError, match="run.device"):
        load_config(None, ["run.device=tpu"])


def test_shared_prompts_and_length_buckets_are_the_plain_forward(random_model, monkeypatch):
    """Groups of rows sharing a prompt, responses of many lengths, prompts of several lengths
    (left padding): the same log-probs and gradients as one dense forward, to float order,
    with fewer FLOPs."""
    from torch.utils.flop_counter import FlopCounterMode

    V = random_model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    rollouts = []
    for group in range(6):
        prompt = torch.randint(2, V, (3 + group % 3,), generator=g).tolist()
        for _ in range(8):
            n = int(torch.randint(1, 13, (1,), generator=g))
            rollouts.append(Rollout(prompt_id=str(group), group_id=group, prompt_ids=prompt,
                                    response_ids=torch.randint(2, V, (n,), generator=g).tolist(),
                                    logp_rollout=[-1.0] * n, version=0, engine="hf",
                                    precision="fp32", finish_reason="stop"))
    batch = collate(rollouts, pad_id=0)
    sampling = SamplingParams(n=8)
    monkeypatch.setattr(tether.scoring.logprobs, "BUCKET_ROWS", 8)

    def run() -> tuple[torch.Tensor, list[torch.Tensor], int]:
        random_model.zero_grad(set_to_none=True)
        with FlopCounterMode(display=False) as flops:
            logp = tether.scoring.logprobs.score_tokens(random_model, batch, sampling).logp
            (logp * torch.linspace(-1, 1, logp.numel()).view_as(logp)).sum().backward()
        return logp.detach(), [p.grad.clone() for p in random_model.parameters()], flops.get_total_flops()

    fast, fast_grads, fast_flops = run()
    monkeypatch.setattr(tether.scoring.logprobs, "decode_shared_prompts", lambda *a: None)
    plain, plain_grads, plain_flops = run()
    torch.testing.assert_close(fast, plain, rtol=0, atol=2e-6)
    for a, b in zip(fast_grads, plain_grads, strict=True):
        assert float((a - b).norm()) <= 1e-4 * float(b.norm()) + 1e-7
    assert fast_flops < 0.7 * plain_flops


def test_generation_shares_prefill_and_drops_finished_rows_without_changing_a_token(warm_model_dir):
    """Greedy decoding (no random draws): the compacting, prefix-sharing decode gives the
    tokens of the plain one (every row forwarded at every step), log-probs to float order."""
    from tether.models import load_model
    from tether.rollout.hf import sample_tokens
    from tether.tasks import CountdownTask

    model, tok = load_model(warm_model_dir)
    task = CountdownTask()
    prompts = [tok(task.train_problem(i).prompt)["input_ids"] for i in range(24) for _ in range(2)]
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=12, logprobs_topk=3)
    fast = sample_tokens(model, prompts, greedy, None, tok.eos_token_id, tok.pad_token_id)
    plain = sample_tokens(model, prompts, greedy, None, tok.eos_token_id, tok.pad_token_id,
                          after_forward=lambda *a: None)  # a recorder: every row, every step
    assert len({len(ids) for ids, *_ in fast}) > 1  # rows did finish at different steps
    for (ids, lp, tk, tlp, fin), (ids2, lp2, tk2, tlp2, fin2) in zip(fast, plain, strict=True):
        assert ids == ids2 and tk == tk2 and fin == fin2
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(lp2), rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.tensor(tlp), torch.tensor(tlp2), rtol=0, atol=1e-5)
