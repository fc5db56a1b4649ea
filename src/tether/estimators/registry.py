"""Decorator registries for objectives and mismatch corrections, and parameter checks.

An entry is a pure function. Its positional parameters name the TokenBatch fields it
reads; its keyword-only parameters are its floats (or strings, or flags), their defaults
are the estimator's defaults, and their types say which values are allowed (`ClipLow`,
`NonNegative`, `Positive`, `PositiveFinite`, `UnitInterval` for floats, `OneOf` for
strings; a bool default makes a flag). So the signature is the whole spec: nothing is
repeated (an estimator that reads `logp_prox` makes the trainer score pi_prox). An
objective also registers its source's aggregation (agg), the estimator's default agg.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Any, TypeVar

from tether.estimators.base import AGGREGATIONS

F = TypeVar("F", bound=Callable[..., Any])

LENGTH_NORMS = ("none", "T", "sqrtT")
BEHAVIOUR_CAPS = ("fixed", "cis")  # decoupled's cap on pi_prox / mu: C, or CIS's calibrated one
CORRECTS = ("numerical", "staleness", "both", "neither")


@dataclass(frozen=True)
class Range:
    """The values a float parameter allows: `test(x)`, said as `allowed` in the error."""

    test: Callable[[float], bool]
    allowed: str


@dataclass(frozen=True)
class OneOf:
    """The values a string parameter allows."""

    choices: tuple[str, ...]


Rule = Range | OneOf | type  # `bool`: a flag

# The parameter types entries declare in their signatures. +inf passes the caps on purpose
# ("no cap"). clip_low = 1 puts the lower bound 1 - clip_low at 0, which r > 0 never crosses.
ClipLow = Annotated[float, Range(lambda x: 0.0 <= x <= 1.0, "in [0, 1] (1: no lower clip)")]
NonNegative = Annotated[float, Range(lambda x: 0.0 <= x < math.inf, "finite and >= 0")]
Positive = Annotated[float, Range(lambda x: x > 0.0, "> 0")]
PositiveFinite = Annotated[float, Range(lambda x: 0.0 < x < math.inf, "finite and > 0")]
UnitInterval = Annotated[float, Range(lambda x: 0.0 <= x <= 1.0, "in [0, 1]")]
LengthNorm = Annotated[str, OneOf(LENGTH_NORMS)]
BehaviourCap = Annotated[str, OneOf(BEHAVIOUR_CAPS)]


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
    rules: dict[str, Rule] = field(default_factory=dict)  # parameter -> allowed values


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
                      head_params=head_params, rules=_rules(fn, defaults), **meta)
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


def _rules(fn: Callable[..., Any], defaults: dict[str, Any]) -> dict[str, Rule]:
    """The allowed values of `fn`'s keyword-only parameters, from their types (only theirs
    are resolved: the tensors' would import torch). A plug-in's parameter whose type cannot
    be resolved, or declares no range, is checked as a number only."""
    rules: dict[str, Rule] = {}
    for name, param in inspect.signature(fn).parameters.items():
        if name not in defaults:
            continue
        hint = param.annotation
        if isinstance(hint, str):  # `from __future__ import annotations`
            try:
                hint = eval(hint, fn.__globals__)  # as typing.get_type_hints does, for one name
            except Exception:  # noqa: BLE001 - an unresolvable hint only loses the range check
                hint = None
        meta = getattr(hint, "__metadata__", ())
        default = defaults[name]
        rule = next((m for m in meta if isinstance(m, (Range, OneOf))), None)
        if rule is None and isinstance(default, bool):
            rule = bool
        if rule is not None:
            rules[name] = rule
    return rules


def check_params(params: dict[str, Any], rules: dict[str, Rule]) -> dict[str, Any]:
    """Validate resolved parameters against `rules`; return them with numbers as floats.

    Raises ValueError naming the parameter and the allowed values.
    """
    checked: dict[str, Any] = {}
    for name, value in params.items():
        rule = rules.get(name)
        if rule is bool:
            if not isinstance(value, bool):
                raise ValueError(f"parameter {name!r} must be true or false, got {value!r}")
            checked[name] = value
        elif isinstance(rule, OneOf):
            if value not in rule.choices:
                raise ValueError(
                    f"parameter {name!r} must be one of {', '.join(rule.choices)}, got {value!r}"
                )
            checked[name] = value
        elif isinstance(value, str) and rule is None:  # a plug-in's own string option
            checked[name] = value
        else:
            x = _number(name, value)
            if isinstance(rule, Range) and not rule.test(x):
                raise ValueError(f"parameter {name!r} must be {rule.allowed}, got {value!r}")
            checked[name] = x
    if "lo" in checked and "hi" in checked and not checked["lo"] < checked["hi"]:
        raise ValueError(
            f"parameter 'lo' must be < 'hi', got lo={checked['lo']} hi={checked['hi']}"
        )
    return checked
