"""What every part of the config package shares: its two errors and the frozen section base."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from tether.errors import InputError


class ConfigError(InputError):
    """A configuration problem a person can act on: names the key, the value and the fix."""


class CrossFieldError(ValueError):
    """Settings that are each valid but conflict; `fields` are the dotted keys involved."""

    def __init__(self, fields: list[str], message: str):
        super().__init__(message)
        self.fields = fields


class Node(BaseModel):
    """A config section: unknown keys refused, frozen once validated, defaults validated too."""

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)
