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

The sections are in gpu_sections.py (the host-sync counter in gpu_syncs.py); this file runs
them. Each section runs in a process of its own, killed at its time limit, so one hang
cannot eat the budget. A section that raises is FAILED and the script exits 1; skips are
fine. Runs and models go to a temporary directory, removed at the end. The tiny models are random-init
(Countdown otherwise as configs/countdown.yaml sets it): their warm start runs on the CPU
and would take minutes. So the probe's figures are a random model's, not comparable to
docs/probe.md's and docs/vllm.md's; for those, run `tether probe --config
configs/countdown.yaml rollout.engine=vllm rollout.precision=bf16` on the GPU machine.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from gpu_sections import (
    Host,
    Skip,
    async_workers,
    device_tests,
    list_device_tests,
    nccl,
    qwen05b,
    routing,
    tiny,
    vllm,
)
from harness import ROOT

SKIPPED = 75  # a section's exit status when it skipped (it printed `SKIP: <reason>`)
BUDGET_S = 450  # the whole script, so it ends within 8 minutes with the interpreter's start


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
