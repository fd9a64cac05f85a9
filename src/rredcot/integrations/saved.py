"""What the TRL adapter writes next to a checkpoint, and how ``rredcot explain`` reads it back.

A TRL ``output_dir`` (after ``save_model``) and each of its ``checkpoint-N`` directories hold the
policy (``config.json`` and weights, TRL's own), the credit method's state (``value_head.pt``:
``{"credit_method": name, "state": state_dict}``) and the run's rredcot settings
(``rredcot_credit.json``: the method, the resolved ``CreditConfig``, the task, how completions
were sampled and, for ``credit_method="auto"``, what it chose and why). No TRL import here: ``rredcot explain`` reads TRL runs without TRL installed.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from rredcot.config import CreditConfig, SamplingConfig
from rredcot.config.io import from_dict, to_dict
from rredcot.errors import UserError
from rredcot.safe_fs import create_file, read_json_file

__all__ = [
    "CREDIT_STATE_FILE",
    "SETTINGS_FILE",
    "RunSettings",
    "atomic_write",
    "is_trl_run",
    "latest_trl_checkpoint",
    "read_settings",
    "write_settings",
]

CREDIT_STATE_FILE = "value_head.pt"
SETTINGS_FILE = "rredcot_credit.json"
_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")


class RunSettings:
    """The rredcot settings of a TRL run: ``credit_method``, ``credit`` (a
    :class:`CreditConfig`), ``task`` (name or None), ``task_args``, ``answer_column`` and
    ``sampling`` (a :class:`SamplingConfig` with TRL's temperature, top_p and
    max_completion_length), ``credit_choice`` (what ``auto`` chose, as
    ``CreditChoice.to_json``; None for a named method) and ``example`` (a training row's prompt
    and answer, the problem ``explain`` shows; None in runs saved before it)."""

    def __init__(
        self,
        credit_method: str,
        credit: CreditConfig,
        task: str | None,
        task_args: dict,
        answer_column: str,
        sampling: SamplingConfig,
        credit_choice: dict | None = None,
        example: dict | None = None,
    ) -> None:
        self.credit_method = credit_method
        self.credit = credit
        self.task = task
        self.task_args = task_args
        self.answer_column = answer_column
        self.sampling = sampling
        self.credit_choice = credit_choice
        self.example = example


def write_settings(directory: str | Path, settings: dict[str, Any]) -> Path:
    """Write ``settings`` (plain JSON: see :func:`read_settings`) to ``directory/SETTINGS_FILE``,
    atomically."""
    path = Path(directory) / SETTINGS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(settings, indent=2, sort_keys=True) + "\n"
    return atomic_write(path, lambda fh: fh.write(text.encode("utf-8")))


def atomic_write(path: str | Path, write: Callable[[IO[bytes]], Any]) -> Path:
    """``write(file)`` into a new temporary file beside ``path``, then renamed over it (a link
    planted at the temporary name is never followed); the settings and the credit state."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    with os.fdopen(create_file(tmp), "wb") as fh:
        write(fh)
    os.replace(tmp, path)
    return path


def settings_dict(
    credit_method: str,
    credit: CreditConfig,
    task: str | None,
    task_args: dict,
    answer_column: str,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    credit_choice: dict | None = None,
    example: dict | None = None,
) -> dict[str, Any]:
    """The JSON object :func:`write_settings` stores. ``example``: one training row's
    ``{"prompt", "answer"}`` (text), the problem ``rredcot explain --run`` shows, so that
    explaining a run never needs its task's data (a hub dataset offline)."""
    return {
        "credit_method": credit_method,
        "credit": to_dict(credit),
        "task": task,
        "task_args": dict(task_args or {}),
        "answer_column": answer_column,
        "sampling": {
            "temperature": float(temperature),
            "top_p": float(top_p),
            "max_new_tokens": int(max_new_tokens),
        },
        "credit_choice": credit_choice,
        "example": example,
    }


def read_settings(directory: str | Path) -> RunSettings | None:
    """The settings a TRL run saved in ``directory`` (an ``output_dir`` or ``checkpoint-N``);
    None if it has none."""
    path = Path(directory) / SETTINGS_FILE
    if not path.is_file():
        return None
    try:
        data = read_json_file(path, "TRL run settings")  # size and nesting within limits
        if not isinstance(data, dict) or not isinstance(data.get("credit_method"), str):
            raise ValueError("no credit_method: not the settings RREDCoTGRPOTrainer writes")
        sampling = data.get("sampling") or {}
        return RunSettings(
            credit_method=data["credit_method"],
            credit=from_dict(CreditConfig, data.get("credit") or {}, where="credit."),
            task=data.get("task"),
            task_args=dict(data.get("task_args") or {}),
            answer_column=data.get("answer_column", "answer"),
            sampling=SamplingConfig(
                temperature=float(sampling.get("temperature", 1.0)),
                top_p=float(sampling.get("top_p", 1.0)),
                max_new_tokens=int(sampling.get("max_new_tokens", 0)),
            ),
            credit_choice=data.get("credit_choice"),
            example=_example(data.get("example")),
        )
    except (ValueError, TypeError, AttributeError, UnicodeDecodeError, UserError) as err:
        why = str(err).splitlines()[0][:300] if str(err) else type(err).__name__
        raise ValueError(f"{path} cannot be read as a TRL run's rredcot settings: {why}") from None


def _example(value: Any) -> dict | None:
    """A saved example: ``{"prompt": str, "answer": str}``, or None (absent or malformed)."""
    if isinstance(value, dict) and all(isinstance(value.get(k), str) for k in ("prompt", "answer")):
        return {"prompt": value["prompt"], "answer": value["answer"]}
    return None


def latest_trl_checkpoint(output_dir: str | Path) -> Path | None:
    """The ``checkpoint-N`` with the largest ``N`` in a TRL ``output_dir`` that holds a model
    (``config.json``); None if there is none."""
    found = []
    for child in Path(output_dir).iterdir() if Path(output_dir).is_dir() else []:
        m = _CHECKPOINT.match(child.name)
        if m and (child / "config.json").exists():
            found.append((int(m.group(1)), child))
    return max(found)[1] if found else None


def is_trl_run(directory: str | Path) -> bool:
    """Whether ``directory`` is a TRL run of the adapter: its settings file, or a
    ``checkpoint-N`` that has one."""
    p = Path(directory)
    if (p / SETTINGS_FILE).is_file():
        return True
    ckpt = latest_trl_checkpoint(p)
    return ckpt is not None and (ckpt / SETTINGS_FILE).is_file()
