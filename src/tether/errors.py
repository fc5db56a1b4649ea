"""The exceptions `tether` turns into exit codes (src/tether/cli.py).

- `InputError` (exit 2, one line): a problem the user can fix, such as a config key, a
  data file, a model directory or a run directory. Its message names the input and the
  fix. Anything else that escapes a command is a bug in tether: the CLI prints the
  traceback and asks for a report (exit 1).
- `TooManyBadSteps` (exit 3) and `StopRequested` (exit 128 + signal): a run stopped, with
  a checkpoint, by its guard or by SIGINT/SIGTERM (tether.guards).
- `RankFailed` (exit 4): a data-parallel trainer rank died (tether.distributed).
Imports nothing from tether, so every module can raise them and the CLI can name them
without loading torch.
"""

from __future__ import annotations


class InputError(ValueError):
    """A problem the user can fix: the message names the input and the fix."""


class TooManyBadSteps(RuntimeError):
    """`train.max_bad_steps` optimizer steps in a row were skipped for non-finite values."""


class StopRequested(RuntimeError):
    """The process was asked to stop (SIGINT/SIGTERM); the run stopped after a checkpoint."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.signum = signum


class MissingPackageError(InputError, ImportError):
    """An optional package a setting needs is not installed; the message says what to install.

    Also an ImportError, so `except ImportError` around an optional import still sees it.
    """


class RankFailed(RuntimeError):
    """A trainer rank died or failed: the data-parallel step cannot complete.

    `intact`: rank 0's weights and optimizer are still those the step started from (the
    failure came before its first optimizer step), so they can be checkpointed."""

    def __init__(self, message: str, intact: bool):
        super().__init__(message)
        self.intact = intact
