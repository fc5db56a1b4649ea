"""Estimator cost against the model's: loss plus backward of every preset, as a fraction
of the tiny model's forward plus backward on the same batch (DESIGN.md section 8: < 1%).

    .venv/bin/python benchmarks/estimators.py [--batch 64] [--length 128] [--threads 1]

Both are timed in this one run, on the same threads; each figure is the median of
--repeats timed calls after warm-up. The estimator sees leaf tensors (B, T) for the
log-probs, so its time is the loss, its metrics (with their one sync) and its own
backward, nothing of the model's. Centering presets get a top-K head with K = 8.
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
from harness import device_name, timed, use_threads

from tether.estimators import PRESETS, TokenBatch, build_estimator
from tether.models.tiny import build_tiny_model

TOPK = 8
WARMUP = 2  # untimed calls before each timed series


def model_step(model: torch.nn.Module, ids: torch.Tensor) -> None:
    """Forward, per-token log-prob of the next token, backward: the trainer's step."""
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids).logits[:, :-1].float()  # (B, T-1, V)
    logp = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    (-logp.mean()).backward()


def synthetic_batch(batch: int, length: int, vocab: int, seed: int = 0) -> TokenBatch:
    """Realistic magnitudes: a small numerical mismatch and some staleness."""
    gen = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(batch, length, generator=gen) * 3
    logp_rollout = logp_old + 0.05 * torch.randn(batch, length, generator=gen)
    logp = (logp_old + 0.1 * torch.randn(batch, length, generator=gen)).requires_grad_(True)
    head = torch.randn(batch, length, vocab, generator=gen).log_softmax(-1)
    ids = head.topk(TOPK, dim=-1).indices
    topk_old = head.gather(-1, ids)
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[:, length // 2 :] = torch.rand(batch, 1, generator=gen) < 0.5  # ragged lengths
    return TokenBatch(
        logp=logp,
        logp_old=logp_old,
        logp_rollout=logp_rollout,
        advantages=torch.randn(batch, generator=gen),
        mask=mask,
        topk_ids=ids,
        topk_logp_rollout=topk_old + 0.05 * torch.randn(topk_old.shape, generator=gen),
        topk_logp=(topk_old + 0.1 * torch.randn(topk_old.shape, generator=gen)).requires_grad_(),
        topk_logp_old=topk_old,
    )


def estimator_step(estimator, batch: TokenBatch) -> None:
    batch.logp.grad = batch.topk_logp.grad = None
    estimator(batch).loss.backward()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    use_threads(args.threads)

    model = build_tiny_model()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.length))
    model_s = timed(lambda: model_step(model, ids), max(3, args.repeats // 4), WARMUP).median

    batch = synthetic_batch(args.batch, args.length, vocab)
    print(
        f"B={args.batch} T={args.length} K={TOPK} threads={args.threads} torch "
        f"{torch.__version__}, {device_name()} ({os.cpu_count()} cores visible)"
    )
    print(f"tiny model forward+backward: {model_s * 1e3:.1f} ms")
    print(f"{'preset':<10}  {'loss+backward ms':>16}  {'% of model':>10}")
    worst = 0.0
    for name in PRESETS:
        seconds = timed(partial(estimator_step, build_estimator(name), batch), args.repeats,
                        WARMUP).median
        worst = max(worst, seconds / model_s)
        print(f"{name:<10}  {seconds * 1e3:>16.2f}  {100 * seconds / model_s:>9.3f}%")
    print(f"worst: {100 * worst:.3f}% of the model step ({'under' if worst < 0.01 else 'OVER'} 1%)")


if __name__ == "__main__":
    main()
