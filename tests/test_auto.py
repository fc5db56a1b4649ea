"""train.correction=auto's controller (tether.auto): each cause's choice from one step's
figures, switched on after k material steps of the last w and off after m negligible ones
in a row, exactly; the
estimator and sync policy each choice trains with; the config rules. End to end:
tests/test_auto_run.py."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tether.advice import ESS_MARGIN, ESS_TAU, ROUTING_SHARE, TAIL_BAND
from tether.auto import NUMERICAL, OFF_AFTER, ON_AFTER, Base, Controller, Switch, targets
from tether.config import ConfigError, load_config
from tether.estimators import build_estimator
from tether.trainer import Trainer
from tether.weights.gate import StalenessGate
from tether.weights.policy import BoundedK, EssTrigger, Switched

N = 256  # 32 prompts x 8 samples: the numerical bar 1/N = 3.9e-3


def row(numerical: bool = False, stale: bool = False, heavy: bool = False,
        routing: float | None = None) -> dict[str, float]:
    """One step's logged split: material or negligible on each cause."""
    chi2 = 2e-2 if numerical else 1e-4
    out = {"numerical/k3_kl/mean": 1e-3 if numerical else 1e-5,
           "numerical/ess/seq": 1 / (1 + chi2),
           "numerical/abs_log_ratio/max": TAIL_BAND + 0.5 if heavy else 0.3,
           "staleness/k3_kl/mean": 0.2 if stale else 1e-3,
           "staleness/ess/token": ESS_TAU + ESS_MARGIN - 0.1 if stale else 0.95}
    if routing is not None:
        out["numerical/routing_disagreement/any_layer"] = routing
    return out


def drive(rows: list[dict], k: int = ON_AFTER, m: int = OFF_AFTER,
          w: int | None = None, pool: int | None = None) -> tuple[Controller, list]:
    c = Controller(N, k, m, w, pool)
    changes = []
    for step, r in enumerate(rows, start=1):
        changes += c.observe(r, step)
    return c, [(ch.step, ch.cause, ch.old, ch.new) for ch in changes]


def test_material_turns_on_after_k_and_off_after_m():
    rows = [row(numerical=True)] * 5 + [row()] * (OFF_AFTER + 2)
    c, changes = drive(rows)
    # On after the k-th material step (3), in force from step 4; off after the m-th
    # negligible one in a row (step 5 + m), in force from the step after.
    assert changes == [(3, "numerical", "none", "cis"),
                       (5 + OFF_AFTER, "numerical", "cis", "none")]
    assert c.numerical == "none" and c.staleness == "plain"


def test_flapping_evidence_never_switches_in_a_row_and_does_in_a_window():
    rows = [row(numerical=True), row()] * 10 + [row(stale=True), row(stale=True), row()] * 5
    assert drive(rows)[1] == []
    # k of the last w: evidence on every other step turns on at the window (steps 1, 3, 5),
    # and m = 10 negligible steps in a row never come to turn it off.
    rows = [row(numerical=True), row()] * 15
    assert drive(rows, m=10, w=5)[1] == [(5, "numerical", "none", "cis")]
    # Isolated dips (2 of any 5 at most) never switch, in a window either.
    assert drive([row(stale=True), row(), row()] * 10, w=5)[1] == []


def test_pooled_evidence_judges_the_last_steps_as_inspect_judges_a_run():
    # Numerical evidence on every other step: pooled over 2 steps, the mean sequence chi2
    # ((2e-2 + 1e-4) / 2) is over 1/N on every step, so it turns on after k = 3 steps.
    flapping = [row(numerical=True), row()] * 10
    assert drive(flapping)[1] == []
    assert drive(flapping, pool=2)[1] == [(3, "numerical", "none", "cis")]
    # One staleness dip, pooled over 5 steps: the lowest ESS keeps it material on its step and
    # the 4 after it, so on after the 3rd; off after m negligible pools in a row (steps 8-13).
    dip = [row()] * 2 + [row(stale=True)] + [row()] * 15
    assert drive(dip)[1] == []
    assert drive(dip, pool=5)[1] == [(5, "staleness", "plain", "dlc"),
                                     (7 + OFF_AFTER, "staleness", "dlc", "plain")]
    # A checkpoint carries the pool: a controller restored mid-pool switches as a straight one.
    c, first = drive(dip[:4], pool=5)
    d = Controller(N, pool=5)
    d.load_state_dict(json.loads(json.dumps(c.state_dict())))
    rest = [(ch.step, ch.cause, ch.old, ch.new)
            for step, r in enumerate(dip[4:], start=5) for ch in d.observe(r, step)]
    assert first + rest == drive(dip, pool=5)[1]
    with pytest.raises(ValueError, match="pool=0"):
        Controller(N, pool=0)


