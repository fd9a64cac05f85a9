"""Shape, mask and dtype checks shared by the tensor modules (the credit algebra, its
normalisation, the shared-prefix statistics): each raises an error that names the tensor, the
layout it should have and what it got."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["as_bool", "as_float", "check_lam", "check_ndim", "check_prefix_mask", "check_shape"]


def check_shape(t: Tensor, shape: tuple[int, ...], name: str, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(t.shape)}")


def check_ndim(t: Tensor, ndim: int, name: str, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim}-D), got {tuple(t.shape)}")


def as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def as_float(t: Tensor, like: Tensor | None = None) -> Tensor:
    if like is not None:
        return t.to(like.dtype)
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


def check_prefix_mask(mask: Tensor, name: str, at_least_one: bool) -> None:
    """Raise unless every row of the 2-D bool ``mask`` is True on a prefix and False after it."""
    if mask.shape[1] > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        row = int((mask[:, 1:] & ~mask[:, :-1]).any(dim=1).nonzero()[0])
        raise ValueError(
            f"{name} must be a prefix mask (True for the first entries of a row, False after): "
            f"row {row} is {mask[row].int().tolist()}. Pad each row on the right."
        )
    if at_least_one and mask.shape[0] > 0 and not bool(mask[:, :1].all()):
        row = int((~mask[:, 0]).nonzero()[0]) if mask.shape[1] > 0 else 0
        raise ValueError(
            f"{name} needs at least one True per row (column 0 is V(s_0), the prompt's value); "
            f"row {row} has none."
        )


def check_lam(lam: float) -> float:
    if isinstance(lam, bool) or not isinstance(lam, (int, float)):
        raise TypeError(f"lam must be a float in [0, 1], got {lam!r}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(
            f"lam must be in [0, 1] (0: A_k = r_k, 1: A_k = R - V(s_(k-1))), got {lam}"
        )
    return float(lam)
