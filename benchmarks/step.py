"""A synchronous training step, phase by phase: where the time, the memory and the FLOPs go.

    .venv/bin/python benchmarks/step.py                       # all sections, about 6 minutes here
    .venv/bin/python benchmarks/step.py --only breakdown      # or: peak, scaling, vocab
    .venv/bin/python benchmarks/step.py --precision bf16      # the trainer under bf16 autocast
    .venv/bin/python benchmarks/step.py --device cuda         # the same step on a GPU

Sections, all measured in this one run on the same threads:
- peak: this machine's matrix-multiply rate, fp32 and bf16, on the shape of the tiny
  model's largest product and on a 1024^3 square (median of repeats).
- breakdown: issue 15's work (tether's tiny model, Countdown, 32 prompts x 8, at most 12
  new tokens, temperature 1, `grpo`) through tether's own functions, phase by phase:
  generate, old-logprob (scored even where the loop would reuse the training forward, to
  show what it costs when needed), train (forward + backward + optimizer, of which the
  estimator's loss and backward on the same (B, T) tensors is timed apart), and sync (the
  engine loading the new weights). Per phase: time, positions per second, peak memory
  above the phase's start. The training phase's FLOPs are counted by torch's
  FlopCounterMode and divided by its time: the achieved rate against the peak.
- scaling: old-logprob and train time of synthetic batches over batch size, group size,
  response length and model size (the tiny model, about 20 M and about 100 M parameters,
  random weights), and generation time of exactly T tokens per row: where cost is linear.
- vocab: a Qwen3-shaped model with a 152k vocabulary (random weights) trains a step; each
  size runs in a fresh process, and its peak memory is set against the formula of
  docs/performance.md, whose one fitted constant comes from a 32k-vocabulary run.

Peak memory of a phase is the most tensor memory it held at once above what existed before
it: on a CPU counted op by op (`LiveBytes`, a pass of its own, as it slows every op), on a
GPU torch's max_memory_allocated. The vocab section reports the process's resident set
(its kernel high-water mark), which also counts what is not a tensor.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import weakref
from contextlib import contextmanager, nullcontext
from pathlib import Path

import psutil
import torch
from harness import COUNTDOWN, MiB, device_name, random_model, timed, use_threads
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from tether.config import TrainConfig, load_config
from tether.estimators import TokenBatch
from tether.rollout.hf import HFGenerator, sample_tokens
from tether.rollout.types import Rollout, SamplingParams
from tether.rollout.worker import rewarded_rollouts
from tether.run import build_run
from tether.scoring import collate, score_batch, token_logprobs
from tether.step import OldLogprobs, train_step
from tether.trainer import Trainer

WORK = {"prompts": 32, "group": 8, "max_new_tokens": 12}


# -- measuring ------------------------------------------------------------------------------

class LiveBytes(TorchDispatchMode):
    """The most bytes of tensor storage created inside the block and alive at once.

    A storage counts from the op that creates it (an output whose storage is none of the
    op's inputs': not a view, not in place) until it is freed (a weakref finalizer)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen = 0, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key in inputs or key in self.seen or storage.nbytes() == 0:
                continue
            self.seen.add(key)
            self.live += storage.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self.seen.discard(key)
        self.live -= nbytes


