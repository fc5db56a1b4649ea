"""The distribution an engine samples from, which the trainer scores token by token.

`process_logits` is the one definition of temperature, top-k and top-p: the HF engine
samples from it and the scoring forward (tether.scoring.logprobs) scores `logp_old` and `logp`
with it, so with equal weights and numerics the three log-probs agree exactly.
`distinct_prompts` finds the prompts a batch's rows share, which both sides run once.
"""

from __future__ import annotations

import torch


def process_logits(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Log-probs of the distribution actually sampled from: (..., V) logits -> (..., V) log-probs.

    Tokens removed by top-k or top-p get -inf. The same function scores `logp_old` and
    `logp` in the trainer, so with equal weights and numerics all three agree exactly.
    """
    logits = logits.float()
    if temperature > 0:
        logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Keep a token if the mass strictly before it is < top_p: the smallest nucleus.
        drop_sorted = (probs.cumsum(-1) - probs) >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def distinct_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct rows of left-padded prompts (U, P): their ids, their attention mask, and
    each row's index among them (B,). Rows match on ids and mask both, so a prompt holding
    the pad token is not taken for a padded one."""
    P = input_ids.shape[1]
    distinct, inverse = torch.unique(torch.cat([input_ids, attention_mask], dim=1), dim=0,
                                     return_inverse=True)
    return distinct[:, :P], distinct[:, P:], inverse
