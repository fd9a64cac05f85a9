"""Reference implementations the tests hold the library against: GRPO's advantages as TRL's
``GRPOTrainer`` computes them, and values straight to token advantages through both stages of
the credit algebra."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rredcot.algebra.credit import (
    Values,
    Weights,
    segment_credit,
    segment_token_counts,
    token_advantages,
)
from rredcot.algebra.normalization import advantage_scale, batch_std, get_normalizer, group_mean_std
from rredcot.algebra.tensor_checks import as_bool, as_float, check_ndim, check_shape


def grpo_advantages(
    rewards: Tensor,
    group_ids: Tensor,
    response_mask: Tensor,
    scale_rewards: str | bool = "group",
    eps: float = 1e-4,
    leave_one_out: bool = False,
) -> Tensor:
    """GRPO's advantages, as TRL's ``GRPOTrainer`` computes them, on every response token.

    ``A = (R - group_mean) / (std + eps)`` with ``std`` the group's (``"group"``), the whole
    batch's (``"batch"``), or no scaling (``"none"``); ``True``/``False`` mean ``"group"``/
    ``"none"`` as in TRL. A group whose rewards all agree gets advantage 0, never NaN.

    Args:
        rewards: ``(B,)``; group_ids: ``(B,)`` integer; response_mask: ``(B, T)``.
        leave_one_out: use the RLOO baseline (see :func:`group_mean_std`).

    Returns:
        advantages ``(B, T)``, 0 on padding.
    """
    check_ndim(response_mask, 2, "response_mask", "(B, T)")
    check_shape(rewards, (response_mask.shape[0],), "rewards", "(B,)")
    if scale_rewards is True:
        scale_rewards = "group"
    elif scale_rewards is False:
        scale_rewards = "none"
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(
            f"scale_rewards must be one of 'group', 'batch', 'none', got {scale_rewards!r}"
        )
    rewards = as_float(rewards)
    mean, std = group_mean_std(rewards, group_ids, leave_one_out=leave_one_out)
    if scale_rewards == "batch":
        std = batch_std(rewards).expand_as(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + eps)
    mask = as_bool(response_mask)
    return torch.where(mask, advantages[:, None].expand_as(mask), torch.zeros((), dtype=mean.dtype))


def token_advantages_from_values(
    values: Tensor,
    value_mask: Tensor,
    rewards: Tensor,
    segment_ids: Tensor,
    response_mask: Tensor,
    lam: float,
    normalization: str = "batch_std",
    group_ids: Tensor | None = None,
    eps: float | None = None,
    min_std: float | None = None,
) -> Tensor:
    """Values of the segment boundaries -> normalised token advantages ``(B, T)``: the segment
    stage then the token stage, checking that ``segment_ids`` and ``value_mask`` agree on each
    row's segments."""
    get_normalizer(normalization)  # fail before any work on a typo
    check_ndim(segment_ids, 2, "segment_ids", "(B, T)")
    if segment_ids.shape[0] != values.shape[0]:
        raise ValueError(
            f"segment_ids (B, T) = {tuple(segment_ids.shape)} and values (B, S+1) = "
            f"{tuple(values.shape)} disagree on B"
        )
    num_segments = as_bool(value_mask).sum(dim=1) - 1
    used = segment_ids.max(dim=1).values + 1 if segment_ids.shape[1] else num_segments * 0
    if bool((used != num_segments).any()):
        row = int((used != num_segments).nonzero()[0])
        raise ValueError(
            f"row {row}: segment_ids use {int(used[row])} segments but value_mask gives "
            f"{int(num_segments[row])} (n + 1 values for n segments); build both from the same "
            "boundaries"
        )
    seg = segment_credit(Values(values, value_mask, lam=lam), rewards, group_ids)
    scale = advantage_scale(rewards, group_ids, normalization, eps, min_std, like=seg.advantages)
    return token_advantages(seg, segment_ids, response_mask, scale)


@dataclass(frozen=True)
class TokenCredit:
    """Both stages' outputs for one batch."""

    advantages: Tensor  # (B, T)
    segment_advantages: Tensor  # (B, S)
    segment_mask: Tensor  # (B, S)
    segment_rewards: Tensor  # (B, S)
    values: Tensor | None


def token_credit(
    estimate: Values | Weights,
    rewards: Tensor,
    group_ids: Tensor | None,
    segment_ids: Tensor,
    response_mask: Tensor,
    normalization: str,
    eps: float | None = None,
    min_std: float | None = None,
) -> TokenCredit:
    """The segment stage then the token stage over one process's rows (segment lengths for
    reweighting counted from ``segment_ids``)."""
    get_normalizer(normalization)
    lengths = None
    if isinstance(estimate, Values):
        S = estimate.values.shape[1] - 1
        lengths = segment_token_counts(segment_ids, response_mask, S)
    seg = segment_credit(estimate, rewards, group_ids, lengths)
    scale = advantage_scale(rewards, group_ids, normalization, eps, min_std, like=seg.advantages)
    tokens = token_advantages(seg, segment_ids, response_mask, scale)
    return TokenCredit(tokens, seg.advantages, seg.mask, seg.rewards, seg.values)


# ---------------------------------------------------------------------------------------------
# the method contract in the short forms the tests read


def learn(method, batch) -> dict[str, float]:
    """``method.update`` after the batch's credit: rows -> estimate -> update (the estimate is a
    pure function of the rows and the method's state, so it is the one the credit used)."""
    rows = method.rows(batch)
    return method.update(rows, method.estimate(rows))


def head_values(method, batch) -> tuple[Tensor, Tensor]:
    """``(the value head's own values (B, S+1), mask)`` of a batch, before its update."""
    rows = method.rows(batch)
    return method.head_values(rows.features, rows.value_mask), rows.value_mask


def anchored_values(method, batch) -> tuple[Tensor, Tensor]:
    """``(the value head's values anchored by its guard, mask)``: what its credit uses where no
    shared prefix sets a value."""
    values, mask = head_values(method, batch)
    mean, _ = group_mean_std(batch.rewards, batch.group_ids)
    return method.guard.anchor(values, mask, mean), mask


def source_values(method, batch) -> tuple[Tensor, Tensor]:
    """``(values, mask)`` a value source (answer likelihood, a PRM) measures on a batch."""
    values, mask, _ = method.boundary_values(batch)
    return values, mask
