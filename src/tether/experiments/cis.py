"""E-CIS (DESIGN.md section 7): on a MoE model with a bf16 generator, what does each
numerical correction do to the weights' second moment, to the bias by token confidence,
and to accuracy?

Matrix: MoE tiny model (`model.moe=true`), generator {bf16, bf16 + router noise} x methods
{none (grpo), tis, mis (= icepop: the same token test), cis} x seeds, plus the on-policy
reference (fp32 generator, grpo). The tiny model's bf16 router sends under 1% of
(token, layer) pairs to other experts; `bf16_route` adds router-logit noise of std 0.1
(`rollout.router_noise`), which re-routes 7-9% on the warm-started model
(docs/mismatch.md), about the 10% that R3 (arXiv 2510.11370) measured between vLLM and
Megatron on a large MoE. `bf16_route_r3` is the same generator with routing replay R3
(`train.routing_replay=r3`: the trainer replays the generator's experts), x {none, cis}:
what replay leaves of the mismatch for a correction to handle. Second moments come from
the training logs
(`numerical/is_weight/*second_moment`: the raw rho; `correction/weight/*`: what the
method applied). Truncation bias by confidence bin is measured once on the starting
model (`truncation_bias`): tokens sampled by the bf16 + router-noise generator, binned
by pi_old(y).

What it simplifies: the MoE mismatch is the tiny model's router under bf16, far smaller
than a 30B MoE's; one probe batch for the bias, not every step.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import torch

from tether.experiments.runner import Cell, Experiment

QUESTION = ("On a MoE model with a bf16 generator, does CIS cut the importance weights' "
            "second moment with less bias on confident tokens than TIS or MIS, at no cost in accuracy?")

TASK = ["task.use_all=true", "task.format_weight=0.1", "sync.policy=every:1", "model.moe=true"]
METHODS = {"none": ["train.estimator=grpo"], "tis": ["train.estimator=tis"],
           "mis": ["train.estimator=mis"], "cis": ["train.estimator=cis"]}
ROUTER_NOISE = 0.1
SCENARIOS = {"exact": ["rollout.precision=fp32"], "bf16": ["rollout.precision=bf16"],
             "bf16_route": ["rollout.precision=bf16", f"rollout.router_noise={ROUTER_NOISE}"],
             "bf16_route_r3": ["rollout.precision=bf16", f"rollout.router_noise={ROUTER_NOISE}",
                               "train.routing_replay=r3"]}
R3_METHODS = ("none", "cis")  # the r3 rows: replay alone, and replay with CIS
BIN_EDGES = (0.0, 0.5, 0.9, 0.99, 1.0)  # pi_old(y) bins; the last holds the confident tokens
BIAS_CORRECTIONS = ("none", "tis", "mis", "cis")


def build(quick: bool = False, seeds: int | None = None) -> Experiment:
    if quick:
        n_seeds, methods, scenarios = seeds or 1, ["none", "cis"], ("bf16_route",)
        base = TASK + ["model.warmstart_steps=20", "train.steps=3", "train.lr=5e-4",
                       "rollout.prompts_per_step=8", "rollout.group_size=4",
                       "rollout.max_new_tokens=12", "task.eval_size=16", "eval.every=0",
                       "eval.samples=0", "diagnostics.monitor_every=0",
                       "run.checkpoint_every=0"]
    else:
        n_seeds, methods, scenarios = seeds or 3, list(METHODS), ("bf16", "bf16_route")
        base = TASK + ["model.warmstart_steps=200", "train.steps=40", "train.lr=5e-4",
                       "rollout.prompts_per_step=32", "rollout.group_size=8",
                       "rollout.max_new_tokens=12", "eval.every=10", "eval.samples=0",
                       "diagnostics.monitor_every=10", "run.checkpoint_every=10"]
    cells = [Cell("exact", "none", s, tuple(SCENARIOS["exact"] + METHODS["none"]))
             for s in range(n_seeds)]
    cells += [Cell(scen, m, s, tuple(SCENARIOS[scen] + METHODS[m]))
              for s in range(n_seeds) for scen in scenarios for m in methods]
    cells += [Cell("bf16_route_r3", m, s, tuple(SCENARIOS["bf16_route_r3"] + METHODS[m]))
              for s in range(n_seeds) for m in (R3_METHODS[:1] if quick else R3_METHODS)]
    notes = ["mis stands for mis/icepop (the same token band test, (0.5, 2))",
             "on-policy reference: exact (fp32 generator) x none (grpo)",
             f"bf16_route: bf16 + router-logit noise std {ROUTER_NOISE} (rollout.router_noise)",
             "bf16_route_r3: the same generator, trainer replaying its experts (R3)",
             (f"truncation bias: starting model, bf16 + router noise {ROUTER_NOISE}, "
              f"pi_old bins {BIN_EDGES}")]
    return Experiment("cis", QUESTION, base, cells, ("exact", "none"), notes)


COLUMNS = [("scenario", "generator"), ("method", "method"), ("seeds", "seeds"),
           ("final_trainer", "final trainer-side"), ("final_accuracy", "final acc"),
           ("final_reward", "final batch reward (generator-side)"),
           ("accuracy_dev_sigma", "acc dev (σ)"), ("is_second_moment", "E[ρ²] raw"),
           ("is_adv_second_moment", "E[ρ²A²]/E[A²] raw"), ("corr_second_moment", "E[w²] applied"),
           ("corr_adv_second_moment", "E[w²A²]/E[A²] applied"), ("numerical_k3", "numerical k3")]


@torch.no_grad()
def truncation_bias(out: Path, prompts: int = 64, samples: int = 4, seed: int = 4321) -> dict:
    """Per pi_old bin and correction: mean (w - rho), its share of mean rho, E[w^2].

    The bias of a corrected estimator relative to exact importance sampling, on a token
    whose score term is the same for every token of the bin, is E[(w - rho) g] = g E[w - rho]:
    the column `bias` (w = 1 for `none`: the uncorrected estimator's bias). Cached in
    OUT/truncation_bias.json.
    """
    path = Path(out) / "truncation_bias.json"
    if path.is_file():
        return json.loads(path.read_text())
    from tether.config import load_config
    from tether.estimators import CORRECTIONS
    from tether.models import load_model
    from tether.models.tokenizer import encode_exact
    from tether.rollout.hf import HFGenerator
    from tether.rollout.types import SamplingParams
    from tether.tasks import task_from_config
    from tether.trainer import collate, token_logprobs

    meta = json.loads((Path(out) / "experiment.json").read_text())
    cfg = load_config(None, meta["base"] + SCENARIOS["bf16_route"])
    task = task_from_config(cfg.task)
    model, tok = load_model(meta["model_path"])
    model.eval()
    problems = [task.train_problem(10_000_000 + i) for i in range(prompts)]
    sampling = SamplingParams(n=samples, max_new_tokens=cfg.rollout.max_new_tokens)
    gen = HFGenerator(model, tok.eos_token_id, tok.pad_token_id, cfg.rollout.precision,
                      cfg.rollout.router_noise)
    batch = collate(gen.generate([encode_exact(tok, p.prompt) for p in problems],
                                 [p.id for p in problems], sampling, seed=seed), tok.pad_token_id)
    logp_old, _ = token_logprobs(model, batch, sampling)  # (B, T) fp32 trainer, same weights
    mask = batch.response_mask.bool()
    rho = (logp_old - batch.logp_rollout).clamp(-20, 20).exp()
    p_old = logp_old.exp()
    tensors = {"logp_old": logp_old, "logp_rollout": batch.logp_rollout, "mask": mask}
    weights = {}
    for name in BIAS_CORRECTIONS:
        entry = CORRECTIONS.get(name)
        weights[name] = entry.fn(*(tensors[k] for k in entry.inputs)).weight
    bins = []
    for lo, hi in itertools.pairwise(BIN_EDGES):
        sel = mask & (p_old >= lo) & ((p_old < hi) if hi < 1.0 else (p_old <= hi))
        n = int(sel.sum())
        row = {"bin": f"[{lo:g}, {hi:g}{']' if hi == 1.0 else ')'}", "tokens": n,
               "rho_mean": float(rho[sel].mean()) if n else float("nan"),
               "rho_second_moment": float((rho[sel] ** 2).mean()) if n else float("nan")}
        for name, w in weights.items():
            w = w.expand_as(rho)
            row[f"{name}/bias"] = float((w[sel] - rho[sel]).mean()) if n else float("nan")
            row[f"{name}/second_moment"] = float((w[sel] ** 2).mean()) if n else float("nan")
        bins.append(row)
    result = {"bins": bins, "tokens": int(mask.sum()), "prompts": prompts, "samples": samples,
              "generator": f"{cfg.rollout.precision} + router noise {cfg.rollout.router_noise:g}",
              "definition": "bias = mean over the bin's tokens of (w - rho), rho = pi_old/mu"}
    path.write_text(json.dumps(result, indent=1))
    return result
