"""Metrics sinks. JSONL in the run directory is the default and the source of truth.

`open_logger(run_dir, ...)` returns one `RunLogger` that writes every row to
RUN_DIR/metrics.jsonl and, when turned on (`log.tensorboard`, `log.wandb`), the numeric
values to TensorBoard (RUN_DIR/tb) and Weights & Biases (offline by default: RUN_DIR/wandb,
`wandb sync` uploads it later). A sink that is off is a `NullSink`, so the loop never
asks which sinks exist. tensorboard and wandb are optional extras:
`pip install 'tether[tensorboard]'`, `pip install 'tether[wandb]'`.
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
from pathlib import Path
from typing import Any, Protocol

from tether.errors import MissingPackageError


def _clean(v: Any) -> Any:
    # JSON has no NaN/inf: write them as strings so a bad step stays visible in the log.
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class Sink(Protocol):
    def log(self, row: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class NullSink:
    """A sink that is off."""

    def log(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class JsonlLogger:
    """Appends one JSON object per step to `path`; each row is on disk when `log` returns."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, row: dict[str, Any]) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({k: _clean(v) for k, v in row.items()}) + "\n")

    def close(self) -> None:
        pass


def _scalars(row: dict[str, Any]) -> dict[str, float]:
    """The finite-or-not numeric values of a row, without `step` (the x axis)."""
    return {k: float(v) for k, v in row.items()
            if k != "step" and isinstance(v, numbers.Real) and not isinstance(v, bool)}


class TensorBoardSink:
    """Scalars to a TensorBoard event file under `log_dir`, at x = row["step"]."""

    def __init__(self, log_dir: Path):
        require("tensorboard", "log.tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def log(self, row: dict[str, Any]) -> None:
        step = int(row.get("step", 0))
        for k, v in _scalars(row).items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """Rows to a Weights & Biases run (mode offline: no network, files under `run_dir`/wandb)."""

    def __init__(self, run_dir: Path, project: str, mode: str, config: dict[str, Any] | None,
                 name: str | None = None):
        require("wandb", "log.wandb")
        import wandb

        self.run = wandb.init(project=project, dir=str(run_dir), mode=mode, config=config,
                              name=name or Path(run_dir).name, reinit="create_new",
                              settings=wandb.Settings(silent=True, console="off"))

    def log(self, row: dict[str, Any]) -> None:
        self.run.log(_scalars(row), step=int(row.get("step", 0)))

    def close(self) -> None:
        self.run.finish()


class RunLogger:
    """Fans each row out to JSONL (always) and the optional sinks."""

    def __init__(self, jsonl: JsonlLogger, *sinks: Sink):
        self.jsonl = jsonl
        self.sinks = sinks

    @property
    def path(self) -> Path:
        return self.jsonl.path

    def log(self, row: dict[str, Any]) -> None:
        self.jsonl.log(row)
        for sink in self.sinks:
            sink.log(row)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()


def require(package: str, key: str) -> None:
    """Raise ImportError naming the config key and the install command if `package` is absent."""
    if importlib.util.find_spec(package) is None:
        raise MissingPackageError(f"{key}=true needs the {package} package: "
                                  f"pip install 'tether[{package}]' (or set {key}=false)")


def open_logger(run_dir: Path, tensorboard: bool = False, wandb: bool = False,
                wandb_project: str = "tether", wandb_mode: str = "offline",
                config: dict[str, Any] | None = None) -> RunLogger:
    """The run's logger: RUN_DIR/metrics.jsonl plus the sinks that are turned on."""
    run_dir = Path(run_dir)
    return RunLogger(
        JsonlLogger(run_dir / "metrics.jsonl"),
        TensorBoardSink(run_dir / "tb") if tensorboard else NullSink(),
        WandbSink(run_dir, wandb_project, wandb_mode, config) if wandb else NullSink(),
    )


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The rows a run wrote (for tests, `tether inspect` and experiments)."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]
