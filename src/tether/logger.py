"""Metrics sinks. JSONL in the run directory is the default and the source of truth."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any


def _clean(v: Any) -> Any:
    # JSON has no NaN/inf: write them as strings so a bad step stays visible in the log.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class JsonlLogger:
    """Appends one JSON object per step to `path`; each row is on disk when `log` returns."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows a run wrote (for tests, `tether inspect` and experiments)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
