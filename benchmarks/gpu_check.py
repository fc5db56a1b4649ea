"""The GPU paths of tether in one run: what works on the device, and what it costs there.

    bash benchmarks/gpu_check.sh                          # every section, 1-3 minutes on CPU
    bash benchmarks/gpu_check.sh --only tiny,async        # some sections (names below)

Meant for a machine with one GPU (H200-class), where it takes under 8 minutes; its output
is meant to be pasted into docs/performance.md. On a CPU-only machine (CI) it runs what it
can at the smallest settings and prints, for the rest, `SKIP: <reason>`. Sections:

1. tests     the test files that exercise devices, under pytest on the GPU
2. tiny      tether's tiny model trained in fp32 then bf16: s/step, peak memory, and the host
             syncs per micro-batch of one training step (counted op by op; on a GPU also
             torch's own sync warnings)
3. qwen05b   a bf16 step of a random Qwen2-shaped 0.5B model through the Trainer: tokens/s
             and the share of the GPU's peak bf16 FLOP/s
4. routing   `tether probe` on the MoE tiny model with router noise; short runs with
             routing replay r2 and r3
5. async     loop.mode=async with two rollout workers: s/step
6. vllm      `tether probe` with rollout.engine=vllm in bf16: numerical k3 against the trainer
7. nccl      two trainer ranks over nccl (needs two GPUs)

Each section runs in a process of its own, killed at its time limit, so one hang cannot eat
the budget. A section that raises is FAILED and the script exits 1; skips are fine. Runs
and models go to a temporary directory, removed at the end. The tiny models are random-init
(Countdown otherwise as configs/countdown.yaml sets it): their warm start runs on the CPU
and would take minutes. So the probe's figures are a random model's, not comparable to
docs/probe.md's and docs/vllm.md's; for those, run `tether probe --config
configs/countdown.yaml rollout.engine=vllm rollout.precision=bf16` on the GPU machine.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "countdown.yaml"
SKIPPED = 75  # a section's exit status when it skipped (it printed `SKIP: <reason>`)
BUDGET_S = 450  # the whole script, so it ends within 8 minutes with the interpreter's start
MiB = 2 ** 20
# Dense bf16 peak FLOP/s (no sparsity), by a substring of torch.cuda.get_device_name().
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12}
# Ops that make the host wait for their result, each with its label.
SCALAR_OPS = {"_local_scalar_dense": ".item()/int/float/bool", "is_nonzero": ".item()/int/float/bool",
              "equal": "torch.equal", "nonzero": "nonzero", "masked_select": "masked_select"}
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


# -- measuring ------------------------------------------------------------------------------


class HostSyncs:
    """Counts the ops that make the host wait for a CUDA device, op by op (a dispatch mode,
    so it works without a GPU): `.item()`/int/float/bool of a tensor, nonzero, masked_select,
    unique, indexing with a boolean mask (it calls nonzero), repeat_interleave without
    output_size, and device-to-host copies (`.tolist()` and `.cpu()` of a device tensor).

    On a GPU an op whose tensors are all on the host is no sync and is not counted. On a CPU
    every tensor is on the host: the ops torch.optim calls are left out (AdamW's step
    counters, host tensors on a GPU too), and `.tolist()` and `.cpu()`, which dispatch no op
    on a host tensor, are counted by wrapping them for the block."""

    def __init__(self, on_gpu: bool):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                kind = counter.kind(func, args, kwargs)
                if kind is not None:
                    counter.record(kind)
                return func(*args, **kwargs)

        self.mode, self.on_gpu = Mode(), on_gpu
        self.kinds: Counter[str] = Counter()
        self.sites: Counter[str] = Counter()
        self.left_out: Counter[str] = Counter()  # host-side ops that are no sync on a GPU

    def __enter__(self) -> Self:
        import torch

        self.saved = {} if self.on_gpu else {m: getattr(torch.Tensor, m) for m in ("tolist", "cpu")}
        for method, original in self.saved.items():
            setattr(torch.Tensor, method, self.wrap(f".{method}()", original))
        self.mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        self.mode.__exit__(*exc)
        for method, original in self.saved.items():
            setattr(torch.Tensor, method, original)

    def wrap(self, kind: str, original: Callable) -> Callable:
        def counted(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            self.record(kind)
            return original(tensor, *args, **kwargs)

        return counted

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def kind(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """The sync this op makes on a GPU (a short label), or None."""
        import torch

        name, overload = func._schema.name.removeprefix("aten::"), func._overloadname
        bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
        tensors = [t for v in bound.values() for t in (v if isinstance(v, list | tuple) else [v])
                   if isinstance(t, torch.Tensor)]
        on_device = any(t.device.type != "cpu" for t in tensors)
        if self.on_gpu and not on_device:
            return None
        if name in SCALAR_OPS:
            return SCALAR_OPS[name]
        if name.lstrip("_").startswith("unique"):
            return "unique"
        if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
            masks = [t for t in bound.get("indices") or [] if isinstance(t, torch.Tensor)
                     and t.dtype in (torch.bool, torch.uint8)]
            return f"{name.strip('_')} with a boolean mask" if masks else None
        if name == "repeat_interleave" and overload != "self_int" and bound.get("output_size") is None:
            return "repeat_interleave"
        if name == "_to_copy":
            src, dst = bound["self"].device, bound.get("device")
            return "device->host copy" if src.type != "cpu" and dst is not None and \
                torch.device(dst).type == "cpu" else None
        if name == "copy_":
            return "device->host copy" if bound["self"].device.type == "cpu" and \
                bound["src"].device.type != "cpu" else None
        return None

    def record(self, kind: str) -> None:
        """Count one sync at the innermost line of tether that led to it (the caller's
        frame is two up: under the mode or a wrapper)."""
        import torch

        frame, site, optim = sys._getframe(2), None, package_dir("torch.optim")
        while frame is not None:
            path = frame.f_code.co_filename
            if path.startswith(optim):
                self.left_out[kind] += 1
                return
            if site is None and path.startswith(package_dir("tether")):
                site = f"{short(path)}:{frame.f_lineno}"
            frame = frame.f_back
        node = torch._C._current_autograd_node()
        where = " ".join(filter(None, [site, node and f"(backward, {node.name()})"])) or "?"
        self.kinds[kind] += 1
        self.sites[f"{where}: {kind}"] += 1


def package_dir(name: str) -> str:
    """Where package `name`'s files are, ending in a separator."""
    return str(Path(importlib.import_module(name).__file__).parent) + os.sep


