"""A tabular autoregressive policy small enough to enumerate every outcome.

The policy over sequences of length T from a vocabulary of V tokens has one logit row
per prefix (all prefixes shorter than T). Expected gradients are sums over all V^T
sequences weighted by the sampler's probability: no Monte Carlo, no tolerance for noise.
"""

from __future__ import annotations

import itertools

import torch

from tether.estimators import TokenBatch


class TabularPolicy:
    """Logit tables for pi_theta (a parameter), pi_old and mu (fixed), float64."""

    def __init__(self, vocab: int, length: int, seed: int = 0) -> None:
        self.vocab, self.length = vocab, length
        prefixes = [p for t in range(length) for p in itertools.product(range(vocab), repeat=t)]
        self.row = {p: i for i, p in enumerate(prefixes)}  # prefix tuple -> logit row
        gen = torch.Generator().manual_seed(seed)
        self.theta = torch.randn(len(prefixes), vocab, generator=gen, dtype=torch.float64)
        self.theta.requires_grad_(True)
        self.old = self.theta.detach().clone()
        self.mu = self.theta.detach().clone()
        self._gen = gen

    def perturbed(self, scale: float) -> torch.Tensor:
        """The current logits plus Gaussian noise of std `scale` (a second policy)."""
        noise = torch.randn(self.theta.shape, generator=self._gen, dtype=torch.float64)
        return self.theta.detach() + scale * noise

    def sequences(self) -> list[tuple[int, ...]]:
        return list(itertools.product(range(self.vocab), repeat=self.length))

    def prefixes_of(self, y: tuple[int, ...]) -> list[tuple[int, ...]]:
        return [y[:t] for t in range(len(y))]

    def token_logp(self, table: torch.Tensor, y: tuple[int, ...]) -> torch.Tensor:
        """(T,) log-probabilities of y's tokens under the logit `table`."""
        rows = torch.stack([table[self.row[h]] for h in self.prefixes_of(y)])  # (T, V)
        return rows.log_softmax(-1).gather(-1, torch.tensor(y).unsqueeze(-1)).squeeze(-1)

    def seq_prob(self, table: torch.Tensor, y: tuple[int, ...]) -> torch.Tensor:
        return self.token_logp(table, y).sum().exp()

    def batch(self, y: tuple[int, ...], advantages: torch.Tensor, k: int = 0) -> TokenBatch:
        """A one-sequence TokenBatch for y; with k > 0 also the top-k of mu at each prefix."""
        topk = {}
        if k:
            mu_rows = torch.stack([self.mu[self.row[h]] for h in self.prefixes_of(y)])  # (T, V)
            ids = mu_rows.topk(k, dim=-1).indices  # the generator's head, by mu
            rows = [
                torch.stack([table[self.row[h]] for h in self.prefixes_of(y)]).log_softmax(-1)
                for table in (self.theta, self.old, self.mu)
            ]
            topk = {
                "topk_ids": ids.unsqueeze(0),
                "topk_logp": rows[0].gather(-1, ids).unsqueeze(0),
                "topk_logp_old": rows[1].gather(-1, ids).unsqueeze(0),
                "topk_logp_rollout": rows[2].gather(-1, ids).unsqueeze(0),
            }
        return TokenBatch(
            logp=self.token_logp(self.theta, y).unsqueeze(0),
            logp_old=self.token_logp(self.old, y).unsqueeze(0),
            logp_rollout=self.token_logp(self.mu, y).unsqueeze(0),
            advantages=advantages.reshape(1, -1).expand(1, self.length),
            mask=torch.ones(1, self.length, dtype=torch.bool),
            **topk,
        )

    def expected_gradient(self, estimator, advantage_of, k: int = 0) -> torch.Tensor:
        """sum_y mu(y) grad_theta loss(batch(y)): the estimator's exact expected gradient."""
        total = torch.zeros_like(self.theta)
        for y in self.sequences():
            self.theta.grad = None
            estimator(self.batch(y, advantage_of(y), k)).loss.backward()
            total += self.seq_prob(self.mu, y) * self.theta.grad
        self.theta.grad = None
        return total

    def policy_gradient(self, advantage_of) -> torch.Tensor:
        """grad_theta J, J = sum_y pi_theta(y) A(y): the on-policy target, by autograd."""
        objective = sum(
            self.seq_prob(self.theta, y) * advantage_of(y).mean() for y in self.sequences()
        )
        (grad,) = torch.autograd.grad(objective, self.theta)
        return grad
