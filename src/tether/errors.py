"""The exceptions `tether` turns into exit codes (src/tether/cli.py).

- `InputError` (exit 2, one line): a problem the user can fix, such as a config key, a
  data file, a model directory or a run directory. Its message names the input and the
  fix. Anything else that escapes a command is a bug in tether: the CLI prints the
  traceback and asks for a report (exit 1).
- `TooManyBadSteps` (exit 3) and `StopRequested` (exit 128 + signal): a run stopped, with
  a checkpoint, by its guard or by SIGINT/SIGTERM (tether.guards).
- `RankFailed` (exit 4): a data-parallel trainer rank died (tether.distributed).
- `EnvironmentFault` (exit 5, one line): something outside tether failed: a path that
  cannot be written, a full disk, a cluster that does not answer, a process that never
  started. `environment_fault` classifies an `OSError` that escapes a command the same way.
Imports nothing from tether, so every module can raise them and the CLI can name them
without loading torch.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager


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


class EnvironmentFault(RuntimeError):
    """Something outside tether failed: the message names the path, address or process and
    what to check. Neither the user's input (InputError) nor a bug in tether."""


# OSErrors that only the machine causes: never a bug in tether, whichever line raised them.
ENVIRONMENT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM,
                      errno.EFBIG, errno.EIO, errno.EMFILE, errno.ENFILE}


def environment_fault(e: BaseException, where: str | None = None) -> EnvironmentFault | None:
    """`e` as an `EnvironmentFault` naming its path (or `where`) and cause, or None when
    it is not an OSError the machine causes."""
    if not isinstance(e, OSError) or e.errno not in ENVIRONMENT_ERRNOS:
        return None
    return EnvironmentFault(describe_os_error(e, where))


def describe_os_error(e: OSError, where: str | None = None) -> str:
    """'PATH: cause (ERRNO)' for an OSError; `where` stands in when it names no path."""
    path = e.filename if e.filename is not None else where
    cause = (e.strerror or os.strerror(e.errno)) if e.errno else str(e)
    code = f" ({errno.errorcode[e.errno]})" if e.errno in errno.errorcode else ""
    return f"{path}: {cause}{code}" if path else f"{cause}{code}"


@contextmanager
def os_errors_at(path: object) -> Iterator[None]:
    """Raise safetensors' own error for an OS failure (it carries the OS error code only in
    its text: 'I/O error: No space left on device (os error 28)') as the OSError at `path`
    it stands for, so a full disk is classified as one (`environment_fault`)."""
    try:
        yield
    except Exception as e:
        m = None if isinstance(e, OSError) else re.search(r"\(os error (\d+)\)", str(e))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), str(path)) from e
