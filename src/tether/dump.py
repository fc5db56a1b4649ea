"""The log-prob dump: per token log-probs from any trainer, for `tether inspect`.

A JSONL file. The first line is a header, every other line one response:

    {"tether_dump": 1, "source": "trl", "estimator": "tis", "batch": 64, "generator": "bf16", "trainer": "fp32"}
    {"step": 3, "version": 2, "prompt_ids": [...], "response_ids": [...], "mask": [1, 1, 0],
     "logp_rollout": [...], "logp_old": [...], "logp": [...]}

- step: the optimizer step (1, 2, ...) whose update these log-probs enter (pi_theta scored
  there); every response of one step forms one batch, split as `tether train` splits its.
- version: the optimizer steps the sampling weights had taken. The trainer's weights at
  step s have taken s - 1, so the response is s - 1 - version versions stale.
- mask: 1 on the tokens that enter the loss (optional: all ones).
- logp_rollout (mu, the engine's sampling log-probs), logp_old (pi_old: the trainer at the
  sampling weights), logp (pi_theta): one float per response token, natural log; any one
  may be null where the framework does not have it (tether.api.split says what two of the
  three can tell apart).
The header's keys are all optional: batch is N, the responses in one optimizer step (the
advice's 1/N bar; default: the responses of the largest step).

Writers: tether.integrations.trl (`dump=PATH`) and `tether train` (`log.dump_logprobs`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import IO, Any

from tether.api import split
from tether.errors import InputError
from tether.lazy import torch

FORMAT = 1
LOGPROBS = ("logp_rollout", "logp_old", "logp")


def is_dump(path: str | Path) -> bool:
    """Whether `path` is a log-prob dump (its first line is a tether_dump header)."""
    path = Path(path)
    if not path.is_file():
        return False
    with open(path) as f:
        try:
            return "tether_dump" in json.loads(f.readline() or "{}")
        except json.JSONDecodeError:
            return False


class DumpWriter:
    """Appends responses to a dump; `header` goes on the first line of a new file. A resumed
    run passes `keep_until`, its checkpoint's step: later rows, which it runs again, go."""

    def __init__(self, path: str | Path, keep_until: int | None = None, **header: Any):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if keep_until is not None and self.path.is_file():
            lines = self.path.read_text().splitlines(keepends=True)
            self.path.write_text("".join(
                line for line in lines if json.loads(line).get("step", 0) <= keep_until))
        fresh = not self.path.exists() or self.path.stat().st_size == 0
        self._f: IO[str] = open(self.path, "a")  # noqa: SIM115 - open until close()
        if fresh:
            self._f.write(json.dumps({"tether_dump": FORMAT, **header}) + "\n")

    def write_batch(self, step: int, versions: list[int], prompt_ids: torch.Tensor,
                    prompt_mask: torch.Tensor, response_ids: torch.Tensor,
                    response_mask: torch.Tensor, mask: torch.Tensor,
                    **logprobs: torch.Tensor | None) -> None:
        """One optimizer step's responses, as trainers hold them: prompts left-padded
        (B, P) with their attention mask, responses right-padded (B, T) with theirs; `mask`
        (B, T) marks the tokens that enter the loss, `logprobs` (named as in LOGPROBS, or
        None) are (B, T)."""
        lists = {k: None if v is None else v.detach().double().cpu().tolist()
                 for k, v in logprobs.items()}
        m = mask.detach().cpu().tolist()
        lengths = response_mask.long().sum(dim=1).tolist()
        rows = zip(prompt_ids.cpu(), prompt_mask.cpu(), response_ids.cpu(), lengths, strict=True)
        for b, (p_ids, p_mask, r_ids, n) in enumerate(rows):
            row = {"step": step, "version": versions[b], "prompt_ids": p_ids[p_mask.bool()].tolist(),
                   "response_ids": r_ids[:n].tolist(), "mask": [int(x) for x in m[b][:n]]}
            row |= {k: None if v is None else v[b][:n] for k, v in lists.items()}
            self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def dump_batch(writer: DumpWriter, step: int, batch: Any, logp_old: torch.Tensor,
               logp: torch.Tensor | None) -> None:
    """A tether batch (tether.trainer.RolloutTensors) with the pi_old and pi_theta its
    step's split used (`log.dump_logprobs`)."""
    P = batch.prompt_len
    writer.write_batch(step, batch.versions.tolist(), batch.input_ids[:, :P],
                       batch.attention_mask[:, :P], batch.response_ids, batch.response_mask,
                       batch.response_mask, logp_rollout=batch.logp_rollout, logp_old=logp_old,
                       logp=logp)


def read_dump(path: str | Path) -> tuple[dict[str, Any], dict[int, dict[str, Any]]]:
    """The header and, per step, the padded (B, T) tensors: mask, the log-probs present in
    every response of the step (others None), and the sampling versions (B,)."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    if not lines or "tether_dump" not in lines[0]:
        raise InputError(f"{path} is not a tether log-prob dump (no tether_dump header line)")
    header, rows = lines[0], lines[1:]
    if header["tether_dump"] != FORMAT:
        raise InputError(f"{path}: dump format {header['tether_dump']}, this tether reads {FORMAT}")
    by_step: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for i, r in enumerate(rows, start=2):
        missing = {"step", "version", "response_ids"} - r.keys()
        if missing:
            raise InputError(f"{path}:{i}: the response has no {', '.join(sorted(missing))}")
        by_step[int(r["step"])].append(r)
    return header, {s: _tensors(rs) for s, rs in sorted(by_step.items())}


def _tensors(rows: list[dict[str, Any]]) -> dict[str, Any]:
    T = max(len(r["response_ids"]) for r in rows)

    def pad(key: str, fill: float) -> torch.Tensor:
        return torch.tensor([list(r[key]) + [fill] * (T - len(r[key])) for r in rows],
                            dtype=torch.float64)

    for r in rows:
        r.setdefault("mask", [1] * len(r["response_ids"]))
    out: dict[str, Any] = {"mask": pad("mask", 0).bool(),
                           "version": torch.tensor([int(r["version"]) for r in rows])}
    for key in LOGPROBS:
        out[key] = pad(key, 0.0) if all(r.get(key) is not None for r in rows) else None
    return out


def dump_rows(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A dump as a run's metric rows and config, for `tether inspect`: per step the split
    that tether.api.split computes (the same function the TRL plug-in logs with), the
    staleness in versions, and a config with the header's estimator and batch."""
    header, steps = read_dump(path)
    rows = []
    for step, t in steps.items():
        given = {k: t[k] for k in LOGPROBS if t[k] is not None}
        if len(given) < 2:
            raise InputError(f"{path}: step {step} has only {', '.join(given) or 'no log-probs'}; "
                             "the split needs two of logp_rollout, logp_old, logp")
        lag = (step - 1 - t["version"]).double()
        rows.append({"step": step, "version": int(t["version"].min()),
                     "staleness/versions/batch": float(lag.mean()),
                     **split(t["mask"], **given)})
    batch = header.get("batch") or max(len(t["version"]) for t in steps.values())
    cfg = {"source": header.get("source", "log-prob"),
           "rollout": {"prompts_per_step": batch, "group_size": 1,
                       "precision": header.get("generator", "?")},
           "train": {"estimator": header.get("estimator", "grpo"),
                     "precision": header.get("trainer", "?")},
           "sync": {"policy": header.get("sync_policy", "?")}}
    return rows, cfg
