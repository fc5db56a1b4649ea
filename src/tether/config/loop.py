"""`loop.*`: which loop runs (sync, async), and the asynchronous loop's workers, admission
bound, window and backend (docs/async.md, docs/distributed.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from tether.config.base import CrossFieldError, Node
from tether.config.sections import RESUMABLE


class LoopConfig(Node):
    mode: Literal["sync", "async"] = Field(
        "sync",
        description="sync: generate, then train, in turn (staleness only from sync.lag and "
        "train.minibatches). async: rollout workers generate while the trainer trains; "
        "staleness is what the race gives, bounded by max_staleness. See docs/async.md.",
    )
    workers: int = Field(
        1, ge=1, json_schema_extra=RESUMABLE,
        description="async: rollout workers (processes, or Ray actors with backend=ray), each "
        "with its own engine.",
    )
    max_staleness: int = Field(
        1, ge=0,
        description="async: admission bound eta. A worker starts a batch only if its training "
        "will start at most eta versions after the weights it samples with (AReaL's "
        "max_head_offpolicyness); nothing is generated only to be thrown away. Versions "
        "count optimizer steps, so overlap needs eta >= train.minibatches (0 < eta < "
        "minibatches is refused: it never overlaps). With window=ess, the ceiling of the "
        "window the ESS governs.",
    )
    window: Literal["fixed", "ess"] = Field(
        "fixed",
        description="async: the admission window. fixed: max_staleness, always. ess (needs "
        "sync.policy=ess:TAU): the ESS governs it between window_min and max_staleness; a batch "
        "that trips the re-sync halves it (from the smaller of the window and that batch's "
        "staleness), each trained batch that does not trip widens it by one version; logged as "
        "async/window. See docs/async.md.",
    )
    window_min: int = Field(
        1, ge=0,
        description="async, window=ess: the smallest window a trip can leave (0: the processes "
        "take turns, as in the synchronous loop; 1 keeps one batch generating while one trains).",
    )
    after_trip: Literal["auto", "window", "regenerate"] = Field(
        "auto",
        description="async: batches sampled before an ESS re-sync and still queued or in flight "
        "when it happens. window: each is trained only if its staleness is within the window in "
        "force at its turn, else dropped (ledger reason outside_window) and its prompts issued "
        "again. regenerate: every one is dropped (sampled_before_resync) and issued again at the "
        "new weights. auto: regenerate with window=ess (it held dlc closer to on-policy in "
        "E-DLC's race, RESULTS.md), window with a fixed window (every batch admitted is trained, "
        "as before the ESS window existed). With no ess policy nothing is ever dropped.",
    )
    partial: bool = Field(
        False,
        description="async, hf engine: partial rollouts. A published version reaches a worker "
        "between decode steps of its in-flight batch (the KV cache is recomputed); each token "
        "records the version that sampled it, and pi_old is scored per token.",
    )
    worker_threads: int = Field(
        1, ge=1, json_schema_extra=RESUMABLE,
        description="async: torch CPU threads in each rollout worker.",
    )
    score_old: Literal["auto", "worker", "trainer"] = Field(
        "auto", json_schema_extra=RESUMABLE,
        description="async: where pi_old is scored. worker: each rollout worker scores the batch "
        "it made, with the trainer's scoring code at the version that sampled each token (one "
        "more fp32 model copy per worker), so the trainer does no pi_old forward. trainer: the "
        "trainer scores it from its kept snapshots (one no-grad forward per batch on its "
        "critical path). auto: worker with rollout.engine=hf, trainer with vllm or "
        "train.routing_replay=r2. The numbers are the same either way. See docs/async.md.",
    )
    backend: Literal["local", "ray"] = Field(
        "local", json_schema_extra=RESUMABLE,
        description="async: where rollout workers run. local: processes on this machine, "
        "weights through shared memory. ray: one Ray actor per worker, on this machine or a "
        "cluster, weights through the Ray object store; a worker that dies is replaced and its "
        "prompts issued again (pip install -e '.[ray]'). See docs/distributed.md.",
    )
    ray_address: str | None = Field(
        None, json_schema_extra=RESUMABLE,
        description="backend=ray: the cluster to join ('auto': the one this machine belongs "
        "to, after `ray start`; or 'host:port'). None: start a local Ray with this machine's CPUs.",
    )
    worker_cpus: float = Field(
        1.0, gt=0.0, json_schema_extra=RESUMABLE,
        description="backend=ray: CPUs Ray reserves for each rollout worker actor.",
    )
    worker_gpus: float = Field(
        0.0, ge=0.0, json_schema_extra=RESUMABLE,
        description="backend=ray: GPUs Ray reserves for each rollout worker actor (fractions "
        "share a GPU; 0: CPU engines).",
    )

    @model_validator(mode="after")
    def _modes(self) -> LoopConfig:
        if self.partial and self.mode != "async":
            raise CrossFieldError(["loop.partial", "loop.mode"],
                                  "loop.partial=true needs loop.mode=async (weights change "
                                  "mid-batch only while generation and training overlap)")
        if self.backend == "ray" and self.mode != "async":
            raise CrossFieldError(["loop.backend", "loop.mode"],
                                  "loop.backend=ray places the asynchronous loop's rollout "
                                  "workers: set loop.mode=async (the synchronous loop has no workers)")
        if self.mode != "async" and (self.window != "fixed" or self.after_trip == "regenerate"):
            raise CrossFieldError(["loop.window", "loop.after_trip", "loop.mode"],
                                  "loop.window and loop.after_trip govern the asynchronous loop's "
                                  "admission: set loop.mode=async (the synchronous loop's batch is "
                                  "never in flight across a re-sync)")
        if self.window_min > self.max_staleness:
            raise CrossFieldError(["loop.window_min", "loop.max_staleness"],
                                  f"loop.window_min ({self.window_min}) must be <= "
                                  f"loop.max_staleness ({self.max_staleness}), the window's ceiling")
        if self.backend == "ray" and self.partial:
            raise CrossFieldError(["loop.partial", "loop.backend"],
                                  "loop.partial=true with loop.backend=ray: a Ray actor loads new "
                                  "weights between batches only; use loop.backend=local for "
                                  "partial rollouts, or loop.partial=false")
        return self