def short(path: str) -> str:
    """A source path from its package on: tether/trainer/core.py, torch/nn/utils/clip_grad.py."""
    for package in ("tether", "torch"):
        root = package_dir(package)
        if path.startswith(root):
            return f"{package}/{Path(path).relative_to(root).as_posix()}"
    return Path(path).name


def median_after_first(rows: list[dict], key: str = "time/step") -> float:
    """Median of `key` over a run's step rows after the first (row 0 is step 0's evaluation)."""
    values = [r[key] for r in rows[1:] if key in r]
    return statistics.median(values[1:] or values)


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


def train_run(host: Host, name: str, *extra: str) -> list[dict]:
    """A `tether train` run of the shared settings plus `extra`, in this process; its rows."""
    from tether.config import load_config
    from tether.logger import read_jsonl
    from tether.loops import train

    result = train(load_config(CONFIG, overrides(host, name, *extra)))
    return read_jsonl(result.run_dir / "metrics.jsonl")


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
        rows = train_run(host, f"tiny-{precision}", f"train.precision={precision}")
        s = host.sizes
        print(f"{precision}: {median_after_first(rows):.3f} s/step (median of steps 2-{s.steps}; "
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
    from tether.setup import build_generator
    from tether.step import old_logprobs, train_step
    from tether.trainer import collate
    from tether.weights import SnapshotStore

    cfg = load_config(CONFIG, overrides(host, f"syncs-{precision}", f"train.precision={precision}"))
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
    from tether.trainer import Trainer, collate, group_advantages

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
    times = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(4):  # the first warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        trainer.train_on(batch, advantages, None, None)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    seconds = statistics.median(times[1:])
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
    t0 = time.perf_counter()
    result = probe(load_config(CONFIG, overrides(host, "probe-moe", *moe)), host.sizes.probe_batches)
    print(f"$ tether probe {' '.join(moe)}   # {time.perf_counter() - t0:.1f} s with the model build")
    print(result.format())
    for replay in ("r2", "r3"):
        rows = train_run(host, f"replay-{replay}", *moe, "train.steps=2",
                         f"train.routing_replay={replay}")
        last = rows[-1]
        print(f"routing replay {replay}: {len(rows) - 1} steps done, {median_after_first(rows):.3f} "
              f"s/step; last step: numerical k3 {last.get('numerical/k3_kl/mean', float('nan')):.2e}, "
              f"routing disagreement {last.get('numerical/routing_disagreement/mean', float('nan')):.2%}")


def async_workers(host: Host) -> None:
    rows = train_run(host, "async", "loop.mode=async", "loop.workers=2")
    last = rows[-1]
    print(f"loop.mode=async loop.workers=2: {median_after_first(rows):.3f} s/step (median of steps "
          f"2-{len(rows) - 1}), {last['async/samples_per_s']:.1f} samples/s, mean staleness "
          f"{last['staleness/versions/mean']:.2f} versions")


def vllm(host: Host) -> None:
    try:
        import vllm  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means it cannot run here
        raise Skip(f"vllm does not import: {type(e).__name__}: {e}".splitlines()[0]) from None
    from tether.config import load_config
    from tether.probe import probe

    t0 = time.perf_counter()
    result = probe(load_config(CONFIG, overrides(host, "probe-vllm", "rollout.engine=vllm",
                                                 "rollout.precision=bf16")),
                   host.sizes.probe_batches)
    print(f"$ tether probe rollout.engine=vllm rollout.precision=bf16   # "
          f"{time.perf_counter() - t0:.1f} s with the engine's start")
    print(result.format())
    print(f"vLLM bf16 vs the fp32 trainer at equal weights: numerical k3 {result.numerical['k3']:.2e}")


def nccl(host: Host) -> None:
    rows = train_run(host, "nccl", "train.world_size=2", "train.dist_backend=nccl", "train.steps=4")
    print(f"train.world_size=2 over nccl: {len(rows) - 1} steps done, "
          f"{median_after_first(rows):.3f} s/step")


@dataclass(frozen=True)
class Section:
    title: str
    run: Callable[[Host], None]
    limit_s: dict[str, int]  # by host.device
    needs: Callable[[Host], str | None] = lambda host: None  # a skip reason, checked up front


def tests_plan(host: Host) -> str | None:
    if host.device == "cuda":
        return None
    list_device_tests()
    return "the suite runs them on CPU already (make test)"


SECTIONS = {
    "tests": Section("device tests", device_tests, {"cuda": 170, "cpu": 0}, tests_plan),
    "tiny": Section("tiny model, fp32 and bf16 training", tiny, {"cuda": 75, "cpu": 120}),
    "qwen05b": Section("a bf16 step of a 0.5B-shaped random model", qwen05b, {"cuda": 60, "cpu": 0},
                       lambda h: None if h.device == "cuda" else
                       "needs a GPU: a 0.5B step is too slow on CPU cores"),
    "routing": Section("probe, routing replay, router noise (MoE tiny model)", routing,
                       {"cuda": 60, "cpu": 150}),
    "async": Section("async with two workers", async_workers, {"cuda": 90, "cpu": 150}),
    "vllm": Section("vLLM on the device vs the trainer at equal weights", vllm,
                    {"cuda": 120, "cpu": 150},
                    lambda h: None if importlib.util.find_spec("vllm") else
                    "vllm is not installed (make install-vllm; on a GPU pip install -e '.[vllm]')"),
    "nccl": Section("two trainer ranks over nccl", nccl, {"cuda": 60, "cpu": 0},
                    lambda h: None if h.gpus >= 2 else
                    f"needs two GPUs (torch sees {h.gpus}); tests/test_distributed.py runs two "
                    "ranks over gloo on CPU"),
}


# -- running them ---------------------------------------------------------------------------


def child(name: str, host: Host) -> int:
    """Run one section in this process: 0 ran, SKIPPED, or 1 (the traceback on stderr)."""
    from tether.models import quiet_transformers

    quiet_transformers()
    try:
        SECTIONS[name].run(host)
    except Skip as e:
        print(f"SKIP: {e}")
        return SKIPPED
    except Exception:  # noqa: BLE001 - reported as FAILED by the parent
        traceback.print_exc()
        return 1
    return 0


def spawn(name: str, host: Host, limit_s: float) -> tuple[str, str]:
    """Run section `name` in its own process group, killed after `limit_s`; (status, detail).
    Its stdout streams through; its stderr is kept and shown only when it fails."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
           "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs to stdout, dozens of warnings
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen([sys.executable, __file__, "--child", name, "--device", host.device,
                                 "--gpus", str(host.gpus), "--tmp", str(host.tmp)],
                                cwd=ROOT, env=env, stderr=err, start_new_session=True)
        rc = None
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            pass
        finally:  # the section's own children (rollout workers, ranks, vLLM) go with it
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if rc in (0, SKIPPED):
            return ("ran" if rc == 0 else "skipped"), ""
        err.seek(0)
        print("\n".join(err.read().strip().splitlines()[-25:]))
        detail = f"timed out after {limit_s:.0f} s" if rc is None else f"exit status {rc}"
        print(f"FAILED: {detail}", flush=True)
        return "FAILED", detail


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", help=f"comma-separated sections, of: {','.join(SECTIONS)}")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--gpus", type=int, help=argparse.SUPPRESS)
    p.add_argument("--tmp", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        sys.exit(child(args.child, Host(args.device, args.gpus, Path(args.tmp))))
    names = args.only.split(",") if args.only else list(SECTIONS)
    if unknown := [n for n in names if n not in SECTIONS]:
        p.error(f"unknown section(s) {unknown}; choose from {list(SECTIONS)}")

    import torch

    gpus = torch.cuda.device_count()
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix="tether-gpu-check-"))
    host = Host("cuda" if gpus else "cpu", gpus, tmp)
    print(f"tether GPU check: torch {torch.__version__}, "
          + (f"{gpus} x {torch.cuda.get_device_name()}" if gpus else "no GPU (CPU only)")
          + f", {os.cpu_count()} CPUs; device {host.device}, settings {host.sizes}", flush=True)
    results = []
    try:
        for name in names:
            section = SECTIONS[name]
            print(f"\n== {list(SECTIONS).index(name) + 1}. {section.title} [{name}] ==", flush=True)
            t0 = time.perf_counter()
            left = BUDGET_S - (t0 - start)
            if reason := section.needs(host):
                print(f"SKIP: {reason}")
                status, detail = "skipped", ""
            elif left < 20:
                print(f"SKIP: the script's {BUDGET_S} s budget is spent")
                status, detail = "skipped", "out of time"
            else:
                status, detail = spawn(name, host, min(section.limit_s[host.device], left))
            results.append((name, status, detail, time.perf_counter() - t0))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\n== summary ({host.device}, {time.perf_counter() - start:.0f} s) ==")
    for name, status, detail, seconds in results:
        print(f"{name:8s} {status:8s} {seconds:6.1f} s  {detail}".rstrip())
    sys.exit(1 if any(status == "FAILED" for _, status, _, _ in results) else 0)


if __name__ == "__main__":
    main()
