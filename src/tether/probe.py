"""`tether probe`: measure the generator/trainer disagreement before training; recommend a fix.

With the run's own model, engine, generator numerics and sampling, the probe
1. samples `batches` rollout batches at equal weights and scores them with the trainer
   (fp32): the numerical mismatch log rho = log pi_old - log mu (k1, k3, max |log rho|,
   the share of tokens with rho outside [1/2, 2], the share outside the trainer's
   truncated support), and eps = logit pi_old - logit mu per confidence bin of mu, beside
   CIS's Appendix A figures (MAD 0.16-0.24, q95 0.26-0.50, flat across bins);
2. MoE models, hf engine: the routing disagreement on the same tokens;
3. staleness, when the config makes any (sync.lag k and train.minibatches M: k + M - 1
   versions; async: loop.max_staleness): that many optimizer steps at train.lr on fresh
   batches from the same (unsynced) generator, then the token ESS and k3 of
   pi_theta / pi_old on the first batches, which were not trained on. The trainer moves;
   the engine keeps its weights, as a stale generator would.
4. `tether.advice`: whether each cause is material (its thresholds, derived in
   docs/probe.md), and DLC's guidance (Li, Zhou, Lan; DESIGN.md) for the material ones: a
   preset and a sync policy, or "nothing to correct" and the config's own.
"""

from __future__ import annotations

import copy
import itertools
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from tether.advice import (
    TAIL_BAND,
    TAIL_SHARE,
    Evidence,
    Recommendation,
    format_advice,
    numerical_finding,
    recommend,
    staleness_finding,
)
from tether.config import Config
from tether.lazy import torch

# Generator confidence mu(y_t) bins for eps (CIS Appendix A reports per-bin spread).
CONFIDENCE_EDGES = (0.0, 0.2, 0.5, 0.8, 0.95, 1.0)
CIS_APPENDIX_A = {"mad": (0.16, 0.24), "q95": (0.26, 0.50)}


@dataclass(frozen=True)
class EpsilonBin:
    """eps = logit pi_old - logit mu over the tokens whose generator probability mu is in [lo, hi)."""

    lo: float
    hi: float
    tokens: int
    mad: float  # median |eps - median eps|
    q05: float
    q95: float


