"""Building estimators by name: presets, compositions, parameter checks, the listing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tether.estimators import (
    CORRECTIONS,
    OBJECTIVES,
    PRESETS,
    Registry,
    TokenBatch,
    build_estimator,
    format_presets_table,
    presets_rows,
)
from tether.estimators.ppo import ppo
from tether.estimators.registry import OneOf, Positive

EXPECTED_PRESETS = {
    "naive", "grpo", "tis", "seq_tis", "mis", "icepop", "seq_mis", "geo_mis",
    "cis", "gspo", "sapo", "cispo", "vespo", "decoupled", "decoupled_cis", "dlc", "dlc_clip",
    "reweight",
}  # fmt: skip


def test_every_preset_from_the_design_exists() -> None:
    assert set(PRESETS) == EXPECTED_PRESETS


def test_presets_resolve_to_their_parts_and_defaults() -> None:
    dlc = build_estimator("dlc")
    assert (dlc.objective.name, dlc.correction.name, dlc.centering) == ("stale_is", "none", True)
    assert dlc.params == {"stale_cap": 2.0, "agg": "token-mean"}
    assert build_estimator("gspo").params["clip_high"] == 4e-4
    assert build_estimator("geo_mis").params["lo"] == 0.99
    assert build_estimator("cis").params == {
        "clip_low": 0.2, "clip_high": 0.28, "lam": 2.3, "kappa": 5e-3, "agg": "token-mean"
    }  # fmt: skip
    assert build_estimator("vespo").params["length_norm"] == "none"
    assert build_estimator("vespo").params["include_rho"] is False
    dlc_clip = build_estimator("dlc_clip")
    assert (dlc_clip.objective.name, dlc_clip.correction.name, dlc_clip.centering) == (
        "ppo", "none", True
    )  # fmt: skip
    assert dlc_clip.params == {"clip_low": 0.2, "clip_high": 0.28, "agg": "token-mean"}
    assert build_estimator("reweight").params == {"cap": 2.0, "agg": "token-mean"}
    assert build_estimator("cispo").params == {
        "clip_low": 1.0, "clip_high": 4.0, "agg": "token-mean"
    }  # fmt: skip


def test_default_aggregation_is_the_sources() -> None:
    # GSPO (eq. 5) and SAPO (eq. 5) average per response, (1/G) sum_i (1/|y_i|) sum_t; the
    # others are token-level. The objective carries it, so compositions agree with presets.
    per_response = {"gspo", "sapo"}
    for name, preset in PRESETS.items():
        expected = "seq-mean-token-mean" if name in per_response else "token-mean"
        assert preset.agg == expected, name
        assert build_estimator(name).params["agg"] == expected, name
    assert build_estimator("gspo+tis").params["agg"] == "seq-mean-token-mean"
    assert build_estimator("sapo", agg="token-mean").params["agg"] == "token-mean"


def test_composition_by_name_and_by_keyword_agree() -> None:
    by_name = build_estimator("ppo+tis", cap=3.0)
    by_keyword = build_estimator(objective="ppo", correction="tis", cap=3.0)
    assert by_name.params == by_keyword.params == {**build_estimator("tis").params, "cap": 3.0}
    assert build_estimator("stale_is+none+centering").params == build_estimator("dlc").params


def test_unknown_name_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="valid presets: naive, grpo.*objectives.*corrections"):
        build_estimator("ppo_tis")
    with pytest.raises(ValueError, match="unknown estimator 'ppo\\+nope'"):
        build_estimator("ppo+nope")
    with pytest.raises(ValueError, match="unknown objective 'nope'; valid: cispo, decoupled"):
        build_estimator(objective="nope")


def test_unknown_parameter_lists_the_valid_ones() -> None:
    with pytest.raises(ValueError, match="'clip' for estimator 'tis'; valid: agg, cap, clip_high"):
        build_estimator("tis", clip=0.2)
    with pytest.raises(ValueError, match="'cap'.*'dlc'"):
        build_estimator("dlc", cap=2.0)


@pytest.mark.parametrize(
    ("preset", "params", "named"),
    [
        ("tis", {"cap": -1.0}, "'cap' must be > 0"),
        # clip_low = 1 is allowed (no lower clip, cispo's default); above 1 is refused.
        ("grpo", {"clip_low": 1.5}, "'clip_low' must be in \\[0, 1\\] \\(1: no lower clip\\)"),
        ("grpo", {"clip_high": -0.1}, "'clip_high'"),
        ("mis", {"lo": 3.0, "hi": 2.0}, "'lo' must be < 'hi'"),
        ("mis", {"lo": -0.1}, "'lo'"),
        ("cis", {"lam": -1.0}, "'lam'"),
        ("cis", {"kappa": 2.0}, "'kappa' must be in \\[0, 1\\]"),
        ("sapo", {"tau_neg": 0.0}, "'tau_neg'"),
        ("vespo", {"k_pos": -1.0}, "'k_pos'"),
        ("vespo", {"length_norm": "L"}, "'length_norm' must be one of none, T, sqrtT"),
        ("vespo", {"include_rho": 1}, "'include_rho' must be true or false"),
        ("reweight", {"cap": 0.0}, "'cap' must be > 0"),
        ("dlc", {"stale_cap": 0.0}, "'stale_cap'"),
        ("naive", {"agg": "mean"}, "'agg' must be one of token-mean"),
        ("tis", {"cap": math.nan}, "'cap' must be a number"),
        ("tis", {"cap": "2"}, "'cap' must be a number"),
    ],
)
def test_out_of_range_parameter_is_named(preset: str, params: dict, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        build_estimator(preset, **params)


def test_infinite_caps_mean_no_cap() -> None:
    assert build_estimator("stale_is+none", stale_cap=math.inf).params["stale_cap"] == math.inf
    assert build_estimator("seq_tis", cap=math.inf).params["cap"] == math.inf


def test_compositions_that_would_count_a_correction_twice_are_refused() -> None:
    with pytest.raises(ValueError, match="'vespo' with include_rho=true already weighs by pi/mu"):
        build_estimator("vespo+tis", include_rho=True)
    assert build_estimator("vespo+tis").params["include_rho"] is False  # W = prod r: no rho
    with pytest.raises(ValueError, match="'decoupled' already weighs by pi/mu"):
        build_estimator(objective="decoupled", correction="cis")
    with pytest.raises(ValueError, match="'total_is' already weighs by pi/mu"):
        build_estimator("total_is+tis")
    with pytest.raises(ValueError, match="centering needs an objective.*: use one of pg, ppo, stale"):
        build_estimator("gspo+none+centering")
    with pytest.raises(ValueError, match="centering is itself the numerical-mismatch correction"):
        build_estimator("stale_is+tis+centering")


def test_registries_refuse_duplicate_names_and_unknown_aggregations() -> None:
    with pytest.raises(ValueError, match="objective 'ppo' is already registered"):
        OBJECTIVES.register("ppo", corrects="staleness", level="token", formula="", source="")(ppo)
    registry = Registry("thing")
    registry.add("a", ppo, corrects="staleness", level="token", formula="", source="")
    with pytest.raises(ValueError, match="thing 'a' is already registered"):
        registry.add("a", ppo, corrects="staleness", level="token", formula="", source="")
    with pytest.raises(ValueError, match="agg must be one of"):
        registry.add("b", ppo, corrects="staleness", level="token", formula="", source="", agg="x")


def test_allowed_values_come_from_the_signature_types() -> None:
    assert CORRECTIONS.get("cis").rules["kappa"].allowed == "in [0, 1]"
    with pytest.raises(ValueError, match=r"parameter 'kappa' must be in \[0, 1\], got 2"):
        build_estimator("cis", kappa=2)

    def thing(logp, mask, *, width: Positive = 1.0, free: float = 0.0, mode: str = "a",
              on: bool = False):
        raise NotImplementedError

    rules = Registry("thing").add("t", thing, corrects="neither", level="token", formula="",
                                  source="").rules
    assert set(rules) == {"width", "on"} and rules["on"] is bool  # free and mode: unchecked
    assert not rules["width"].test(0.0) and rules["width"].test(float("inf"))  # inf: no cap
    assert OBJECTIVES.get("vespo").rules["length_norm"] == OneOf(("none", "T", "sqrtT"))


def test_only_an_estimator_that_reads_logp_prox_needs_it() -> None:
    # The trainer scores pi_prox for exactly these (an extra no-grad forward per stale batch).
    assert [p for p in PRESETS if build_estimator(p).needs_prox] == ["decoupled", "decoupled_cis"]
    assert OBJECTIVES.get("decoupled").inputs[:2] == ("logp", "logp_prox")


def test_registry_reads_inputs_and_defaults_from_the_signature() -> None:
    entry = CORRECTIONS.get("cis")
    assert entry.inputs == ("logp_old", "logp_rollout", "mask")
    assert entry.defaults == {"lam": 2.3, "kappa": 5e-3}


def test_presets_table_lists_every_preset_with_what_it_corrects() -> None:
    table = format_presets_table()
    lines = {line.split()[0]: line for line in table.splitlines() if line.strip()}
    for name, preset in PRESETS.items():
        assert f" {preset.corrects} " in lines[name]
    assert "stale_is+none+centering" in lines["dlc"]
    assert " both " in lines["dlc"] and " neither " in lines["naive"]
    assert " staleness " in lines["grpo"] and " both " in lines["cis"]


def test_docs_mirror_the_presets_table() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "estimators.md").read_text()
    for r in presets_rows():
        row = (
            f"| {r['preset']} | {r['composition']} | {r['corrects']} | {r['agg']} "
            f"| `{r['formula']}` "
            f"| {r['defaults']} | {r['source']} |"
        )
        assert row in docs, f"docs/estimators.md is out of date for {r['preset']}: {row}"


METRIC_NAMES = {
    f"{cause}/{name}/{stat}"
    for cause, name in (("numerical", "is_weight"), ("staleness", "ratio"), ("total", "is_weight"))
    for stat in ("mean", "max", "second_moment")
} | {
    f"{cause}/ess/{level}"
    for cause in ("numerical", "staleness", "total")
    for level in ("token", "seq")
} | {
    "numerical/is_weight/adv_second_moment",
    "correction/weight/mean", "correction/weight/max", "correction/weight/second_moment",
    "correction/weight/adv_second_moment", "correction/frac_truncated", "correction/frac_masked",
    "objective/frac_clipped", "objective/coef/mean", "objective/coef/max",
    "loss/total", "loss/objective",
}  # fmt: skip


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_estimator_reports_the_same_metric_names(preset: str) -> None:
    b, t, k = 2, 3, 2
    batch = TokenBatch(
        logp=torch.full((b, t), -1.0, requires_grad=True),
        logp_old=torch.full((b, t), -1.1),
        logp_rollout=torch.full((b, t), -1.2),
        advantages=torch.tensor([1.0, -1.0]),
        mask=torch.ones(b, t),
        topk_ids=torch.zeros(b, t, k, dtype=torch.long),
        topk_logp=torch.full((b, t, k), -2.0, requires_grad=True),
        topk_logp_old=torch.full((b, t, k), -2.0),
        topk_logp_rollout=torch.full((b, t, k), -2.0),
    )
    metrics = build_estimator(preset)(batch).metrics
    centering = {"loss/centering", "centering/rho_tail/mean", "centering/head_mass/rollout"}
    assert set(metrics) == METRIC_NAMES | (centering if PRESETS[preset].centering else set())
    # raw staleness ratio e^0.1 and numerical ratio e^0.1, before any correction
    assert metrics["staleness/ratio/mean"] == pytest.approx(math.exp(0.1), rel=1e-6)
    assert metrics["numerical/is_weight/mean"] == pytest.approx(math.exp(0.1), rel=1e-6)
    assert metrics["total/is_weight/max"] == pytest.approx(math.exp(0.2), rel=1e-6)
