"""A training checkpoint: what ``rredcot train`` saves after a step and restores on
``--resume``, written and verified through ``rredcot.training.runio``'s atomic, manifest-checked
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

from rredcot.errors import UserError
from rredcot.models import load_policy
from rredcot.training import runio

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


_STATE_PARTS = {"optimizer": dict, "scheduler": dict, "credit_method": dict, "rng": dict}


def check_trainer_state(state: dict[str, Any], ckpt: Path) -> None:
    """Refuse, in one line naming the file, a ``trainer_state.pt`` that lacks a part a resume
    restores, or whose counters are not non-negative numbers (its ``step`` the checkpoint's
    own, ``step_N``)."""
    path = ckpt / "trainer_state.pt"
    fix = "resume from another checkpoint (delete this one) or start again with --overwrite"
    missing = [name for name, kind in _STATE_PARTS.items() if not isinstance(state.get(name), kind)]
    missing += [n for n in COUNTERS if n not in _ADDED_LATER and n not in state]
    if missing:
        raise UserError(
            f"{path} lacks {', '.join(missing)} (not a trainer state rredcot wrote); {fix}"
        )
    for name in COUNTERS:
        value = state.get(name, _ADDED_LATER.get(name, 0))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise UserError(f"{path}: {name}={str(value)[:40]} must be a number >= 0; {fix}")
    step = state["step"]
    expected = int(ckpt.name.removeprefix("step_")) if ckpt.name.startswith("step_") else step
    if not isinstance(step, int) or step != expected:
        raise UserError(f"{path}: step={step} but the checkpoint is {ckpt.name}; {fix}")


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
    check_trainer_state(state, ckpt)  # before the policy loads
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
