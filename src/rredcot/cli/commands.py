"""The ``rredcot`` command: train, sft, segment, explain, bench."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import sys

from rredcot import __version__
from rredcot.bench.cli import add_bench_parser, run_bench
from rredcot.cli.diagnose import add_diagnose_parser
from rredcot.cli.explain import add_explain_parser, run_explain
from rredcot.cli.segment import add_segment_parser
from rredcot.config import SFTConfig, TrainConfig
from rredcot.config.io import add_dataclass_flags, split_task_args
from rredcot.errors import UserError

# The CLI's one lazy import. The flags of every command are built from torch-free modules (the
# configs, the segmenters, the explain and bench parsers); the commands that train run from
# modules that import torch, transformers and accelerate at their top, so these are imported only
# when their command runs: `rredcot --help`, `segment` with a text strategy and `explain --demo`
# start in a fraction of a second (tests/cli/test_cli_startup.py). bench runs each benchmark's
# module the same way (bench.cli.SUBCOMMANDS).
DEFERRED = {
    "train": "rredcot.cli.train:run_train",
    "sft": "rredcot.cli.train:run_warmstart",
}
# the commands that take --task.NAME VALUE parameters
TASK_COMMANDS = ("train", "sft", "explain", "bench", "diagnose")


def deferred(command: str):
    """The runner of a command in :data:`DEFERRED`, imported when it is called."""
    module, _, name = DEFERRED[command].partition(":")

    def run(args: argparse.Namespace, task_args: dict) -> int:
        return getattr(importlib.import_module(module), name)(args, task_args)

    return run


def _config_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    parser.add_argument("--config", default=None, help="YAML file with any of the fields below.")
    add_dataclass_flags(parser, cls)


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
    p.set_defaults(func=deferred("train"))

    p = sub.add_parser(
        "sft",
        help="Supervised warm-start on a task's gold traces: the tiny model to the edge of "
        "competence, or any causal LM (--init) for a short warm-up.",
    )
    _config_flags(p, SFTConfig)
    p.set_defaults(func=deferred("sft"))

    add_segment_parser(sub)  # sets its own func: cli_segment.run_segment
    add_explain_parser(sub)
    sub.choices["explain"].set_defaults(func=run_explain)
    add_bench_parser(sub)
    sub.choices["bench"].set_defaults(func=run_bench)
    add_diagnose_parser(sub)  # sets its own func: cli_diagnose.run_diagnose
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
        if args.command in TASK_COMMANDS:
            return args.func(args, task_args)
        if task_args:
            raise ValueError(f"--task.* flags are not used by `rredcot {args.command}`")
        return args.func(args)
    except (UserError, ValueError, FileNotFoundError, ImportError, TypeError) as err:
        if os.environ.get("RREDCOT_DEBUG"):
            raise
        print(f"rredcot: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # the file system said no: a path, a full disk, a read-only mount
        if os.environ.get("RREDCOT_DEBUG"):
            raise
        _silence_unwritable_stdout()
        if isinstance(err, BrokenPipeError):  # `rredcot segment | head`: the reader had enough
            return 1
        print(f"rredcot: error: {describe_os_error(err)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


_OS_ERROR_FIXES = {
    errno.EISDIR: "give a file name, not a directory",
    errno.ENOTDIR: "a parent of that path is a file, not a directory",
    errno.EACCES: "that location is not writable by you; pick another path",
    errno.EPERM: "that location is not writable by you; pick another path",
    errno.EROFS: "that file system is read-only; pick another path",
    errno.ENOSPC: "the disk is full; free space or write elsewhere",
}


def describe_os_error(err: OSError) -> str:
    """One line for an ``OSError``: the path (or the output), what went wrong and the fix."""
    if err.errno is None and err.filename is None:  # a message of its own (a model that won't load)
        return str(err)
    what = err.strerror or str(err)
    where = f"{err.filename}: " if err.filename is not None else "writing the output: "
    fix = _OS_ERROR_FIXES.get(err.errno)
    return f"{where}{what}" + (f"; {fix}" if fix else "")


def _silence_unwritable_stdout() -> None:
    """After standard output failed (``> /dev/full``, a closed pipe), point it at the null
    device so that the interpreter's last flush does not fail again with a second message."""
    try:
        sys.stdout.flush()
    except OSError:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


if __name__ == "__main__":
    raise SystemExit(main())
