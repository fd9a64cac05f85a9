"""This machine's physical memory, and the refusal of a size that cannot fit it.

Read without torch, before anything is loaded or sampled: the configs (``rredcot.config``) check
their batch, evaluation and Monte Carlo sizes with it when they are built, and the commands that
sample (``explain``, ``diagnose``) check theirs. A lower bound, not an estimate of a run's peak
(``rredcot.sampling.memory`` sizes the forwards once the model is loaded): what exceeds it would
fail in an allocator or swap for hours.
"""

from __future__ import annotations

import os

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
