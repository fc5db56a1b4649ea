"""Hypothesis example counts, one switch for the thorough pass.

Each property runs at its own count in the suite, with no example database: every run starts
from a fresh random draw, locally as in CI (a database replays a machine's past failures, so a
test that fails at random failed there on every run and passed in CI by luck). With
TETHER_HYPOTHESIS_EXAMPLES=N every property runs at least N examples, so a false premise
cannot hide behind a lucky draw; CI runs that pass once (.ci/run).
"""

from __future__ import annotations

import os

from hypothesis import settings

THOROUGH = int(os.environ.get("TETHER_HYPOTHESIS_EXAMPLES", "0"))


def examples(n: int) -> settings:
    """Settings for a property that runs `n` examples (at least THOROUGH in the thorough pass)."""
    return settings(max_examples=max(n, THOROUGH), deadline=None, database=None)
