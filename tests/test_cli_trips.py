"""What a new user trips over: name clashes, a slow CLI, bugs shown as bad input, and
defaults that disagree between the config and the library functions it feeds."""

import dataclasses
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import tether.cli
import tether.tasks
from tether.config import Config

ROOT = Path(__file__).resolve().parents[1]
_SCRIPT = Path(sys.executable).with_name("tether")  # the installed console script
TETHER = [str(_SCRIPT)] if _SCRIPT.is_file() else [sys.executable, "-m", "tether.cli"]


# --- names ---------------------------------------------------------------------------

def test_no_module_or_function_shadows_a_familiar_name():
    # `tether.inspect` shadowed the stdlib inspect; `tether.tasks.evaluate` sat beside
    # `tether.evaluate` (held-out accuracy) while being the expression parser.
    assert importlib.util.find_spec("tether.inspect") is None
    assert not hasattr(tether.tasks, "evaluate")
    from tether.inspection import inspect_run
    from tether.tasks import ExprValue, evaluate_expr

    assert callable(inspect_run)
    assert evaluate_expr("(9-3)*7").value == 42
    assert isinstance(evaluate_expr("1+2"), ExprValue)


# --- a fast CLI ------------------------------------------------------------------------

HEAVY = ("torch", "transformers", "vllm")


def _imports_after(argv: list[str]) -> list[str]:
    """Heavy modules loaded by `tether.cli.main(argv)` in a fresh interpreter."""
    code = (
        "import sys, contextlib, io\n"
        "from tether.cli import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main({argv!r}) == 0\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=ROOT, check=True)
    return eval(out.stdout.strip().splitlines()[-1])  # a printed list of names


@pytest.mark.parametrize("argv", [
    ["config", "--fields"],
    ["config", "--config", "configs/countdown.yaml"],
    # the registries are checked too: a preset with centering, a composed estimator
    ["config", "train.estimator=dlc", "rollout.logprobs_topk=8"],
    ["config", "train.estimator=ppo+tis", "train.estimator_params={cap: 3.0}"],
], ids=["fields", "countdown-yaml", "dlc", "composed"])
def test_config_commands_do_not_import_torch(argv):
    assert _imports_after(argv) == []


def test_config_still_rejects_bad_estimators_without_torch(capsys):
    assert tether.cli.main(["config", "train.estimator=nope"]) == 2
    assert "unknown estimator 'nope'" in capsys.readouterr().err
    assert tether.cli.main(["config", "train.estimator=tis", "train.estimator_params={cap: -1}"]) == 2
    assert "'cap' must be > 0" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--help"], ["train", "--help"], ["config", "--fields"]],
                         ids=["help", "train-help", "config-fields"])
def test_help_and_config_answer_fast(args):
    # Counted, not timed: the installed command imports about 240 modules and answers in
    # ~0.2 s here; importing torch alone is over 1100 modules and ~4 s.
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    out = subprocess.run([*TETHER, *args], capture_output=True, text=True, check=True,
                         cwd=ROOT, env=env)
    imported = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert not {m for m in imported if m.split(".")[0] in HEAVY}
    assert 100 < len(imported) < 400, len(imported)


# --- input errors against bugs ---------------------------------------------------------

def _estimators_raising(monkeypatch, error: Exception) -> None:
    def fail(args):
        raise error

    parser = tether.cli.build_parser

    def patched():
        p = parser()
        sub = next(a for a in p._actions if a.dest == "command")
        sub.choices["estimators"].set_defaults(func=fail)
        return p

    monkeypatch.setattr(tether.cli, "build_parser", patched)


