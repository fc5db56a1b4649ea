"""The `task` section: one model per built-in task, or a task of your own by import path.

BUILTIN_TASKS is the one list of built-in task names in the config: the `task` union, the
help text and the error messages are all made from it.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import ConfigDict, Discriminator, Field, Tag, field_validator, model_validator

from tether.config.base import CrossFieldError, Node
from tether.defaults import RL_SHARE
from tether.plugins import split_spec


class CountdownTaskConfig(Node):
    name: Literal["countdown"] = "countdown"
    num_numbers: int = Field(3, ge=2, le=6, description="How many numbers each problem gives.")
    num_min: int = Field(1, ge=0, description="Smallest number drawn.")
    num_max: int = Field(9, ge=1, description="Largest number drawn.")
    target_min: int = Field(1, description="Smallest target.")
    target_max: int = Field(100, description="Largest target.")
    seed: int = Field(0, description="Seed of the problem generator (train and held-out sets).")
    eval_size: int = Field(200, ge=1, description="Size of the fixed held-out evaluation set.")
    use_all: bool = Field(
        True, description="Targets need every number (the classic game); false: subsets suffice."
    )
    train_size: int = Field(
        0, ge=0, description="Cycle through only the first N training problems (0: endless).",
    )
    format_weight: float = Field(
        0.0, ge=0.0, le=1.0,
        description="Reward for a well-formed answer with allowed numbers that misses the target.",
    )
    answer: Literal["expr", "steps"] = Field(
        "expr", description="How the answer is written: one expression '(9-3)*7', or its steps "
        "'9-3=6,7*6=42' (each number, given or intermediate, used at most once; responses "
        "several times longer). The default model is warm-started on this format.",
    )
    rl_share: float = Field(
        RL_SHARE, ge=0.0, lt=1.0,
        description="Share of problems kept for RL: training batches draw only from them and "
        "the default model's warm start only from the rest (a hash of numbers and target), so "
        "RL trains on problems the warm start never solved. 0: one stream for both.",
    )

    @model_validator(mode="after")
    def _ranges(self) -> CountdownTaskConfig:
        if self.num_min > self.num_max:
            raise CrossFieldError(["task.num_min", "task.num_max"],
                                  f"num_min ({self.num_min}) must be <= num_max ({self.num_max})")
        if self.target_min > self.target_max:
            raise CrossFieldError(["task.target_min", "task.target_max"],
                                  f"target_min ({self.target_min}) must be <= target_max ({self.target_max})")
        return self


class ChainTaskConfig(Node):
    name: Literal["chain"] = "chain"
    steps_min: int = Field(10, ge=1, le=24, description="Fewest operations in a chain (steps in its answer).")
    steps_max: int = Field(14, ge=1, le=24, description="Most operations in a chain; 10-14 steps "
                           "write 60-111 tokens. The default model's context grows to fit.")
    operand_max: int = Field(9, ge=1, le=9, description="Operands and the start are drawn from 1..operand_max.")
    value_max: int = Field(99, ge=1, description="Every intermediate value stays in 0..value_max.")
    seed: int = Field(0, description="Seed of the problem generator (train and held-out sets).")
    eval_size: int = Field(200, ge=1, description="Size of the fixed held-out evaluation set.")
    train_size: int = Field(
        0, ge=0, description="Cycle through only the first N training problems (0: endless).",
    )
    format_weight: float = Field(
        0.0, ge=0.0, lt=1.0,
        description="Reward for an answer of the right number of well-formed steps that is not the chain.",
    )
    rl_share: float = Field(
        RL_SHARE, ge=0.0, lt=1.0,
        description="Share of problems kept for RL; the default model's warm start draws only "
        "from the rest (a hash of the prompt). 0: one stream for both.",
    )

    @model_validator(mode="after")
    def _ranges(self) -> ChainTaskConfig:
        if self.steps_min > self.steps_max:
            raise CrossFieldError(["task.steps_min", "task.steps_max"],
                                  f"steps_min ({self.steps_min}) must be <= steps_max ({self.steps_max})")
        if self.value_max < self.operand_max:
            raise CrossFieldError(["task.value_max", "task.operand_max"],
                                  f"value_max ({self.value_max}) must be >= operand_max ({self.operand_max})")
        return self


class NumericTaskConfig(Node):
    name: Literal["numeric"] = "numeric"
    path: str = Field(description="Local JSONL or parquet file of prompt/answer rows (GSM8K style).")
    prompt_key: str = Field("prompt", description="Column holding the prompt text.")
    answer_key: str = Field("answer", description="Column holding the reference answer.")
    eval_fraction: float = Field(
        0.1, gt=0.0, lt=1.0, description="Share of rows held out for evaluation (if no eval_path)."
    )
    eval_path: str | None = Field(None, description="A separate held-out file in the same format.")
    seed: int = Field(0, description="Seed of the train/eval split and the training order.")


class UserTaskConfig(Node):
    """A task of your own, by import path; its other keys are its constructor's keyword
    arguments, type-checked against their annotations at load (tether.tasks.user_task_params)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    name: str = Field(
        description="Your own task class (or factory): 'package.module:Class' or "
        "'path/to/file.py:Class'; the other task.* keys are its keyword arguments. docs/tasks.md.",
    )

    @field_validator("name")
    @classmethod
    def _spec(cls, name: str) -> str:
        split_spec(name, kind="Class")
        return name


BUILTIN_TASKS: dict[str, type[Node]] = {
    node.model_fields["name"].default: node for node in (CountdownTaskConfig, ChainTaskConfig, NumericTaskConfig)
}
USER_TASK = "user"  # the union tag of a task named by import path
TASK_TAGS = (*BUILTIN_TASKS, USER_TASK)
_BUILTIN_LIST = ", ".join(BUILTIN_TASKS)
TASK_NAME_HELP = f"Task: {_BUILTIN_LIST}, or your own class as 'package.module:Class' (docs/tasks.md)."
for _node in BUILTIN_TASKS.values():  # the help names every built-in, so it is set once they exist
    _node.model_fields["name"].description = TASK_NAME_HELP
    _node.model_rebuild(force=True)


def task_kind(value: Any) -> str | None:
    """The union tag of a task section: a built-in name, or USER_TASK for an import path."""
    name = value.get("name") if isinstance(value, dict) else getattr(value, "name", None)
    if isinstance(name, str) and ":" in name:
        return USER_TASK
    return name if name in BUILTIN_TASKS else None


# The union is made from BUILTIN_TASKS (so Union[...]: `|` takes no tuple).
TaskConfig = Annotated[
    Union[tuple(Annotated[node, Tag(name)] for name, node in BUILTIN_TASKS.items())  # noqa: UP007
          + (Annotated[UserTaskConfig, Tag(USER_TASK)],)],
    Discriminator(task_kind, custom_error_type="task_name",
                  custom_error_message=f"unknown task: use {_BUILTIN_LIST}, or your own class as "
                  "'package.module:Class' / 'path/to/file.py:Class'"),
]
