"""Shared fixtures: a random tiny model (fast) and a warm-started one (built once, cached);
and the suite's tiers (`SLOW`)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tether.models import build_char_tokenizer, build_tiny_model
from tether.tasks import ALPHABET
from tether.testbed import ensure_default_model

REPO = Path(__file__).resolve().parents[1]
# Tests warm-start a smaller model than the demo's, cached inside the checkout (gitignored).
TEST_CACHE = os.environ.get("TETHER_TEST_CACHE", str(REPO / ".cache" / "test-models"))
TEST_WARMSTART_STEPS = 120

# The slow tier: modules whose tests start real processes for minutes in all (rollout actors,
# trainer ranks, experiment cells, vLLM engines, killed and resumed runs). `make test` leaves
# them out (-m "not slow") to stay within its 8 minutes; `make test-slow` runs them, and
# `.ci/run` runs both tiers in full. docs/testing.md lists each tier's cost.
SLOW = {
    "test_experiments.py": "quick experiment matrices (dlc, cis, vespo, auto), resumed and reported",
    "test_records.py": "every committed record (results/) restored and summarised: tens of seconds",
    "test_auto_run.py": "train.correction=auto runs in subprocesses: switches, SIGTERM, resume",
    "test_faults.py": "killed experiments, full disks, concurrent model builds",
    "test_ray.py": "a real local Ray: actors placed, killed, replaced",
    "test_ray_nodes.py": "a real two-node Ray cluster: a node and a driver killed",
    "test_distributed.py": "gloo trainer ranks in their own processes",
    "test_sharded.py": "FSDP2 trainer runs against replicated ones; a rank killed, resumed at 1 and 4",
    "test_sharding.py": "FSDP2 primitives on two gloo ranks in their own processes",
    "test_vllm.py": "vLLM's CPU engine: start-up alone is tens of seconds",
    "test_vllm_loop.py": "a Countdown run with vLLM rollouts",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.name in SLOW:
            item.add_marker(pytest.mark.slow)


# Tiny tensors and a tiny model: one intra-op thread avoids thread-pool contention on
# a 2-core machine (seen here: tiny ops 30x slower with two contending pools).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="session")
def random_model(tokenizer):
    return build_tiny_model(len(tokenizer), seed=0)


@pytest.fixture(scope="session")
def warm_model_dir() -> Path:
    return ensure_default_model(TEST_CACHE, moe=False, seed=0,
                                warmstart_steps=TEST_WARMSTART_STEPS, verbose=False)


@pytest.fixture(scope="session")
def random_moe_dir(tmp_path_factory, tokenizer) -> Path:
    """A random-init tiny MoE saved as a model directory (routing columns, no warm-start)."""
    path = tmp_path_factory.mktemp("moe-model")
    build_tiny_model(len(tokenizer), moe=True, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
