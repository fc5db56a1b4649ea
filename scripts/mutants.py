"""Mutation check: small wrong edits to the logged metrics that the unit tests must catch.

    .venv/bin/python scripts/mutants.py               every mutant (3-4 minutes on 2 busy cores)
    .venv/bin/python scripts/mutants.py NAME [NAME]   only those

Each mutant is one exact edit of src/tether (a snippet and its replacement, found exactly
once or the script stops). The script copies src/ to a temporary directory, edits the
copy, and runs pytest on the mutant's unit tests with that copy first on PYTHONPATH,
which wins over the editable install (a plain path in a .pth file, so it comes after
PYTHONPATH on sys.path); it checks that `tether` is imported from the copy. The working
tree is never touched. First the unmutated copy must pass the same tests, so a kill is the
mutation's doing.

What it proves: each listed wrong formula (a mean for a sum, a mask ignored, a sign
flipped, a metric swapped for its neighbour) fails a unit test with a hand-worked value,
not only a pinned recording or an end-to-end run. A SURVIVED line names a metric whose
tests do not check what they claim. Exit status 1 if any mutant survives or breaks.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

METRIC_TESTS = "tests/test_metric_values.py"
ESTIMATOR_TESTS = (METRIC_TESTS, "tests/estimators")
DIAGNOSTIC_TESTS = (
    METRIC_TESTS,
    "tests/test_diagnostics.py::test_divergence_metrics_by_hand",
    "tests/test_diagnostics.py::test_empty_mask_disagrees_nowhere",
    "tests/test_diagnostics.py::test_decompose_directions_and_causes",
)
MONITOR_TESTS = (
    METRIC_TESTS, "tests/test_diagnostics.py::test_monitor_sees_only_the_generators_numerics"
)


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to src/tether
    old: str  # must occur exactly once in the file
    new: str
    description: str
    tests: tuple[str, ...]  # pytest paths, run in this order (the likely killer first)


MUTANTS = [
    # The six that went through every unit test in issue 37's first mutation check.
    Mutant("adv_second_moment_one", "estimators/metrics.py",
           "return torch.where(den > 0, num / den.clamp(min=torch.finfo(den.dtype).tiny), 1.0)",
           "return torch.ones_like(den)",
           "*/adv_second_moment always 1", ESTIMATOR_TESTS),
    Mutant("ess_seq_mean", "estimators/ess.py",
           "torch.zeros_like(log_ratio)).sum(dim=-1)  # (B,)",
           "torch.zeros_like(log_ratio)).mean(dim=-1)  # (B,)",
           "ess_seq on the mean log-ratio of a row, not its sum", ESTIMATOR_TESTS),
    Mutant("ratio_ess_seq_mean", "estimators/metrics.py",
           "ess_from_log((log_ratios * maskf).sum(dim=-1)",
           "ess_from_log((log_ratios * maskf).mean(dim=-1)",
           "<cause>/ess/seq on the mean log-ratio of a row, not its sum", ESTIMATOR_TESTS),
    Mutant("coef_mean_is_max", "estimators/metrics.py",
           '"objective/coef/mean": coef_stats[0],', '"objective/coef/mean": coef_stats[1],',
           "objective/coef/mean reports the max", ESTIMATOR_TESTS),
    Mutant("rho_tail_doubled", "estimators/metrics.py",
           '"centering/rho_tail/mean": (rho_tail * maskf).sum() / n,',
           '"centering/rho_tail/mean": 2 * (rho_tail * maskf).sum() / n,',
           "centering/rho_tail/mean doubled", ESTIMATOR_TESTS),
    Mutant("kl_share_complement", "monitor.py",
           "float(k3[rare].sum() / total)", "float(k3[~rare].sum() / total)",
           "monitor/kl_share/rare on the tokens that are not rare", MONITOR_TESTS),
    Mutant("weight_second_moment_is_mean", "estimators/metrics.py",
           '"correction/weight/second_moment": corr_stats[2],',
           '"correction/weight/second_moment": corr_stats[0],',
           "correction/weight/second_moment reports the mean", ESTIMATOR_TESTS),
    # Diagnostics (tether.diagnostics).
    Mutant("k3_is_k1", "diagnostics.py",
           "k3 = torch.where(keep, torch.expm1(dc) - dc, 0.0).sum() / n", "k3 = (-d).sum() / n",
           "k3_kl/mean computed as k1", DIAGNOSTIC_TESTS),
    Mutant("k1_sign", "diagnostics.py", "k1 = (-d).sum() / n", "k1 = d.sum() / n",
           "k1_kl/mean with the sign flipped", DIAGNOSTIC_TESTS),
    Mutant("chi2_token_no_minus_one", "diagnostics.py",
           "torch.where(keep, torch.expm1(2 * dc), 0.0)",
           "torch.where(keep, torch.exp(2 * dc), 0.0)",
           "chi2/token = E[w^2], missing the -1", DIAGNOSTIC_TESTS),
    Mutant("chi2_seq_over_tokens", "diagnostics.py",
           "torch.expm1(2 * seq), 0.0).sum() / n_rows", "torch.expm1(2 * seq), 0.0).sum() / n",
           "chi2/seq averaged over tokens instead of rows", DIAGNOSTIC_TESTS),
    Mutant("ppl_ratio_sign", "diagnostics.py",
           "torch.exp(-mean_t.clamp(", "torch.exp(mean_t.clamp(",
           "ppl_ratio/mean inverted (sampler over target)", DIAGNOSTIC_TESTS),
    Mutant("abs_max_ignores_mask", "diagnostics.py",
           "d.abs().max() if keep.any()", "delta.double().abs().max() if keep.any()",
           "abs_log_ratio/max reads masked tokens", DIAGNOSTIC_TESTS),
    Mutant("staleness_total_swapped", "diagnostics.py",
           "Decomposition(log_rho, diff(logp, logp_old), diff(logp, logp_rollout), keep)",
           "Decomposition(log_rho, diff(logp, logp_rollout), diff(logp, logp_old), keep)",
           "decompose swaps the staleness and total log-ratios", DIAGNOSTIC_TESTS),
    Mutant("routing_any_is_all", "diagnostics.py",
           "differs.any(dim=-1, keepdim=True)", "differs.all(dim=-1, keepdim=True)",
           "routing_disagreement/any_layer counts tokens that differ in every layer",
           DIAGNOSTIC_TESTS),
    Mutant("routing_order_matters", "diagnostics.py",
           "r.long().sort(dim=-1).values[:, P - 1:P + T - 1]", "r.long()[:, P - 1:P + T - 1]",
           "routing_disagreement compares expert lists, not sets", DIAGNOSTIC_TESTS),
    # Monitor (tether.monitor.monitor_metrics).
    Mutant("token_frac_over_padding", "monitor.py",
           "float(rare.sum() / n)", "float(rare.sum() / keep.numel())",
           "monitor/token_frac/rare divided by every position, padding included", MONITOR_TESTS),
    Mutant("rare_by_sampler", "monitor.py",
           "rare = keep & (logp_gen < math.log(rare_prob))",
           "rare = keep & (logp_sampler < math.log(rare_prob))",
           "monitor's rare tokens read off pi_theta instead of mu", MONITOR_TESTS),
    # Estimator metrics (tether.estimators.metrics, ess).
    Mutant("frac_truncated_per_row", "estimators/metrics.py",
           "corr.truncated.sum() / n", "corr.truncated.sum() / mask.shape[0]",
           "correction/frac_truncated divided by rows, not tokens", ESTIMATOR_TESTS),
    Mutant("ess_counts_padding", "estimators/ess.py",
           "n = keep.sum(dim=-1).to(log_w.dtype)",
           "n = torch.full_like(log_w[..., 0], log_w.shape[-1])",
           "ESS normalised by every position, masked ones included", ESTIMATOR_TESTS),
    Mutant("weight_max_ignores_mask", "estimators/metrics.py",
           "torch.where(maskf.bool(), values, torch.zeros_like(values)).flatten(-2).amax(dim=-1)",
           "values.flatten(-2).amax(dim=-1)",
           "*/max reads masked tokens", ESTIMATOR_TESTS),
    Mutant("ignores_mismatch_weight", "estimators/metrics.py",
           "applied = corr.weight if obj.mismatch_weight is None else obj.mismatch_weight",
           "applied = corr.weight",
           "correction/weight/* ignore an objective's own pi/mu weight (decoupled)",
           ESTIMATOR_TESTS),
    Mutant("numerical_adv_uses_applied", "estimators/metrics.py",
           '"numerical/is_weight/adv_second_moment": _adv_second_moment(rho, a2),',
           '"numerical/is_weight/adv_second_moment": _adv_second_moment(applied, a2),',
           "numerical/is_weight/adv_second_moment on the applied weight, not raw rho",
           ESTIMATOR_TESTS),
]


def mutated(src: Path, mutant: Mutant) -> str:
    """The mutant's file under `src` with its edit; stop unless the snippet occurs once."""
    text = (src / "tether" / mutant.file).read_text()
    count = text.count(mutant.old)
    if count != 1:
        sys.exit(f"mutant {mutant.name}: snippet found {count} times in "
                 f"src/tether/{mutant.file} (expected exactly once): {mutant.old!r}")
    return text.replace(mutant.old, mutant.new)


