"""Names in the config that registries resolve (estimators, sync policies, optional packages),
checked at load after the schema; and the defaults they resolve to.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from tether.config.base import ConfigError
from tether.config.schema import Config
from tether.config.sections import DEFAULT_CENTERING_TOPK, EXACT_TOPK_MAX_VOCAB


def resolve_logprobs_topk(cfg: Config, vocab_size: int) -> int:
    """`rollout.logprobs_topk`, or when empty the estimator's need (see its description)."""
    if cfg.rollout.logprobs_topk is not None:
        return cfg.rollout.logprobs_topk
    from tether.estimators import build_estimator

    if not build_estimator(cfg.train.estimator, **cfg.train.estimator_params).centering:
        return 0
    return centering_topk(cfg, vocab_size)


def centering_topk(cfg: Config, vocab_size: int) -> int:
    """The top-K a centering estimator reads: `rollout.logprobs_topk` when set, else every
    token of a small vocabulary, else DEFAULT_CENTERING_TOPK. What an engine must be able to
    give when train.correction=auto may turn centering on."""
    if cfg.rollout.logprobs_topk is not None:
        return cfg.rollout.logprobs_topk
    return vocab_size if vocab_size <= EXACT_TOPK_MAX_VOCAB else DEFAULT_CENTERING_TOPK


def check_registries(cfg: Config) -> None:
    """Names resolved by registries (estimators, sync policies) are checked at load too."""
    from tether.estimators import build_estimator
    from tether.weights.policy import BoundedK, parse_sync_policy

    try:
        estimator = build_estimator(cfg.train.estimator, **cfg.train.estimator_params)
    except ValueError as e:
        raise ConfigError(f"train.estimator / train.estimator_params: {e}") from None
    if estimator.centering and cfg.rollout.logprobs_topk == 0:
        raise ConfigError(
            f"rollout.logprobs_topk=0 with train.estimator={cfg.train.estimator}: it centers "
            "scores over the generator's top-K head; set rollout.logprobs_topk > 0 (e.g. 20), or "
            "leave it empty for the estimator's default"
        )
    try:
        policy = parse_sync_policy(cfg.sync.policy, cfg.train.estimator)
    except ValueError as e:
        raise ConfigError(f"sync.policy: {e}") from None
    auto = cfg.train.correction == "auto"
    if auto:
        _check_auto(cfg, estimator, policy)
    if cfg.sync.on_trip == "regenerate" and not policy.measures_ess and not auto:
        raise ConfigError(
            f"sync.on_trip=regenerate applies to the batch that trips an ESS re-sync, but "
            f"sync.policy resolves to {policy.spec}: use sync.policy=ess:TAU or on_trip=train"
        )
    if cfg.loop.mode == "async" and not auto:
        _check_async_policy(cfg, policy)
    bound = policy.k if isinstance(policy, BoundedK) else None
    if bound is not None and cfg.sync.lag > bound:
        raise ConfigError(
            f"sync.lag={cfg.sync.lag} with sync.policy={policy.spec}: a delivery at lag "
            f"{cfg.sync.lag} can never bring the generator within {bound} versions; "
            f"lower sync.lag to <= {bound} or raise K"
        )
    if cfg.loop.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ConfigError("loop.backend=ray needs Ray, which is not installed: "
                          "pip install -e '.[ray]' (or loop.backend=local)")
    from tether.logger import require

    for key, package in (("tensorboard", "tensorboard"), ("wandb", "wandb")):
        if getattr(cfg.log, key):
            try:
                require(package, f"log.{key}")
            except ImportError as e:
                raise ConfigError(str(e)) from None


def _check_auto(cfg: Config, estimator: Any, policy: Any) -> None:
    """train.correction=auto chooses the correction and the re-sync: the config must leave
    both to it (tether.auto)."""
    from tether.auto import Base, window_problem

    problem = Base.check(estimator)
    if problem:
        raise ConfigError(f"train.estimator: {problem}")
    problem = window_problem(cfg.train.auto_on_after, cfg.train.auto_window)
    if problem:
        raise ConfigError(f"train.auto_on_after: {problem} (train.auto_window)")
    if policy.measures_ess or cfg.loop.window == "ess":
        raise ConfigError(
            f"train.correction=auto arms the ESS re-sync at 0.5 itself and switches the ESS "
            f"window (async) with DLC's handling; sync.policy={policy.spec} / "
            f"loop.window={cfg.loop.window} would set them apart from it: set sync.policy to "
            "every:K, bounded:K or resync:K and loop.window=fixed"
        )
    if cfg.loop.mode == "async":
        _check_async_policy(cfg.model_copy(update={"loop": cfg.loop.model_copy(
            update={"window": "fixed", "after_trip": "window"})}), policy)


def _check_async_policy(cfg: Config, policy: Any) -> None:
    """Async publishing must keep admission possible (docs/async.md)."""
    from tether.weights.policy import BoundedK, EveryK

    eta = cfg.loop.max_staleness
    for key, value, other in (("window", cfg.loop.window, "fixed"),
                              ("after_trip", cfg.loop.after_trip, "window")):
        if value in ("ess", "regenerate") and not policy.measures_ess:
            raise ConfigError(
                f"loop.{key}={value} acts on ESS trips, but sync.policy resolves to "
                f"{policy.spec}, which never trips: use sync.policy=ess:TAU or loop.{key}={other}"
            )
    if isinstance(policy, BoundedK) and policy.k != eta:
        raise ConfigError(
            f"sync.policy={policy.spec} with loop.mode=async: in async mode bounded:K is the "
            f"admission bound, and loop.max_staleness={eta} says another; set "
            f"loop.max_staleness={policy.k} or sync.policy=bounded:{eta}"
        )
    if isinstance(policy, EveryK) and policy.k > eta + 1:
        raise ConfigError(
            f"sync.policy={policy.spec} with loop.mode=async and loop.max_staleness={eta}: "
            f"publishing every {policy.k} versions leaves workers unable to start any batch "
            f"within {eta} versions of their weights; use every:K with K <= {eta + 1} or raise "
            f"loop.max_staleness"
        )


def resolve_sync(cfg: Config) -> Config:
    """`sync.policy: auto` -> the estimator preset's policy, and `loop.after_trip: auto` ->
    regenerate under the ESS window, else window; so the run's config.yaml says which."""
    from tether.weights.policy import resolve_policy_spec

    spec = resolve_policy_spec(cfg.sync.policy, cfg.train.estimator)
    rule = cfg.loop.after_trip
    if rule == "auto":  # train.correction=auto: for when it turns the ESS window on
        ess = cfg.loop.window == "ess" or (cfg.train.correction == "auto"
                                           and cfg.loop.mode == "async")
        rule = "regenerate" if ess else "window"
    return cfg.model_copy(update={"sync": cfg.sync.model_copy(update={"policy": spec}),
                                  "loop": cfg.loop.model_copy(update={"after_trip": rule})})

