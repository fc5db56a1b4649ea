"""What MoE routing replay removes from the numerical mismatch (docs/mismatch.md, issue 14).

One batch of 32 Countdown prompts x 8 samples from the warm-started tiny MoE model
(`model.moe=true`, 200 warm-start steps) under each generator, recorded routing included;
the fp32 trainer scores it at the same weights twice: without replay (its routers choose)
and with R3 (the generator's experts replayed). R2 at equal weights replays the trainer's
own choice, which changes nothing (tests/test_routing_replay.py), so it has no column here.
Also the bytes the routes cost.

    python benchmarks/routing_replay.py
"""

from __future__ import annotations

from dataclasses import replace

from harness import model_path, use_threads

from tether.diagnostics import compare_routes, decompose, mismatch_metrics
from tether.models import load_model
from tether.models.tokenizer import encode_exact
from tether.rollout.hf import HFGenerator
from tether.rollout.types import SamplingParams
from tether.scoring import collate, score_batch
from tether.tasks import build_task

GENERATORS = [("bf16", 0.0), ("fp8", 0.0), ("bf16", 0.1), ("bf16", 0.3)]


def main() -> None:
    use_threads(1)
    # configs/countdown.yaml's model as MoE (200 warm-start steps); a first build uses every core
    model, tok = load_model(model_path(None, "model.moe=true", "run.threads=0"))
    task = build_task("countdown")
    prompts = [encode_exact(tok, task.train_problem(i).prompt) for i in range(32)]
    sampling = SamplingParams(n=8, max_new_tokens=12)
    print("| generator | routing disagreement (token, layer) | any layer | numerical k3, "
          "no replay | numerical k3, r3 | max \\|log ρ\\|, no replay | max \\|log ρ\\|, r3 | "
          "E[ρ²], no replay | E[ρ²], r3 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for precision, noise in GENERATORS:
        gen = HFGenerator(model, tok.eos_token_id, tok.pad_token_id, precision, noise,
                          record_routes=True)
        rollouts = gen.generate(prompts, [str(i) for i in range(32)], sampling, seed=1)
        batch = collate(rollouts, tok.pad_token_id)
        off = score_batch(model, replace(batch, routed_experts=None), sampling, 64, record=True)
        r3 = score_batch(model, batch, sampling, 64)
        route = compare_routes(off.experts, batch.routed_experts, batch)
        m = {name: mismatch_metrics(decompose(batch.logp_rollout, s.logp, None,
                                              batch.response_mask))
             for name, s in (("off", off), ("r3", r3))}
        label = f"{precision}{f' + router noise {noise:g}' if noise else ''}"
        print(f"| {label} | {route['numerical/routing_disagreement/mean']:.2%} | "
              f"{route['numerical/routing_disagreement/any_layer']:.1%} | "
              f"{m['off']['numerical/k3_kl/mean']:.2e} | {m['r3']['numerical/k3_kl/mean']:.2e} | "
              f"{m['off']['numerical/abs_log_ratio/max']:.3f} | "
              f"{m['r3']['numerical/abs_log_ratio/max']:.3f} | "
              f"{m['off']['numerical/is_weight/second_moment']:.4f} | "
              f"{m['r3']['numerical/is_weight/second_moment']:.4f} |")
    per_response = [r.routed_experts.nbytes for r in rollouts]
    print(f"routes: {batch.routed_experts.dtype}, {sum(per_response) / len(per_response):.0f} "
          f"bytes per response on average ({batch.routed_experts.shape[2]} layers x top-"
          f"{batch.routed_experts.shape[3]} x prompt + response positions)")


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.split("\n\n    python")[0],
                            formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()
