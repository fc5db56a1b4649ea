"""The choices train.correction=auto logs, replayed from a run's own rows: what the controller
makes of each step's logged figures, as the `auto/numerical`, `auto/staleness` codes the next
step would log. Shared by the end-to-end runs (tests/test_auto_run.py) and the committed
E-AUTO record (tests/test_records.py)."""

from __future__ import annotations

from typing import Any

from tether.auto import NUMERICAL, STALENESS, Controller

CENTER = float(NUMERICAL.index("center"))


def replayed(rows: list[dict[str, Any]], controller: Controller) -> list[tuple[float, float]]:
    """Each auto row's expected (auto/numerical, auto/staleness): the choice in force before
    its figures are observed; centering where staleness is handled and the batch carried the
    engine's top-K (async: one sampled before centering was chosen trains uncentered)."""
    out = []
    for r in rows:
        numerical, staleness = controller.numerical, controller.staleness
        centered = staleness != "plain" and r.get("auto/topk", 0) > 0
        out.append((CENTER if centered else float(NUMERICAL.index(numerical)),
                    float(STALENESS.index(staleness))))
        controller.observe(r, r["step"])
    return out


def logged(rows: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """Each row's logged (auto/numerical, auto/staleness)."""
    return [(r["auto/numerical"], r["auto/staleness"]) for r in rows]
