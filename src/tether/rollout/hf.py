"""The Hugging Face rollout engine: batched sampling with a KV cache, exact log-probs.

The engine holds its own copy of the weights, cast to the generator's numerics
(`tether.rollout.numerics`), so the trainer's fp32 model and the generator can
disagree exactly as a bf16 or fp8 inference engine would. Each sampled token's
log-prob is taken from the processed distribution it was drawn from: logits / T,
then top-k, then top-p, then renormalised (`process_logits`). With `record_routes`
(routing replay R3), each rollout also carries the experts the generator's routers chose
at every position it forwarded (`Rollout.routed_experts`, tether.models.routing).
With `logit_noise` (`rollout.logit_noise`: injected, not a numerics model), every output
logit gets Student-t noise before it is processed (`student_t`; at a given share of
positions, the outliers, every logit's noise Gaussian at a larger scale), so the generator samples from,
and reports the log-probs of, a heavy-tailed perturbation of the trainer's policy.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from transformers import DynamicCache, PreTrainedModel

from tether.errors import InputError
from tether.models.routing import add_router_noise, route
from tether.rollout.numerics import apply_numerics
from tether.rollout.types import Rollout, SamplingParams
from tether.scoring.distribution import distinct_prompts, process_logits


def student_t(shape: tuple[int, ...], dof: int, g: torch.Generator, device) -> torch.Tensor:
    """Standard Student-t draws with integer `dof` from generator `g`:
    t = z / sqrt(chi2_dof / dof), chi2_dof a sum of dof squared standard normals (torch's
    StudentT takes no generator)."""
    z = torch.randn(shape, generator=g, device=device)
    chi2 = torch.randn((dof, *shape), generator=g, device=device).square().sum(0)
    return z / (chi2 / dof).sqrt()


class HFGenerator:
    """Generator protocol over a transformers causal LM (the default engine)."""

    engine = "hf"

    def __init__(self, model: PreTrainedModel, eos_id: int, pad_id: int, precision: str = "fp32",
                 router_noise: float = 0.0, record_routes: bool = False,
                 logit_noise: tuple[float, int, float, float] | None = None):
        """`logit_noise` (scale, dof, outlier share, outlier scale): INJECTED Student-t noise
        on every output logit before sampling (rollout.logit_noise*), Gaussian at the outlier
        scale on that share of positions (rows of a decode step); drawn from its own generator,
        reseeded per batch."""
        self.model = copy.deepcopy(model).eval()
        self.eos_id, self.pad_id = eos_id, pad_id
        self.precision = precision
        self.record_routes = record_routes
        self.version = 0
        self.load_weights(model.state_dict(), version=0)
        # Router noise draws from its own generator, reseeded with every batch, so a
        # resumed run samples the same routes.
        self.noise = torch.Generator(self.model.device)
        self.logit_noise = logit_noise
        self.logit_gen = torch.Generator(self.model.device)
        if router_noise > 0 and add_router_noise(self.model, router_noise, self.noise) == 0:
            raise InputError("rollout.router_noise needs a MoE model (model.moe=true); "
                             "this model has no router")

    def load_weights(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        apply_numerics(self.model, state_dict, self.precision)
        self.version = version

    def close(self) -> None:
        """Nothing to free: the weights are ordinary tensors."""

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], prompt_ids: list[str], sampling: SamplingParams, seed: int,
        refresh: Callable[[], bool] | None = None,
    ) -> list[Rollout]:
        """`refresh` (partial rollouts): called between decode steps; it may load a newer
        weight version into this engine and returns True when it did. Each token then
        records the version that sampled it (`Rollout.token_versions`)."""
        g = torch.Generator(self.model.device).manual_seed(seed)
        self.noise.manual_seed(seed + 1)
        perturb = None
        if self.logit_noise is not None:
            scale, dof, share, outlier_scale = self.logit_noise
            self.logit_gen.manual_seed(seed + 2)

            def perturb(logits: torch.Tensor) -> torch.Tensor:  # (rows, V)
                t = student_t(tuple(logits.shape), dof, self.logit_gen, logits.device)
                if share == 0:
                    return logits.float() + scale * t
                # A whole position is an outlier, not single logits: E_mu[rho^2] of those few
                # prefixes grows while the typical token's eps (its q95) does not move. Gaussian
                # there: a Student-t's exp(s t) has no mean, so one draw would own the average.
                rows = (logits.shape[0], 1)
                outlier = torch.rand(rows, generator=self.logit_gen, device=logits.device) < share
                z = torch.randn(tuple(logits.shape), generator=self.logit_gen, device=logits.device)
                return logits.float() + torch.where(outlier, outlier_scale * z, scale * t)
        n = sampling.n
        rows = [p for p in prompts for _ in range(n)]  # prompt-major: group members adjacent
        step_versions: list[int] = []  # the version that sampled each decode step's tokens

        def before_step() -> bool:
            changed = step_versions != [] and refresh()
            step_versions.append(self.version)
            return changed

        with route(self.model, record=self.record_routes) as routes:
            columns: list[torch.Tensor] = []  # (B, S_new, layers, k) per forward

            def after_forward(shape: tuple[int, int], new: int) -> None:
                if routes is not None:
                    columns.append(routes.pop(shape)[:, -new:])

            out = sample_tokens(self.model, rows, sampling, g, self.eos_id, self.pad_id,
                                before_step if refresh is not None else None,
                                after_forward if routes is not None else None, perturb)
        L = max(len(p) for p in rows)
        # (B, L + steps, layers, k), moved to the host once, not row by row
        experts = torch.cat(columns, dim=1).cpu().numpy() if columns else None
        rollouts = []
        for i, (ids, logps, topk_ids, topk_logp, finish) in enumerate(out):
            versions = step_versions[:len(ids)]
            # Positions the generator forwarded: the prompt, and the response but its last token.
            routed = None if experts is None else experts[i, L - len(rows[i]):L + len(ids) - 1].copy()
            rollouts.append(
                Rollout(
                    prompt_id=prompt_ids[i // n],
                    group_id=i // n,
                    prompt_ids=list(rows[i]),
                    response_ids=ids,
                    logp_rollout=logps,
                    version=versions[0] if versions else self.version,
                    engine=self.engine,
                    precision=self.precision,
                    finish_reason=finish,
                    topk_ids=topk_ids,
                    topk_logp=topk_logp,
                    token_versions=versions if len(set(versions)) > 1 else None,
                    routed_experts=routed,
                )
            )
        return rollouts


def _shared_prefill(model: PreTrainedModel, input_ids: torch.Tensor, attn: torch.Tensor,
                    cache: DynamicCache) -> torch.Tensor:
    """The prefill's last logits (B, V), each distinct prompt row forwarded once; `cache`
    then holds every row's keys and values."""
    ids, mask, inverse = distinct_prompts(input_ids, attn)
    logits = model(input_ids=ids, attention_mask=mask,
                   position_ids=(mask.cumsum(-1) - 1).clamp(min=0), past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1, :]
    cache.reorder_cache(inverse)
    return logits[inverse]


