"""tether inside TRL: `TetherGRPOTrainer` is TRL's GRPOTrainer that logs the split of the
generator/trainer disagreement every step and can take any tether preset as its loss.

    from tether.integrations.trl import TetherGRPOTrainer

    trainer = TetherGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...),
                                train_dataset=..., estimator="tis", generator="bf16",
                                dump="run/logprobs.jsonl")
    trainer.train()
    print(trainer.advice())          # the split over the run and what to correct

What it logs, under tether's metric names (docs/metrics.md), from the log-probs TRL has:
- mu, the engine's sampling log-probs: TRL's `sampling_per_token_logps` (its vLLM paths, a
  rollout_func), or tether's own engine (`generator=PRECISION`) sampling in TRL's place;
  TRL's transformers generation keeps none, so without them only staleness is logged.
- pi_old: TRL's `old_per_token_logps`; TRL scores it only when a generation is trained over
  more than one optimizer step (steps_per_generation, num_iterations) or on its vLLM paths,
  and otherwise pi_old is pi_theta detached, as in TRL's own loss.
- pi_theta: the training forward's log-probs.

The loss (`estimator`), the ESS re-sync (`resync_tau`) and the dump are tether.api's and
tether.dump's functions; docs/integrations.md has the details and what each TRL setting
allows.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch
from trl import GRPOTrainer

from tether import api
from tether.advice import advise_rows
from tether.dump import DumpWriter
from tether.rollout.hf import HFGenerator
from tether.rollout.types import SamplingParams
from tether.scoring import RolloutTensors, score_tokens

TOPK = 20  # the generator's top-K recorded for dlc's centering (rollout.logprobs_topk's default)


class TetherGRPOTrainer(GRPOTrainer):
    """GRPOTrainer plus tether; every TRL argument is passed through unchanged.

    estimator: a tether preset or composition as the loss ("dlc", "tis", "cis", "vespo",
        ...; `tether estimators`), None for TRL's own loss (the split is logged either way).
    estimator_params: its parameters ({"cap": 3.0}).
    generator: "fp32", "bf16", "fp16" or "fp8": tether's engine samples in TRL's place, at
        that precision, from the current weights, and returns mu (and the top-K that dlc's
        centering needs). None: TRL generates.
    resync_tau: DLC's ESS re-sync. When the token ESS of pi_theta/pi_old on a batch falls
        below tau, the rest of the generation is dropped and regenerated at the current
        weights (logged as sync/ess/token, sync/tripped).
    correction: "fixed" (the estimator as given) or "auto": `tether train`'s
        train.correction=auto (tether.api.Auto). `estimator` then names the objective only
        (default grpo); after each optimizer step, the mean of its micro-steps' split chooses
        per cause: cis or icepop for a material numerical mismatch, centering for material
        staleness (with generator=..., which records the top-K; otherwise the numerical cap
        stays). The ESS re-sync at 0.5 is armed throughout, as dlc's. Logged as
        auto/numerical, auto/staleness.
    dump: a path; every trained token's mu, pi_old and pi_theta are appended there in
        tether.dump's format, which `tether inspect` reads.
    """

    def __init__(self, *args: Any, estimator: str | None = None,
                 estimator_params: dict[str, Any] | None = None, generator: str | None = None,
                 resync_tau: float | None = None, dump: str | Path | None = None,
                 correction: str = "fixed", **kwargs: Any):
        if generator is not None and kwargs.get("rollout_func") is not None:
            raise ValueError("generator= replaces TRL's generation with tether's engine; it "
                             "cannot be combined with a rollout_func")
        if generator is not None:
            kwargs["rollout_func"] = self._tether_rollout
        super().__init__(*args, **kwargs)
        if correction not in ("fixed", "auto"):
            raise ValueError(f"correction={correction!r}: valid are 'fixed' and 'auto'")
        if correction == "auto":
            if resync_tau is not None:
                raise ValueError("correction='auto' arms the ESS re-sync at 0.5 itself; leave "
                                 "resync_tau unset")
            estimator = estimator or "grpo"
        self.tether_estimator = estimator
        self.tether_params = dict(estimator_params or {})
        self._auto = None if correction == "fixed" else api.Auto(
            estimator, batch=self._batch, **self.tether_params)
        self._auto_split: list[dict[str, float]] = []  # the optimizer step's micro-steps
        self._auto_step = 0
        self.tether_generator = generator
        self.resync_tau = resync_tau
        self._engine: HFGenerator | None = None
        self._topk: list[tuple[list[list[int]], list[list[float]]]] | None = None
        self._logp: torch.Tensor | None = None
        # What the estimator reads (api.needs), once: "topk" makes the engine record top-K.
        self._reads = set() if estimator is None else api.needs(estimator, **self.tether_params)
        if self._auto is not None:  # what it may switch on; the top-K only with tether's engine
            self._reads |= {"logp_rollout"}
        self._check(estimator)
        self._dump = None if dump is None else DumpWriter(
            dump, source="trl", estimator=estimator or f"trl:{self.loss_type}", batch=self._batch,
            generator=generator or ("vllm" if self.use_vllm else "trl"), trainer=self._precision())

    # --- what the configuration can give ---------------------------------------------------

    @property
    def _batch(self) -> int:
        """N, the responses in one optimizer step (the advice's 1/N bar)."""
        return (self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
                * self.accelerator.num_processes)

    def _precision(self) -> str:
        """The trainer's numerics: TRL's mixed precision (bf16 by default, also on CPU)."""
        return "bf16" if self.args.bf16 else "fp16" if self.args.fp16 else "fp32"

    def _has_mu(self) -> bool:
        return self.tether_generator is not None or self.use_vllm or self.rollout_func is not None

    def _check(self, estimator: str | None) -> None:
        """Fail at construction when the configuration cannot give what was asked for."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        if self.resync_tau is not None and generate_every <= self.args.gradient_accumulation_steps:
            raise ValueError(
                f"resync_tau: each generation is trained within one optimizer step "
                f"(steps_per_generation x num_iterations = {generate_every} <= "
                f"gradient_accumulation_steps = {self.args.gradient_accumulation_steps}), so "
                "pi_theta never drifts from pi_old and the re-sync cannot trip; raise "
                "steps_per_generation or num_iterations, or leave resync_tau unset")
        reads = self._reads - ({"logp_rollout"} if self._auto is not None else set())
        if "logp_prox" in reads:
            raise ValueError(f"estimator {estimator!r} needs pi_prox (the trainer at the step's "
                             "start), which TRL does not keep")
        if "topk" in reads and self.tether_generator is None:
            raise ValueError(
                f"estimator {estimator!r} centers scores: it needs the generator's top-K ids "
                "and log-probs, which no TRL generation path returns; pass generator='fp32' "
                "(or 'bf16', ...) so tether's engine samples and records them")
        if "logp_rollout" in reads and not self._has_mu():
            raise ValueError(
                f"estimator {estimator!r} corrects the numerical mismatch and needs the "
                "engine's sampling log-probs (mu); TRL's transformers generation does not "
                "return them. Pass generator='bf16' (tether's engine samples), use_vllm=True, "
                "or a rollout_func that returns logprobs")

    # --- generation: tether's engine in TRL's place (generator=...) --------------------------

    def _tether_rollout(self, prompts: list, trainer: GRPOTrainer) -> dict[str, list]:
        """TRL's rollout_func: tether's HF engine at `generator` precision samples the group
        of every prompt from the current weights; mu per token, and the top-K for centering."""
        G = self.num_generations if self.model.training else self.num_generations_eval
        unique = prompts[::G]  # TRL repeats each prompt G times, adjacent
        prompt_ids, _, _ = self._tokenize_prompts(unique)
        model = self.accelerator.unwrap_model(self.model)
        tok = self.processing_class
        if self._engine is None:
            self._engine = HFGenerator(model, tok.eos_token_id, tok.pad_token_id,
                                       self.tether_generator)
            # TRL patches the instance's forward (its fused LM head) with a closure over the
            # trainer's model: the copy would run the trainer's. The class's forward is the copy's.
            self._engine.model.__dict__.pop("forward", None)
        self._engine.load_weights(model.state_dict(), version=self.state.global_step)
        centering = "topk" in self._reads or (self._auto is not None and self._auto.centers)
        args = self.args
        sampling = SamplingParams(n=G, temperature=args.temperature, top_k=args.top_k or 0,
                                  top_p=args.top_p, max_new_tokens=args.max_completion_length,
                                  logprobs_topk=TOPK if centering else 0)
        seed = args.seed * 1_000_003 + self.state.global_step * 7919 + self._step
        rollouts = self._engine.generate([list(p) for p in prompt_ids],
                                         [str(i) for i in range(len(unique))], sampling, seed)
        self._topk = [(r.topk_ids, r.topk_logp) for r in rollouts] if centering else None
        return {"prompt_ids": [r.prompt_ids for r in rollouts],
                "completion_ids": [r.response_ids for r in rollouts],
                "logprobs": [r.logp_rollout for r in rollouts]}

    def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
        """TRL's, plus each row's sampling version and, for centering, the generator's top-K
        with pi_old there (one no-grad forward at the sampling weights)."""
        out = super()._generate_and_score_completions(inputs)
        B, C = out["completion_ids"].shape
        out["tether_version"] = torch.full((B,), self.state.global_step, dtype=torch.long)
        if self._topk is not None:
            ids = torch.zeros(B, C, TOPK, dtype=torch.long)
            logp = torch.full((B, C, TOPK), float("-inf"))
            for b, (row_ids, row_logp) in enumerate(self._topk):
                n = min(len(row_ids), C)
                ids[b, :n] = torch.tensor(row_ids[:n])
                logp[b, :n] = torch.tensor(row_logp[:n], dtype=torch.float32)
            device = out["completion_ids"].device
            ids, logp = ids.to(device), logp.to(device)
            out["tether_topk_ids"], out["tether_topk_logp_rollout"] = ids, logp
            if out.get("old_per_token_logps") is not None:
                with torch.no_grad():
                    _, out["tether_topk_logp_old"] = self._score(self.model, out, ids)
            self._topk = None
        return out

    # --- the loss ------------------------------------------------------------------------------

    def _get_per_token_logps_and_entropies(self, *args: Any, **kwargs: Any):
        out = super()._get_per_token_logps_and_entropies(*args, **kwargs)
        if kwargs.get("compute_entropy"):  # the training forward of TRL's own loss
            self._logp = out[0]
        return out

    def _score(self, model: torch.nn.Module, inputs: dict[str, Any],
               topk_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """log pi_theta of the sampled tokens (B, C) and at the top-K ids (B, C, K), by tether's
        own scoring (tether.scoring: the processed distribution, fp32 head), the
        forward `tether train` takes its loss through."""
        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        B, C = completion_ids.shape
        zeros = torch.zeros(B, C, dtype=torch.long, device=completion_ids.device)
        batch = RolloutTensors(
            input_ids=torch.cat([prompt_ids, completion_ids], dim=1),
            attention_mask=torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1),
            response_ids=completion_ids, response_mask=inputs["completion_mask"],
            logp_rollout=zeros.float(), rewards=zeros[:, 0].float(), group_ids=zeros[:, 0],
            token_versions=zeros, topk_ids=topk_ids)
        args = self.args
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k or 0,
                                  top_p=args.top_p)
        scores = score_tokens(model, batch, sampling, precision=self._precision())
        return scores.logp, scores.topk

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            self._auto_observe()
        mask = inputs["completion_mask"]
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        if self.tether_estimator is None:
            loss = super()._compute_loss(model, inputs)
            logp, topk_logp = self._logp, None
        else:
            logp, topk_logp = self._score(model, inputs, inputs.get("tether_topk_ids"))
        # pi_old where TRL skipped it is pi_theta detached, as in TRL's own loss; a token vLLM
        # gave no log-prob for (NaN) gets no numerical correction.
        old = inputs.get("old_per_token_logps")
        old = logp.detach() if old is None else old
        mu = inputs.get("sampling_per_token_logps")
        mu = None if mu is None else torch.where(torch.isnan(mu), old, mu)
        if self.tether_estimator is not None:
            topk = {} if topk_logp is None else {
                "topk_ids": inputs["tether_topk_ids"],
                "topk_logp_rollout": inputs["tether_topk_logp_rollout"], "topk_logp": topk_logp,
                "topk_logp_old": inputs.get("tether_topk_logp_old", topk_logp.detach())}
            tensors = {"logp": logp, "logp_old": old, "logp_rollout": old if mu is None else mu,
                       "advantages": inputs["advantages"], "mask": mask, **topk}
            out = (api.loss(self.tether_estimator, **tensors, **self.tether_params)
                   if self._auto is None else self._auto.loss(**tensors))
            if self._auto is not None and mode == "train":
                for k, v in self._auto.codes("topk_ids" in topk).items():
                    self._metrics[mode][k].append(v)
            # TRL sums the micro-batches of one optimizer step; tether's loss is their mean.
            loss = out.loss / (self.current_gradient_accumulation_steps if mode == "train" else 1)
            for k, v in out.metrics.items():
                if k.startswith(("loss/", "applied/", "centering/")):
                    self._metrics[mode][k].append(v)
        self._after_loss(mode, mask, mu, old, logp.detach(), inputs)
        return loss

    def _after_loss(self, mode: str, mask: torch.Tensor, mu: torch.Tensor | None,
                    old: torch.Tensor, logp: torch.Tensor, inputs: dict[str, Any]) -> None:
        """The split into TRL's logs, the ESS re-sync decision, the dump; the time they take
        is logged as time/tether (s per micro-step: the plug-in's overhead, without a loss)."""
        start = time.perf_counter()
        split = api.split(mask, logp_rollout=mu, logp_old=old, logp=logp)
        for k, v in split.items():
            self._metrics[mode][k].append(v)
        lag = self.state.global_step - inputs["tether_version"].double().mean()
        self._metrics[mode]["staleness/versions/batch"].append(float(lag))
        tau = self.resync_tau
        if self._auto is not None and mode == "train":
            self._auto_split.append(split)
            tau = self._auto.tau  # the re-sync's trigger is armed in either choice
        if tau is not None and mode == "train":
            ess, trip = api.resync(logp, old, mask, tau)
            self._metrics[mode]["sync/ess/token"].append(ess)
            self._metrics[mode]["sync/tripped"].append(float(trip))
            if trip:  # TRL generates again when its buffer is empty
                self._buffered_inputs = None
        if self._dump is not None and mode == "train":
            self._dump.write_batch(self.state.global_step + 1, inputs["tether_version"].tolist(),
                                   inputs["prompt_ids"], inputs["prompt_mask"],
                                   inputs["completion_ids"], inputs["completion_mask"], mask,
                                   logp_rollout=mu, logp_old=old, logp=logp)
        self._metrics[mode]["time/tether"].append(time.perf_counter() - start)

    def _auto_observe(self) -> None:
        """correction='auto', at an optimizer step's first micro-step: the previous step's
        split (its micro-steps' mean) goes to the controller; its switches apply from here."""
        if self._auto is None or self.state.global_step == self._auto_step or not self._auto_split:
            return
        keys = set().union(*self._auto_split)
        mean = {k: sum(d[k] for d in self._auto_split if k in d) /
                sum(k in d for d in self._auto_split) for k in keys}
        for line in self._auto.observe(mean, self.state.global_step):
            print(line, file=sys.stderr, flush=True)
        self._auto_step, self._auto_split = self.state.global_step, []

    # --- the verdict -----------------------------------------------------------------------------

    def advice(self) -> str:
        """The split over the logged steps, each cause's verdict and what to correct, as
        `tether inspect` ends (docs/probe.md); needs mu (the numerical split)."""
        rows = [h for h in self.state.log_history if "numerical/k3_kl/mean" in h]
        text = advise_rows(rows, self._batch, self.tether_estimator or "grpo",
                           f"ess:{self.resync_tau}" if self.resync_tau else "every:1")
        return text or ("no numerical split was logged: TRL kept no sampling log-probs (pass "
                        "generator=... or use vLLM); staleness alone is in the logs")
