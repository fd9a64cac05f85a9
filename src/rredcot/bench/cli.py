"""``rredcot bench credit | learn | overhead | peer | memory``: the command-line side of the benchmarks.

Each subcommand's flags are generated from its config dataclass (``rredcot.bench.configs``) by
the generator ``rredcot train`` uses, so every flag has its help text and its default from one
place. Task parameters go as ``--task.NAME VALUE`` (``rredcot.cli.commands`` pulls them out before
parsing). The credit settings of every method are flags as in ``rredcot train``
(``--credit.lam 0.5``, ``--credit.value_head.lr 1e-3``); ``--set key=value`` (repeatable) overrides
any ``TrainConfig`` / ``CreditConfig`` field for every method, e.g. ``--set
sampling.num_generations=4``. A variant's own ``key=value`` wins over both.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib

from rredcot.bench.configs import (
    CreditBenchConfig,
    LearnBenchConfig,
    MemoryBenchConfig,
    OverheadBenchConfig,
    PeerBenchConfig,
    RecordAutoConfig,
    parse_trl_overrides,
)
from rredcot.bench.variants import parse_set
from rredcot.config import CreditConfig
from rredcot.config.io import add_dataclass_flags, from_dict
from rredcot.errors import UserError

# name -> (config, runner module, runner, help, description). A benchmark's module imports torch
# at its top: it is imported (importlib) only when its benchmark runs, as rredcot.cli.commands.DEFERRED.
SUBCOMMANDS = {
    "credit": (
        CreditBenchConfig,
        "rredcot.bench.credit",
        "run_credit_bench",
        "Credit quality on a frozen policy against Monte Carlo ground truth.",
        "Writes credit.json, credit.md and example HTML pages under --out.",
    ),
    "learn": (
        LearnBenchConfig,
        "rredcot.bench.learn",
        "run_learn_bench",
        "Every method from one warm-start, same prompts, same token budget, several seeds.",
        "Writes learn.json, learn.md and PNG curves under --out; resumable.",
    ),
    "overhead": (
        OverheadBenchConfig,
        "rredcot.bench.overhead",
        "run_overhead_bench",
        "Full step time of each method / uniform's, interleaved in one process.",
        "Writes overhead.json and overhead.md under --out.",
    ),
    "peer": (
        PeerBenchConfig,
        "rredcot.bench.peer",
        "run_peer_bench",
        "rredcot's uniform trainer against TRL's GRPOTrainer: same model, task, batch, length.",
        "Alternating processes; seconds per step, completions per second, peak memory and the "
        "time split of each. Writes peer.json and peer.md under --out.",
    ),
    "memory": (
        MemoryBenchConfig,
        "rredcot.bench.memory",
        "run_memory_bench",
        "Peak resident memory of a step per credit method, model and batch size.",
        "Each measurement in its own process; writes memory.json and memory.md under --out.",
    ),
    "record-auto": (
        RecordAutoConfig,
        "rredcot.bench.record",
        "run_record_auto",
        "Record a learn bench's per-second figures as rows --credit auto reads.",
        "Adds (or replaces) rows of src/rredcot/measurements/credit_auto.json (or --file).",
    ),
}
# fields filled from flags of their own, not from the generator
SPECIAL_FIELDS = ("task", "task_args", "overrides", "trl_overrides")
# credit fields a subcommand sets with flags of its own (bench credit: --segmenters, --lam)
CREDIT_FLAGS_SKIP = {"credit": ("segmenter", "lam")}


def add_bench_parser(sub) -> None:
    """Register ``bench`` with one subcommand per entry of :data:`SUBCOMMANDS`."""
    bench = sub.add_parser(
        "bench",
        help="Benchmarks: credit quality, learning under a token budget, step-time overhead, "
        "peer trainers.",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.set_defaults(bench_help=bench.format_help)
    bsub = bench.add_subparsers(dest="bench_command")
    for name, (cls, _, _, help_text, description) in SUBCOMMANDS.items():
        p = bsub.add_parser(name, help=help_text, description=description)
        add_dataclass_flags(p, cls, skip=SPECIAL_FIELDS)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        if "task" in fields:
            p.add_argument(
                "--task",
                dest="task_name",
                default=argparse.SUPPRESS,
                help=fields["task"].metadata.get("help"),
            )
        if "overrides" in fields:
            p.add_argument(
                "--set",
                dest="set_pairs",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="Config override for every method (repeatable), e.g. --set credit.lam=0.5.",
            )
            group = p.add_argument_group(
                "credit",
                "Credit settings of every method, as for `rredcot train` (the same as --set "
                "credit.KEY=VALUE; a variant's own key=value wins).",
            )
            skip = CREDIT_FLAGS_SKIP.get(name, ())
            add_dataclass_flags(p, CreditConfig, "credit.", skip, group)
        if "trl_overrides" in fields:
            p.add_argument(
                "--trl-set",
                dest="trl_pairs",
                action="append",
                default=[],
                metavar="KEY=VALUE",
                help="GRPOConfig override for TRL (repeatable; JSON values), e.g. "
                "--trl-set bf16=true.",
            )


def bench_config(command: str, args: argparse.Namespace, task_args: dict):
    """The validated config of ``rredcot bench COMMAND`` from its parsed flags."""
    cls = SUBCOMMANDS[command][0]
    names = {f.name for f in dataclasses.fields(cls)}
    given = {k: v for k, v in vars(args).items() if k in names and k not in SPECIAL_FIELDS}
    if hasattr(args, "task_name"):
        given["task"] = args.task_name
    if "task_args" in names:
        given["task_args"] = task_args
    if "overrides" in names:
        credit_flags = {k: v for k, v in vars(args).items() if k.startswith("credit.")}
        given["overrides"] = {**parse_set(getattr(args, "set_pairs", [])), **credit_flags}
    if "trl_overrides" in names:
        given["trl_overrides"] = parse_trl_overrides(getattr(args, "trl_pairs", []))
    if command == "credit":
        if not given.get("checkpoint"):
            raise UserError(
                "bench credit needs --checkpoint (a model, checkpoint or run directory)"
            )
        bad = [k for k in given["overrides"] if not k.startswith("credit.")]
        if bad:
            raise UserError(
                f"bench credit: --set only takes credit.* keys (the policy is frozen); got {bad}"
            )
    return from_dict(cls, given)


def run_bench(args: argparse.Namespace, task_args: dict) -> int:
    command = getattr(args, "bench_command", None)
    if command is None:
        print(args.bench_help())
        return 2
    cfg = bench_config(command, args, task_args)
    _, module, runner, _, _ = SUBCOMMANDS[command]
    getattr(importlib.import_module(module), runner)(cfg)
    return 0
