"""Rollout throughput, vLLM against the Hugging Face engine, side by side in one run.

    python benchmarks/rollout.py                      # tether's default tiny model, bf16
    python benchmarks/rollout.py --model DIR --precision fp32 --prompts 64 --n 8

Both engines get the same model directory, the same Countdown prompts, the same
sampling settings and the same number of torch threads; each is warmed up with one
call, then timed over `--repeats` calls. Throughput is generated tokens (eos included)
per second of wall time, so different response lengths do not skew it. Needs vLLM
(`make install-vllm`).

Each engine's last batch is also scored by the fp32 trainer (`token_logprobs`, i.e.
logp_old at the same weights): the numerical mismatch columns are mean |log pi_old -
log mu| and k3 = E[rho - 1 - log rho], rho = pi_old / mu, over the sampled tokens whose
pi_old > 0, and the share of sampled tokens that the trainer's own top-k / top-p
truncation excludes (pi_old = 0: only possible with truncation and unequal numerics).

What it leaves out: engine start-up and weight sync are reported, not part of the
throughput; one process runs both engines one after the other, never at once.
"""

from __future__ import annotations

import argparse
import json

import torch
from harness import model_path, timed, use_threads


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--model", help="local HF model dir (default: tether's tiny model, built on first use)"
    )
    p.add_argument(
        "--precision",
        default="bf16",
        choices=["fp32", "bf16", "fp16"],
        help="numerics of both engines",
    )
    p.add_argument("--prompts", type=int, default=32, help="prompts per call")
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3, help="timed calls per engine")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (1: fastest for the tiny model on a shared 2-core machine)",
    )
    p.add_argument("--engines", default="hf,vllm", help="comma-separated subset of hf,vllm")
    p.add_argument("--json", help="also write the results here")
    return p.parse_args()


def countdown_prompts(tokenizer, count: int) -> tuple[list[list[int]], list[str]]:
    from tether.models.tokenizer import encode_exact
    from tether.tasks.countdown import CountdownTask

    task = CountdownTask(seed=0)
    problems = [task.train_problem(i) for i in range(count)]
    return [encode_exact(tokenizer, p.prompt) for p in problems], [p.id for p in problems]


def throughput(gen, prompts, ids, sampling, repeats: int) -> tuple[dict, list]:
    """One warm-up call (caches, allocator, first kernels; seed 0), then `repeats` timed ones
    (seeds 1, 2, ...): their generated tokens over their summed seconds; the last rollouts."""
    calls: list[list] = []

    def generate() -> list:
        calls.append(gen.generate(prompts, ids, sampling, seed=len(calls)))
        return calls[-1]

    t = timed(generate, repeats, warmup=1)
    tokens = sum(len(x.response_ids) for rollouts in calls[1:] for x in rollouts)
    return {"tokens": tokens, "seconds": t.total, "tokens_per_s": tokens / t.total}, t.result


def mismatch(model, pad_id: int, rollouts, sampling) -> dict:
    """Numerical mismatch of the rollouts' log-probs against the fp32 trainer's."""
    from tether.scoring import LOGP_FLOOR, collate, token_logprobs

    batch = collate(rollouts, pad_id)
    with torch.no_grad():
        logp_old, _ = token_logprobs(model, batch, sampling)
    m = batch.response_mask.bool()
    outside = m & (logp_old <= LOGP_FLOOR)  # sampled, but outside the trainer's nucleus
    log_rho = (logp_old - batch.logp_rollout)[m & ~outside]
    return {
        "mean_abs_dlogp": log_rho.abs().mean().item(),
        "k3": (torch.expm1(log_rho) - log_rho).mean().item(),
        "outside_support": (outside.sum() / m.sum()).item(),
    }


def main() -> None:
    args = parse_args()
    use_threads(args.threads)
    from tether.models import load_model
    from tether.rollout.types import SamplingParams

    path = model_path(args.model, config=None)  # the model `tether train` uses by default
    model, tokenizer = load_model(path)
    prompts, ids = countdown_prompts(tokenizer, args.prompts)
    sampling = SamplingParams(
        n=args.n,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
    )
    engines = args.engines.split(",")
    results: dict[str, dict] = {}
    makers = {}
    if "hf" in engines:
        from tether.rollout.hf import HFGenerator

        makers["hf"] = lambda: HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id,
                                           args.precision)
    if "vllm" in engines:
        from tether.rollout.vllm_engine import VLLMGenerator

        makers["vllm"] = lambda: VLLMGenerator(path, args.precision)
    for name, make in makers.items():
        start = timed(make)  # the engine's start-up: reported, not part of the throughput
        gen = start.result
        speed, rollouts = throughput(gen, prompts, ids, sampling, args.repeats)
        results[name] = {
            "startup_s": start.total,
            **speed,
            **mismatch(model, tokenizer.pad_token_id, rollouts, sampling),
        }
        if name == "vllm":
            gen.load_weights(model.state_dict(), version=1)
            results["vllm"]["sync_s"] = gen.last_sync_seconds
            gen.close()
        del gen, start

    print(
        f"\nmodel {path}\n{args.prompts} prompts x {args.n} samples, <= {args.max_new_tokens} "
        f"new tokens, T={args.temperature} top_k={args.top_k} top_p={args.top_p}, "
        f"{args.precision}, {args.threads} threads, {args.repeats} timed calls\n"
    )
    print(
        f"{'engine':8}{'start s':>9}{'tokens':>9}{'seconds':>9}{'tokens/s':>10}"
        f"{'mean|dlogp|':>13}{'k3':>10}{'outside':>9}"
    )
    for name, r in results.items():
        print(
            f"{name:8}{r['startup_s']:9.1f}{r['tokens']:9d}{r['seconds']:9.2f}"
            f"{r['tokens_per_s']:10.0f}{r['mean_abs_dlogp']:13.3g}{r['k3']:10.3g}"
            f"{r['outside_support']:9.2%}"
        )
    if len(results) == 2:
        ratio = results["vllm"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
        results["ratio_vllm_over_hf"] = ratio
        print(
            f"\nvLLM / HF throughput: {ratio:.2f}x   (vLLM weight sync: "
            f"{results['vllm']['sync_s']:.3f} s)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "model": path, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