def test_a_streak_broken_once_starts_again():
    rows = [row(stale=True)] * 2 + [row()] + [row(stale=True)] * 3
    assert drive(rows)[1] == [(6, "staleness", "plain", "dlc")]
    assert drive(rows, w=5)[1] == [(4, "staleness", "plain", "dlc")]  # steps 1, 2, 4 of 1-5
    # The window counts only its last w steps: material at 1, 2 and 7 is never 3 in 5.
    assert drive([row(stale=True)] * 2 + [row()] * 4 + [row(stale=True)] + [row()] * 3,
                 w=5)[1] == []
    # Once on, one negligible step among material ones does not turn it off, nor m - 1 of them.
    rows = [row(stale=True)] * 3 + [row()] * (OFF_AFTER - 1) + [row(stale=True)] + [row()] * OFF_AFTER
    for w in (None, 5):
        assert drive(rows, w=w)[1] == [(3, "staleness", "plain", "dlc"),
                                       (3 + OFF_AFTER + OFF_AFTER, "staleness", "dlc", "plain")]


def test_the_kind_changes_after_k_steps_of_the_other_kind():
    rows = [row(numerical=True)] * 3 + [row(numerical=True, heavy=True)] * 3
    assert drive(rows)[1] == [(3, "numerical", "none", "cis"), (6, "numerical", "cis", "icepop")]
    # From none, the kind the window called for most: icepop on 2 of the 3 material steps.
    rows = [row(numerical=True, heavy=True), row(numerical=True), row(numerical=True, heavy=True)]
    assert drive(rows)[1] == [(3, "numerical", "none", "icepop")]
    rows = [row(numerical=True), row(numerical=True, heavy=True), row(numerical=True)]
    assert drive(rows, w=5)[1] == [(3, "numerical", "none", "cis")]


def test_both_causes_switch_independently():
    rows = [row(numerical=True, stale=True)] * 3 + [row(stale=True)] * OFF_AFTER
    c, changes = drive(rows)
    assert changes == [(3, "numerical", "none", "cis"), (3, "staleness", "plain", "dlc"),
                       (3 + OFF_AFTER, "numerical", "cis", "none")]
    assert c.staleness == "dlc"


def test_targets_follow_the_advice_rules():
    from tether.advice import evidence_from_rows

    def t(r: dict) -> tuple[str, str]:
        return targets(evidence_from_rows([r], N))[:2]

    assert t(row()) == ("none", "plain")
    assert t(row(numerical=True)) == ("cis", "plain")
    assert t(row(numerical=True, heavy=True)) == ("icepop", "plain")  # a heavy tail: mask
    assert t(row(numerical=True, routing=ROUTING_SHARE + 0.01)) == ("icepop", "plain")
    assert t(row(numerical=True, routing=ROUTING_SHARE - 0.01)) == ("cis", "plain")
    assert t(row(heavy=True)) == ("none", "plain")  # a peak alone is not a material cause
    assert t(row(stale=True)) == ("none", "dlc")
    assert targets(None)[:2] == ("none", "plain")  # nothing logged: no evidence to correct
    # The bar itself: ESS exactly at tau + margin is not material.
    at_bar = {**row(), "staleness/k3_kl/mean": 0.1, "staleness/ess/token": ESS_TAU + ESS_MARGIN}
    assert t(at_bar) == ("none", "plain")


@given(st.lists(st.booleans(), max_size=40), st.integers(1, 4), st.integers(0, 3),
       st.integers(1, 8))
def test_switch_is_the_hysteresis_rule(material, k, extra, m):
    """The rule, restated: among the steps after the last change, the choice turns on at step
    i exactly when at least k of the last w (ending at i) called for it, and off exactly when
    the last m all called for none."""
    w = k + extra
    s, active, last_change = Switch("off"), "off", 0
    for i, mat in enumerate(material, start=1):
        since = material[last_change:i]
        if active == "off":
            want = sum(since[-w:]) >= k
        else:
            want = len(since) >= m and not any(since[-m:])
        assert s.update("on" if mat else "off", "off", k, m, w) == want
        if want:
            active, last_change = ("off" if active == "on" else "on"), i
        assert s.active == active