@dataclass
class ProbeResult:
    settings: dict[str, Any]
    numerical: dict[str, float]
    epsilon: list[EpsilonBin]
    routing: dict[str, float] | None
    staleness: dict[str, float] | None
    evidence: Evidence
    recommendation: Recommendation
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON (an empty confidence bin's NaN statistics become null)."""
        def clean(v: Any) -> Any:
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            if isinstance(v, list):
                return [clean(x) for x in v]
            return None if isinstance(v, float) and not math.isfinite(v) else v

        rec, e = self.recommendation, self.evidence
        findings = {f.cause: asdict(f) for f in (numerical_finding(e), staleness_finding(e))}
        return clean({**asdict(self), "findings": findings, "recommendation": {
            **asdict(rec), "overrides": rec.overrides, "headline": rec.headline}})

    def format(self) -> str:
        s, n = self.settings, self.numerical
        lines = [
            f"tether probe: {s['model']}, engine {s['engine']}, generator {s['precision']}"
            + (f" + router noise {s['router_noise']}" if s["router_noise"] else "")
            + (f" + INJECTED logit noise (Student-t, dof {s['logit_noise_dof']}, scale "
               f"{s['logit_noise']}; outliers {s['logit_noise_outliers']:g} at scale "
               f"{s['logit_noise_outlier_scale']:g})"
               if s.get("logit_noise") or s.get("logit_noise_outliers") else "")
            + (f", routing replay {s['routing_replay']}" if s["routing_replay"] != "none" else "")
            + f"; {s['batches']} batches x {s['batch_size']} responses ({s['tokens']} tokens)",
            "",
            "Numerical mismatch at equal weights (pi_old: trainer fp32; mu: generator):",
            f"  k1 KL {n['k1']:.2e}   k3 KL {n['k3']:.2e}   max |log rho| {n['max_abs_log_rho']:.3f}",
            (f"  rho outside [1/2, 2]: {n['tail_share']:.2%} of tokens   outside the trainer's "
            f"top-k/top-p support: {n['outside_support']:.2%}"),
            ("eps = logit pi_old - logit mu by generator confidence mu (CIS Appendix A: MAD "
            "0.16-0.24, q95 0.26-0.50, flat across bins):"),
            "  mu in          tokens      MAD       q05       q95",
        ]
        for b in self.epsilon:
            close = "]" if b.hi >= 1.0 else ")"
            lines.append(f"  [{b.lo:.2f}, {b.hi:.2f}{close}  {b.tokens:>8}  {b.mad:8.4f}  {b.q05:8.4f}  {b.q95:8.4f}")
        if self.routing is not None:
            lines.append(f"MoE routing disagreement: {self.routing['mean']:.2%} of (token, layer) "
                         f"pairs; {self.routing['any_layer']:.2%} of tokens in at least one layer")
        if self.staleness is not None:
            st = self.staleness
            lines.append(f"Staleness after {int(st['steps'])} optimizer steps at lr {s['lr']:g} "
                         f"({s['staleness_source']}): token ESS {st['ess']:.3f}, k3 KL {st['k3']:.2e}")
        lines += [f"Note: {note}" for note in self.notes]
        lines += ["", "By cause (thresholds: docs/probe.md):",
                  format_advice(self.evidence, self.recommendation)]
        return "\n".join(lines)


# -- pure measurements -----------------------------------------------------------------------


def _logit(logp: torch.Tensor) -> torch.Tensor:
    """log p - log(1 - p), float64, from log p."""
    lp = logp.double()
    return lp - torch.log(-torch.expm1(lp))


def epsilon_bins(logp_old: torch.Tensor, logp_rollout: torch.Tensor, mask: torch.Tensor,
                 edges: tuple[float, ...] = CONFIDENCE_EDGES) -> list[EpsilonBin]:
    """eps = logit pi_old - logit mu per bin of mu, on valid tokens with 0 < p < 1 on both sides.

    Tokens a side gives probability 1 (log p = 0 in fp32) have no finite logit and are left
    out; so are tokens outside the trainer's support (probability 0).
    """
    lo_, lr_ = logp_old.double(), logp_rollout.double()
    keep = mask.bool() & (lo_ < 0) & (lr_ < 0) & (lo_ > -1e3)
    eps = (_logit(lo_) - _logit(lr_))[keep]
    mu = lr_.exp()[keep]
    out = []
    for lo, hi in itertools.pairwise(edges):
        sel = (mu >= lo) & ((mu < hi) if hi < 1.0 else (mu <= hi))
        e = eps[sel]
        if e.numel() == 0:
            out.append(EpsilonBin(lo, hi, 0, float("nan"), float("nan"), float("nan")))
            continue
        q05, q95 = torch.quantile(e, e.new_tensor([0.05, 0.95])).tolist()
        mad = float((e - e.median()).abs().median())
        out.append(EpsilonBin(lo, hi, int(e.numel()), mad, q05, q95))
    return out


def numerical_summary(logp_old: torch.Tensor, logp_rollout: torch.Tensor,
                      mask: torch.Tensor, floor: float) -> dict[str, float]:
    """k1, k3, sequence chi2, max |log rho|, the share outside [1/2, 2] and outside the
    trainer's support."""
    from tether.diagnostics import divergence_metrics

    keep = mask.bool()
    n = max(1, int(keep.sum()))
    log_rho = (logp_old.double() - logp_rollout.double()).masked_fill(~keep, 0.0)
    d = divergence_metrics(log_rho, keep, "numerical")
    return {
        "k1": d["numerical/k1_kl/mean"],
        "k3": d["numerical/k3_kl/mean"],
        "chi2_seq": seq_chi2(log_rho, keep),
        "max_abs_log_rho": d["numerical/abs_log_ratio/max"],
        "tail_share": float(((log_rho.abs() > TAIL_BAND) & keep).sum()) / n,
        "outside_support": float(((logp_old <= floor / 2) & keep).sum()) / n,
    }


def seq_chi2(log_rho: torch.Tensor, mask: torch.Tensor) -> float:
    """chi2(pi_old || mu) over whole responses, self-normalised: 1/ESS - 1 of the sequence
    weights prod_t rho_t (tether.estimators.ess_seq, as numerical/ess/seq is logged); >= 0 on
    any sample, unlike the plain mean(w^2) - 1, which dips below 0 when chi2 is small."""
    from tether.estimators.ess import ess_seq

    return 1.0 / float(ess_seq(log_rho.double(), mask)) - 1.0


# -- the probe itself ------------------------------------------------------------------------


def staleness_steps(cfg: Config) -> tuple[int, str]:
    """How many optimizer steps the run's staleness spans, and which settings make it."""
    if cfg.loop.mode == "async":
        return cfg.loop.max_staleness, f"loop.max_staleness={cfg.loop.max_staleness}"
    steps = cfg.sync.lag + cfg.train.minibatches - 1
    parts = [f"sync.lag={cfg.sync.lag}"] if cfg.sync.lag else []
    parts += [f"train.minibatches={cfg.train.minibatches}"] if cfg.train.minibatches > 1 else []
    return steps, " and ".join(parts)


def probe(cfg: Config, batches: int = 2) -> ProbeResult:
    """Run the probe on `cfg`'s model, engine and numerics (see the module docstring)."""
    from tether.diagnostics import divergence_metrics, is_moe, routing_disagreement
    from tether.rollout.worker import rewarded_rollouts
    from tether.scoring import LOGP_FLOOR, collate
    from tether.setup import (
        build_generator,
        build_task_and_reward,
        load_policy,
        sampling_params,
        sampling_seed,
        seed_process,
    )
    from tether.trainer import Trainer, group_advantages
    from tether.weights.policy import staleness_ess

    r = cfg.rollout
    seed_process(cfg)
    task, reward_fn = build_task_and_reward(cfg)
    model_path, model, tokenizer = load_policy(cfg)
    sampling = sampling_params(cfg, model.config.vocab_size)
    generator = build_generator(cfg, model, model_path, tokenizer)
    steps, source = staleness_steps(cfg)
    # One optimizer step per fresh batch: the staleness spans `steps` versions.
    trainer = Trainer(model, cfg.train.model_copy(update={"minibatches": 1}), sampling)
    notes: list[str] = []
    try:
        def sample(i: int):
            indices = [i * r.prompts_per_step + j for j in range(r.prompts_per_step)]
            rollouts = rewarded_rollouts(generator, tokenizer, task, reward_fn, indices, sampling,
                                         seed=sampling_seed(cfg, i))
            return rollouts, collate(rollouts, tokenizer.pad_token_id, model.device)

        held = [sample(i)[1] for i in range(batches)]
        scored = [trainer.score_old(b, model) for b in held]
        logp_old = _cat([lp for lp, _ in scored])
        logp_mu = _cat([b.logp_rollout for b in held])
        mask = _cat([b.response_mask for b in held])
        numerical = numerical_summary(logp_old, logp_mu, mask, LOGP_FLOOR)
        eps = epsilon_bins(logp_old, logp_mu, mask)
        routing = None
        if is_moe(model):
            gen_model = getattr(generator, "model", None)
            if gen_model is None:
                notes.append("MoE routing disagreement not measured: the vllm engine does not "
                             "expose its router's choices to tether.")
            else:
                parts = [routing_disagreement(model, gen_model, b, cfg.train.micro_batch) for b in held]
                routing = {k.rsplit("/", 1)[-1]: sum(p[k] for p in parts) / len(parts) for k in parts[0]}
        staleness = None
        if steps:
            start = copy.deepcopy(model).eval()  # the weights the generator keeps
            for i in range(steps):
                _, b = sample(batches + i)
                old, topk_old = trainer.score_old(b, start)
                adv = group_advantages(b.rewards, b.group_ids, cfg.train.adv_std_norm)
                trainer.train_on(b, adv, old, topk_old)
            logp_now = _cat([trainer.score_old(b, model)[0] for b in held])
            log_r = (logp_now.double() - logp_old.double()).masked_fill(~mask.bool(), 0.0)
            staleness = {"steps": float(steps), "ess": staleness_ess(logp_now, logp_old, mask),
                         "k3": divergence_metrics(log_r, mask.bool(), "staleness")["staleness/k3_kl/mean"]}
    finally:
        generator.close()
    evidence = Evidence(
        numerical_k3=numerical["k3"], numerical_chi2_seq=numerical["chi2_seq"],
        batch=max(1, r.prompts_per_step * r.group_size // cfg.train.minibatches),
        tail_share=numerical["tail_share"], heavy=numerical["tail_share"] > TAIL_SHARE,
        routing_any=None if routing is None else routing["any_layer"],
        staleness_k3=None if staleness is None else staleness["k3"],
        ess=None if staleness is None else staleness["ess"],
        staleness_what=f"{steps} optimizer steps ({source})")
    rec = recommend(evidence, cfg.train.estimator, cfg.sync.policy)
    settings = {"model": str(model_path), "engine": r.engine, "precision": r.precision,
                "router_noise": r.router_noise, "routing_replay": cfg.train.routing_replay,
                "logit_noise": r.logit_noise, "logit_noise_dof": r.logit_noise_dof,
                "logit_noise_outliers": r.logit_noise_outliers,
                "logit_noise_outlier_scale": r.logit_noise_outlier_scale,
                "lr": cfg.train.lr, "estimator": cfg.train.estimator,
                "staleness_source": source or "none", "batches": batches,
                "batch_size": r.prompts_per_step * r.group_size, "tokens": int(mask.sum())}
    return ProbeResult(settings, numerical, eps, routing, staleness, evidence, rec, notes)


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Concatenate (B_i, T_i) tensors along B, right-padding T with zeros."""
    T = max(p.shape[1] for p in parts)
    return torch.cat([torch.nn.functional.pad(p, (0, T - p.shape[1])) for p in parts])
