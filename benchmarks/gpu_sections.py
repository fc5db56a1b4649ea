"""The sections of benchmarks/gpu_check.py, each a check of one GPU path of tether, and what
they share: where they run (Host), at which sizes, with which run settings. gpu_check.py
runs each in a process of its own (see its docstring)."""

from __future__ import annotations

import math
import resource
import subprocess
import sys
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpu_syncs import HostSyncs, short
from harness import COUNTDOWN, ROOT, MiB, step_median, timed, train_run

# Dense bf16 peak FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
DEVICE_TESTS = ["tests/test_devices.py", "tests/test_distributed.py", "tests/test_routing_replay.py",
                "tests/test_probe.py", "tests/rollout/test_vllm.py", "tests/rollout/test_vllm_loop.py"]


class Skip(Exception):
    """A section that cannot run here; the message says why."""


@dataclass(frozen=True)
class Sizes:
    prompts: int  # rollout.prompts_per_step
    group: int  # rollout.group_size
    new_tokens: int  # rollout.max_new_tokens
    steps: int  # train.steps of the timed runs (the first is not timed)
    micro_batch: int  # train.micro_batch: 4 micro-batches per step either way
    probe_batches: int  # tether probe --batches


SIZES = {"cuda": Sizes(32, 8, 12, 6, 64, 2),  # the demo's work (configs/countdown.yaml)
         "cpu": Sizes(4, 4, 8, 4, 4, 1)}


@dataclass(frozen=True)
class Host:
    device: str  # cuda or cpu: where the sections put the trainer
    gpus: int
    tmp: Path  # runs and models

    @property
    def sizes(self) -> Sizes:
        return SIZES[self.device]


def overrides(host: Host, name: str, *extra: str) -> list[str]:
    """The sections' shared settings (host.sizes, no evaluation beyond step 0 and the end,
    no monitor), with runs and models under host.tmp; then `extra`."""
    s = host.sizes
    return [f"run.dir={host.tmp / name}", f"run.device={host.device}",
            f"model.cache_dir={host.tmp / 'models'}", "model.warmstart_steps=0",
            f"rollout.prompts_per_step={s.prompts}", f"rollout.group_size={s.group}",
            f"rollout.max_new_tokens={s.new_tokens}", f"train.steps={s.steps}",
            f"train.micro_batch={s.micro_batch}", "task.eval_size=16", "eval.every=0",
            "eval.samples=0", "diagnostics.monitor_every=0", "run.checkpoint_every=0",
            "run.progress=false", *extra]


def train_rows(host: Host, name: str, *extra: str) -> list[dict]:
    """A `tether train` run of the shared settings plus `extra`, in this process; its rows."""
    return train_run(overrides(host, name, *extra), host.tmp / name).rows


def peak_memory(host: Host) -> str:
    """Since the last reset: torch's max_memory_allocated on a GPU; on CPU the process's
    resident-set high-water mark (since it started, so it holds every earlier run's)."""
    if host.device == "cuda":
        import torch

        return f"peak GPU memory {torch.cuda.max_memory_allocated() / MiB:,.0f} MiB"
    return f"max RSS of the process so far {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB"


def reset_peak(host: Host) -> None:
    if host.device == "cuda":
        import torch

        torch.cuda.reset_peak_memory_stats()


# -- the sections ---------------------------------------------------------------------------


def list_device_tests() -> list[str]:
    """Print DEVICE_TESTS, marking those missing; the ones there."""
    there = [f for f in DEVICE_TESTS if (ROOT / f).is_file()]
    print("test files:", " ".join(f if f in there else f"{f} (not there)" for f in DEVICE_TESTS))
    return there


def device_tests(host: Host) -> None:
    there = list_device_tests()
    # pytest's output streams through (its last line: the counts), so a kill at the time
    # limit still shows how far it got.
    rc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                         *there], check=False, cwd=ROOT).returncode
    if rc != 0:
        raise RuntimeError(f"pytest exited {rc}")


def tiny(host: Host) -> None:
    sites = None
    for precision in ("fp32", "bf16"):
        reset_peak(host)
        rows = train_rows(host, f"tiny-{precision}", f"train.precision={precision}")
        s = host.sizes
        print(f"{precision}: {step_median(rows):.3f} s/step (median of steps 2-{s.steps}; "
              f"{s.prompts} x {s.group} rows, <= {s.new_tokens} new tokens), {peak_memory(host)}")
        sites = host_syncs(host, precision, sites)


