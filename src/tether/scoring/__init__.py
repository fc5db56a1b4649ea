"""Scoring: (weights, tokens) -> the processed log-probs of the sampled tokens (and top-K).

The one primitive the trainer (logp with grad), pi_old (in the trainer or in a rollout
worker), kept versions, the probe, evaluation analyses and the TRL plug-in share. It sits
below all of them and above tether.models and tether.estimators (docs/architecture.md),
so a sharded trainer can swap parameters under it without any caller knowing.

    distribution.py  process_logits: temperature, top-k, top-p; distinct_prompts
    batch.py         RolloutTensors, collate: rollouts as tensors
    logprobs.py      decode, score_tokens, score_batch, TokenScorer: the forward itself
                     (chunked vocabulary, shared prompts, length buckets, autocast,
                     routing replay)
    versions.py      score_at_versions: each token at the weight version that sampled it
"""

from tether.scoring.batch import RolloutTensors, collate
from tether.scoring.distribution import distinct_prompts, process_logits
from tether.scoring.logprobs import (
    LOGP_FLOOR,
    Scores,
    TokenScorer,
    autocast,
    decode,
    forward,
    score_batch,
    score_tokens,
    token_logprobs,
)
from tether.scoring.versions import ModelAt, score_at_versions

__all__ = ["LOGP_FLOOR", "ModelAt", "RolloutTensors", "Scores", "TokenScorer", "autocast",
           "collate", "decode", "distinct_prompts", "forward", "process_logits",
           "score_at_versions", "score_batch", "score_tokens", "token_logprobs"]
