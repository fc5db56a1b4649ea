"""Sync policies, lagged deliveries, the ESS re-sync and the snapshot store's bookkeeping."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tether.config import TrainConfig, load_config
from tether.estimators import ess_token
from tether.logger import read_jsonl
from tether.loops import train
from tether.models import load_model
from tether.models.tokenizer import encode_exact
from tether.rollout.hf import HFGenerator
from tether.rollout.types import SamplingParams
from tether.scoring import collate
from tether.tasks import build_task
from tether.trainer import Trainer, group_advantages
from tether.weights import (
    BoundedK,
    EssTrigger,
    EveryK,
    ResyncK,
    parse_sync_policy,
    resolve_policy_spec,
)
from tether.weights.gate import StalenessGate
from tether.weights.publisher import InProcessPublisher
from tether.weights.snapshots import SnapshotStore
from tether.weights.synchronizer import Synchronizer

# -- parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,policy", [
    ("every:1", EveryK(1)), ("every:4", EveryK(4)), ("bounded:0", BoundedK(0)),
    ("bounded:3", BoundedK(3)), ("ess:0.5", EssTrigger(0.5)), ("ess:1", EssTrigger(1.0)),
    ("ess:0.5:max=8", EssTrigger(0.5, 8)), ("resync:12", ResyncK(12)),
])
def test_parse_valid_specs(spec, policy):
    assert parse_sync_policy(spec) == policy
    assert parse_sync_policy(policy.spec) == policy  # spec round-trips


@pytest.mark.parametrize("spec,message", [
    ("sometimes", "unknown sync policy"), ("every:0", "K must be >= 1"),
    ("every:x", "K must be an integer"), ("bounded:-1", "K must be >= 0"),
    ("ess:0", "TAU must be in (0, 1]"), ("ess:1.5", "TAU must be in (0, 1]"),
    ("ess:half", "TAU must be a number"), ("ess:0.5:min=3", "unknown option 'min=3'"),
    ("ess:0.5:max=0", "max must be >= 1"), ("every:1:2", "expected every:K"),
    ("resync:0", "K must be >= 1"), ("resync", "expected resync:K"),
])
def test_parse_bad_specs_name_the_fix(spec, message):
    with pytest.raises(ValueError, match="valid forms|must|unknown option") as e:
        parse_sync_policy(spec)
    assert message in str(e.value)


def test_auto_takes_the_presets_policy():
    assert resolve_policy_spec("auto", "dlc") == "ess:0.5"
    assert resolve_policy_spec("auto", "dlc_clip") == "ess:0.5"  # dlc with a clip: same policy
    assert resolve_policy_spec("auto", "reweight") == "every:1"  # DLC's baseline: no re-sync
    assert resolve_policy_spec("auto", "grpo") == "every:1"
    assert resolve_policy_spec("every:3", "dlc") == "every:3"  # explicit wins
    cfg = load_config("configs/countdown.yaml", ["train.estimator=dlc", "rollout.logprobs_topk=8"])
    assert cfg.sync.policy == "ess:0.5"  # resolved at load: the run's config.yaml says so
    assert load_config("configs/countdown.yaml").sync.policy == "every:1"


@pytest.mark.parametrize("overrides,culprit", [
    (["sync.on_trip=regenerate"], "sync.on_trip=regenerate"),
    (["sync.policy=bounded:2", "sync.lag=3"], "sync.lag=3"),
    (["sync.lag=-1"], "sync.lag"),
    (["sync.on_trip=drop"], "sync.on_trip"),
    (["train.estimator=dlc", "rollout.logprobs_topk=0"], "rollout.logprobs_topk=0"),
])
def test_bad_sync_config_fails_at_load(overrides, culprit):
    from tether.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config("configs/countdown.yaml", overrides)
    assert culprit in str(e.value)


# -- deliveries and snapshots, on a fake trainer whose weights equal its version ---------------


class FakeTrainer:
    def __init__(self):
        self.model = nn.Linear(1, 1, bias=False)
        self.version = 0
        self.model.weight.data.fill_(0.0)

    def step(self):
        self.version += 1
        self.model.weight.data.fill_(float(self.version))


class FakeGenerator:
    def __init__(self):
        self.version = 0
        self.weight = 0.0

    def load_weights(self, state_dict, version):
        self.version, self.weight = version, float(state_dict["weight"])


def synchronizer(policy, gen, trainer, **kw) -> Synchronizer:
    return Synchronizer(policy, InProcessPublisher(gen), SnapshotStore(trainer.model),
                        trainer.model.state_dict(), **kw)


def after_step(sync: Synchronizer, trainer, step: int, tripped: bool = False) -> dict[str, float]:
    return sync.after_step(step, trainer.version, trainer.model.state_dict(), tripped)


def drive(policy: str, lag: int, steps: int):
    trainer, gen = FakeTrainer(), FakeGenerator()
    sync = synchronizer(parse_sync_policy(policy), gen, trainer, lag=lag)
    seen = []
    for step in range(steps):
        stale = trainer.version - gen.version  # staleness of the batch this step trains on
        trainer.step()
        m = after_step(sync, trainer, step)
        assert gen.weight == gen.version  # the delivered weights are that version's
        seen.append((stale, gen.version, int(m["snapshots/count"]), int(m["sync/synced"])))
    return seen, sync


def test_every_k_without_lag():
    seen, _ = drive("every:2", lag=0, steps=5)
    assert [s[1] for s in seen] == [0, 2, 2, 4, 4]
    assert [s[0] for s in seen] == [0, 1, 0, 1, 0]
    assert [s[2] for s in seen] == [1] * 5  # only the generator's own version is kept


def test_lag_k_keeps_generator_k_behind_and_k_plus_1_snapshots():
    seen, sync = drive("every:1", lag=3, steps=7)
    assert [s[0] for s in seen] == [0, 1, 2, 3, 3, 3, 3]  # staleness ramps up to the lag
    assert [s[1] for s in seen] == [0, 0, 0, 1, 2, 3, 4]
    assert [s[2] for s in seen] == [2, 3, 4, 4, 4, 4, 4]
    assert sync.snapshots.versions == [4, 5, 6, 7]


def test_bounded_k_never_trains_more_than_k_stale():
    seen, _ = drive("bounded:2", lag=0, steps=7)
    assert [s[0] for s in seen] == [0, 1, 2, 0, 1, 2, 0]
    assert BoundedK(2).admits(sampled_version=3, trained_version=5)
    assert not BoundedK(2).admits(sampled_version=3, trained_version=6)


def test_max_interval_forces_a_resync():
    # ess:1.0:max=3 with a lag that never delivers: only the interval bound syncs.
    seen, _ = drive("ess:1.0:max=3", lag=100, steps=7)
    assert [s[1] for s in seen] == [0, 0, 3, 3, 3, 6, 6]
    assert [s[3] for s in seen] == [0, 0, 1, 0, 0, 1, 0]


def test_resync_k_is_the_ess_trigger_on_a_fixed_schedule():
    # Lag 2, every step lagged; a re-sync to the trainer's version every 3 steps without one.
    seen, _ = drive("resync:3", lag=2, steps=8)
    assert [s[1] for s in seen] == [0, 0, 3, 3, 3, 6, 6, 6]  # version the generator holds
    assert [s[0] for s in seen] == [0, 1, 2, 0, 1, 2, 0, 1]  # staleness never passes the lag here
    assert [s[3] for s in seen] == [0, 0, 1, 0, 0, 1, 0, 0]
    seen, _ = drive("resync:4", lag=1, steps=6)  # lagged deliveries in between: gen = V - 1
    assert [s[1] for s in seen] == [0, 1, 2, 4, 4, 5]
    policy = ResyncK(4)
    assert not policy.trips(0.0) and not policy.measures_ess
    assert policy.publishes(behind=4, blocked=False, tripped=False)
    assert not policy.publishes(behind=3, blocked=False, tripped=True)


def test_sync_state_round_trips():
    _, sync = drive("every:1", lag=2, steps=4)
    state = sync.state_dict()
    weights = {v: sync.snapshots.state(v) for v in state["snapshot_versions"]}
    trainer, gen = FakeTrainer(), FakeGenerator()
    for _ in range(4):
        trainer.step()
    fresh = synchronizer(parse_sync_policy("every:1"), gen, trainer, lag=2)
    fresh.load_state_dict(state, weights)
    assert gen.version == sync.generator_version == 2 and gen.weight == 2.0
    assert fresh.snapshots.versions == sync.snapshots.versions == [2, 3, 4]


# -- the ESS trigger on a real stale batch -------------------------------------------------------

SAMPLING = SamplingParams(n=4, max_new_tokens=12)


@pytest.fixture(scope="module")
def stale_batch(warm_model_dir):
    """A batch sampled at version 0, the trainer moved to version 2, and the measured ESS."""
    model, tokenizer = load_model(warm_model_dir)
    task = build_task("countdown")
    torch.manual_seed(0)
    trainer = Trainer(model, TrainConfig(lr=1e-3), SAMPLING)
    gens = [HFGenerator(model, tokenizer.eos_token_id, tokenizer.pad_token_id, "fp32")
            for _ in range(3)]
    # Built at version 0: each keeps version 0 for its generator. Gates made per test.
    syncs = [synchronizer(EssTrigger(0.5), g, trainer, lag=8) for g in gens]
    problems = [task.train_problem(i) for i in range(8)]
    rollouts = gens[0].generate([encode_exact(tokenizer, p.prompt) for p in problems],
                                [p.id for p in problems], SAMPLING, seed=0)
    for ro in rollouts:
        ro.reward = task.reward(problems[ro.group_id],
                                tokenizer.decode(ro.response_ids, skip_special_tokens=True)).total
    batch = collate(rollouts, tokenizer.pad_token_id)
    logp_old, topk = trainer.score_old(batch, syncs[0].snapshots.model_at(0))
    adv = group_advantages(batch.rewards, batch.group_ids, True)
    for _ in range(2):
        trainer.train_on(batch, adv, logp_old, topk)
    logp_now, _ = trainer.score_old(batch, model)
    ess = float(ess_token(logp_now.double() - logp_old.double(), batch.response_mask))
    assert trainer.version == 2 and 0.05 < ess < 0.999, ess
    return trainer, syncs, batch, (adv, logp_old, topk), ess


def test_ess_policy_trips_exactly_below_the_threshold(stale_batch):
    trainer, (at, above, _), batch, (adv, logp_old, topk), ess = stale_batch
    gate_at = StalenessGate(EssTrigger(ess), "train")  # ESS == tau: not below, no re-sync
    gate_above = StalenessGate(EssTrigger(math.nextafter(ess, 1.0)), "train")  # one float above: trips
    # on_trip=train: the batch is trained on; its ESS is read off the training forward,
    # whose logp at version 2 (before this step's update) equals the no-grad one exactly.
    class NoScoring:  # the trainer, refusing to score: nothing but the training forward is read
        version, model = trainer.version, None

        def score_old(self, batch, model):
            raise AssertionError("on_trip=train reads the ESS off the training forward")

    assert gate_at.before(batch, logp_old, NoScoring()) is False
    assert gate_above.before(batch, logp_old, NoScoring()) is False
    _, logp = trainer.train_on(batch, adv, logp_old, topk)
    assert trainer.version == 3
    m_at = after_step(at, trainer, 2, gate_at.after(logp, NoScoring())) | gate_at.metrics()
    m_above = after_step(above, trainer, 2, gate_above.after(logp, NoScoring())) | gate_above.metrics()
    assert m_at["sync/ess/token"] == m_above["sync/ess/token"] == ess
    assert (m_at["sync/tripped"], m_at["sync/synced"]) == (0.0, 0.0)
    assert at.generator_version == 0  # the lag (8) delivers nothing either
    assert at.snapshots.versions == [0, 3]  # 3: pending for a later lagged delivery
    assert (m_above["sync/tripped"], m_above["sync/synced"]) == (1.0, 1.0)
    assert above.generator_version == trainer.version == 3  # re-synced after the step
    assert above.snapshots.versions == [3] and m_above["snapshots/count"] == 1  # version 0 freed
    assert m_above["snapshots/freed"] == 1


def test_regenerate_resyncs_before_training(stale_batch):
    trainer, (_, _, regen), batch, (_, logp_old, _), _ = stale_batch
    gate = StalenessGate(EssTrigger(1.0), "regenerate")  # any staleness trips
    assert gate.before(batch, logp_old, trainer) is True  # drop the batch
    regen.resync(trainer.version, trainer.model.state_dict())  # the loop syncs, then regenerates
    assert regen.generator_version == trainer.version > 0
    assert gate.after(None, trainer) is False  # decided before training
    m = after_step(regen, trainer, 2) | gate.metrics()
    assert (m["sync/regenerated"], m["sync/synced"]) == (1.0, 1.0)
    assert m["sync/ess/token"] < 1.0 and m["sync/tripped"] == 1.0
    assert regen.snapshots.versions == [trainer.version]


def test_regenerate_through_the_loop(warm_model_dir, tmp_path):
    # ess:0.999 trips on every stale batch; lag 2 makes every batch after the first stale.
    cfg = load_config("configs/countdown.yaml", [
        f"model.path={warm_model_dir}", f"run.dir={tmp_path}", "train.steps=3", "train.lr=3e-3",
        "rollout.prompts_per_step=4", "rollout.group_size=4", "task.eval_size=4",
        "eval.every=0", "run.progress=false", "sync.policy=ess:0.999", "sync.lag=2",
        "sync.on_trip=regenerate", "diagnostics.monitor_every=0",
    ])
    train(cfg)
    rows = read_jsonl(tmp_path / "metrics.jsonl")[1:]
    assert [r["sync/regenerated"] for r in rows] == [0.0, 1.0, 1.0]
    assert all(r["staleness/versions/batch"] == 0 for r in rows)
    assert all(r["staleness/abs_log_ratio/max"] < 1e-5 for r in rows)  # trained fresh
    assert [r["generator_version"] for r in rows] == [0, 1, 2]


def test_on_trip_train_measures_the_first_minibatch_only():
    # minibatch:2 - the second half is trained after one update; its drift is the minibatch
    # source's, which no re-sync can remove, so the trigger looks at the first half only.
    from types import SimpleNamespace

    trainer, gen = FakeTrainer(), FakeGenerator()
    sync = synchronizer(EssTrigger(0.5), gen, trainer, lag=4)
    gate = StalenessGate(EssTrigger(0.5), "train", minibatches=2)
    trainer.step()  # the batch below was sampled at version 0, training starts at 1
    batch = SimpleNamespace(response_mask=torch.ones(4, 3), sampled_at=lambda v: v == 0)
    logp_old = torch.zeros(4, 3)
    logp = torch.tensor([[0.0] * 3, [0.0] * 3, [9.0] * 3, [-9.0] * 3])
    assert gate.before(batch, logp_old, trainer) is False
    m = after_step(sync, trainer, 0, gate.after(logp, trainer)) | gate.metrics()
    assert (m["sync/ess/token"], m["sync/tripped"]) == (1.0, 0.0)
    gate.minibatches = 1  # the whole batch: e^9 dominates, ESS ~ 1/4 -> trips
    gate.before(batch, logp_old, trainer)
    m = after_step(sync, trainer, 1, gate.after(logp, trainer)) | gate.metrics()
    assert m["sync/ess/token"] == pytest.approx(0.25, abs=1e-3) and m["sync/tripped"] == 1.0
    assert gen.version == trainer.version == 1
