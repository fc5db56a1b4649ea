"""The run configuration: a validated, frozen tree loaded from YAML with `key=value` overrides.

Every field carries its meaning in `description`; `tether config --fields` prints them.
A wrong key or value fails at load, before any work, with its dotted path in the message.

- `sections`, `task`: one model per section, a rule within one section as its validator;
- `schema`: `Config`, the sections together with the rules across them, and which keys a
  resumed run may change (`resumable_keys`);
- `checks`: names the estimator and sync-policy registries resolve, checked at load;
- `load`: YAML, overrides, and error messages that point at the file and line;
- `fields`: the `tether config --fields` listing.
"""

from tether.config.base import ConfigError, CrossFieldError
from tether.config.checks import centering_topk, resolve_logprobs_topk
from tether.config.fields import SECTIONS, describe_fields, format_fields
from tether.config.load import dump_config, load_config, parse_overrides
from tether.config.loop import LoopConfig
from tether.config.schema import Config, resumable_keys
from tether.config.sections import (
    DEFAULT_CENTERING_TOPK,
    EXACT_TOPK_MAX_VOCAB,
    DiagnosticsConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    RunConfig,
    SyncConfig,
    TrainConfig,
    WeightsConfig,
)
from tether.config.task import (
    BUILTIN_TASKS,
    TASK_NAME_HELP,
    ChainTaskConfig,
    CountdownTaskConfig,
    NumericTaskConfig,
    TaskConfig,
    UserTaskConfig,
)

__all__ = [
    "BUILTIN_TASKS",
    "DEFAULT_CENTERING_TOPK",
    "EXACT_TOPK_MAX_VOCAB",
    "SECTIONS",
    "TASK_NAME_HELP",
    "ChainTaskConfig",
    "Config",
    "ConfigError",
    "CountdownTaskConfig",
    "CrossFieldError",
    "DiagnosticsConfig",
    "EvalConfig",
    "LogConfig",
    "LoopConfig",
    "ModelConfig",
    "NumericTaskConfig",
    "RewardConfig",
    "RolloutConfig",
    "RunConfig",
    "SyncConfig",
    "TaskConfig",
    "TrainConfig",
    "UserTaskConfig",
    "WeightsConfig",
    "centering_topk",
    "describe_fields",
    "dump_config",
    "format_fields",
    "load_config",
    "parse_overrides",
    "resolve_logprobs_topk",
    "resumable_keys",
]
