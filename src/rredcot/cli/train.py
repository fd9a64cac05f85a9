"""``rredcot train`` and ``rredcot sft``: resolve the config from the flags, then train.

``rredcot.cli.commands`` imports this module only when one of these commands runs (its table
``cli.DEFERRED``): the trainer's libraries (torch, transformers, accelerate) load here, at the
top, not while the flags are built.
"""

from __future__ import annotations

import argparse

from rredcot.config import SFTConfig, TrainConfig
from rredcot.config.io import given_fields, resolve_config
from rredcot.errors import UserError
from rredcot.training.sft import run_sft
from rredcot.training.trainer import train

# parsed flags that are not config fields
NOT_FIELDS = ("command", "config", "func")


def overrides(args: argparse.Namespace) -> dict:
    """The config fields given as flags."""
    return {k: v for k, v in vars(args).items() if k not in NOT_FIELDS}


def run_train(args: argparse.Namespace, task_args: dict) -> int:
    given = overrides(args)
    cfg = resolve_config(TrainConfig, args.config, given, task_args)
    result = train(cfg, given=given_fields(args.config, given, task_args))
    start, final = result["start_accuracy"], result["final_accuracy"]
    if start is not None and final is not None:
        print(
            f"greedy accuracy: {start:.1%} before RL -> {final:.1%} after {result['steps']} steps "
            f"({final - start:+.1%}); run directory: {result['run_dir']}"
        )
    return 0


TINY_SHAPE = ("hidden_size", "num_layers", "num_heads")


def run_warmstart(args: argparse.Namespace, task_args: dict) -> int:
    given = overrides(args)
    cfg = resolve_config(SFTConfig, args.config, given, task_args)
    shape = sorted(set(TINY_SHAPE) & given_fields(args.config, given))
    if cfg.init and shape:
        raise UserError(
            f"--init {cfg.init} with --{', --'.join(shape)}: those shape the tiny model, and an "
            "--init model keeps its own; drop them, or drop --init to train the tiny model"
        )
    run_sft(cfg)
    return 0