def host_syncs(host: Host, precision: str, before: Counter[str] | None) -> Counter[str]:
    """Host syncs of one training step (`tether.step.train_step` on a fresh batch, after an
    uncounted one), per micro-batch: by kind, and by the line of tether that made them
    unless those are `before`'s. On a GPU another step runs under torch's sync debug mode
    (apart: under the dispatch mode every warning would point at the mode's own line)."""
    import warnings

    import torch

    from tether.config import load_config
    from tether.rollout.worker import rewarded_rollouts
    from tether.run import build_run
    from tether.scoring import collate
    from tether.setup import build_generator
    from tether.step import old_logprobs, train_step
    from tether.weights.snapshots import SnapshotStore

    cfg = load_config(COUNTDOWN, overrides(host, f"syncs-{precision}", f"train.precision={precision}"))
    run = build_run(cfg)
    trainer, tok, r = run.trainer, run.tokenizer, cfg.rollout
    generator = build_generator(cfg, run.model, run.model_path, tok)
    snapshots = SnapshotStore(run.model)

    def step(i: int, around: Any) -> int:
        """Step `i` of the loop's work, its training step inside `around`; its rows."""
        rollouts = rewarded_rollouts(generator, tok, run.task, run.reward_fn,
                                     [i * r.prompts_per_step + j for j in range(r.prompts_per_step)],
                                     run.sampling, seed=run.sampling_seed(i))
        batch = collate(rollouts, tok.pad_token_id, run.model.device)
        old, batch = old_logprobs(trainer, batch, snapshots)
        with around:
            train_step(trainer, batch, rollouts, old, cfg.train.adv_std_norm)
        generator.load_weights(run.model.state_dict(), trainer.version)
        return batch.input_ids.shape[0]

    counter = HostSyncs(host.device == "cuda")
    try:
        step(0, nullcontext())
        rows = step(1, counter)
        micro = cfg.train.minibatches * math.ceil(rows / cfg.train.minibatches / cfg.train.micro_batch)
        print(f"  host syncs of one training step ({micro} micro-batches of {cfg.train.micro_batch} "
              f"rows), counted op by op: {counter.total} = {counter.total / micro:.1f} per "
              "micro-batch; by kind: " + ", ".join(f"{k} {n}" for k, n in counter.kinds.most_common()))
        if counter.sites == before:
            print("    at the same lines as above")
        else:
            for site, n in counter.sites.most_common():
                print(f"    {n:3d}  {site}")
            print(f"    (not counted: {sum(counter.left_out.values())} .item() of AdamW's step "
                  "counters in torch.optim, host tensors on a GPU too)")
        if host.device == "cuda":
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    step(2, nullcontext())
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            syncs = Counter(f"{short(w.filename)}:{w.lineno}" for w in caught
                            if "synchroniz" in str(w.message))
            total = sum(syncs.values())
            print(f"  torch.cuda sync debug mode, the next step: {total} syncs = "
                  f"{total / micro:.1f} per micro-batch; at " +
                  ", ".join(f"{k} x{n}" for k, n in syncs.most_common()))
        elif before is None:
            print("    (CPU: .tolist() and .cpu() dispatch no op on a host tensor; they are "
                  "counted by wrapping them. A count op by op can miss a sync inside a kernel "
                  "or count one that a GPU run keeps on the host; on a GPU the sync debug mode "
                  "counts the real ones)")
    finally:
        generator.close()
    return counter.sites


