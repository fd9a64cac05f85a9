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
    fix = runio.RESUME_FIX
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


def _first_line(err: Exception) -> str:
    text = str(err).splitlines()[0][:120] if str(err) else ""
    return text or type(err).__name__


def check_optimizer_state(saved: Any, optimizer: torch.optim.Optimizer, path: Path) -> None:
    """Refuse, in one line naming ``path``, a saved optimiser state whose groups or per-parameter
    tensors (Adam's moments) do not have the shapes of the live optimiser's parameters: loading
    it would succeed and the first step fail."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    problem = None
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    per_param = saved.get("state") if isinstance(saved, dict) else None
    if not isinstance(groups, list) or not isinstance(per_param, dict):
        problem = "no param_groups or state"
    elif len(groups) != len(optimizer.param_groups):
        problem = f"{len(groups)} parameter groups, the run has {len(optimizer.param_groups)}"
    else:
        for index, values in per_param.items():
            if not isinstance(index, int) or not 0 <= index < len(params):
                problem = f"a state for parameter {str(index)[:20]}, the run has {len(params)}"
                break
            for key, value in values.items() if isinstance(values, dict) else []:
                shape = params[index].shape
                if isinstance(value, torch.Tensor) and value.dim() and value.shape != shape:
                    problem = (
                        f"{key} of parameter {index} is {tuple(value.shape)}, not {tuple(shape)}"
                    )
                    break
            if problem:
                break
    if problem:
        raise UserError(
            f"{path}: its optimizer state does not fit this run's model ({problem}); "
            f"{runio.RESUME_FIX}"
        )


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
    path = ckpt / "trainer_state.pt"
    state = runio.load_trainer_state(path)
    check_trainer_state(state, ckpt)  # before the policy loads
    check_optimizer_state(state["optimizer"], optimizer, path)
    saved, _ = load_policy(str(ckpt / "policy"), dtype=dtype)
    policy.load_state_dict(saved.state_dict())
    parts = {
        "optimizer": optimizer.load_state_dict,
        "scheduler": scheduler.load_state_dict,
        "credit_method": method.load_state_dict,
        "rng": runio.restore_rng_state,
    }
    for name, load in parts.items():
        try:
            load(state[name])
        except (ValueError, KeyError, TypeError, IndexError, RuntimeError, AttributeError) as err:
            raise UserError(
                f"{path}: its {name} state does not fit this run ({_first_line(err)}); "
                f"{runio.RESUME_FIX}"
            ) from None
    return {
        name: state.get(name, _ADDED_LATER[name]) if name in _ADDED_LATER else state[name]
        for name in COUNTERS
    }
