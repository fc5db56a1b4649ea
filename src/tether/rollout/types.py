"""The rollout record and the generator interface (DESIGN.md section 2).

A rollout carries the response token ids exactly as sampled and, per token, the
log-prob of the sampled token under the distribution it was really drawn from
(after temperature, top-k and top-p renormalisation). Nothing is decoded and
re-tokenized on the way to the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from tether.defaults import GROUP_SIZE, MAX_NEW_TOKENS, TEMPERATURE


@dataclass(frozen=True)
class SamplingParams:
    """How the generator samples. `n` responses are drawn per prompt (the GRPO group)."""

    n: int = GROUP_SIZE
    temperature: float = TEMPERATURE
    top_k: int = 0  # 0: no top-k truncation
    top_p: float = 1.0  # 1.0: no nucleus truncation
    max_new_tokens: int = MAX_NEW_TOKENS
    logprobs_topk: int = 0  # K > 0: also record the generator's top-K ids and log-probs


@dataclass
class Rollout:
    """One sampled response and everything the trainer needs to score it."""

    prompt_id: str
    group_id: int  # all n samples of one prompt in one batch share it
    prompt_ids: list[int]
    response_ids: list[int]  # exactly as sampled, eos included when sampled
    logp_rollout: list[float]  # (len(response_ids),) log mu(y_t | h_t), processed distribution
    version: int  # weight version the generator held when sampling the first token
    engine: str  # "hf", "vllm", ...
    precision: str  # generator numerics: "fp32", "bf16", "fp16", "fp8"
    finish_reason: str  # "stop" (eos sampled) or "length" (max_new_tokens reached)
    topk_ids: list[list[int]] | None = None  # (len(response_ids), K)
    topk_logp: list[list[float]] | None = None  # (len(response_ids), K), same distribution
    # Partial rollouts: the version that sampled each token, when weights changed mid-response
    # (None: every token at `version`).
    token_versions: list[int] | None = None
    # Routing replay R3 (MoE): the experts the generator's routers chose at each position it
    # forwarded, prompt then response but its last token: (len(prompt_ids) + len(response_ids)
    # - 1, MoE layers, top-k), uint8 (int16 beyond 256 experts); tether.models.routing.
    routed_experts: np.ndarray | None = None
    # pi_old scored where the rollout was made (async, `loop.score_old=worker`): each token's
    # log-prob under the trainer's scoring at the version that sampled it, and at the top-K
    # ids. None: the trainer scores it.
    logp_old: list[float] | None = None  # (len(response_ids),)
    topk_logp_old: list[list[float]] | None = None  # (len(response_ids), K)
    reward: float | None = None  # filled in by the task
    reward_parts: dict[str, float] = field(default_factory=dict)


class Generator(Protocol):
    """What the loop needs from a rollout engine (Hugging Face, vLLM, ...)."""

    version: int  # the weight version the engine currently holds

    def generate(
        self, prompts: list[list[int]], prompt_ids: list[str], sampling: SamplingParams, seed: int
    ) -> list[Rollout]:
        """Sample `sampling.n` responses per prompt; return them grouped prompt by prompt."""
        ...

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        """Replace the engine's weights with the trainer's and stamp the new version."""
        ...

    def close(self) -> None:
        """Free the engine's resources (a vLLM engine must be closed before another starts)."""
        ...
