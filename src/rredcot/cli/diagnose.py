"""``rredcot diagnose``: the flags (from :class:`~rredcot.config.diagnose.DiagnoseConfig`, torch
free) and the command, which imports :mod:`rredcot.diagnose` (torch, transformers) only when it
runs."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from rredcot.config.diagnose import DiagnoseConfig
from rredcot.config.io import add_dataclass_flags, from_dict

# fields set by flags of their own: --task NAME and the free-form --task.KEY VALUE
SPECIAL = ("task", "task_args")


def add_diagnose_parser(sub) -> None:
    p = sub.add_parser(
        "diagnose",
        help="Will finer credit help this run? Where GRPO is blind, where its update lands, "
        "what better credit could change.",
        description="Samples P prompts x G completions from a frozen policy and reports the "
        "share of agreeing groups, where GRPO's logit-gradient mass lands per segment kind and "
        "position, the policy's uncertainty along the trace, Monte Carlo figures on a subset, "
        "and a verdict. Writes diagnose.json, diagnose.md and diagnose.png under --out; every "
        "figure is defined in docs/diagnose.md. Task parameters go as --task.NAME VALUE.",
    )
    add_dataclass_flags(p, DiagnoseConfig, skip=SPECIAL)
    p.add_argument(
        "--task",
        dest="task_name",
        default=argparse.SUPPRESS,
        help=dataclasses.fields(DiagnoseConfig)[1].metadata["help"],
    )
    p.set_defaults(func=run_diagnose)


def diagnose_config(args: argparse.Namespace, task_args: dict) -> DiagnoseConfig:
    """The validated config of the parsed flags (bad values are refused before a model loads)."""
    names = {f.name for f in dataclasses.fields(DiagnoseConfig)}
    given = {k: v for k, v in vars(args).items() if k in names and k not in SPECIAL}
    if hasattr(args, "task_name"):
        given["task"] = args.task_name
    given["task_args"] = task_args
    return from_dict(DiagnoseConfig, given)


def run_diagnose(args: argparse.Namespace, task_args: dict) -> int:
    cfg = diagnose_config(args, task_args)
    from rredcot.diagnose import diagnose_source  # lazy: torch loads only when the command runs

    report = diagnose_source(cfg, log=lambda *a: print(*a, file=sys.stderr))
    print(report.summary())
    written = report.write(cfg.out)
    print(f"wrote {', '.join(str(p) for p in written)}")
    return 0