@contextmanager
def peak_memory(device: torch.device, out: dict):
    """out["peak_mib"]: the most tensor memory the block held above its start."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        yield
        out["peak_mib"] = (torch.cuda.max_memory_allocated(device) - start) / MiB
        return
    with LiveBytes() as probe:
        yield
    out["peak_mib"] = probe.peak / MiB


def matmul_rate(m: int, k: int, n: int, dtype: torch.dtype, device: torch.device) -> float:
    """GFLOP/s of an (m, k) @ (k, n) product in `dtype`."""
    a = torch.randn(m, k, device=device).to(dtype)
    b = torch.randn(k, n, device=device).to(dtype)
    a @ b
    repeats = max(3, int(2e10 / (2 * m * k * n)))
    seconds = timed(lambda: [a @ b for _ in range(repeats)], 3, device=device).median
    return 2 * m * k * n * repeats / seconds / 1e9


def peak_rates(device: torch.device) -> dict[str, float]:
    """fp32 and bf16 matrix-multiply rates: the tiny model's MLP product over 5,120 positions
    (the breakdown's training batch) and a 1024^3 square."""
    out = {}
    for dtype, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        out[f"{name}_model_shape"] = matmul_rate(5120, 192, 768, dtype, device)
        out[f"{name}_square"] = matmul_rate(1024, 1024, 1024, dtype, device)
    return out


# -- the breakdown --------------------------------------------------------------------------

def estimator_seconds(trainer: Trainer, batch, device: torch.device, repeats: int = 20) -> float:
    """The estimator's loss, metrics and backward on leaf (B, T) log-probs of the batch's
    shape: its share of the step, nothing of the model's."""
    B, T = batch.response_ids.shape
    mask = batch.response_mask.bool()
    logp = (batch.logp_rollout + 0.01 * torch.randn(B, T, device=device)).requires_grad_()
    tb = TokenBatch(logp=logp, logp_old=batch.logp_rollout.clone(), logp_rollout=batch.logp_rollout,
                    advantages=torch.randn(B, device=device), mask=mask,
                    topk_ids=batch.topk_ids, topk_logp_rollout=batch.topk_logp_rollout,
                    topk_logp=None if batch.topk_ids is None else
                    batch.topk_logp_rollout.clone().requires_grad_(),
                    topk_logp_old=batch.topk_logp_rollout)

    def run():
        logp.grad = None
        trainer.estimator(tb).loss.backward()

    return timed(run, repeats, warmup=1, device=device).median


def forward_backward(trainer: Trainer, batch) -> None:
    """The training forward and backward of every micro-batch, as `Trainer._step` runs them."""
    trainer.model.train()
    mb = trainer.cfg.micro_batch
    for i in range(0, batch.input_ids.shape[0], mb):
        micro = batch.select(slice(i, i + mb))
        logp, _ = token_logprobs(trainer.model, micro, trainer.sampling, trainer.cfg.precision)
        (logp * micro.response_mask).sum().backward()
    trainer.model.zero_grad(set_to_none=True)


def breakdown(args, device: torch.device, peaks: dict[str, float]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(COUNTDOWN, [
            f"rollout.prompts_per_step={WORK['prompts']}", f"rollout.group_size={WORK['group']}",
            f"rollout.max_new_tokens={WORK['max_new_tokens']}", "rollout.temperature=1.0",
            "train.estimator=grpo", "task.format_weight=0.0", f"train.precision={args.precision}",
            f"run.device={device}", use_threads(args.threads), f"run.dir={tmp}/run",
            "run.progress=false"])
        run = build_run(cfg)
    model, trainer = run.model, run.trainer
    generator = HFGenerator(model, run.tokenizer.eos_token_id, run.tokenizer.pad_token_id)

    def phases(step: int, measure=lambda name: nullcontext()) -> dict:
        """One step, phase by phase; `measure(phase)` wraps each phase."""
        idx = [step * WORK["prompts"] + i for i in range(WORK["prompts"])]
        with measure("generate"):
            gen = timed(lambda: rewarded_rollouts(
                generator, run.tokenizer, run.task, run.reward_fn, idx, run.sampling,
                seed=run.sampling_seed(step)), device=device)
        rollouts = gen.result
        batch = collate(rollouts, run.tokenizer.pad_token_id, device)
        with measure("old_logprob"):
            t_old = timed(lambda: trainer.score_old(batch, model), device=device).median
        t_fb = timed(lambda: forward_backward(trainer, batch), device=device).median
        with measure("train"):
            t_train = timed(lambda: train_step(trainer, batch, rollouts, OldLogprobs(None, None), True),
                            device=device).median
        with measure("sync"):
            t_sync = timed(lambda: generator.load_weights(model.state_dict(), trainer.version),
                           device=device).median
        return {"generate": gen.median, "old_logprob": t_old, "forward_backward": t_fb,
                "train": t_train, "sync": t_sync, "positions": int(batch.attention_mask.sum()),
                "response_tokens": int(batch.response_mask.sum()), "batch": batch}

    rows = [phases(step) for step in range(args.steps)]
    batch = rows[-1].pop("batch")
    for r in rows[:-1]:
        r.pop("batch")
    memory: dict[str, dict] = {}

    def measure(name: str):
        memory[name] = {}
        return peak_memory(device, memory[name])

    phases(args.steps, measure)  # a step of its own: the memory probe slows every op
    kept = rows[1:] or rows  # the first step warms up
    mean = {k: statistics.mean(r[k] for r in kept) for k in rows[0]}
    with FlopCounterMode(display=False) as counter:
        forward_backward(trainer, batch)
    flops = counter.get_total_flops() * mean["positions"] / rows[-1]["positions"]
    est = estimator_seconds(trainer, batch, device)
    step_s = mean["generate"] + mean["train"] + mean["sync"]
    peak = max(peaks[f"{args.precision}_model_shape"], peaks[f"{args.precision}_square"])
    return {
        "mean": mean, "peak_mib": {p: m["peak_mib"] for p, m in memory.items()}, "step_s": step_s,
        "step_with_old_s": step_s + mean["old_logprob"],
        "old_share_of_step": mean["old_logprob"] / (step_s + mean["old_logprob"]),
        "estimator_s": est, "estimator_share_of_fb": est / mean["forward_backward"],
        "train_gflop": flops / 1e9, "train_gflops": flops / 1e9 / mean["forward_backward"],
        "flop_rate_vs_peak": flops / 1e9 / mean["forward_backward"] / peak,
        "params": sum(p.numel() for p in model.parameters()),
    }


# -- scaling --------------------------------------------------------------------------------

def synthetic_rollouts(prompts: int, group: int, prompt_len: int, length: int, vocab: int,
                       seed: int = 0) -> list[Rollout]:
    """Full-length responses of random tokens (no eos), the shape a scaling row asks for."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for p in range(prompts):
        prompt = torch.randint(2, vocab, (prompt_len,), generator=g).tolist()
        for _ in range(group):
            ids = torch.randint(2, vocab, (length,), generator=g).tolist()
            out.append(Rollout(prompt_id=str(p), group_id=p, prompt_ids=prompt, response_ids=ids,
                               logp_rollout=[-3.0] * length, version=0, engine="synthetic",
                               precision="fp32", finish_reason="length", reward=float(len(out) % 2)))
    return out


def scale_row(size: str, prompts: int, group: int, length: int, precision: str,
              device: torch.device) -> dict:
    vocab, prompt_len = 21, 9  # the char vocabulary; Countdown's prompts are about 9 tokens
    model = random_model(size, vocab, device)
    sampling = SamplingParams(n=group, temperature=1.0, max_new_tokens=length)
    trainer = Trainer(model, TrainConfig(precision=precision), sampling)
    rollouts = synthetic_rollouts(prompts, group, prompt_len, length, vocab)
    batch = collate(rollouts, 0, device)
    t_old = timed(lambda: score_batch(model, batch, sampling, 64, precision=precision), 2,
                  device=device).median
    t_train = timed(lambda: train_step(trainer, batch, rollouts, OldLogprobs(None, None), True), 2,
                    device=device).median
    prompts_ids = [r.prompt_ids for r in rollouts]
    model.eval()
    t_gen = timed(lambda: sample_tokens(model, prompts_ids, sampling,
                                        torch.Generator(device).manual_seed(0), -1, 0),
                  device=device).median
    n = prompts * group
    return {"size": size, "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
            "precision": precision, "rows": n, "group": group, "T": length,
            "positions": n * (prompt_len + length),
            "generate": t_gen, "old_logprob": t_old, "train": t_train}


def scaling(args, device: torch.device) -> list[dict]:
    """Rows in --precision; the model-size rows also in the other precision."""
    other = "fp32" if args.precision == "bf16" else "bf16"
    plan = [("tiny", 8, 8, 12), ("tiny", 16, 8, 12), ("tiny", 32, 8, 12),  # batch
            ("tiny", 16, 4, 12), ("tiny", 16, 16, 12),  # group size at 16 prompts
            ("tiny", 16, 8, 24), ("tiny", 16, 8, 48),  # response length
            ("20M", 8, 8, 12), ("100M", 8, 8, 12)]  # model size
    rows = [scale_row(*p, args.precision, device) for p in plan]
    return rows + [scale_row(*p, other, device) for p in plan if p[0] != "tiny" or p == plan[0]]


# -- the 152k vocabulary --------------------------------------------------------------------

VOCAB_ROWS, VOCAB_PROMPT, VOCAB_T = 32, 16, 32


def vocab_step(vocab: int, device: torch.device) -> dict:
    """One training step of a Qwen3-shaped model (hidden 256, 2 layers, untied embeddings) at
    `vocab`, in this process: memory before it and the process's high-water mark."""
    model = random_model((256, 2, 4, 2, 768), vocab, device, tied=False)
    sampling = SamplingParams(n=8, temperature=1.0, max_new_tokens=VOCAB_T)
    trainer = Trainer(model, TrainConfig(micro_batch=VOCAB_ROWS), sampling)
    rollouts = synthetic_rollouts(VOCAB_ROWS // 8, 8, VOCAB_PROMPT, VOCAB_T, vocab)
    batch = collate(rollouts, 0, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    else:
        before = psutil.Process().memory_info().rss
    seconds = timed(lambda: train_step(trainer, batch, rollouts, OldLogprobs(None, None), True)).median
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else rss_high_water()
    largest = max(p.numel() for p in model.parameters())
    return {"vocab": vocab, "params": sum(p.numel() for p in model.parameters()),
            "largest_param": largest, "before_mib": before / MiB, "peak_mib": peak / MiB,
            "step_mib": (peak - before) / MiB, "seconds": seconds}


def rss_high_water() -> int:
    """This process's peak resident set in bytes: VmHWM, which (unlike ru_maxrss) starts
    afresh at exec, so a child does not inherit its parent's peak."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def predicted_step_mib(params: int, largest: int, working_mib: float) -> float:
    """docs/performance.md: a step's memory above the loaded model, in fp32 with AdamW.

        grads 4P + Adam moments 8P + AdamW's temporaries 2 x 4 x (largest tensor)
        + the working set W: one chunk of logits and its softmax, activations (no V term)
    """
    return (12 * params + 8 * largest) / MiB + working_mib


def vocab_section(args, device: torch.device) -> list[dict]:
    """32k fits W (the working set); 152k is then predicted and measured, each in a fresh process."""
    def measure(vocab: int) -> dict:
        out = subprocess.run([sys.executable, __file__, "--vocab-child", str(vocab),
                              "--device", str(device), "--threads", str(args.threads)],
                             capture_output=True, text=True, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    small = measure(32768)
    working = small["step_mib"] - predicted_step_mib(small["params"], small["largest_param"], 0.0)
    rows = [small]
    for vocab in (65536, 151936):
        row = measure(vocab)
        row["predicted_mib"] = predicted_step_mib(row["params"], row["largest_param"], working)
        rows.append(row)
    small["predicted_mib"] = small["step_mib"]  # by construction: it fits W
    for r in rows:
        r["working_mib"] = working
    return rows


# -- report ---------------------------------------------------------------------------------

def report(out: dict, args) -> None:
    if "peak" in out:
        p = out["peak"]
        print(f"\nmatmul peak (GFLOP/s): fp32 {p['fp32_model_shape']:.0f} (model shape), "
              f"{p['fp32_square']:.0f} (1024^3); bf16 {p['bf16_model_shape']:.0f}, {p['bf16_square']:.0f}")
    if "breakdown" in out:
        b = out["breakdown"]
        m = b["mean"]
        print(f"\nbreakdown: {WORK['prompts']} prompts x {WORK['group']}, <= {WORK['max_new_tokens']} "
              f"new tokens, {b['params'] / 1e6:.2f} M params, precision {args.precision}, "
              f"steps 2-{args.steps} averaged")
        print("| phase | s | positions/s | peak memory MiB |\n|---|---|---|---|")
        per = {"generate": m["response_tokens"], "old_logprob": m["positions"],
               "train": m["positions"], "sync": 0}
        for phase in ("generate", "old_logprob", "train", "sync"):
            rate = f"{per[phase] / m[phase]:.0f}" if per[phase] else "-"
            print(f"| {phase} | {m[phase]:.3f} | {rate} | {b['peak_mib'][phase]:.1f} |")
        print(f"step (old-logprob reused): {b['step_s']:.3f} s; with an old-logprob forward "
              f"{b['step_with_old_s']:.3f} s, of which old-logprob {100 * b['old_share_of_step']:.1f}%")
        print(f"forward+backward {m['forward_backward']:.3f} s; estimator loss+backward "
              f"{b['estimator_s'] * 1e3:.2f} ms = {100 * b['estimator_share_of_fb']:.2f}% of it")
        print(f"training FLOPs {b['train_gflop']:.1f} GFLOP, {b['train_gflops']:.0f} GFLOP/s = "
              f"{100 * b['flop_rate_vs_peak']:.0f}% of this machine's {args.precision} matmul peak")
    if "scaling" in out:
        print("\n| model | params M | precision | rows | group | T | positions | generate s | "
              "old-logprob s | train s |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in out["scaling"]:
            print(f"| {r['size']} | {r['params_m']:.1f} | {r['precision']} | {r['rows']} | "
                  f"{r['group']} | {r['T']} | "
                  f"{r['positions']} | {r['generate']:.3f} | {r['old_logprob']:.3f} | {r['train']:.3f} |")
    if "vocab" in out:
        print(f"\n{VOCAB_ROWS} rows x ({VOCAB_PROMPT} + {VOCAB_T}) tokens, hidden 256, 2 layers, untied")
        print("| vocab | params M | before MiB | step MiB measured | step MiB predicted | s |")
        print("|---|---|---|---|---|---|")
        for r in out["vocab"]:
            print(f"| {r['vocab']} | {r['params'] / 1e6:.1f} | {r['before_mib']:.0f} | "
                  f"{r['step_mib']:.0f} | {r['predicted_mib']:.0f} | {r['seconds']:.2f} |")
        print(f"W (working set, fitted at 32k) = {out['vocab'][0]['working_mib']:.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=["peak", "breakdown", "scaling", "vocab"], action="append",
                        help="Run only these sections (repeatable); default: all.")
    parser.add_argument("--steps", type=int, default=5, help="Breakdown steps (the first warms up).")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32",
                        help="train.precision of the trainer forwards.")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N.")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads.")
    parser.add_argument("--json", metavar="FILE", help="Also write every figure here.")
    parser.add_argument("--vocab-child", type=int, help=argparse.SUPPRESS)  # internal: one vocab run
    args = parser.parse_args()
    use_threads(args.threads)
    device = torch.device(args.device)
    if args.vocab_child:
        print(json.dumps(vocab_step(args.vocab_child, device)))
        return
    sections = args.only or ["peak", "breakdown", "scaling", "vocab"]
    print(f"{device_name(device)}, {os.cpu_count()} cores visible, {args.threads} thread(s), torch {torch.__version__}")
    out: dict = {}
    if "peak" in sections or "breakdown" in sections:
        out["peak"] = peak_rates(device)
    if "breakdown" in sections:
        out["breakdown"] = breakdown(args, device, out["peak"])
    if "scaling" in sections:
        out["scaling"] = scaling(args, device)
    if "vocab" in sections:
        out["vocab"] = vocab_section(args, device)
    report(out, args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