def test_an_error_inside_tether_is_reported_as_a_bug(monkeypatch, capsys):
    monkeypatch.delenv("TETHER_DEBUG", raising=False)
    _estimators_raising(monkeypatch, ValueError("boom"))
    assert tether.cli.main(["estimators"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err
    assert "ValueError: boom" in err
    assert "this is a bug in tether, please report it" in err
    assert tether.__version__ in err


def test_an_input_error_is_one_line_with_status_2(monkeypatch, capsys):
    from tether.errors import InputError

    monkeypatch.delenv("TETHER_DEBUG", raising=False)
    _estimators_raising(monkeypatch, InputError("data.jsonl: no rows"))
    assert tether.cli.main(["estimators"]) == 2
    assert capsys.readouterr().err == "tether estimators: error: data.jsonl: no rows\n"


def test_tether_debug_shows_an_input_errors_traceback(monkeypatch):
    from tether.errors import InputError

    monkeypatch.setenv("TETHER_DEBUG", "1")
    _estimators_raising(monkeypatch, InputError("data.jsonl: no rows"))
    with pytest.raises(InputError, match="no rows"):
        tether.cli.main(["estimators"])


def test_user_input_problems_raise_input_error(tmp_path):
    from tether.config import ConfigError
    from tether.errors import InputError, MissingPackageError
    from tether.inspection import inspect_run
    from tether.logger import require
    from tether.rewards import load_reward_fn
    from tether.tasks import NumericAnswerTask

    assert issubclass(ConfigError, InputError)
    with pytest.raises(InputError, match="no such file"):
        NumericAnswerTask(tmp_path / "missing.jsonl")
    with pytest.raises(InputError, match="neither a tether run directory .* nor a log-prob dump"):
        inspect_run(tmp_path, None, plots=False)
    with pytest.raises(InputError, match="no module named"):
        load_reward_fn("no_such_module_here:fn")
    # a missing optional package is both: `except ImportError` around imports still works
    with pytest.raises(MissingPackageError) as e:
        require("no_such_package_here", "log.wandb")
    assert isinstance(e.value, ImportError) and isinstance(e.value, InputError)


# --- one default per setting -----------------------------------------------------------

def _default(fn, name):
    return inspect.signature(fn).parameters[name].default


def test_library_defaults_match_the_config_defaults():
    from tether.evaluate import greedy_accuracy, heldout_scores
    from tether.monitor import current_model_monitor
    from tether.rollout import SamplingParams
    from tether.tasks import CountdownTask
    from tether.testbed import ensure_default_model

    cfg = Config()
    sampling = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    pairs = {
        "rollout.max_new_tokens": (cfg.rollout.max_new_tokens, sampling["max_new_tokens"]),
        "rollout.group_size": (cfg.rollout.group_size, sampling["n"]),
        "rollout.temperature": (cfg.rollout.temperature, sampling["temperature"]),
        "rollout.top_k": (cfg.rollout.top_k, sampling["top_k"]),
        "rollout.top_p": (cfg.rollout.top_p, sampling["top_p"]),
        "greedy max_new_tokens": (cfg.rollout.max_new_tokens,
                                  _default(greedy_accuracy, "max_new_tokens")),
        "model.warmstart_steps": (cfg.model.warmstart_steps,
                                  _default(ensure_default_model, "warmstart_steps")),
        "model.cache_dir": (cfg.model.cache_dir, _default(ensure_default_model, "cache_dir")),
        "model.seed": (cfg.model.seed, _default(ensure_default_model, "seed")),
        "model.moe": (cfg.model.moe, _default(ensure_default_model, "moe")),
        "eval.batch_size": (cfg.eval.batch_size, _default(heldout_scores, "batch_size")),
        "eval.batch_size (greedy)": (cfg.eval.batch_size, _default(greedy_accuracy, "batch_size")),
        "diagnostics.rare_prob": (cfg.diagnostics.rare_prob,
                                  _default(current_model_monitor, "rare_prob")),
        "task.rl_share": (cfg.task.rl_share, _default(CountdownTask, "rl_share")),
    }
    differ = {key: pair for key, pair in pairs.items() if pair[0] != pair[1]}
    assert differ == {}, f"(config default, library default) disagree: {differ}"


# --- a task of your own, and config messages that name the fix ---------------------------

ADDITION = f"{ROOT}/examples/addition_task.py:Addition"


def test_a_users_task_plugs_in_by_import_path_with_validated_keys(tmp_path, warm_model_dir):
    from tether.config import ConfigError, load_config
    from tether.errors import InputError
    from tether.logger import read_jsonl

    cfg = load_config(None, [f"task.name={ADDITION}", "task.max_operand=5"])
    assert cfg.task.max_operand == 5
    with pytest.raises(InputError, match=r"task.max_operand: .*valid integer.*got 'x'"):
        load_config(None, [f"task.name={ADDITION}", "task.max_operand=x"])
    with pytest.raises(InputError, match="did you mean task.max_operand"):
        load_config(None, [f"task.name={ADDITION}", "task.max_operandz=3"])
    with pytest.raises(ConfigError, match="unknown task"):
        load_config(None, ["task.name=addition"])
    run_dir = tmp_path / "run"
    assert tether.cli.main(["train", "--config", str(ROOT / "configs/addition.yaml"),
                            f"task.name={ADDITION}", f"model.path={warm_model_dir}",
                            "train.steps=2", "rollout.prompts_per_step=4", "eval.samples=0",
                            "task.eval_size=8", f"run.dir={run_dir}", "run.progress=false"]) == 0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    assert len(rows) == 3 and "eval/accuracy" in rows[-1] and "reward/correct" in rows[-1]


def test_accuracy_counts_a_full_reward_when_the_task_reports_no_correct_part(random_model, tokenizer):
    from tether.evaluate import greedy_accuracy
    from tether.tasks import Problem, Reward

    class Anything:  # every answer earns the full reward; no "correct" part
        name = "anything"

        def train_problem(self, index):
            return Problem(f"t{index}", "1+1=")

        def eval_problems(self):
            return [Problem(f"e{i}", "2+2=") for i in range(3)]

        def reward(self, problem, response):
            return Reward(total=1.0, parts={})

    assert greedy_accuracy(random_model, tokenizer, Anything(), max_new_tokens=2) == 1.0


def test_switching_task_names_the_other_tasks_keys_and_the_fix():
    from tether.config import ConfigError, load_config

    countdown = str(ROOT / "configs/countdown.yaml")
    with pytest.raises(ConfigError) as e:
        load_config(countdown, ["task.name=numeric", "task.path=rows.jsonl"])
    assert "task.format_weight" in str(e.value) and "keys of task countdown, not of task numeric" in str(e.value)
    assert "~task" in str(e.value) and "did you mean task.format_weight" not in str(e.value)
    cfg = load_config(countdown, ["~task", "task.name=numeric", "task.path=rows.jsonl"])
    assert cfg.task.name == "numeric"
    cfg = load_config(countdown, ["~task.format_weight"])
    assert cfg.task.format_weight == 0.0  # back to its default
    with pytest.raises(ConfigError, match="nothing to drop"):
        load_config(countdown, ["~train.nope"])


def test_a_centering_preset_brings_its_top_k():
    from tether.config import ConfigError, load_config, resolve_logprobs_topk

    cfg = load_config(None, ["train.estimator=dlc"])  # failed at load before
    assert resolve_logprobs_topk(cfg, 21) == 21  # a small vocabulary: exact centering, K = V
    assert resolve_logprobs_topk(cfg, 151_936) == 20
    assert resolve_logprobs_topk(load_config(None, ["train.estimator=tis"]), 21) == 0
    assert resolve_logprobs_topk(load_config(None, ["train.estimator=dlc", "rollout.logprobs_topk=8"]), 21) == 8
    with pytest.raises(ConfigError, match="rollout.logprobs_topk=0"):
        load_config(None, ["train.estimator=dlc", "rollout.logprobs_topk=0"])


def test_cross_field_errors_name_their_fields():
    from tether.config import ConfigError, load_config

    with pytest.raises(ConfigError) as e:
        load_config(str(ROOT / "configs/countdown.yaml"), ["rollout.group_size=1"])
    assert "(top level)" not in str(e.value)
    assert "rollout.group_size + train.adv_std_norm:" in str(e.value)
    with pytest.raises(ConfigError, match=r"task.num_min \+ task.num_max: .*\(command line\)"):
        load_config(None, ["task.num_min=9", "task.num_max=2"])


def test_config_fields_are_grouped_and_task_name_is_listed_once(capsys):
    assert tether.cli.main(["config", "--fields"]) == 0
    out = capsys.readouterr().out
    assert out.count("task.name = ") == 1
    sections = [line.split("]")[0][1:] for line in out.splitlines() if line.startswith("[")]
    assert sections == [name for name in Config.model_fields]
    assert "with task.name=numeric:" in out


def test_diagnostics_off_for_an_engine_without_weights_say_so_once(caplog, random_model):
    import torch

    from tether.config import DiagnosticsConfig
    from tether.models import build_tiny_model
    from tether.rollout.types import SamplingParams
    from tether.scoring import RolloutTensors
    from tether.step import Diagnostics

    moe = build_tiny_model(21, moe=True, seed=0)
    diagnose = Diagnostics(DiagnosticsConfig(monitor_every=1), moe, SamplingParams(), [[3, 4]], 1, 0, 8)
    B, T = 2, 3
    batch = RolloutTensors(torch.ones(B, 5, dtype=torch.long), torch.ones(B, 5, dtype=torch.long),
                           torch.ones(B, T, dtype=torch.long), torch.ones(B, T), torch.zeros(B, T),
                           torch.zeros(B), torch.zeros(B), torch.zeros(B, T, dtype=torch.long))
    with caplog.at_level("WARNING", logger="tether.diagnostics"):
        for step in range(3):  # vLLM: no in-process generator model
            diagnose(step, 0, batch, torch.zeros(B, T), None, lambda v: moe, lambda v: None, 0)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2  # once for the monitor, once for routing; not every step
    assert any("diagnostics.monitor_every is off" in m for m in messages)
    assert any("diagnostics.routing is off" in m for m in messages)
