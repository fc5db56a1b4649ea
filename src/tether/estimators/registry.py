"""Decorator registries for objectives and mismatch corrections, and parameter checks.

An entry is a pure function. Its positional parameters name the TokenBatch fields it
reads; its keyword-only parameters are its floats (or strings, or flags), and their
defaults are the estimator's defaults. So the signature is the whole spec: nothing is
repeated (an estimator that reads `logp_prox` makes the trainer score pi_prox). An
objective also registers its source's aggregation (agg), the estimator's default agg.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from tether.estimators.base import AGGREGATIONS

F = TypeVar("F", bound=Callable[..., Any])

LENGTH_NORMS = ("none", "T", "sqrtT")
CORRECTS = ("numerical", "staleness", "both", "neither")


@dataclass(frozen=True)
class Entry:
    """One registered objective or correction."""

    name: str
    fn: Callable[..., Any]
    inputs: tuple[str, ...]  # TokenBatch fields passed positionally
    defaults: dict[str, Any]  # keyword-only parameters and their defaults
    corrects: str  # "numerical", "staleness", "both" or "neither"
    level: str  # "token" or "sequence": where the weight or ratio lives
    formula: str
    source: str
    # Objectives only: w(v) on the generator's top-K head, for centering (None: no centering).
    # Its positional parameters name fields (topk_logp, topk_logp_old, maybe advantages).
    head_weight: Callable[..., Any] | None = None
    head_inputs: tuple[str, ...] = ()  # the fields head_weight reads
    head_params: tuple[str, ...] = ()  # the objective's parameters head_weight takes
    # Objectives only: the objective already weighs by pi/mu, so a correction would count twice.
    includes_mismatch: bool = False
    # Objectives only: a flag parameter that, set, makes the objective weigh by pi/mu.
    mismatch_flag: str | None = None
    # Objectives only: the aggregation of the objective's source, the estimator's default agg.
    agg: str = "token-mean"


class Registry:
    """Name -> Entry, refusing duplicates and listing the valid names on a miss."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(
        self,
        name: str,
        *,
        corrects: str,
        level: str,
        formula: str,
        source: str,
        head_weight: Callable[..., Any] | None = None,
        includes_mismatch: bool = False,
        mismatch_flag: str | None = None,
        agg: str = "token-mean",
    ) -> Callable[[F], F]:
        def decorator(fn: F) -> F:
            self.add(
                name,
                fn,
                corrects=corrects,
                level=level,
                formula=formula,
                source=source,
                head_weight=head_weight,
                includes_mismatch=includes_mismatch,
                mismatch_flag=mismatch_flag,
                agg=agg,
            )
            return fn

        return decorator

    def add(self, name: str, fn: Callable[..., Any], **meta: Any) -> Entry:
        """Register `fn` under `name` (also usable for a second name of one function)."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if meta.get("corrects") not in CORRECTS:
            raise ValueError(f"corrects must be one of {CORRECTS}, got {meta.get('corrects')!r}")
        if meta.get("agg", "token-mean") not in AGGREGATIONS:
            raise ValueError(f"agg must be one of {AGGREGATIONS}, got {meta.get('agg')!r}")
        params = inspect.signature(fn).parameters.values()
        inputs = tuple(p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD)
        defaults = {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}
        head = meta.get("head_weight")
        # head_weight(topk_logp, topk_logp_old[, advantages], **some of the objective's parameters)
        head_sig = inspect.signature(head).parameters.values() if head else ()
        head_inputs = tuple(p.name for p in head_sig if p.kind is p.POSITIONAL_OR_KEYWORD)
        head_params = tuple(p.name for p in head_sig if p.kind is p.KEYWORD_ONLY)
        if not set(head_params) <= set(defaults):
            raise ValueError(f"{self.kind} {name!r}: head_weight takes unknown parameters")
        flag = meta.get("mismatch_flag")
        if flag is not None and not isinstance(defaults.get(flag), bool):
            raise ValueError(f"{self.kind} {name!r}: mismatch_flag {flag!r} is not a flag parameter")
        entry = Entry(name=name, fn=fn, inputs=inputs, defaults=defaults, head_inputs=head_inputs,
                      head_params=head_params, **meta)
        self._entries[name] = entry
        return entry

    def get(self, name: str) -> Entry:
        if name not in self._entries:
            raise ValueError(
                f"unknown {self.kind} {name!r}; valid: {', '.join(sorted(self._entries))}"
            )
        return self._entries[name]

    def names(self) -> list[str]:
        return list(self._entries)


OBJECTIVES = Registry("objective")
CORRECTIONS = Registry("correction")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"parameter {name!r} must be a number, got {value!r}")
    return float(value)


# name -> (test, what the value must be); +inf passes the caps on purpose ("no cap").
_RULES: dict[str, tuple[Callable[[float], bool], str]] = {
    # clip_low = 1 puts the lower bound 1 - clip_low at 0, which r > 0 never crosses: no lower clip.
    "clip_low": (lambda x: 0.0 <= x <= 1.0, "in [0, 1] (1: no lower clip)"),
    "clip_high": (lambda x: 0.0 <= x < math.inf, "finite and >= 0"),
    "cap": (lambda x: x > 0.0, "> 0"),
    "stale_cap": (lambda x: x > 0.0, "> 0"),
    "lo": (lambda x: 0.0 <= x < math.inf, "finite and >= 0"),
    "hi": (lambda x: x > 0.0, "> 0"),
    "lam": (lambda x: 0.0 <= x < math.inf, "finite and >= 0"),
    "kappa": (lambda x: 0.0 <= x <= 1.0, "in [0, 1]"),
    "k_pos": (lambda x: 0.0 <= x < math.inf, "finite and >= 0"),
    "k_neg": (lambda x: 0.0 <= x < math.inf, "finite and >= 0"),
    "lam_pos": (lambda x: 0.0 <= x < math.inf, "finite and >= 0"),
    "lam_neg": (lambda x: 0.0 <= x < math.inf, "finite and >= 0"),
    "tau_pos": (lambda x: 0.0 < x < math.inf, "finite and > 0"),
    "tau_neg": (lambda x: 0.0 < x < math.inf, "finite and > 0"),
}
BEHAVIOUR_CAPS = ("fixed", "cis")  # decoupled's cap on pi_prox / mu: C, or CIS's calibrated one
_CHOICES: dict[str, tuple[str, ...]] = {"agg": AGGREGATIONS, "length_norm": LENGTH_NORMS,
                                        "behaviour_cap": BEHAVIOUR_CAPS}
_FLAGS = {"include_rho"}


def check_params(params: dict[str, Any]) -> dict[str, Any]:
    """Validate resolved parameters; return them with numbers as floats.

    Raises ValueError naming the parameter and the allowed range.
    """
    checked: dict[str, Any] = {}
    for name, value in params.items():
        if name in _FLAGS:
            if not isinstance(value, bool):
                raise ValueError(f"parameter {name!r} must be true or false, got {value!r}")
            checked[name] = value
            continue
        if name in _CHOICES:
            if value not in _CHOICES[name]:
                raise ValueError(
                    f"parameter {name!r} must be one of {', '.join(_CHOICES[name])}, got {value!r}"
                )
            checked[name] = value
            continue
        if isinstance(value, str) and name not in _RULES:  # a plug-in's own string option
            checked[name] = value
            continue
        x = _number(name, value)
        test, allowed = _RULES.get(name, (lambda x: True, ""))
        if not test(x):
            raise ValueError(f"parameter {name!r} must be {allowed}, got {value!r}")
        checked[name] = x
    if "lo" in checked and "hi" in checked and not checked["lo"] < checked["hi"]:
        raise ValueError(
            f"parameter 'lo' must be < 'hi', got lo={checked['lo']} hi={checked['hi']}"
        )
    return checked
