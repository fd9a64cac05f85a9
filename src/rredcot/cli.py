"""The ``rredcot`` command: train, sft, segment, explain, bench."""

from __future__ import annotations

import argparse
import os
import sys

from rredcot import __version__
from rredcot.config import (
    TrainConfig,
    add_dataclass_flags,
    given_fields,
    resolve_config,
    split_task_args,
)
from rredcot.errors import UserError


def _config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    parser.add_argument("--config", default=None, help="YAML file with any of the fields below.")
    add_dataclass_flags(parser, cls)


def _overrides(
    args: argparse.Namespace, skip: tuple[str, ...] = ("command", "config", "func")
) -> dict:
    return {k: v for k, v in vars(args).items() if k not in skip}


def cmd_train(args: argparse.Namespace, task_args: dict) -> int:
    from rredcot.trainer import train

    overrides = _overrides(args)
    cfg = resolve_config(TrainConfig, args.config, overrides, task_args)
    result = train(cfg, given=given_fields(args.config, overrides, task_args))
    start, final = result["start_accuracy"], result["final_accuracy"]
    if start is not None and final is not None:
        print(
            f"greedy accuracy: {start:.1%} before RL -> {final:.1%} after {result['steps']} steps "
            f"({final - start:+.1%}); run directory: {result['run_dir']}"
        )
    return 0


def cmd_sft(args: argparse.Namespace, task_args: dict) -> int:
    from rredcot.sft import SFTConfig, run_sft

    cfg = resolve_config(SFTConfig, args.config, _overrides(args), task_args)
    run_sft(cfg)
    return 0


def cmd_explain(args: argparse.Namespace, task_args: dict) -> int:
    from rredcot.cli_explain import run_explain

    return run_explain(args, task_args)


def cmd_bench(args: argparse.Namespace, task_args: dict) -> int:
    from rredcot.bench.cli import run_bench

    return run_bench(args, task_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rredcot",
        description="Segment-level credit assignment for RL fine-tuning of chain-of-thought models.",
    )
    parser.add_argument("--version", action="version", version=f"rredcot {__version__}")
    sub = parser.add_subparsers(dest="command")

    p = sub.add_parser(
        "train",
        help="RL fine-tuning with a credit method (no arguments: the embedded CPU default).",
        description="Task parameters go as --task.NAME VALUE (e.g. --task.num_steps 5).",
    )
    _config_flags(p, TrainConfig)
    p.add_argument(
        "--credit",
        dest="credit_method",
        default=argparse.SUPPRESS,
        help="Alias of --credit_method.",
    )
    p.set_defaults(func=cmd_train)

    from rredcot.sft import SFTConfig

    p = sub.add_parser(
        "sft", help="Supervised warm-start of the tiny model to the edge of competence."
    )
    _config_flags(p, SFTConfig)
    p.set_defaults(func=cmd_sft)

    from rredcot.cli_segment import add_segment_parser

    add_segment_parser(sub)

    from rredcot.cli_explain import add_explain_parser

    add_explain_parser(sub)
    p = sub.choices["explain"]
    p.set_defaults(func=cmd_explain)

    try:
        from rredcot.bench.cli import add_bench_parser
    except ImportError:
        add_bench_parser = None
    if add_bench_parser is not None:
        add_bench_parser(sub)
        sub.choices["bench"].set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        argv, task_args = split_task_args(argv)
    except ValueError as err:
        print(f"rredcot: error: {err}", file=sys.stderr)
        return 2
    parser = build_parser()
    if not argv:
        argv = ["train"]  # the embedded default job
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        if args.command in ("train", "sft", "explain", "bench"):
            return args.func(args, task_args)
        if task_args:
            raise ValueError(f"--task.* flags are not used by `rredcot {args.command}`")
        return args.func(args)
    except (UserError, ValueError, FileNotFoundError, ImportError, TypeError) as err:
        if os.environ.get("RREDCOT_DEBUG"):
            raise
        print(f"rredcot: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
