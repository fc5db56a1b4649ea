"""tether's split, loss, re-sync test and advice inside a loop that is not tether's.

    .venv/bin/python examples/tensor_api.py [--model PATH]     (about 15 s on a CPU)

One hand-written GRPO step with plain transformers on tether's tiny model (the demo's,
built and cached on first use): a bf16 copy of the policy samples (the "engine": mu), the
fp32 policy scores the samples (pi_old), then two optimizer steps on the batch, PPO-style,
so that pi_theta moves away from pi_old. tether.api gives the loss and, from the three
log-probs, the split by cause and the advice. docs/integrations.md explains each call.
"""

from __future__ import annotations

import argparse
import copy

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tether import api
from tether.config import load_config
from tether.setup import resolve_model_path
from tether.tasks import build_task

PROMPTS, GROUP, NEW_TOKENS = 16, 8, 12


def response_logps(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """log p of each response token under `model`, (B, T)."""
    logits = model(ids).logits[:, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, prompt_len:, None]).squeeze(-1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local causal-LM directory with tether's character "
                   "tokenizer (default: the demo's tiny model, built on first use)")
    torch.manual_seed(0)
    path = p.parse_args().model or resolve_model_path(load_config("configs/demo.yaml"))
    tok, policy = AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path)
    engine = copy.deepcopy(policy).to(torch.bfloat16)  # the sampler's numerics differ
    task = build_task("countdown", use_all=True)
    problems = [p for p in (task.train_problem(i) for i in range(200)) if len(p.prompt) == 9][:PROMPTS]
    prompts = torch.tensor([tok.encode(p.prompt) for p in problems]).repeat_interleave(GROUP, 0)

    # 1. Generate, keeping the engine's log-prob of each sampled token (mu).
    with torch.no_grad():
        out = engine.generate(prompts, do_sample=True, max_new_tokens=NEW_TOKENS, top_k=0,
                              output_scores=True, return_dict_in_generate=True,
                              pad_token_id=tok.pad_token_id)
    ids, L = out.sequences, prompts.shape[1]
    scores = torch.stack(out.scores, 1).float().log_softmax(-1)
    mu = scores.gather(-1, ids[:, L:, None]).squeeze(-1)
    after_eos = (ids[:, L:] == tok.eos_token_id).int().cumsum(1) - (ids[:, L:] == tok.eos_token_id).int()
    mask = after_eos == 0  # the response up to and including its eos
    texts = tok.batch_decode(ids[:, L:] * mask, skip_special_tokens=True)
    rewards = torch.tensor([task.reward(problems[i // GROUP], t).total for i, t in enumerate(texts)])
    groups = rewards.view(PROMPTS, GROUP)
    adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-6)).flatten()

    # 2. pi_old: the trainer's own numerics at the sampling weights.
    with torch.no_grad():
        old = response_logps(policy, ids, L)

    # 3. Two optimizer steps on the batch with a tether preset as the loss.
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    for epoch in range(2):
        new = response_logps(policy, ids, L)
        loss = api.loss("tis", logp=new, logp_old=old, logp_rollout=mu, advantages=adv, mask=mask)
        opt.zero_grad()
        loss.loss.backward()
        opt.step()
        print(f"epoch {epoch}: loss {loss.loss.item():+.4f}, tis weight max "
              f"{loss.metrics['correction/weight/max']:.3f}")

    # 4. The split of the last epoch's batch, the re-sync test and the advice.
    split = api.split(mask, logp_rollout=mu, logp_old=old, logp=new.detach())
    for cause in ("numerical", "staleness", "total"):
        print(f"{cause:<10} k3 {split[f'{cause}/k3_kl/mean']:.2e}   token ESS "
              f"{split[f'{cause}/ess/token']:.4f}")
    ess, resync = api.resync(new.detach(), old, mask, tau=0.5)
    print(f"re-sync the engine (ESS {ess:.3f} < 0.5)? {resync}")
    print(api.advise(split, batch=PROMPTS * GROUP, estimator="tis")[1])


if __name__ == "__main__":
    main()
