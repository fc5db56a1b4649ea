"""The `tether` command: train, config, init-model, estimators.

Errors a user can fix (bad config, bad data, wrong model directory) print one message
and exit with status 2, without a Python traceback.
"""

from __future__ import annotations

import argparse
import sys

from tether.config import ConfigError, describe_fields, dump_config, load_config

TRAIN_HELP = """\
Train with RL: generate, score old log-probs, compute the loss, step, sync.

Settings come from a YAML file (--config) and/or dotted key=value overrides, e.g.
  tether train --config configs/countdown.yaml train.lr=5e-4 rollout.precision=fp8

Sections: model (which model; default is tether's own tiny Qwen3), task (countdown or
numeric), rollout (engine, generator precision, sampling), train (steps, optimizer,
estimator), sync (when the generator gets new weights), eval, run (directory, seed).
`tether config --fields` lists every key with its default and meaning;
`tether config --config FILE [key=value ...]` prints the resolved config.
Writes RUN_DIR/config.yaml, RUN_DIR/metrics.jsonl (one row per step) and RUN_DIR/final
(the trained model in Hugging Face safetensors format)."""


def _cmd_train(args: argparse.Namespace) -> int:
    from tether.loop import train

    cfg = load_config(args.config, args.overrides)
    result = train(cfg)
    print(f"run directory: {result.run_dir}")
    print(f"held-out accuracy (greedy): before {result.accuracy_before:.3f} -> "
          f"after {result.accuracy_after:.3f}")
    return 0


def _cmd_config(args: argparse.Namespace) -> int:
    if args.fields:
        print("\n".join(describe_fields()))
        return 0
    print(dump_config(load_config(args.config, args.overrides)), end="")
    return 0


def _cmd_init_model(args: argparse.Namespace) -> int:
    from tether.models import ensure_default_model

    cfg = load_config(args.config, args.overrides)
    task_kwargs = cfg.task.model_dump(exclude={"name", "seed", "eval_size", "format_weight"})
    path = ensure_default_model(cfg.model.cache_dir, cfg.model.moe, cfg.model.seed,
                                cfg.model.warmstart_steps, task_kwargs)
    print(path)
    return 0


def _cmd_estimators(args: argparse.Namespace) -> int:
    from tether.estimators import format_presets_table

    print(format_presets_table())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tether",
        description="RL for LLMs that stays stable when the generator and the trainer disagree.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", metavar="FILE", help="YAML config file (optional).")
        p.add_argument("overrides", nargs="*", metavar="key=value",
                       help="Dotted overrides applied after the file, e.g. train.lr=3e-4.")

    p = sub.add_parser("train", help="Run RL training.", description=TRAIN_HELP,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    with_config(p)
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("config", help="Print the resolved config (or every key with --fields).",
                       description="Validate a config and print it resolved, as YAML.")
    with_config(p)
    p.add_argument("--fields", action="store_true", help="List every key, its default and meaning.")
    p.set_defaults(func=_cmd_config)

    p = sub.add_parser(
        "init-model", help="Build and warm-start tether's tiny model (cached); print its path.",
        description="Build tether's tiny Qwen3 (model.moe=true: Qwen3-MoE) with a character "
        "tokenizer and warm-start it by supervised training on synthetic Countdown solutions. "
        "Deterministic for model.seed; cached under model.cache_dir.")
    with_config(p)
    p.set_defaults(func=_cmd_init_model)

    p = sub.add_parser("estimators", help="List the loss presets with formula and source.")
    p.set_defaults(func=_cmd_estimators)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, ValueError, FileNotFoundError, ImportError) as e:
        print(f"tether {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
