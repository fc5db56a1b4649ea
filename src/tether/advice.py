"""Which cause of the generator/trainer disagreement is material, and the correction for it.

`tether probe` (before a run), `tether inspect` and the end of `tether train` (from a run's
log) judge each cause against a threshold and say "nothing to correct" unless one is
material. docs/probe.md derives the thresholds; in short:

- numerical (pi_old vs mu): *rounding* when its per-token k3 KL is below ROUNDING_K3 (an
  fp32 engine: ~1e-13); *material* when the sequence-level chi2(pi_old || mu) exceeds 1/N,
  N the responses in one optimizer step. Leaving rho out changes the expected gradient by
  at most sqrt(chi2) times the per-sample gradient's RMS (Cauchy-Schwarz:
  |E_mu[(rho - 1) g]| <= sqrt(E_mu[(rho - 1)^2]) sqrt(E_mu[g^2])), while the batch mean
  already carries sampling noise of RMS / sqrt(N). Below 1/N the bias cannot exceed one
  batch's noise. Both bounds lean towards "material", so "nothing to correct" is safe.
- staleness (pi_theta vs pi_old): *material* when the lowest token ESS of pi_theta/pi_old
  falls below ESS_TAU + ESS_MARGIN (0.7): DLC saw drift start at 0.5, and the margin
  advises the re-sync before a run gets there. Above it the PPO ratio and clip every
  preset applies to pi_theta/pi_old handle the lag.

Then DLC's guidance (Li, Zhou, Lan; DESIGN.md): numerical only -> cis (icepop when rho's
tail is heavy or MoE routing moves many tokens); staleness, alone or with the numerical
part -> dlc (capped staleness IS, centering, the ESS re-sync; for staleness alone E-DLC
measured centering with the re-sync above the re-sync alone); neither -> keep the current
estimator. train.correction=auto (tether.auto) applies the same rules step by step.
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import Any

# Per-token k3 below this is float rounding: fp32 engines measure ~1e-13, fp16 ~1e-6.
ROUNDING_K3 = 1e-9
# DLC's ESS re-sync threshold, and the margin above it at which staleness is advised on.
ESS_TAU = 0.5
ESS_MARGIN = 0.2
# Heavy tail: a share of tokens whose rho leaves MIS's [1/2, 2] band that far exceeds
# what a Gaussian eps of the measured spread gives (effectively none below spread 0.2).
TAIL_BAND = math.log(2.0)
TAIL_SHARE = 1e-3
# MoE: routing is the main numerical source when this share of tokens changes experts in
# some layer (R3 measured ~10% of router decisions differing between vLLM and Megatron).
ROUTING_SHARE = 0.05


@dataclass(frozen=True)
class Evidence:
    """What was measured, per cause. Staleness fields are None when nothing was stale."""

    numerical_k3: float  # per-token mean
    numerical_chi2_seq: float  # chi2(pi_old || mu) over whole responses: 1/ESS_seq - 1
    batch: int  # N: responses per optimizer step
    tail_share: float | None = None  # tokens with rho outside [1/2, 2]; None: unknown
    heavy: bool = False  # the tail counts as heavy (probe: tail_share > TAIL_SHARE)
    routing_any: float | None = None  # tokens routed to other experts in some layer (MoE)
    staleness_k3: float | None = None
    ess: float | None = None  # lowest token ESS of pi_theta / pi_old
    staleness_what: str = "the configured staleness"


@dataclass(frozen=True)
class Finding:
    """One cause's verdict: level is rounding, negligible or material (absent: not present)."""

    cause: str
    level: str
    line: str  # the figures and the threshold, one line


@dataclass(frozen=True)
class Recommendation:
    cause: str  # none | numerical | staleness | both (the material causes)
    estimator: str
    sync_policy: str
    why: str
    change: bool  # False: keep the current estimator and sync policy

    @property
    def overrides(self) -> str:
        return f"train.estimator={self.estimator} sync.policy={self.sync_policy}"

    @property
    def headline(self) -> str:
        if self.cause == "none":
            return f"nothing to correct: keep {self.overrides}"
        verb = "change to" if self.change else "keep (it corrects this)"
        return f"correct {self.cause}: {verb} {self.overrides}"


