"""What every benchmark shares: how a call is timed and its median taken, which model a
benchmark runs, how many threads torch gets, and a training run's rows.

Benchmarks run as `python benchmarks/X.py`, so this folder is on sys.path and they import
it as `harness`. Nothing here imports torch or tether at module level, so a benchmark can
set its environment (OMP_NUM_THREADS) before either loads.

Timing: `timed(fn, repeats, warmup, device)` calls `fn` `warmup` times untimed, then
`repeats` times timed, each call between two syncs of `device` (on a GPU the work a call
queued counts in that call); `.median` is the figure the benchmarks report, `.total` their
sum (throughput over several calls), `.result` the last call's return value.
`interleaved(cases, repeats)` times several cases round by round, so a drift of the machine
hits each alike. `step_median(rows)` is the same median over a training run's logged steps.
"""

from __future__ import annotations

import platform
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COUNTDOWN = ROOT / "configs" / "countdown.yaml"  # the demo's config: its model, task and work
MiB = 2 ** 20
# Qwen3 shapes of the random models: name -> (hidden, layers, heads, kv heads, intermediate).
SIZES = {
    "tiny": (192, 4, 4, 2, 768),
    "20M": (384, 8, 6, 2, 1536),
    "100M": (768, 12, 12, 4, 3072),
}


# -- timing ---------------------------------------------------------------------------------

@dataclass
class Timing:
    """The wall seconds of the timed calls (warm-up calls left out) and the last result."""

    times: list[float] = field(default_factory=list)
    result: Any = None

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def total(self) -> float:
        return sum(self.times)


def sync(device: Any) -> None:
    """Wait for the work queued on `device` (a CUDA device); nothing for the CPU or None."""
    if device is None:
        return
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[..., Any], repeats: int = 1, warmup: int = 0, device: Any = None,
          setup: Callable[[], Any] | None = None) -> Timing:
    """`warmup` untimed calls of `fn()`, then `repeats` timed ones, each between two syncs
    of `device`. `setup`: called untimed before each call, its result passed to `fn`."""
    out = Timing()
    for i in range(warmup + repeats):
        args = () if setup is None else (setup(),)
        sync(device)
        t0 = time.perf_counter()
        out.result = fn(*args)
        sync(device)
        if i >= warmup:
            out.times.append(time.perf_counter() - t0)
    return out


def interleaved(cases: dict[str, Callable[[], Any]], repeats: int,
                device: Any = None) -> dict[str, Timing]:
    """Each case timed `repeats` times, one call of every case a round."""
    out = {name: Timing() for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            t = timed(fn, device=device)
            out[name].times += t.times
            out[name].result = t.result
    return out


def step_median(rows: list[dict], key: str = "time/step") -> float:
    """Median of `key` over a run's step rows after the first (row 0 is step 0's
    evaluation; the first step warms up)."""
    values = [r[key] for r in rows[1:] if key in r]
    return statistics.median(values[1:] or values)


# -- the machine, the threads ---------------------------------------------------------------

def use_threads(n: int) -> str:
    """Run torch on `n` threads in this process; return the config override that gives a
    training run (and a default model's first build) the same: `run.threads=n`."""
    import torch

    torch.set_num_threads(n)
    return f"run.threads={n}"


def device_name(device: Any = None) -> str:
    """The CPU's model name (None or a CPU device) or the GPU's."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# -- the model ------------------------------------------------------------------------------

def model_path(path: str | None = None, *overrides: str, config: Path | None = COUNTDOWN) -> str:
    """The model directory a benchmark runs: `path` when given, else the one `tether train
    --config CONFIG OVERRIDES` trains (tether's tiny model, built and warm-started on first
    use, then cached). `config` None: `tether train` with no config file."""
    if path:
        return path
    from tether.config import load_config
    from tether.setup import resolve_model_path

    return str(resolve_model_path(load_config(config, list(overrides))))


def random_model(size: str | tuple[int, int, int, int, int], vocab: int, device: Any = "cpu",
                 tied: bool | None = None):
    """A Qwen3-shaped model with random weights (seed 0), fp32, on `device`: `size` a name of
    SIZES or its tuple; head dim 64, 256 positions, sdpa attention; embeddings tied when
    `tied`, by default when the vocabulary is under 1,000."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    hidden, layers, heads, kv, inter = SIZES[size] if isinstance(size, str) else size
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=64,
                         intermediate_size=inter, max_position_embeddings=256,
                         tie_word_embeddings=vocab < 1000 if tied is None else tied,
                         pad_token_id=0, eos_token_id=1)
    config._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(config).float().to(device)


# -- training runs --------------------------------------------------------------------------

@dataclass
class Run:
    cfg: Any  # the run's tether Config
    rows: list[dict]  # its metrics.jsonl, row 0 (step 0's evaluation) included
    wall_s: float  # train()'s wall time, start-up included


def train_run(overrides: Iterable[str], keep: Path | str | None = None,
              config: Path | None = COUNTDOWN) -> Run:
    """`tether train` in this process on `config` with `overrides`, writing to `keep` (left
    there) or else to a temporary directory (removed)."""
    from tether.config import load_config
    from tether.logger import read_jsonl
    from tether.loops import train

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(keep) if keep else Path(tmp) / "run"
        cfg = load_config(config, [*overrides, f"run.dir={run_dir}"])
        t0 = time.perf_counter()
        result = train(cfg)
        wall = time.perf_counter() - t0
        rows = read_jsonl(result.run_dir / "metrics.jsonl")
    return Run(cfg, rows, wall)
