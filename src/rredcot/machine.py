"""This machine: its physical memory, the refusal of a size that cannot fit it, and the torch
device a run names (``--device``).

Read without torch, before anything is loaded or sampled: the configs (``rredcot.config``) check
their batch, evaluation and Monte Carlo sizes with it when they are built, and the commands that
sample (``explain``, ``diagnose``) check theirs. A lower bound, not an estimate of a run's peak
(``rredcot.sampling.memory`` sizes the forwards once the model is loaded): what exceeds it would
fail in an allocator or swap for hours.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from rredcot.errors import UserError

if TYPE_CHECKING:
    import torch

BYTES_PER_TOKEN = 12  # the least a sampled token costs: its int64 id and float32 log-prob


def physical_memory() -> int | None:
    """This machine's physical memory in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def refuse_bytes_beyond_memory(what: str, need: int, detail: str, fix: str) -> None:
    """Refuse, before anything is loaded or built, what needs ``need`` bytes (``detail`` says
    for what) where that exceeds this machine's physical memory, with the estimate: it would
    fail in an allocator or swap for hours."""
    memory = physical_memory()
    if memory and need > memory:
        raise ValueError(
            f"{what}: {detail} need at least {need / 2**30:,.0f} GiB, more than this machine's "
            f"{memory / 2**30:,.0f} GiB; {fix}"
        )


def refuse_beyond_memory(what: str, rows: int, tokens: int, fix: str) -> None:
    """Refuse, before anything is loaded or sampled, a size whose token ids and log-probs alone
    (``rows`` x ``tokens`` x :data:`BYTES_PER_TOKEN`, a lower bound of what it needs) exceed
    this machine's physical memory, with the estimate: such a run would fail in an allocator
    or swap for hours."""
    memory = physical_memory()
    need = rows * max(tokens, 1) * BYTES_PER_TOKEN
    if memory and need > memory:
        raise ValueError(
            f"{what}: {rows:,} rows of at least {max(tokens, 1)} tokens need at least "
            f"{need / 2**30:,.0f} GiB for their token ids and log-probs alone, more than this "
            f"machine's {memory / 2**30:,.0f} GiB; {fix}"
        )


def resolve_device(name: str) -> torch.device:
    """The torch device of ``--device``; a device this machine does not have is a ``UserError``
    (training on the CPU instead would be a silent surprise). torch is imported here, so the
    memory checks above stay free of it."""
    import torch

    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        return torch.device("cpu")
    try:
        device = torch.device(name)
    except RuntimeError as err:
        raise UserError(f"--device {name!r} is not a device; use auto, cpu, cuda or mps") from err
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UserError(
                f"--device {name}: no CUDA GPU is visible on this machine "
                "(torch.cuda.is_available() is False); use --device cpu or auto"
            )
        if device.index is not None and device.index >= count:
            raise UserError(f"--device {name}: this machine has {count} CUDA GPU(s); use cuda:0")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {name}: MPS is not available here; use --device cpu or auto")
    return device
