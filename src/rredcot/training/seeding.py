"""Seeds: one for the whole run, and one per step so that a resumed run samples what the
original did."""

from __future__ import annotations

import random

import numpy as np
import torch

__all__ = ["seed_everything", "step_seed"]


def seed_everything(seed: int) -> None:
    """Seed Python's, NumPy's and torch's generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def step_seed(seed: int, step: int, salt: int = 0) -> int:
    """A seed for one step's randomness (``salt`` separates the uses within a step)."""
    return (seed * 1_000_003 + step * 9_973 + salt) % 2**31
