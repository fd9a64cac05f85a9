"""Free Monte Carlo values: the prefixes several samples of a group share.

Samples of one prompt that pass through the same prefix (the same tokens so far) give that
prefix a value for free: the mean outcome of the samples below it. Independent samples share
prefixes by chance; tree groups (``sampling.tree``) share them by construction. These functions
find the shared prefixes, their values, and how they combine with a method's own values
(docs/method.md, shared prefixes; docs/tree.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rredcot.algebra.layout import shared_prefix_ids  # re-exported: its path before
from rredcot.algebra.tensor_checks import (
    as_bool,
    as_float,
    check_lam,
    check_ndim,
    check_shape,
)

__all__ = [
    "combine_shared_prefix",
    "node_fraction",
    "node_values",
    "shared_prefix_ids",
    "shared_prefix_values",
]


def shared_prefix_values(prefix_ids: Tensor, rewards: Tensor) -> tuple[Tensor, Tensor]:
    """``V(s_k)`` as the mean outcome of the samples that pass through ``s_k``, and how many do.

    A group's samples form a tree of prefixes; where several share a prefix, the mean of their
    rewards is a Monte Carlo estimate of its value that costs nothing (the samples exist
    already). ``s_0`` is shared by the whole group (its value is the group mean reward); a
    prefix only one sample reached has count 1 and its own reward as value, which says nothing
    beyond that sample: callers treat counts below 2 as unknown.

    Args:
        prefix_ids: ``(B, S+1)`` from :func:`shared_prefix_ids`, ``-1`` on padding.
        rewards: ``(B,)``.

    Returns:
        values ``(B, S+1)`` and counts ``(B, S+1)`` long, both 0 on padding.
    """
    check_ndim(prefix_ids, 2, "prefix_ids", "(B, S+1)")
    check_shape(rewards, (prefix_ids.shape[0],), "rewards", "(B,)")
    rewards = as_float(rewards)
    valid = prefix_ids >= 0
    if not bool(valid.any()):
        return torch.zeros_like(prefix_ids, dtype=rewards.dtype), torch.zeros_like(prefix_ids)
    B = prefix_ids.shape[0]
    rows = torch.arange(B, device=prefix_ids.device)[:, None].expand_as(prefix_ids)
    # a row passes through each of its prefixes once: count (prefix, row) pairs
    pairs = torch.unique(prefix_ids[valid] * B + rows[valid])
    pid, prow = pairs // B, pairs % B
    num = int(prefix_ids.max()) + 1
    count = torch.zeros(num, dtype=torch.long, device=prefix_ids.device)
    count = count.index_add(0, pid, torch.ones_like(pid))
    total = torch.zeros(num, dtype=rewards.dtype, device=rewards.device)
    total = total.index_add(0, pid, rewards[prow])
    at = prefix_ids.clamp_min(0)
    counts = torch.where(valid, count[at], torch.zeros_like(prefix_ids))
    values = torch.where(valid, total[at] / count[at].clamp_min(1), torch.zeros_like(total[at]))
    return values.to(rewards.dtype), counts


def combine_shared_prefix(
    shared_values: Tensor,
    counts: Tensor,
    fallback_values: Tensor,
    value_mask: Tensor,
    fallback_weight: float,
    min_count: int = 2,
) -> tuple[Tensor, Tensor]:
    """Values and per-boundary lambda from the group's shared prefixes, with a fallback estimator
    between them.

    A boundary ``s_k`` that at least ``min_count`` samples of the group pass through is *known*:
    its value is their mean outcome and ``lam_k = 0`` (credit stops there: segment ``k`` gets
    ``V(s_k) - V(s_{k-1})``). ``s_0`` is always known (the group mean). Any other boundary is
    unknown: credit passes through it (``lam_k = 1``) and its value, which then only serves as a
    baseline for the next segment, is the last known value moved by ``fallback_weight`` times
    the fallback estimator's change since that boundary. With ``fallback_weight = 0`` a row that
    shares nothing beyond ``s_0`` gets GRPO's ``R - mean(R_group)`` on every segment.

    Args:
        shared_values, counts: ``(B, S+1)`` from :func:`shared_prefix_values`.
        fallback_values: ``(B, S+1)`` another estimate of ``V(s_k)`` (e.g. a value head).
        value_mask: ``(B, S+1)`` prefix mask.
        fallback_weight: in ``[0, 1]``, how far to trust the fallback's changes.
        min_count: samples that must share a prefix for it to be known (usually 2: a prefix
            only one sample reached has that sample's own outcome as value; 1 trusts it).


    Returns:
        values ``(B, S+1)`` (0 on padding) and lam ``(B, S)`` for :func:`rredcot.algebra.credit.segment_gae`.
    """
    check_ndim(shared_values, 2, "shared_values", "(B, S+1)")
    shape = tuple(shared_values.shape)
    check_shape(counts, shape, "counts", "(B, S+1)")
    check_shape(fallback_values, shape, "fallback_values", "(B, S+1)")
    check_shape(value_mask, shape, "value_mask", "(B, S+1)")
    if min_count < 1:
        raise ValueError(f"min_count={min_count} must be >= 1")
    if not 0.0 <= float(fallback_weight) <= 1.0:
        raise ValueError(f"fallback_weight={fallback_weight} must be in [0, 1]")
    mask = as_bool(value_mask)
    shared = as_float(shared_values)
    fallback = as_float(fallback_values, like=shared)
    known = (counts >= min_count) & mask
    known[:, 0] = mask[:, 0]
    values = torch.zeros_like(shared)
    last_value = shared[:, 0]
    last_fallback = fallback[:, 0]
    for k in range(shared.shape[1]):
        here = known[:, k]
        moved = last_value + float(fallback_weight) * (fallback[:, k] - last_fallback)
        values[:, k] = torch.where(here, shared[:, k], moved)
        last_value = torch.where(here, shared[:, k], last_value)
        last_fallback = torch.where(here, fallback[:, k], last_fallback)
    values = torch.where(mask, values, torch.zeros_like(values))
    # lam 0 at known boundaries. Any other lam there would not change the update: the samples
    # that share a prefix hold the same tokens in it, and the credit lam would move back onto
    # them sums to zero over those samples (their values average to the shared one).
    lam = torch.where(known[:, 1:], torch.zeros_like(shared[:, 1:]), torch.ones_like(shared[:, 1:]))
    return values, lam


def node_values(
    values: Tensor,
    value_mask: Tensor,
    lam: float | Tensor,
    prefix_ids: Tensor,
    rewards: Tensor,
    fallback_weight: float = 1.0,
    min_count: int = 2,
) -> tuple[Tensor, Tensor]:
    """A value method's estimate with the values of a tree's nodes put in.

    A node (a prefix ``s_k`` at least ``min_count`` leaves of the group pass through) gets the
    mean reward of those leaves and lambda 0, so a segment between two nodes gets the change in
    value it caused; ``s_0`` gets the group mean. Between nodes the method's own values fill in
    (moved by ``fallback_weight`` times their change since the last node:
    :func:`combine_shared_prefix`) with the method's own ``lam``.

    Args:
        values: ``(B, S+1)`` the method's ``V(s_k)``; value_mask: ``(B, S+1)`` prefix mask.
        lam: a float or ``(B, S)``, the method's lambda.
        prefix_ids: ``(B, S+1)`` from :func:`shared_prefix_ids`; rewards: ``(B,)``.
        fallback_weight: in ``[0, 1]``; min_count: leaves that make a node.

    Returns:
        values ``(B, S+1)`` and lam ``(B, S)`` for :func:`rredcot.algebra.credit.segment_gae`.
    """
    check_ndim(values, 2, "values", "(B, S+1)")
    check_shape(prefix_ids, tuple(values.shape), "prefix_ids", "(B, S+1)")
    values = as_float(values)
    shared, counts = shared_prefix_values(prefix_ids.to(values.device), rewards.to(values.device))
    combined, lam_nodes = combine_shared_prefix(
        shared, counts, values, value_mask, fallback_weight, min_count
    )
    if isinstance(lam, Tensor):
        check_shape(lam, tuple(lam_nodes.shape), "lam", "(B, S)")
        own = as_float(lam, like=lam_nodes)
    else:
        own = torch.full_like(lam_nodes, check_lam(lam))
    return combined, torch.where(lam_nodes == 0, torch.zeros_like(own), own)


def node_fraction(prefix_ids: Tensor, value_mask: Tensor, min_count: int = 2) -> float:
    """Share of the interior boundaries (neither ``s_0`` nor ``s_n``) that are nodes: prefixes at
    least ``min_count`` rows of the group pass through. ``prefix_ids``, ``value_mask``:
    ``(B, S+1)``."""
    mask = as_bool(value_mask).to(prefix_ids.device)
    _, counts = shared_prefix_values(prefix_ids, torch.zeros(prefix_ids.shape[0]))
    interior = mask.clone()
    interior[:, 0] = False
    interior.scatter_(1, (mask.sum(1, keepdim=True) - 1).clamp_min(0), False)
    known = (counts >= min_count) & interior
    return float(known.sum()) / max(int(interior.sum()), 1)
