"""The trainer side, by role:

    batch.py        RolloutTensors, collate: rollouts as tensors
    scoring.py      the trainer's forward and the log-probs of the sampled tokens
    advantages.py   GRPO group advantages
    core.py         Trainer: the model, its optimizer, the loss and optimizer step(s)
    collective.py   what a Trainer needs from the other data-parallel ranks
"""

from tether.trainer.advantages import group_advantages
from tether.trainer.batch import RolloutTensors, collate
from tether.trainer.collective import Collective, Solo
from tether.trainer.core import Trainer, combine, mean_metrics
from tether.trainer.scoring import (
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

__all__ = ["LOGP_FLOOR", "Collective", "RolloutTensors", "Scores", "Solo", "TokenScorer",
           "Trainer", "autocast", "collate", "combine", "decode", "forward", "group_advantages",
           "mean_metrics", "score_batch", "score_tokens", "token_logprobs"]