def numerical_finding(e: Evidence) -> Finding:
    limit = 1.0 / e.batch
    if e.numerical_k3 < ROUNDING_K3:
        return Finding("numerical", "rounding", f"k3 {e.numerical_k3:.1e}/token: float rounding, "
                       "the generator computes what the trainer does")
    level = "material" if e.numerical_chi2_seq > limit else "negligible"
    line = (f"k3 {e.numerical_k3:.1e}/token, sequence chi2 {e.numerical_chi2_seq:.1e} "
            f"{'>' if level == 'material' else '<='} 1/N = {limit:.1e} (N = {e.batch}): {level}")
    if e.routing_any:
        line += f"; {e.routing_any:.1%} of tokens routed to other experts"
    return Finding("numerical", level, line)


def staleness_finding(e: Evidence) -> Finding:
    if e.staleness_k3 is None:
        return Finding("staleness", "absent", "none configured")
    if e.staleness_k3 < ROUNDING_K3 and (e.ess is None or e.ess > 1 - 1e-6):
        return Finding("staleness", "rounding", f"k3 {e.staleness_k3:.1e}/token: float "
                       "rounding, the trained weights are the sampling ones")
    bar = ESS_TAU + ESS_MARGIN
    material = e.ess is not None and e.ess < bar
    level = "material" if material else "negligible"
    ess = "-" if e.ess is None else f"{e.ess:.3f}"
    return Finding("staleness", level, f"k3 {e.staleness_k3:.1e}/token, lowest token ESS {ess} "
                   f"{'<' if material else '>='} {bar:g} (tau {ESS_TAU:g} + margin {ESS_MARGIN:g})"
                   f": {level}")


def recommend(e: Evidence, current_estimator: str = "grpo",
              current_sync: str = "every:1") -> Recommendation:
    """The correction for the material causes of `e`, or "keep the current one" (docstring).

    `why` explains the choice; the figures are each finding's `line` (`format_advice`)."""
    num, stale = numerical_finding(e), staleness_finding(e)
    numerical, stale_m = num.level == "material", stale.level == "material"

    def rec(cause: str, estimator: str, policy: str, why: str) -> Recommendation:
        change = (estimator, policy) != (current_estimator, current_sync)
        return Recommendation(cause, estimator, policy, why, change)

    if numerical and stale_m:
        return rec("both", "dlc", "ess:0.5",
                   "Both causes are material. DLC's guidance for both: center the score over the "
                   "generator's top-K head for the numerical part (it persists after any "
                   "re-sync), weight by the capped staleness ratio pi_theta/pi_old, and re-sync "
                   "the generator when the staleness ESS falls below 0.5, where DLC saw runs "
                   "start to drift.")
    if stale_m:
        return rec("staleness", "dlc", "ess:0.5",
                   f"Staleness is material (after {e.staleness_what}); the numerical part is not. "
                   "The generator's weights lag the trainer's: weight each token by the capped "
                   "staleness ratio pi_theta/pi_old, center the score over the generator's "
                   "top-K head and re-sync when the ESS falls below 0.5. In E-DLC at 12 paired "
                   "seeds (lag 32, fp32, RESULTS.md) the re-sync kept dlc on the on-policy path "
                   "(dlc - dlc_noresync +0.035 [+0.021, +0.049]); centering added +0.015 "
                   "[+0.003, +0.027] without it and under 0.01 with it (dlc - stale_is_ess "
                   "+0.001 [-0.008, +0.010]), so `stale_is+none` with ess:0.5 is the choice "
                   "without the top-K.")
    if numerical and e.routing_any is not None and e.routing_any > ROUTING_SHARE:
        return rec("numerical", "icepop", "every:1",
                   f"Numerical mismatch is material, most of it from MoE routing "
                   f"({e.routing_any:.1%} of tokens routed to other experts in some layer). A "
                   "token sent to other experts can move its probability far, a tail a cap "
                   "keeps as bias; IcePop masks the tokens whose rho leaves [1/2, 2]. Routing "
                   "replay (train.routing_replay=r3, docs/mismatch.md) removes the source.")
    if numerical and e.heavy:
        tail = ("most steps saw a token" if e.tail_share is None
                else f"{e.tail_share:.2%} of tokens have") + " rho outside [1/2, 2]"
        return rec("numerical", "icepop", "every:1",
                   f"Numerical mismatch is material, with a heavy tail ({tail}). Truncating a "
                   "heavy tail keeps its bias; masking the tokens outside the band (IcePop / "
                   "MIS) drops them. cis is the alternative when few tokens leave it.")
    if numerical:
        return rec("numerical", "cis", "every:1",
                   "Numerical mismatch is material; staleness is not. It is a fixed bias of the "
                   "engine, not of time, so a re-sync cannot remove it: calibrated importance "
                   "sampling (cis) corrects it with a cap that loosens on low-confidence "
                   "tokens, where TIS's fixed cap biases most.")
    return Recommendation(
        "none", current_estimator, current_sync,
        "Neither cause is material: a correction would trade variance for a bias no larger "
        "than one batch's noise, so keep your current estimator and sync policy.", change=False)


