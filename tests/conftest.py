"""Shared fixtures: a random tiny model (fast) and a warm-started one (built once, cached)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tether.models import build_char_tokenizer, build_tiny_model, ensure_default_model
from tether.tasks import ALPHABET

REPO = Path(__file__).resolve().parents[1]
# Tests warm-start a smaller model than the demo's, cached inside the checkout (gitignored).
TEST_CACHE = os.environ.get("TETHER_TEST_CACHE", str(REPO / ".cache" / "test-models"))
TEST_WARMSTART_STEPS = 120

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