def sample_tokens(
    model: PreTrainedModel,
    prompts: list[list[int]],
    sampling: SamplingParams,
    g: torch.Generator | None,
    eos_id: int,
    pad_id: int,
    before_step: Callable[[], bool] | None = None,
    after_forward: Callable[[tuple[int, int], int], None] | None = None,
    perturb: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> list[tuple[list[int], list[float], list[list[int]] | None, list[list[float]] | None, str]]:
    """Sample one continuation per prompt (temperature 0: greedy), batched, with a KV cache.

    Prompts are left-padded so every row's next token sits in the last column.
    `before_step()` runs before each decode step; True means the model's weights changed,
    and the KV cache is recomputed over every row's prefix with the new weights, so each
    later token is drawn from the new version's distribution over its whole prefix.
    `after_forward((B, S), new)` runs after each forward over S positions, of which the
    last `new` are positions no earlier forward sampled from (the prompt at the prefill,
    then one per step; a recomputed prefix keeps what it had when it was sampled).
    `perturb(logits)` (injected logit noise) replaces each step's (rows, V) logits before
    they are processed and sampled. Without `after_forward`, rows with the same prompt (a group) share its prefill (each
    distinct prompt is run once and its KV cache indexed out to its rows), and a row that
    has sampled eos leaves the batch: later steps forward only the rows still sampling.
    Returns per row: token ids, their log-probs, optional top-K ids and log-probs,
    and the finish reason.
    """
    B, N, K, dev = len(prompts), sampling.max_new_tokens, sampling.logprobs_topk, model.device
    L = max(len(p) for p in prompts)
    input_ids = torch.full((B, L), pad_id, dtype=torch.long)
    attn = torch.zeros((B, L), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, L - len(p):] = torch.tensor(p)
        attn[i, L - len(p):] = 1
    input_ids, attn = input_ids.to(dev), attn.to(dev)
    compact = after_forward is None  # recorded routes need every row at every step
    # Every row's samples; a row that finished keeps pad (and log-prob 0) from then on.
    tokens = torch.full((B, N), pad_id, dtype=torch.long, device=dev)
    logps = torch.zeros(B, N, device=dev)
    tk_ids = torch.zeros(B, N, K, dtype=torch.long, device=dev) if K else None
    tk_logp = torch.zeros(B, N, K, device=dev) if K else None
    rows = torch.arange(B, device=dev)  # the rows in the batch (the cache's order)
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    cache = DynamicCache()
    step_ids, steps = input_ids, 0
    for step in range(N):
        if before_step is not None and before_step() and step:
            cache = DynamicCache()  # weights changed: prefill the prefixes again
            step_ids = torch.cat([input_ids[rows], tokens[rows, :step]], dim=1)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
        if step == 0 and compact:
            logits = _shared_prefill(model, input_ids, attn, cache)
        else:
            logits = model(
                input_ids=step_ids, attention_mask=attn, position_ids=position_ids,
                past_key_values=cache, use_cache=True, logits_to_keep=1,
            ).logits[:, -1, :]  # (rows, V)
        if after_forward is not None:
            after_forward(tuple(step_ids.shape), L if step == 0 else 1)
        if perturb is not None:
            logits = perturb(logits)
        logp_all = process_logits(logits, sampling.temperature, sampling.top_k, sampling.top_p)
        if sampling.temperature > 0:
            nxt = torch.multinomial(logp_all.exp(), 1, generator=g).squeeze(-1)
        else:
            nxt = logits.argmax(-1)
        nxt = torch.where(done, pad_id, nxt)
        tokens[rows, step] = nxt
        logps[rows, step] = logp_all.gather(-1, nxt[:, None]).squeeze(-1)
        if K:
            tk_logp[rows, step], tk_ids[rows, step] = torch.topk(logp_all, K, dim=-1)
        steps = step + 1
        alive = ~done
        done = done | (nxt == eos_id)
        if bool(done.all()):
            break
        if compact and bool(done.any()):  # finished rows leave the batch and the cache
            keep = (~done).nonzero().squeeze(1)
            cache.batch_select_indices(keep)
            rows, nxt, attn, alive, done = rows[keep], nxt[keep], attn[keep], alive[keep], done[keep]
        step_ids = nxt[:, None]
        attn = torch.cat([attn, alive.long()[:, None]], dim=1)
    toks, lps = tokens[:, :steps].cpu(), logps[:, :steps].cpu()  # to the host once, for lists
    tk_ids = None if tk_ids is None else tk_ids[:, :steps].cpu()
    tk_logp = None if tk_logp is None else tk_logp[:, :steps].cpu()
    results = []
    for i in range(B):
        row = toks[i].tolist()
        n = row.index(eos_id) + 1 if eos_id in row else len(row)
        finish = "stop" if eos_id in row else "length"
        ids = None if tk_ids is None else tk_ids[i, :n].tolist()
        lp = None if tk_logp is None else tk_logp[i, :n].tolist()
        results.append((row[:n], lps[i, :n].tolist(), ids, lp, finish))
    return results