def format_advice(e: Evidence, rec: Recommendation, why: bool = True, width: int = 92) -> str:
    """One line per cause, the advice, and (`why`) the reason, wrapped."""
    lines = [f"  {f.cause:<10} {f.line}" for f in (numerical_finding(e), staleness_finding(e))]
    lines.append(f"advice: {rec.headline}")
    return "\n".join(lines + ([textwrap.fill(rec.why, width)] if why else []))


# Every metric evidence_from_rows reads of a row (tether.auto's pool keeps only these).
EVIDENCE_KEYS = ("numerical/k3_kl/mean", "numerical/ess/seq", "numerical/abs_log_ratio/max",
                 "numerical/routing_disagreement/any_layer", "staleness/k3_kl/mean",
                 "staleness/ess/token")


def evidence_from_rows(rows: list[dict[str, Any]], batch: int) -> Evidence | None:
    """What a run logged (`tether inspect`, the end of `tether train`, `tether.api.advise`):
    the mean numerical k3 and sequence chi2 (1/ESS - 1 of numerical/ess/seq), the mean
    staleness k3 and its lowest token ESS, the mean routing disagreement; `batch` is N. The
    tail share is not logged: a run counts as heavy-tailed when most steps saw a token
    outside [1/2, 2] (numerical/abs_log_ratio/max > log 2). None without mismatch rows."""
    def values(key: str) -> list[float]:
        assert key in EVIDENCE_KEYS  # a key read here and not listed would be lost to a pool
        return [float(r[key]) for r in rows if isinstance(r.get(key), (int, float))
                and not isinstance(r.get(key), bool) and math.isfinite(r[key])]

    def mean(xs: list[float]) -> float | None:
        return sum(xs) / len(xs) if xs else None

    num = values("numerical/k3_kl/mean")
    if not num:
        return None
    stale, ess = values("staleness/k3_kl/mean"), values("staleness/ess/token")
    peaks = values("numerical/abs_log_ratio/max")
    return Evidence(
        numerical_k3=mean(num),
        numerical_chi2_seq=mean([1 / x - 1 for x in values("numerical/ess/seq") if x > 0]) or 0.0,
        batch=batch, heavy=sum(p > TAIL_BAND for p in peaks) > len(peaks) / 2,
        routing_any=mean(values("numerical/routing_disagreement/any_layer")),
        staleness_k3=mean(stale), ess=min(ess) if ess else None,
        staleness_what=f"{len(num)} logged step{'s' if len(num) > 1 else ''} (mean k3, lowest ESS)")


def batch_of(cfg: dict[str, Any]) -> int:
    """N, the responses in one optimizer step, from a run's config (as a dict)."""
    r, t = cfg.get("rollout", {}), cfg.get("train", {})
    return max(1, r.get("prompts_per_step", 1) * r.get("group_size", 1) // t.get("minibatches", 1))


def advise_rows(rows: list[dict[str, Any]], batch: int, estimator: str, sync_policy: str,
                why: bool = True) -> str | None:
    """The split and the advice for logged metric rows (N = `batch`) of a run with that
    estimator and sync policy; None if no mismatch was logged."""
    e = evidence_from_rows(rows, batch)
    if e is None:
        return None
    return format_advice(e, recommend(e, estimator, sync_policy), why)


def advise_run(rows: list[dict[str, Any]], cfg: dict[str, Any], why: bool = True) -> str | None:
    """The split and the advice for a run's rows and its config (as a dict); None if unlogged."""
    return advise_rows(rows, batch_of(cfg), cfg.get("train", {}).get("estimator", "grpo"),
                       str(cfg.get("sync", {}).get("policy", "every:1")), why)