def test_controller_state_round_trips():
    c, _ = drive([row(numerical=True)] * 4 + [row(stale=True)] * 2)
    d = Controller(N)
    d.load_state_dict(c.state_dict())
    assert (d.num, d.stale) == (c.num, c.stale)
    assert d.state_dict() == c.state_dict()


def test_change_line_names_step_cause_figure_and_threshold():
    c = Controller(N, 1, 1)
    (change,) = c.observe(row(stale=True), 7)
    assert change.line.startswith("tether: auto: staleness plain -> dlc from step 8 (")
    assert "lowest token ESS 0.600 < 0.7" in change.line
    assert c.evidence["auto/staleness/ess"] == pytest.approx(0.6)
    assert c.evidence["auto/numerical/bar"] == pytest.approx(1 / N)


# --- what each choice trains with ------------------------------------------------------------


@pytest.mark.parametrize("estimator", ["tis", "dlc", "cis", "decoupled", "reweight", "ppo+cis"])
def test_base_refuses_an_estimator_that_already_corrects(estimator):
    with pytest.raises(ValueError, match="train.correction=auto"):
        Base.of(estimator, {})


def test_each_choice_composes_the_users_objective():
    grpo = Base.of("grpo", {"clip_high": 0.3})
    for numerical, correction in (("none", "none"), ("cis", "cis"), ("icepop", "icepop")):
        e = grpo.estimator(numerical, "plain")
        assert (e.objective.name, e.correction.name, e.centering) == ("ppo", correction, False)
        assert e.params["clip_high"] == 0.3  # the user's parameters are kept
    # Staleness handled: grpo's own ratio pi_theta/pi_old (clipped) weights it, centered when
    # the batch has the top-K (dlc_clip's form).
    assert grpo.estimator("center", "dlc").spec == build_estimator("dlc_clip", clip_high=0.3).spec
    assert grpo.estimator("cis", "dlc").spec[:3] == ("ppo", "cis", False)  # no top-K: the cap
    # naive (pg) has no ratio: stale_is stands in while staleness is handled; both is dlc.
    naive = Base.of("naive", {})
    assert naive.estimator("none", "plain").spec[:3] == ("pg", "none", False)
    assert naive.estimator("none", "dlc").spec[:3] == ("stale_is", "none", False)
    assert naive.estimator("center", "dlc").spec == build_estimator("dlc").spec
    assert naive.can_center and grpo.can_center and not Base.of("vespo", {}).can_center


def test_the_rule_on_tensors_centers_while_staleness_is_handled():
    from tether.api import Auto

    auto = Auto("grpo", batch=N, on_after=1, off_after=1)
    assert auto.choice(has_topk=True) == ("none", "plain") and not auto.centers
    auto.observe(row(numerical=True), 1)
    assert auto.choice(has_topk=True) == ("cis", "plain")  # numerical alone: the cap
    lines = auto.observe(row(stale=True), 2)  # staleness: DLC's handling, the cap turned off
    assert [line.split(" from ")[0] for line in lines] == [
        "tether: auto: numerical cis -> none", "tether: auto: staleness plain -> dlc"]
    assert auto.handles_staleness and auto.centers
    assert auto.choice(has_topk=True) == ("center", "dlc")
    assert auto.choice(has_topk=False) == ("none", "dlc")  # no top-K: uncentered
    assert auto.codes(has_topk=True) == {"auto/numerical": 3.0, "auto/staleness": 1.0}
    assert auto.estimator(has_topk=True).spec[:3] == ("ppo", "none", True)
    with pytest.raises(ValueError, match="on_after=4 steps of the last window=3"):
        Auto("grpo", batch=N, on_after=4, window=3)
    vespo = Auto("vespo", batch=N, on_after=1, off_after=1)
    vespo.observe(row(numerical=True, stale=True), 1)
    assert not vespo.centers and vespo.choice(has_topk=True) == ("cis", "dlc")  # no head weight


