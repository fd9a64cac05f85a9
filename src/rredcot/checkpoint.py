"""A training checkpoint: what ``rredcot train`` saves after a step and restores on
``--resume``, written and verified through ``rredcot.runio``'s atomic, manifest-checked
primitives.

``checkpoints/step_N/`` holds ``policy/`` (``save_pretrained`` of the policy and tokenizer) and
``trainer_state.pt``: the run's counters (:data:`COUNTERS`), the optimiser's, the learning-rate
schedule's and the credit method's state dicts, and the RNG states, as tensors and plain data
only: it loads with ``torch.load(weights_only=True)`` (``runio.load_trainer_state``), so a
checkpoint from someone else cannot run code when it is resumed or explained.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from rredcot import runio
from rredcot.models import load_policy

COUNTERS = (
    "step",
    "samples_seen",
    "tokens_generated",
    "extra_tokens_generated",
    "skipped_total",
    "train_seconds",
    "compute_used",
    "reference_tokens_trained",
)
"""The run's totals after the checkpoint's step, as ``trainer_state.pt`` keys."""

# absent from older checkpoints: their default (a resumed old run counts from there)
_ADDED_LATER = {
    "extra_tokens_generated": 0,
    "train_seconds": 0.0,
    "compute_used": 0.0,
    "reference_tokens_trained": 0,
}


def save_training_checkpoint(
    run_dir: str | Path,
    counters: dict[str, float],
    policy: Any,
    tokenizer: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    method: Any,
    keep: int,
) -> Path:
    """Write ``checkpoints/step_{counters['step']}`` (keeping the newest ``keep``); returns it."""
    state = {
        **{name: counters[name] for name in COUNTERS},
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "credit_method": method.state_dict(),
        "rng": runio.capture_rng_state(),
    }
    return runio.save_checkpoint(run_dir, counters["step"], policy, tokenizer, state, keep=keep)


def restore_training_checkpoint(
    ckpt: str | Path,
    policy: Any,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    method: Any,
    dtype: torch.dtype,
) -> dict[str, int]:
    """Load checkpoint ``ckpt`` into the live policy, optimiser, schedule and credit method and
    restore the RNG states; returns the counters (:data:`COUNTERS`) it was saved with."""
    ckpt = Path(ckpt)
    state = runio.load_trainer_state(ckpt / "trainer_state.pt")
    saved, _ = load_policy(str(ckpt / "policy"), dtype=dtype)
    policy.load_state_dict(saved.state_dict())
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    method.load_state_dict(state["credit_method"])
    runio.restore_rng_state(state["rng"])
    return {
        name: state.get(name, _ADDED_LATER[name]) if name in _ADDED_LATER else state[name]
        for name in COUNTERS
    }
