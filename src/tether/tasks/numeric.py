"""Any dataset of (prompt, numeric answer) rows, GSM8K style, rewarded by the final number.

Rows come from a local JSONL file (one JSON object per line; blank lines skipped) or a
parquet file (needs pyarrow). The reference number is the last number after the last
"####" in the answer (GSM8K's "... #### 42"), or the last number anywhere when there
is no "####"; a numeric answer field (42, 3.5) is taken as is. A response earns 1 when
its last number equals the reference exactly: "1,234" == "1234", "3.50" == "3.5",
"-7" is negative. Comparison goes through fractions.Fraction, never float or eval.

Split: with `eval_path`, every row of `path` trains and every row of `eval_path` is
held out; otherwise a seeded shuffle of the rows puts the first
max(1, round(eval_fraction * n)) into the held-out set. Training rows whose prompt text
also appears in the held-out set are dropped, so the two never share a prompt.
train_problem(i) cycles through the remaining rows in the seeded shuffled order.
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

from tether.errors import InputError, MissingPackageError
from tether.tasks.base import Problem, Reward

MAX_NUMBER_CHARS = 64
"""Longest number text (digits, commas, point) compared; longer runs are not numbers to us.
Keeps a response of a million digits from costing a million-digit int conversion."""

# A number: optional sign (a "-" directly after a digit is subtraction, not a sign),
# digits with optional thousands commas, optional decimal part. ASCII digits only.
_NUMBER = re.compile(r"(?:(?<![0-9])-)?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?")


def final_number(text: str) -> Fraction | None:
    """The last number written in `text`, exactly, or None if there is none (or it is too long)."""
    last = None
    for match in _NUMBER.finditer(text):
        last = match.group()
    if last is None or len(last) > MAX_NUMBER_CHARS:
        return None
    return Fraction(last.replace(",", ""))


def reference_number(answer: str) -> Fraction | None:
    """The number an answer text states: the last one after its last "####", else its last one."""
    _, marker, after = answer.rpartition("####")
    return final_number(after if marker else answer)


class NumericAnswerTask:
    """Prompts and numeric answers from a local file; reward 1 if the final numbers match.

    A problem's solution is the row's answer text; its meta holds that text as "answer"
    and the reference number as exact Fraction text as "target" ("1234", "-7/2").
    """

    name = "numeric"

    def __init__(
        self,
        path: str | Path,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        eval_fraction: float = 0.1,
        eval_path: str | Path | None = None,
        seed: int = 0,
    ) -> None:
        """Read and check every row now, so a bad file fails before training starts.

        Args:
            path: JSONL (.jsonl) or parquet (.parquet) file of rows.
            prompt_key: field holding the prompt text (a string).
            answer_key: field holding the answer: text ending in a number, or a number.
            eval_fraction: share of `path`'s rows held out when `eval_path` is None, in (0, 1).
            eval_path: a separate held-out file in the same format; then all of `path` trains.
            seed: the shuffle deciding the split and the training order.
        """
        rows = _read_rows(Path(path), prompt_key, answer_key)
        rng = random.Random(f"numeric/{seed}")
        if eval_path is None:
            if not 0.0 < eval_fraction < 1.0:
                raise InputError(f"eval_fraction must be in (0, 1), got {eval_fraction}")
            rng.shuffle(rows)
            n_eval = max(1, round(eval_fraction * len(rows)))
            eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
        else:
            eval_rows = _read_rows(Path(eval_path), prompt_key, answer_key)
            train_rows = rows
            rng.shuffle(train_rows)
        eval_prompts = {row.prompt for row in eval_rows}
        train_rows = [row for row in train_rows if row.prompt not in eval_prompts]
        if not train_rows:
            raise InputError(
                f"{path}: no training rows left after holding out {len(eval_rows)} "
                f"(eval_fraction={eval_fraction}, eval_path={eval_path}); add rows or hold out fewer"
            )
        self._train = [row.problem(f"numeric-train-{i}") for i, row in enumerate(train_rows)]
        self._eval = [row.problem(f"numeric-eval-{i}") for i, row in enumerate(eval_rows)]

    def train_problem(self, index: int) -> Problem:
        """Training row index mod n, in the seeded shuffled order."""
        if index < 0:
            raise ValueError(f"index must be >= 0, got {index}")
        return self._train[index % len(self._train)]

    def eval_problems(self) -> list[Problem]:
        """The held-out rows (a fresh list; the problems themselves are shared)."""
        return list(self._eval)

    def reward(self, problem: Problem, response: str) -> Reward:
        """1 if the response's last number equals the reference number exactly, else 0."""
        said = final_number(response)
        correct = said is not None and said == Fraction(problem.meta["target"])
        return Reward(
            total=float(correct),
            parts={"correct": float(correct), "format": float(said is not None)},
        )