def qwen05b(host: Host) -> None:
    """A bf16 Trainer step (forward, backward, AdamW) of a random Qwen2-0.5B-shaped model on
    16 rows of 256 prompt + 256 response tokens, every prompt distinct (no shared-prompt
    saving), so the 6 * params * tokens FLOP estimate holds."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from tether.config import TrainConfig
    from tether.rollout.types import Rollout, SamplingParams
    from tether.scoring import collate
    from tether.trainer import Trainer, group_advantages

    config = Qwen2Config(vocab_size=151936, hidden_size=896, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864,
                         max_position_embeddings=4096, tie_word_embeddings=True, pad_token_id=0,
                         eos_token_id=1)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config)
    params = sum(p.numel() for p in model.parameters())
    rows, prompt, response = 16, 256, 256
    sampling = SamplingParams(n=2, temperature=1.0, max_new_tokens=response)
    trainer = Trainer(model, TrainConfig(precision="bf16", micro_batch=rows), sampling)
    g = torch.Generator().manual_seed(0)
    rollouts = [Rollout(prompt_id=str(i), group_id=i // 2,
                        prompt_ids=torch.randint(2, config.vocab_size, (prompt,), generator=g).tolist(),
                        response_ids=torch.randint(2, config.vocab_size, (response,), generator=g).tolist(),
                        logp_rollout=[-12.0] * response, version=0, engine="synthetic",
                        precision="bf16", finish_reason="length", reward=float(i % 2))
                for i in range(rows)]
    batch = collate(rollouts, 0, "cuda")
    advantages = group_advantages(batch.rewards, batch.group_ids, True)
    torch.cuda.reset_peak_memory_stats()
    seconds = timed(lambda: trainer.train_on(batch, advantages, None, None), 3, warmup=1,
                    device="cuda").median
    tokens = rows * (prompt + response)
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    share = f"{6 * params * tokens / seconds / peak:.1%} of {name}'s {peak / 1e12:.0f} TFLOP/s" \
        if peak else f"unknown ({name} is not in the peak table)"
    print(f"{params / 1e6:.0f} M params, {rows} x {prompt + response} tokens: {seconds:.3f} s/step, "
          f"{tokens / seconds:,.0f} tokens/s, 6*N*D FLOP/s = {share}; "
          f"{peak_memory(host)}")


def routing(host: Host) -> None:
    from tether.config import load_config
    from tether.probe import probe

    moe = ("model.moe=true", "rollout.precision=bf16", "rollout.router_noise=0.1")
    cfg = load_config(COUNTDOWN, overrides(host, "probe-moe", *moe))
    run = timed(lambda: probe(cfg, host.sizes.probe_batches))
    print(f"$ tether probe {' '.join(moe)}   # {run.total:.1f} s with the model build")
    print(run.result.format())
    for replay in ("r2", "r3"):
        rows = train_rows(host, f"replay-{replay}", *moe, "train.steps=2",
                         f"train.routing_replay={replay}")
        last = rows[-1]
        print(f"routing replay {replay}: {len(rows) - 1} steps done, {step_median(rows):.3f} "
              f"s/step; last step: numerical k3 {last.get('numerical/k3_kl/mean', float('nan')):.2e}, "
              f"routing disagreement {last.get('numerical/routing_disagreement/mean', float('nan')):.2%}")


def async_workers(host: Host) -> None:
    rows = train_rows(host, "async", "loop.mode=async", "loop.workers=2")
    last = rows[-1]
    print(f"loop.mode=async loop.workers=2: {step_median(rows):.3f} s/step (median of steps "
          f"2-{len(rows) - 1}), {last['async/samples_per_s']:.1f} samples/s, mean staleness "
          f"{last['staleness/versions/mean']:.2f} versions")


def vllm(host: Host) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means it cannot run here
        raise Skip(f"vllm does not import: {type(e).__name__}: {e}".splitlines()[0]) from None
    from tether.config import load_config
    from tether.probe import probe

    cfg = load_config(COUNTDOWN, overrides(host, "probe-vllm", "rollout.engine=vllm",
                                           "rollout.precision=bf16"))
    run = timed(lambda: probe(cfg, host.sizes.probe_batches))
    result = run.result
    print(f"$ tether probe rollout.engine=vllm rollout.precision=bf16   # "
          f"{run.total:.1f} s with the engine's start")
    print(result.format())
    print(f"vLLM bf16 vs the fp32 trainer at equal weights: numerical k3 {result.numerical['k3']:.2e}")


def nccl(host: Host) -> None:
    rows = train_rows(host, "nccl", "train.world_size=2", "train.dist_backend=nccl", "train.steps=4")
    print(f"train.world_size=2 over nccl: {len(rows) - 1} steps done, "
          f"{step_median(rows):.3f} s/step")
