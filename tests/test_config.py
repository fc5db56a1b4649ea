"""Config loading: YAML + dotted overrides, validated at load with the culprit named."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from tether.config import ConfigError, describe_fields, dump_config, load_config, parse_overrides

REPO_CONFIG = "configs/countdown.yaml"


def test_overrides_parse_as_yaml_values():
    tree = parse_overrides(["train.lr=3e-4", "rollout.precision=fp8", "train.estimator_params={cap: 3}"])
    assert tree == {"train": {"lr": 3e-4, "estimator_params": {"cap": 3}},
                    "rollout": {"precision": "fp8"}}


def test_file_then_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("train:\n  lr: 0.001\n  steps: 5\n")
    cfg = load_config(p, ["train.steps=7"])
    assert (cfg.train.lr, cfg.train.steps) == (0.001, 7)
    assert cfg.rollout.group_size == 8  # untouched default


def test_shipped_config_loads_and_round_trips(tmp_path):
    cfg = load_config(REPO_CONFIG)
    p = tmp_path / "resolved.yaml"
    p.write_text(dump_config(cfg))
    assert load_config(p) == cfg


@pytest.mark.parametrize(
    "override,culprit",
    [
        ("train.lr=-1", "train.lr"),
        ("train.lrr=1", "train.lrr: unknown key"),
        ("rollout.precision=fp4", "rollout.precision"),
        ("rollout.top_p=1.5", "rollout.top_p"),
        ("task.num_min=20", "num_min (20) must be <= num_max"),
        ("rollout.group_size=1", "rollout.group_size=1"),
        ("train.minibatches=3", "train.minibatches=3"),
        ("train.estimator=bogus", "unknown estimator 'bogus'"),
        ("sync.policy=sometimes", "sync.policy"),
        ("task.name=chess", "task"),
        ("nonsense", "not key=value"),
    ],
)
def test_bad_values_fail_at_load_naming_the_key(override, culprit):
    with pytest.raises(ConfigError) as e:
        load_config(REPO_CONFIG, [override])
    assert culprit in str(e.value)


def test_config_is_frozen():
    cfg = load_config()
    with pytest.raises(ValidationError, match="frozen"):
        cfg.train.lr = 1.0


def test_every_field_is_documented():
    lines = describe_fields()
    assert any(line.startswith("train.lr = 0.0001") for line in lines)
    assert all(line.split("\n")[1].strip() for line in lines), "a field without description"


def test_config_fields_lists_every_section():
    from tether.config import format_fields
    from tether.config.schema import Config

    out = format_fields()
    for section in Config.model_fields:
        assert f"[{section}]" in out, section
    assert "weights.snapshot_compress = 'none'" in out