@dataclass(frozen=True)
class _Row:
    """One checked row: its prompt, its answer text, and the exact reference number."""

    prompt: str
    answer: str
    target: Fraction

    def problem(self, problem_id: str) -> Problem:
        return Problem(
            id=problem_id,
            prompt=self.prompt,
            solution=self.answer,
            meta={"answer": self.answer, "target": str(self.target)},
        )


def _read_rows(path: Path, prompt_key: str, answer_key: str) -> list[_Row]:
    """All rows of a JSONL or parquet file, each checked; errors name file, line and field."""
    if path.suffix not in (".jsonl", ".parquet"):
        raise InputError(f"{path}: unknown file type {path.suffix!r}; use .jsonl or .parquet")
    if not path.is_file():
        raise InputError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        records = _jsonl_records(path)
        where = "line"
    else:
        records = enumerate(_parquet_records(path), start=1)
        where = "row"
    rows = [
        _check_row(record, f"{path}:{where} {n}", prompt_key, answer_key) for n, record in records
    ]
    if not rows:
        raise InputError(f"{path}: no rows")
    return rows


def _jsonl_records(path: Path) -> list[tuple[int, Any]]:
    """(line number, parsed JSON) for each non-blank line."""
    records = []
    with path.open("rb") as file:
        for lineno, raw in enumerate(file, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise InputError(f"{path}:line {lineno}: not UTF-8 ({err.reason})") from None
            if not line.strip():
                continue
            try:
                records.append((lineno, json.loads(line)))
            except ValueError as err:  # JSONDecodeError, or an integer too long to convert
                raise InputError(f"{path}:line {lineno}: invalid JSON ({err})") from None
    return records


def _parquet_records(path: Path) -> list[dict[str, Any]]:
    try:
        from pyarrow import parquet
    except ImportError:
        raise MissingPackageError(
            f"reading {path} needs pyarrow, which is not installed: pip install pyarrow"
        ) from None
    try:
        return parquet.read_table(path).to_pylist()
    except Exception as e:  # noqa: BLE001 -- pyarrow's errors for a damaged or foreign file
        raise InputError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from None


def _check_row(record: Any, where: str, prompt_key: str, answer_key: str) -> _Row:
    """Turn one parsed record into a _Row, or raise an InputError saying where and which field."""
    if not isinstance(record, dict):
        # A malformed row is bad data, reported like every other bad row: InputError.
        raise InputError(f"{where}: expected a JSON object, got {type(record).__name__}")
    for key in (prompt_key, answer_key):
        if key not in record:
            raise InputError(f"{where}: missing field {key!r} (fields: {sorted(record)})")
    prompt = record[prompt_key]
    if not isinstance(prompt, str) or not prompt:
        raise InputError(
            f"{where}: field {prompt_key!r} must be a non-empty string, got {prompt!r:.80}"
        )
    answer = record[answer_key]
    if isinstance(answer, str):
        target = reference_number(answer)
        if target is None:
            raise InputError(f"{where}: field {answer_key!r} states no number: {answer[-80:]!r}")
        return _Row(prompt, answer, target)
    finite_number = isinstance(answer, int) or (isinstance(answer, float) and math.isfinite(answer))
    if isinstance(answer, bool) or not finite_number:
        raise InputError(
            f"{where}: field {answer_key!r} must be a string or a finite number, got {answer!r:.80}"
        )
    # Through the shortest decimal text, so the float 0.1 means 1/10, not its binary value.
    return _Row(prompt, repr(answer), Fraction(repr(answer)))
