"""The credit's state beside TRL's checkpoints: the method's state (``value_head.pt``) and the
run's settings (``rredcot_credit.json``, :mod:`rredcot.integrations.saved`), written with each
checkpoint and read back on resume. No TRL import."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rredcot.config import CreditConfig
from rredcot.errors import UserError
from rredcot.integrations.saved import (
    CREDIT_STATE_FILE,
    SETTINGS_FILE,
    atomic_write,
    read_settings,
    settings_dict,
    write_settings,
)
from rredcot.methods.auto import CreditChoice
from rredcot.methods.base import CreditMethod
from rredcot.tasks.base import Problem, Task
from rredcot.training.runio import load_plain

__all__ = ["check_saved_code", "example_row", "load_method_state", "saved_choice", "write_credit"]


def write_credit(
    output_dir: str | Path,
    method: CreditMethod,
    args: Any,
    temperature: float,
    choice: CreditChoice | None,
    example: dict | None,
) -> Path | None:
    """Write the run's settings (``args``: the trainer's ``RREDCoTGRPOConfig``) and ``method``'s
    state, if it has one, into ``output_dir``; the state file's path, or None without a state."""
    write_settings(
        output_dir,
        settings_dict(
            method.name,
            method.config,
            args.task,
            args.task_args,
            args.answer_column,
            temperature,
            args.top_p,
            args.max_completion_length,
            credit_choice=None if choice is None else choice.to_json(),
            example=example,
        ),
    )
    state = method.state_dict()
    if not state:
        return None
    record = {"credit_method": method.name, "state": state}
    return atomic_write(Path(output_dir) / CREDIT_STATE_FILE, lambda f: torch.save(record, f))


def example_row(task: Task | None, dataset: Any, problem: Callable[[dict], Problem]) -> dict | None:
    """The first training row's prompt and answer as text (``rredcot explain --run`` shows
    it, and so needs none of the task's data); None where the prompt is not plain text."""
    if task is None:
        return None
    try:
        row = dataset[0]
        found = problem(dict(row))
    except Exception:  # noqa: BLE001 - an iterable or empty dataset: nothing recorded
        return None
    if not isinstance(found.prompt, str) or not found.prompt or not found.answer:
        return None
    return {"prompt": found.prompt, "answer": str(found.answer)}


def saved_choice(
    checkpoint_dir: str | Path, mine: CreditConfig
) -> tuple[CreditChoice, CreditConfig] | None:
    """What ``auto`` chose in a checkpoint (``rredcot_credit.json``) and the credit config it
    saved; None where nothing was chosen there. ``mine``: this trainer's credit config, whose
    process-reward function or model the saved one may name (:func:`check_saved_code`)."""
    saved = read_settings(checkpoint_dir)
    if saved is None or not saved.credit_choice:
        return None
    where = f"{Path(checkpoint_dir) / SETTINGS_FILE} (credit_choice)"
    choice = CreditChoice.read_dict(saved.credit_choice, where)  # names no code
    check_saved_code(saved.credit, mine, Path(checkpoint_dir) / SETTINGS_FILE)
    return choice, saved.credit


def load_method_state(checkpoint_dir: str | Path, method: CreditMethod) -> bool:
    """Read ``value_head.pt`` from a checkpoint or model directory into ``method``; False if
    it has none."""
    path = Path(checkpoint_dir) / CREDIT_STATE_FILE
    if not path.exists():
        return False
    saved = load_plain(path)  # a payload or a cut file: one line naming it
    if not isinstance(saved, dict) or "state" not in saved:
        raise UserError(f"{path} is not a credit state RREDCoTGRPOTrainer writes")
    if saved.get("credit_method") != method.name:
        raise ValueError(
            f"{path} holds the state of credit method {saved.get('credit_method')!r}, but "
            f"this trainer uses {method.name!r}"
        )
    method.load_state_dict(saved["state"])
    return True


def check_saved_code(saved: CreditConfig, mine: CreditConfig, path: Path) -> None:
    """A checkpoint's saved credit config may name a process-reward function or model only
    where this trainer's own (``mine``) names the same: reading a checkpoint never imports
    code or loads a model that the checkpoint alone names."""
    for name in ("function", "model"):
        theirs = getattr(saved.process_reward, name)
        if theirs and theirs != getattr(mine.process_reward, name):
            raise UserError(
                f"{path} names credit.process_reward.{name}={theirs[:120]!r}, which resuming "
                "would load; rredcot never loads code or a model a checkpoint names: read "
                f"that file, then give it yourself (credit.process_reward.{name}) to allow it"
            )