def test_trainer_use_rebuilds_only_a_new_spec(random_model):
    from tether.config import TrainConfig
    from tether.rollout.types import SamplingParams

    trainer = Trainer(random_model, TrainConfig(estimator="grpo"), SamplingParams())
    same = trainer.estimator
    trainer.use(build_estimator("grpo").spec)
    assert trainer.estimator is same  # a fixed run's estimator is never rebuilt
    trainer.use(build_estimator("dlc").spec)
    assert trainer.estimator.spec == build_estimator("dlc").spec


def test_switched_policy_follows_the_choice():
    """The configured policy's schedule while plain, the re-sync's while handled; the ESS
    trigger armed in both (a batch past DLC's drift point re-syncs at once, as dlc's)."""
    p = Switched(BoundedK(4), EssTrigger(ESS_TAU))
    assert p.spec == "bounded:4" and p.measures_ess and p.trips(0.49) and not p.trips(0.5)
    assert not p.publishes(behind=3, blocked=False, tripped=False)  # lazily, as bounded:4
    assert p.publishes(behind=3, blocked=False, tripped=True)  # a trip publishes at once
    p.on = True
    assert p.spec == "ess:0.5" and p.measures_ess and p.trips(0.49) and not p.trips(0.5)
    assert p.publishes(behind=3, blocked=False, tripped=True)


def test_config_rules():
    cfg = load_config(None, ["train.correction=auto"])
    assert isinstance(StalenessGate.of(cfg).policy, Switched)
    assert not isinstance(StalenessGate.of(load_config(None, [])).policy, Switched)
    with pytest.raises(ConfigError, match="train.estimator: train.correction=auto chooses"):
        load_config(None, ["train.correction=auto", "train.estimator=tis"])
    with pytest.raises(ConfigError, match="arms the ESS re-sync at 0.5 itself"):
        load_config(None, ["train.correction=auto", "sync.policy=ess:0.5"])
    with pytest.raises(ConfigError, match="arms the ESS re-sync at 0.5 itself"):
        load_config(None, ["train.correction=auto", "loop.mode=async", "loop.window=ess",
                           "sync.policy=bounded:2", "loop.max_staleness=2"])
    with pytest.raises(ConfigError, match="train.auto_on_after"):
        load_config(None, ["train.correction=auto", "train.auto_on_after=0"])
    with pytest.raises(ConfigError, match="train.auto_on_after: 4 steps of the last"):
        load_config(None, ["train.correction=auto", "train.auto_on_after=4", "train.auto_window=3"])
    # An async auto run under the ESS window's default rule for trips it may turn on.
    cfg = load_config(None, ["train.correction=auto", "loop.mode=async", "sync.policy=bounded:2",
                             "loop.max_staleness=2"])
    assert cfg.loop.after_trip == "regenerate"
    assert load_config(None, ["loop.mode=async"]).loop.after_trip == "window"


def test_codes_are_documented_in_order():
    assert NUMERICAL == ("none", "cis", "icepop", "center")
    assert math.isclose(1 / N, 0.00390625)


def test_a_resync_hides_staleness_until_the_lag_builds_back():
    def at(versions: float, stale: bool) -> dict[str, float]:
        return {**row(stale=stale), "staleness/versions/batch": versions}

    # Material at 8 versions behind: on. Then a re-sync: fresh batches (1-7 versions) with a
    # high ESS are no evidence, however many; at 8 or more versions they count again.
    rows = [at(8, True)] * 3 + [at(v, False) for v in range(1, 8)] * 2 + [at(9, False)] * OFF_AFTER
    _, changes = drive(rows)
    assert changes == [(3, "staleness", "plain", "dlc"),
                       (3 + 14 + OFF_AFTER, "staleness", "dlc", "plain")]
    # A fresh step breaks no streak: two stale-enough negligible steps, a fresh one, m - 2 more.
    rows = [at(8, True)] * 3 + [at(8, False)] * 2 + [at(1, False)] + [at(8, False)] * (OFF_AFTER - 2)
    assert drive(rows)[1][-1] == (4 + OFF_AFTER, "staleness", "dlc", "plain")
    # No lag at all (k3 and the ratio at rounding): off after m steps, fresh or not.
    gone = {**row(), "staleness/k3_kl/mean": 0.0, "staleness/ess/token": 1.0,
            "staleness/versions/batch": 0.0}
    assert drive([at(8, True)] * 3 + [gone] * OFF_AFTER)[1][-1] == \
        (3 + OFF_AFTER, "staleness", "dlc", "plain")
