"""tether's default model: the tiny Qwen3 (dense or MoE), built and warm-started once, cached.

The recipe needs a task (the warm start trains on its worked solutions), which is why it
lives here and not in tether.models: models know architectures, tokenizers and routing;
the testbed knows what to train them on.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tether.defaults import MODEL_CACHE_DIR, WARMSTART_STEPS
from tether.models.tiny import MAX_POSITIONS, MOE_EXPERTS, build_tiny_model, positions_for
from tether.models.tokenizer import build_char_tokenizer
from tether.tasks.chain import ChainTask
from tether.tasks.countdown import ALPHABET, CountdownTask
from tether.testbed.warmstart import warm_start

# Bump when the recipe of the default model changes, so stale caches are not reused.
RECIPE_VERSION = 1

# How often a build says where it is when its output is not a terminal (a log file, CI):
# this share of the steps, so a 900-step build prints 20 lines, one every few seconds to a
# minute depending on the machine's load.
PROGRESS_SHARE = 0.05


def default_model_dir(cache_dir: str, moe: bool, seed: int, warmstart_steps: int, task_key: dict,
                      arch_key: dict | None = None) -> Path:
    """`arch_key`: the MoE knobs that differ from the default architecture (none: keyed as
    before they existed, so cached models stay valid)."""
    key = {"v": RECIPE_VERSION, "moe": moe, "seed": seed, "steps": warmstart_steps, "task": task_key}
    if arch_key:
        key["arch"] = arch_key
    key = json.dumps(key, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    kind = "moe" if moe else "dense"
    return Path(os.path.expanduser(cache_dir)) / f"tiny-{kind}-{digest}"


def ensure_default_model(
    cache_dir: str = MODEL_CACHE_DIR, moe: bool = False, seed: int = 0,
    warmstart_steps: int = WARMSTART_STEPS,
    task_kwargs: dict | None = None, verbose: bool = True,
    moe_experts: int = MOE_EXPERTS, moe_aux_loss: float = 0.0, threads: int = 0,
) -> Path:
    """Build and warm-start tether's tiny model unless cached; return its HF directory.

    `task_kwargs` is the task section: the model is warm-started on the chain task when its
    `name` is "chain", else on Countdown; the task's WARMSTART_KNOBS among them shape the
    data (others are ignored). The cache key holds their resolved values, so defaults
    passed explicitly or left out find the same model; so do
    `moe_experts` (experts per layer) and `moe_aux_loss` (the router load-balancing loss's
    weight in the warm start), MoE only, keyed only when not the default. The
    directory loads with AutoModelForCausalLM / AutoTokenizer. It is written to a
    temporary directory and renamed into place, so a killed build leaves no half model;
    concurrent callers build it once (`build_lock`), the others wait and load it.

    `threads` (`run.threads`): torch threads for the build; 0, every core this process may
    run on (the build is a batch-128 SFT that scales with cores). `verbose`: say what is
    built and how far it got (`build_progress`); the thread count and the steps are written
    beside the weights in `tether_build.json`.
    """
    task_kwargs = task_kwargs or {}
    chain = task_kwargs.get("name") == ChainTask.name
    task_cls = ChainTask if chain else CountdownTask  # the chain task shares Countdown's ALPHABET
    knobs = {k: v for k, v in task_kwargs.items() if k in task_cls.WARMSTART_KNOBS}
    task = task_cls(**knobs, seed=seed)
    key = {k: getattr(task, k) for k in task_cls.WARMSTART_KNOBS}
    if chain:
        key["name"] = ChainTask.name
    for knob, before in (("answer", "expr"), ("rl_share", 0.0)):
        if key.get(knob) == before:  # keyed as before the option existed: cached models stay valid
            del key[knob]
    positions = positions_for(getattr(task, "context", 0))
    arch = {"positions": positions} if positions != MAX_POSITIONS else {}
    if moe and moe_experts != MOE_EXPERTS:
        arch["experts"] = moe_experts
    if moe and moe_aux_loss:
        arch["aux_loss"] = moe_aux_loss
    out = default_model_dir(cache_dir, moe, seed, warmstart_steps, key, arch)
    if (out / "config.json").is_file():
        return out
    with build_lock(out, verbose):  # a second process waits here for the first one's build
        if (out / "config.json").is_file():
            return out
        tokenizer = build_char_tokenizer(ALPHABET)
        model = build_tiny_model(len(tokenizer), moe=moe, seed=seed, experts=moe_experts,
                                 positions=positions)
        before = torch.get_num_threads()
        build_threads = threads or len(os.sched_getaffinity(0))
        torch.set_num_threads(build_threads)
        if verbose:
            print(f"building tether's tiny {'MoE' if moe else 'dense'} model once: "
                  f"{warmstart_steps} warm-start steps on {build_threads} thread(s) -> {out}",
                  flush=True)
        try:
            warm_start(model, tokenizer, task, warmstart_steps, seed=seed,
                       router_aux_loss=moe_aux_loss if moe else 0.0,
                       progress=build_progress(warmstart_steps) if verbose else None)
        finally:
            torch.set_num_threads(before)
        tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".building-"))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "tether_build.json").write_text(json.dumps(
            {"recipe": RECIPE_VERSION, "warmstart_steps": warmstart_steps,
             "threads": build_threads, "torch": torch.__version__}, indent=1))
        tmp.rename(out)  # a killed build leaves no half model
    return out


def build_progress(steps: int) -> Callable[[int, float], None]:
    """The warm start's `progress`: a bar on a terminal; otherwise (a log file, CI) a line
    every `PROGRESS_SHARE` of the steps and at the last, with the mean loss since the
    previous line, the elapsed time and an estimate of what remains."""
    if sys.stdout.isatty():
        from tqdm import tqdm

        bar = tqdm(total=steps, desc="warm start", unit="step", leave=False, file=sys.stdout)

        def on_tty(step: int, loss: float) -> None:
            bar.set_postfix(loss=f"{loss:.4f}", refresh=False)
            bar.update(1)
            if step == steps:
                bar.close()

        return on_tty
    every = max(1, round(steps * PROGRESS_SHARE))
    start, losses = time.perf_counter(), []

    def as_lines(step: int, loss: float) -> None:
        losses.append(loss)
        if step % every and step != steps:
            return
        elapsed = time.perf_counter() - start
        print(f"warm-start step {step}/{steps} loss {sum(losses) / len(losses):.4f} "
              f"{elapsed:.0f} s, about {elapsed / step * (steps - step):.0f} s left",
              flush=True)
        losses.clear()

    return as_lines


@contextmanager
def build_lock(out: Path, verbose: bool) -> Iterator[None]:
    """Hold an exclusive lock on OUT's build (an flock on `.OUT.lock` beside it: released by
    the kernel when its holder dies, so a killed build never blocks the next)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if verbose:
                print(f"waiting for another process building {out}", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
