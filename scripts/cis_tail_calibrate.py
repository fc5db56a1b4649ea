"""Calibrate E-CIS's heavy-tailed generator `inj_tail`: outlier positions (share, scale).

    .venv/bin/python scripts/cis_tail_calibrate.py [--chunks 2] SHARE:SCALE [SHARE:SCALE ...]

For each candidate, the `inj` generator plus `rollout.logit_noise_outliers=SHARE` and
`rollout.logit_noise_outlier_scale=SCALE` samples `--chunks` batches of 256 x 8 (default 4, as the report) on E-CIS's
starting model (the 200-step MoE warm start, built once if not cached), exactly as
`tether report` measures `truncation_bias` (`cis.measure_generator`). Printed per candidate:
eps's MAD and q95 per generator-confidence bin, and plain IS's second moment E_mu[rho^2],
exact per prefix (sum_v pi_old(v)^2 / mu(v), K = V) and sampled. The bars (issue 29, CIS
Appendix A): q95 per bin within 2x of Appendix A's 0.26-0.50 and near `inj`'s own, and the
exact second moment >= 5, in every batch. One thread after the model is built.
"""

from __future__ import annotations

import argparse

import torch

from tether.experiments import cis
from tether.experiments.runner import resolve_start_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("candidates", nargs="+", help="SHARE:SCALE, e.g. 0.02:4 (0:0 is inj itself)")
    ap.add_argument("--chunks", type=int, default=cis.BIAS_CHUNKS, help="Batches of 256 x 8 per candidate.")
    args = ap.parse_args()
    base = cis.build().base
    meta = {"base": base, "model_path": resolve_start_model(base, None)}  # built once if needed
    torch.set_num_threads(1)
    print("candidate | MAD per bin | q95 per bin | E[rho^2] exact (max) | exact per batch | sampled")
    for cand in args.candidates:
        share, scale = (float(x) for x in cand.split(":"))
        keys = cis.INJECTED + ([f"rollout.logit_noise_outliers={share}",
                                f"rollout.logit_noise_outlier_scale={scale}"] if share else [])
        g = cis.measure_generator(meta, f"tail_{cand}", seed=4321, keys=keys, chunks=args.chunks)
        mad = " ".join(f"{b['mad']:.3f}" for b in g["epsilon"])
        q95 = " ".join(f"{b['q95']:.2f}" for b in g["epsilon"])
        per_batch = " ".join(f"{b['exact']:.3g}" for b in g["rho_second_moment_per_batch"])
        print(f"{cand} | {mad} | {q95} | {g['rho_second_moment_exact']:.3g} "
              f"({g['rho_second_moment_exact_max']:.3g}) | {per_batch} | {g['rho_second_moment']:.3g}",
              flush=True)


if __name__ == "__main__":
    main()
