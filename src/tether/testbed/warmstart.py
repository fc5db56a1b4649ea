"""Supervised warm-start of the tiny model on synthetic worked solutions.

RL needs a policy that sometimes succeeds: the warm-start trains on `prompt + solution
+ eos` with the loss on the solution tokens only, long enough that greedy decoding
solves part of the held-out set but far from all of it. Deterministic for a seed:
the problem stream is indexed, the order fixed, torch seeded.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from tether.models.tokenizer import encode_exact
from tether.tasks.base import Task


def sft_batch(
    task: Task, tokenizer: PreTrainedTokenizerBase, start: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (B, L) right-padded, and labels (B, L) with -100 outside the solution."""
    rows, labels = [], []
    for i in range(start, start + size):
        p = task.warmstart_problem(i)  # never an RL training problem (CountdownTask rl_share)
        prompt = encode_exact(tokenizer, p.prompt)
        answer = encode_exact(tokenizer, p.solution or "", "solution") + [tokenizer.eos_token_id]
        rows.append(prompt + answer)
        labels.append([-100] * len(prompt) + answer)
    L = max(len(r) for r in rows)
    ids = torch.full((size, L), tokenizer.pad_token_id, dtype=torch.long)
    lab = torch.full((size, L), -100, dtype=torch.long)
    for i, (r, y) in enumerate(zip(rows, labels)):
        ids[i, : len(r)] = torch.tensor(r)
        lab[i, : len(y)] = torch.tensor(y)
    return ids, lab


def warm_start(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    steps: int,
    batch_size: int = 128,
    lr: float = 2e-3,
    seed: int = 0,
    router_aux_loss: float = 0.0,
    progress: Callable[[int, float], None] | None = None,
) -> list[float]:
    """Train `model` in place for `steps` AdamW steps (warmup, then cosine to 10%); returns losses.

    `progress(step, loss)`, when given, is called after every step (1-based).

    `router_aux_loss` > 0 (MoE): the loss adds that times the router load-balancing loss
    (Switch Transformer's, as Qwen3-MoE computes it with `output_router_logits`), which
    spreads tokens over the experts. The returned losses are the language-model loss alone.
    """
    torch.manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    warmup = max(1, steps // 20)

    def schedule(s: int) -> float:
        if s < warmup:
            return (s + 1) / warmup
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    aux = router_aux_loss > 0
    if aux:
        model.config.router_aux_loss_coef = router_aux_loss
    model.train()
    losses = []
    for step in range(steps):
        ids, labels = sft_batch(task, tokenizer, step * batch_size, batch_size)
        out = model(input_ids=ids, attention_mask=(ids != tokenizer.pad_token_id) | (labels != -100),
                    labels=labels, **({"output_router_logits": True} if aux else {}))
        loss = out.loss  # with aux: lm loss + router_aux_loss * balancing loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append((loss - router_aux_loss * out.aux_loss).item() if aux else loss.item())
        if progress is not None:
            progress(step + 1, losses[-1])
    model.eval()
    return losses
