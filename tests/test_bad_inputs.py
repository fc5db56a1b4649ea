"""Bad input stops `tether train` with one message naming the culprit: exit 2, no traceback.

Each row runs the CLI's `main` in-process (what a user's shell sees, without paying for a
new interpreter per row; tests/test_e2e.py checks the same in a real subprocess). Rows
that do not need a model point model.path at a directory that does not exist, so a check
that fails to fire shows up as a different message instead of building a model.
"""

from __future__ import annotations

import json
import shutil

import pytest

from tether.cli import main
from tether.config import dump_config, load_config
from tether.models import build_char_tokenizer
from tether.tasks import ALPHABET

NO_MODEL = "model.path={tmp}/no-model"
RUN = ["run.dir={tmp}/run", "run.threads=1", "run.progress=false", "train.steps=2",
       "rollout.prompts_per_step=2", "rollout.group_size=2", "eval.batch_size=8"]

CASES = [
    # --- config: file syntax, keys, types, ranges, names (before anything is built) ---
    ("yaml-syntax", ["--config", "{tmp}/broken.yaml"],
     ["broken.yaml:4:4: YAML syntax error", "line 3"]),
    ("yaml-tab", ["--config", "{tmp}/tab.yaml"], ["tab.yaml:2:1: YAML syntax error"]),
    ("unknown-key-in-file", ["--config", "{tmp}/typo.yaml", NO_MODEL],
     ["train.stepz: unknown key", "typo.yaml:3", "did you mean train.steps?"]),
    ("unknown-section", ["trian.lr=0.1", NO_MODEL], ["trian: unknown key", "did you mean train?"]),
    ("ill-typed", ["train.steps=many", NO_MODEL], ["train.steps", "valid integer", "'many'"]),
    ("negative-cap", ["rollout.max_new_tokens=-4", NO_MODEL], ["rollout.max_new_tokens", "-4"]),
    ("clip-low-ge-1", ["train.estimator_params={{clip_low: 1.5}}", NO_MODEL],
     ["clip_low", "in [0, 1]"]),
    ("group-of-one", ["rollout.group_size=1", NO_MODEL],
     ["rollout.group_size=1", "raise rollout.group_size"]),
    ("unknown-estimator", ["train.estimator=ppo2", NO_MODEL],
     ["unknown estimator 'ppo2'", "valid presets", "grpo"]),
    ("unknown-engine", ["rollout.engine=sglang", NO_MODEL], ["rollout.engine", "'hf' or 'vllm'"]),
    ("unknown-sync-policy", ["sync.policy=often", NO_MODEL], ["sync.policy", "every:K"]),
    ("unknown-task", ["task.name=chess", NO_MODEL], ["task.name: unknown task 'chess'", "'countdown', 'chain', 'numeric'"]),
    ("missing-config-file", ["--config", "{tmp}/nope.yaml"], ["nope.yaml does not exist"]),
    ("reward-fn-form", ["reward.fn=just_a_name", NO_MODEL], ["reward.fn", "module:function"]),
    # --- data: malformed rows name file and line (before any model is built) ---
    ("dataset-bad-json", ["task.name=numeric", "task.path={tmp}/bad.jsonl", NO_MODEL],
     ["bad.jsonl:line 3: invalid JSON"]),
    ("dataset-missing-field", ["task.name=numeric", "task.path={tmp}/nofield.jsonl", NO_MODEL],
     ["nofield.jsonl:line 2: missing field 'answer'"]),
    ("dataset-missing-file", ["task.name=numeric", "task.path={tmp}/gone.jsonl", NO_MODEL],
     ["gone.jsonl"]),
    # --- a user's reward function: only from an explicit path, checked at start ---
    ("reward-no-module", ["reward.fn=no_such_module_xyz:score", NO_MODEL],
     ["reward.fn='no_such_module_xyz:score'", "no module named 'no_such_module_xyz'"]),
    ("reward-no-function", ["reward.fn={tmp}/rewards_ok.py:nope", NO_MODEL],
     ["has no 'nope'", "it defines: one_arg, score"]),
    ("reward-syntax-error", ["reward.fn={tmp}/rewards_broken.py:score", NO_MODEL],
     ["importing", "SyntaxError", "rewards_broken.py:1"]),
    ("reward-wrong-arity", ["reward.fn={tmp}/rewards_ok.py:one_arg", NO_MODEL],
     ["one_arg must take two arguments (problem, response)"]),
    # --- the run directory ---
    ("run-dir-taken", ["run.dir={tmp}/taken", NO_MODEL],
     ["run.dir={tmp}/taken already holds a run", "--resume {tmp}/taken"]),
    ("resume-not-a-run", ["--resume", "{tmp}/empty"], ["no config.yaml", "{tmp}/empty"]),
    ("resume-changes-lr", ["--resume", "{tmp}/done", "train.lr=0.5"],
     ["train.lr cannot change when resuming", "train.steps"]),
    ("resume-complete", ["--resume", "{tmp}/done"], ["the run is complete (4 steps)", "train.steps=8"]),
    ("resume-with-config", ["--resume", "{tmp}/done", "--config", "{tmp}/typo.yaml"],
     ["drop --config"]),
    # --- the model directory (these load a tokenizer or the tiny model) ---
    ("model-dir-missing", [NO_MODEL], ["model.path={tmp}/no-model", "no config.json"]),
    ("model-not-causal-lm", ["model.path={tmp}/t5"], ["T5Config", "not a causal language model"]),
    ("model-vocab-mismatch", ["model.path={tmp}/wide-tokenizer"],
     ["tokenizer has 29 tokens but the model's embedding has 21"]),
    ("prompt-too-long", ["model.path={model}", "rollout.max_new_tokens=200"],
     ["prompt countdown-", "max_position_embeddings=128", "rollout.max_new_tokens to at most"]),
    ("prompt-outside-vocab", ["model.path={model}", "task.name=numeric", "task.path={tmp}/words.jsonl"],
     ["prompt numeric-", "outside the vocabulary"]),
]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, warm_model_dir):
    """Every bad file the table points at, made once."""
    tmp = tmp_path_factory.mktemp("bad-inputs")
    (tmp / "broken.yaml").write_text("train:\n  lr: 0.1\n  steps: [1, 2\nrun:\n  seed: 1\n")
    (tmp / "tab.yaml").write_text("train:\n\tlr: 0.1\n")
    (tmp / "typo.yaml").write_text("train:\n  lr: 0.001\n  stepz: 3\n")
    (tmp / "bad.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n\n{"prompt": "2+2", "ans\n')
    (tmp / "nofield.jsonl").write_text('{"prompt": "1+1", "answer": "2"}\n{"prompt": "2+2"}\n')
    (tmp / "words.jsonl").write_text("".join(
        json.dumps({"prompt": f"What is {i}+{i}?", "answer": str(2 * i)}) + "\n" for i in range(20)))
    (tmp / "rewards_ok.py").write_text(
        "def score(problem, response):\n    return 1.0\n\n\ndef one_arg(response):\n    return 0.0\n")
    (tmp / "rewards_broken.py").write_text("def score(problem, response)\n    return 1.0\n")
    (tmp / "t5").mkdir()
    (tmp / "t5" / "config.json").write_text('{"model_type": "t5"}')
    build_char_tokenizer(ALPHABET).save_pretrained(tmp / "t5")
    shutil.copytree(warm_model_dir, tmp / "wide-tokenizer")
    build_char_tokenizer(ALPHABET + "abcdefgh").save_pretrained(tmp / "wide-tokenizer")
    (tmp / "taken").mkdir()
    (tmp / "taken" / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp / "empty").mkdir()
    (tmp / "done" / "checkpoints" / "step-00000004").mkdir(parents=True)
    (tmp / "done" / "config.yaml").write_text(dump_config(load_config(None, ["train.steps=4"])))
    return tmp


@pytest.mark.parametrize("args,culprits", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_exits_2_naming_the_culprit(inputs, warm_model_dir, capsys, args, culprits):
    fill = {"tmp": inputs, "model": warm_model_dir}
    given = {a.partition("=")[0] for a in args}
    defaults = [] if "--resume" in args else [a for a in RUN if a.partition("=")[0] not in given]
    code = main(["train", *(a.format(**fill) for a in args + defaults)])
    out = capsys.readouterr()
    assert code == 2, out.err
    # One message, last; above it at most transformers' "Loading weights" progress bar.
    message = out.err[out.err.find("tether train: error: "):]
    assert out.err.count("tether train: error: ") == 1, out.err
    for culprit in culprits:
        assert culprit.format(**fill) in message, out.err
    assert "Traceback" not in out.err + out.out