def pytest_env(src: Path) -> dict[str, str]:
    path = os.pathsep.join([str(src), os.environ.get("PYTHONPATH", "")])
    # PYTHONDONTWRITEBYTECODE: no .pyc written into the shared tree's tests/
    return {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}


def imported_from(src: Path) -> str:
    """Where `tether` comes from under pytest_env(src); stop unless it is the copy."""
    proc = subprocess.run([sys.executable, "-c", "import tether; print(tether.__file__)"],
                          env=pytest_env(src), cwd=REPO, capture_output=True, text=True, check=True)
    origin = proc.stdout.strip()
    if not origin.startswith(str(src)):
        sys.exit(f"tether was imported from {origin}, not from the mutated copy under {src}")
    return origin


def run_tests(src: Path, tests: tuple[str, ...]) -> tuple[int, str, float]:
    """pytest on `tests` with the package under `src` imported; (exit code, output, seconds)."""
    env = pytest_env(src)
    imported_from(src)
    start = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-rfE", *tests]
    proc = subprocess.run(cmd, check=False, env=env, cwd=REPO, capture_output=True, text=True)
    return proc.returncode, proc.stdout + proc.stderr, time.perf_counter() - start


def fresh_copy(root: Path) -> Path:
    src = root / "src"
    shutil.rmtree(src, ignore_errors=True)
    shutil.copytree(REPO / "src", src, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return src


def main(names: list[str]) -> int:
    unknown = set(names) - {m.name for m in MUTANTS}
    if unknown:
        valid = ", ".join(m.name for m in MUTANTS)
        sys.exit(f"unknown mutant(s) {sorted(unknown)}; valid: {valid}")
    mutants = [m for m in MUTANTS if not names or m.name in names]
    for m in mutants:  # every snippet checked before the first, slow, test run
        mutated(REPO / "src", m)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="tether-mutants-") as tmp:
        root = Path(tmp)
        src = fresh_copy(root)
        print(f"tether imported from {imported_from(src)} (checked before every run)")
        baseline = tuple(dict.fromkeys(t for m in mutants for t in m.tests))
        code, output, secs = run_tests(src, baseline)
        if code != 0:
            print(output)
            print(f"the unmutated copy fails its tests (pytest exit {code}): fix that first")
            return 1
        print(f"baseline, no mutation: {len(baseline)} test paths pass ({secs:.1f} s)\n")
        statuses = []
        for m in mutants:
            src = fresh_copy(root)
            (src / "tether" / m.file).write_text(mutated(src, m))
            code, output, secs = run_tests(src, m.tests)
            failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", output, flags=re.MULTILINE)
            if code == 0:
                status, detail = "SURVIVED", m.description
            elif code == 1 and failed:
                status, detail = "KILLED", f"by {failed[0]}"
            else:  # a collection error or crash: the mutant itself is broken
                last = output.strip().splitlines()[-1] if output.strip() else ""
                status, detail = "BROKEN", f"pytest exit {code}: {last}"
            statuses.append(status)
            print(f"{status:<8} {m.name:<30} {secs:5.1f} s  {detail}", flush=True)
    killed = statuses.count("KILLED")
    print(f"\n{len(statuses)} mutants: {killed} killed, {statuses.count('SURVIVED')} survived, "
          f"{statuses.count('BROKEN')} broken ({time.perf_counter() - started:.0f} s)")
    return 0 if killed == len(statuses) else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="MUTANT", help="mutants to apply (default: all): "
                   + ", ".join(m.name for m in MUTANTS))
    sys.exit(main(p.parse_args().names))
