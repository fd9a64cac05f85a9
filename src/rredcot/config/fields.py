"""What every config dataclass is built from: ``help_field`` (a field with its help text, read by
``rredcot.config.io``'s flag generator) and the checks of field values that many configs share
(train, sft, bench's and diagnose's): a finite number, a seed, a thread count, an output path.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import field
from typing import Any


def help_field(text: str, flags: tuple[str, ...] = (), **kw: Any) -> Any:
    """A dataclass field with its help text (and extra flag spellings) for the CLI generator."""
    return field(metadata={"help": text, "flags": tuple(flags)}, **kw)


def refuse_non_finite(cfg: Any, prefix: str = "") -> None:
    """Refuse a float field of the config dataclass ``cfg`` (or of a config nested in it) that
    is nan or infinite (``--lr inf``, ``--lr 1e400``, ``--kl_coef nan``), naming it."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            refuse_non_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{prefix}{f.name}={value}: give a finite number")


def refuse_blank_path(path: str | None, name: str = "out", what: str = "directory") -> None:
    """Refuse an output path that is empty or whitespace only (``--out ''`` would write into the
    current directory, ``--out ' '`` into a folder named by a space); every command that writes
    calls this one check."""
    if path is not None and not str(path).strip():
        raise ValueError(
            f"{name}='' names no {what} (given {str(path)!r}: blank, so the current directory or "
            f"a folder named by spaces); give --{name} PATH"
        )


def refuse_unknown(value: Any, valid: tuple[str, ...], name: str) -> None:
    """Refuse a setting ``name`` whose ``value`` is not one of ``valid``, listing them."""
    if value not in valid:
        raise ValueError(f"{name}={value!r}; valid: {', '.join(valid)}")


SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds torch takes (a 64-bit integer); a larger one failed with "Overflow when unpacking
long"."""

MAX_THREADS = 1024
"""The most CPU threads a ``threads`` setting may ask for (more only contend for the cores)."""


def refuse_bad_seed(seed: int, name: str = "seed") -> None:
    """Refuse a seed outside :data:`SEED_RANGE`, naming the range."""
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(
            f"{name}={seed} is outside the range of a seed (64 bits): give one in "
            "[-2**63, 2**63 - 1]"
        )


def refuse_bad_threads(threads: int, name: str = "threads", zero: str = "auto") -> None:
    """Refuse a thread count outside ``[0, MAX_THREADS]`` (``zero``: what 0 means)."""
    if not 0 <= threads <= MAX_THREADS:
        raise ValueError(
            f"{name}={threads} must be in [0, {MAX_THREADS}] (0: {zero}; this machine has "
            f"{os.cpu_count() or 'an unknown number of'} cores)"
        )
