"""The credit algebra: values -> redistributed segment rewards -> segment GAE -> token advantages.

Every credit method in rredcot ends here (docs/method.md, the credit algebra). For a response split into
segments ``k = 1..n`` with prefix states ``s_0 .. s_n`` and outcome reward ``R``:

    V(s_n) := R                          (the finished trace is worth its outcome)
    r_k     = V(s_k) - V(s_{k-1})        (redistributed reward; sum_k r_k = R - V(s_0))
    A_k     = sum_{j >= k} lam^(j-k) r_j (segment-level GAE, gamma = 1)

and every token of segment ``k`` gets ``A_k``, optionally normalised over the batch.

Pure tensor functions, torch only. Layout conventions (docs/architecture.md):

- values ``(B, S+1)`` with ``value_mask (B, S+1)``: ``values[b, k] = V(s_k)``, valid for
  ``k <= n_b``; the mask is a prefix mask with at least one True (``s_0``) per row.
- segment quantities ``(B, S)`` with ``segment_mask (B, S)``: column ``k-1`` holds segment ``k``.
- token quantities ``(B, T)`` with ``response_mask (B, T)``.
- ``segment_ids (B, T)`` long: the 0-based segment of each response token, ``-1`` on padding.

Masks may be bool or 0/1 numbers (nonzero = valid). Every reduction is masked, and padded
positions of every output are exactly 0: whatever sits in the padding (even NaN) never leaks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "Cost",
    "TokenCredit",
    "Values",
    "Weights",
    "anchor_values",
    "token_credit",
    "boundaries_to_segment_ids",
    "combine_shared_prefix",
    "node_fraction",
    "node_values",
    "get_normalizer",
    "group_mean_std",
    "grpo_advantages",
    "masked_mean",
    "masked_var",
    "masked_whiten",
    "normalize_advantages",
    "redistribute",
    "register_normalizer",
    "reweight_coefficients",
    "reweight_grpo",
    "segment_token_counts",
    "segment_advantages_from_values",
    "segment_gae",
    "segments_to_tokens",
    "shared_prefix_ids",
    "shared_prefix_values",
    "token_advantages_from_values",
    "weights_to_segment_rewards",
]


# --------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------


def _check_shape(t: Tensor, shape: tuple[int, ...], name: str, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {layout} = {tuple(shape)}, got {tuple(t.shape)}")


def _check_ndim(t: Tensor, ndim: int, name: str, layout: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have shape {layout} ({ndim}-D), got {tuple(t.shape)}")


def _as_bool(mask: Tensor) -> Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def _as_float(t: Tensor, like: Tensor | None = None) -> Tensor:
    if like is not None:
        return t.to(like.dtype)
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


def _check_prefix_mask(mask: Tensor, name: str, at_least_one: bool) -> None:
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


def _check_lam(lam: float) -> float:
    if isinstance(lam, bool) or not isinstance(lam, (int, float)):
        raise TypeError(f"lam must be a float in [0, 1], got {lam!r}")
    if not 0.0 <= lam <= 1.0:
        raise ValueError(
            f"lam must be in [0, 1] (0: A_k = r_k, 1: A_k = R - V(s_(k-1))), got {lam}"
        )
    return float(lam)


# --------------------------------------------------------------------------------------
# Values -> segment rewards -> segment advantages
# --------------------------------------------------------------------------------------


def redistribute(values: Tensor, value_mask: Tensor, rewards: Tensor) -> tuple[Tensor, Tensor]:
    """Redistribute each outcome over its segments by differences of values.

    Row ``b`` has ``n_b = value_mask[b].sum() - 1`` segments. ``V(s_{n_b})`` is replaced by the
    outcome ``R_b`` (whatever ``values[b, n_b]`` holds is ignored) and segment ``k`` gets
    ``r_k = V(s_k) - V(s_{k-1})`` at column ``k-1``. The rewards of a row telescope to
    ``R_b - V(s_0)`` whatever the value estimates are. Rows with ``n_b = 0`` (empty response)
    have no segments.

    Args:
        values: ``(B, S+1)`` float, ``values[b, k] = V(s_k)``.
        value_mask: ``(B, S+1)`` prefix mask, at least one True per row.
        rewards: ``(B,)`` outcome rewards.

    Returns:
        segment_rewards ``(B, S)`` (0 on padding) and segment_mask ``(B, S)`` bool.
    """
    _check_ndim(values, 2, "values", "(B, S+1)")
    if values.shape[1] < 1:
        raise ValueError("values must have at least one column (V(s_0)); got shape (B, 0)")
    _check_shape(value_mask, tuple(values.shape), "value_mask", "(B, S+1)")
    _check_shape(rewards, (values.shape[0],), "rewards", "(B,)")
    values = _as_float(values)
    value_mask = _as_bool(value_mask)
    _check_prefix_mask(value_mask, "value_mask", at_least_one=True)

    last = value_mask.sum(dim=1) - 1  # (B,) index of s_n
    full = torch.where(value_mask, values, torch.zeros_like(values))
    full = full.scatter(1, last[:, None], _as_float(rewards, like=values)[:, None])
    segment_mask = value_mask[:, 1:]
    diffs = full[:, 1:] - full[:, :-1]
    segment_rewards = torch.where(segment_mask, diffs, torch.zeros_like(diffs))
    return segment_rewards, segment_mask


def anchor_values(values: Tensor, value_mask: Tensor, baseline: Tensor) -> Tensor:
    """Shift every row's values so that ``V(s_0)`` is ``baseline``:
    ``V'(s_k) = V(s_k) - V(s_0) + baseline``.

    With the group's mean reward as the baseline, :func:`redistribute` then gives each trace
    GRPO's total ``R - mean(R_group)``, and the estimator only moves credit between the
    segments of the trace by its value increments. Whatever it gets wrong about how hard the
    prompt is (the same error at every boundary of a row) cancels.

    Args:
        values: ``(B, S+1)``; value_mask: ``(B, S+1)`` prefix mask; baseline: ``(B,)``.

    Returns:
        anchored values ``(B, S+1)``, 0 on padding.
    """
    _check_ndim(values, 2, "values", "(B, S+1)")
    _check_shape(value_mask, tuple(values.shape), "value_mask", "(B, S+1)")
    _check_shape(baseline, (values.shape[0],), "baseline", "(B,)")
    values = _as_float(values)
    value_mask = _as_bool(value_mask)
    shifted = values - values[:, :1] + _as_float(baseline, like=values)[:, None]
    return torch.where(value_mask, shifted, torch.zeros_like(shifted))


def segment_gae(segment_rewards: Tensor, segment_mask: Tensor, lam: float | Tensor) -> Tensor:
    """Segment-level GAE with gamma = 1: ``A_k = r_k + lam_k A_{k+1}`` over valid segments.

    ``lam = 0`` gives ``A_k = r_k`` (pure redistribution); ``lam = 1`` gives
    ``A_k = R - V(s_{k-1})`` (Monte Carlo return with a state-value baseline).

    ``lam`` may also be a ``(B, S)`` tensor: ``lam[b, k-1]`` is the weight of the boundary
    ``s_k`` that ends segment ``k``. ``lam_k = 1`` passes straight through ``s_k``, so whatever
    ``V(s_k)`` holds cancels (a boundary whose value is unknown); ``lam_k = 0`` trusts it fully.

    Args:
        segment_rewards: ``(B, S)`` from :func:`redistribute`.
        segment_mask: ``(B, S)`` prefix mask.
        lam: GAE lambda in ``[0, 1]``: a float or ``(B, S)``.

    Returns:
        segment_advantages ``(B, S)``, 0 on padding.
    """
    _check_ndim(segment_rewards, 2, "segment_rewards", "(B, S)")
    _check_shape(segment_mask, tuple(segment_rewards.shape), "segment_mask", "(B, S)")
    segment_rewards = _as_float(segment_rewards)
    segment_mask = _as_bool(segment_mask)
    _check_prefix_mask(segment_mask, "segment_mask", at_least_one=False)
    if isinstance(lam, Tensor):
        _check_shape(lam, tuple(segment_rewards.shape), "lam", "(B, S)")
        lam = _as_float(lam, like=segment_rewards)
        valid = lam[segment_mask]
        if bool(((valid < 0) | (valid > 1) | ~torch.isfinite(valid)).any()):
            raise ValueError("every lam[b, k] must be in [0, 1] on valid segments")
        lam = torch.where(segment_mask, lam, torch.zeros_like(lam))
        lam_at = lambda k: lam[:, k]  # noqa: E731
    else:
        lam = _check_lam(lam)
        lam_at = lambda k: lam  # noqa: E731

    r = torch.where(segment_mask, segment_rewards, torch.zeros_like(segment_rewards))
    advantages = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0]) if r.shape[1] > 0 else None
    for k in reversed(range(r.shape[1])):  # padding is on the right and is 0: it adds nothing
        running = r[:, k] + lam_at(k) * running
        advantages[:, k] = running
    return torch.where(segment_mask, advantages, torch.zeros_like(advantages))


def segment_advantages_from_values(
    values: Tensor, value_mask: Tensor, rewards: Tensor, lam: float | Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`redistribute` then :func:`segment_gae`.

    Args:
        values: ``(B, S+1)``; value_mask: ``(B, S+1)``; rewards: ``(B,)``; lam in ``[0, 1]``
        (a float, or ``(B, S)`` per boundary: see :func:`segment_gae`).

    Returns:
        segment_advantages ``(B, S)``, segment_mask ``(B, S)``, segment_rewards ``(B, S)``.
    """
    segment_rewards, segment_mask = redistribute(values, value_mask, rewards)
    return segment_gae(segment_rewards, segment_mask, lam), segment_mask, segment_rewards


# --------------------------------------------------------------------------------------
# Free Monte Carlo values: samples of a group that share a prefix
# --------------------------------------------------------------------------------------


def shared_prefix_ids(
    response_ids: Tensor, response_mask: Tensor, boundaries: list[list[int]], group_ids: Tensor
) -> Tensor:
    """An id per prefix ``s_k``: two rows get the same id at columns ``k`` and ``k'`` exactly
    when they are in the same group and their first ``b_k`` / ``b_k'`` response tokens are the
    same token sequence (so both prefixes are one state of the policy's tree of samples).

    Args:
        response_ids: ``(B, T)`` long; response_mask: ``(B, T)``;
        boundaries: per row ``[0, b_1, ..., b_n]`` in response tokens; group_ids: ``(B,)``.

    Returns:
        prefix ids ``(B, S+1)`` long (``S`` the most segments of a row), ``-1`` on padding.
    """
    _check_ndim(response_ids, 2, "response_ids", "(B, T)")
    _check_shape(response_mask, tuple(response_ids.shape), "response_mask", "(B, T)")
    _check_shape(group_ids, (response_ids.shape[0],), "group_ids", "(B,)")
    if len(boundaries) != response_ids.shape[0]:
        raise ValueError(
            f"boundaries has {len(boundaries)} rows, response_ids {response_ids.shape[0]}"
        )
    S = max((len(b) - 1 for b in boundaries), default=0)
    ids = torch.full((len(boundaries), S + 1), -1, dtype=torch.long)
    lengths = _as_bool(response_mask).sum(dim=1).tolist()
    rows = response_ids.tolist()
    seen: dict[tuple, int] = {}
    for row, (bounds, group) in enumerate(zip(boundaries, group_ids.tolist())):
        tokens = rows[row][: lengths[row]]
        for k, b in enumerate(bounds):
            if b > lengths[row]:
                raise ValueError(f"row {row}: boundary {b} is past its {lengths[row]} tokens")
            key = (group, tuple(tokens[:b]))
            ids[row, k] = seen.setdefault(key, len(seen))
    return ids.to(response_ids.device)


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
    _check_ndim(prefix_ids, 2, "prefix_ids", "(B, S+1)")
    _check_shape(rewards, (prefix_ids.shape[0],), "rewards", "(B,)")
    rewards = _as_float(rewards)
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
        values ``(B, S+1)`` (0 on padding) and lam ``(B, S)`` for :func:`segment_gae`.
    """
    _check_ndim(shared_values, 2, "shared_values", "(B, S+1)")
    shape = tuple(shared_values.shape)
    _check_shape(counts, shape, "counts", "(B, S+1)")
    _check_shape(fallback_values, shape, "fallback_values", "(B, S+1)")
    _check_shape(value_mask, shape, "value_mask", "(B, S+1)")
    if min_count < 1:
        raise ValueError(f"min_count={min_count} must be >= 1")
    if not 0.0 <= float(fallback_weight) <= 1.0:
        raise ValueError(f"fallback_weight={fallback_weight} must be in [0, 1]")
    mask = _as_bool(value_mask)
    shared = _as_float(shared_values)
    fallback = _as_float(fallback_values, like=shared)
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
        values ``(B, S+1)`` and lam ``(B, S)`` for :func:`segment_gae`.
    """
    _check_ndim(values, 2, "values", "(B, S+1)")
    _check_shape(prefix_ids, tuple(values.shape), "prefix_ids", "(B, S+1)")
    values = _as_float(values)
    shared, counts = shared_prefix_values(prefix_ids.to(values.device), rewards.to(values.device))
    combined, lam_nodes = combine_shared_prefix(
        shared, counts, values, value_mask, fallback_weight, min_count
    )
    if isinstance(lam, Tensor):
        _check_shape(lam, tuple(lam_nodes.shape), "lam", "(B, S)")
        own = _as_float(lam, like=lam_nodes)
    else:
        own = torch.full_like(lam_nodes, _check_lam(lam))
    return combined, torch.where(lam_nodes == 0, torch.zeros_like(own), own)


def node_fraction(prefix_ids: Tensor, value_mask: Tensor, min_count: int = 2) -> float:
    """Share of the interior boundaries (neither ``s_0`` nor ``s_n``) that are nodes: prefixes at
    least ``min_count`` rows of the group pass through. ``prefix_ids``, ``value_mask``:
    ``(B, S+1)``."""
    mask = _as_bool(value_mask).to(prefix_ids.device)
    _, counts = shared_prefix_values(prefix_ids, torch.zeros(prefix_ids.shape[0]))
    interior = mask.clone()
    interior[:, 0] = False
    interior.scatter_(1, (mask.sum(1, keepdim=True) - 1).clamp_min(0), False)
    known = (counts >= min_count) & interior
    return float(known.sum()) / max(int(interior.sum()), 1)


def weights_to_segment_rewards(
    weights: Tensor, segment_mask: Tensor, rewards: Tensor, baseline: Tensor
) -> Tensor:
    """Split ``R - baseline`` over segments by attribution weights: ``r_k = w_k (R - baseline)``.

    Weights are renormalised over the valid segments of each row so they sum to 1; they must
    be finite and ``>= 0`` there (padding is ignored). A row whose valid weights are all zero
    gets uniform weights ``1 / n_b``. Rows without segments get nothing.

    Args:
        weights: ``(B, S)`` non-negative attribution weights.
        segment_mask: ``(B, S)`` prefix mask.
        rewards: ``(B,)`` outcome rewards.
        baseline: ``(B,)`` the value of the prompt, ``V(s_0)`` (e.g. the group mean reward).

    Returns:
        segment_rewards ``(B, S)``, 0 on padding; each row sums to ``R - baseline`` when it
        has at least one segment. Feed it to :func:`segment_gae` (usually with ``lam = 0``).
    """
    _check_ndim(weights, 2, "weights", "(B, S)")
    _check_shape(segment_mask, tuple(weights.shape), "segment_mask", "(B, S)")
    _check_shape(rewards, (weights.shape[0],), "rewards", "(B,)")
    _check_shape(baseline, (weights.shape[0],), "baseline", "(B,)")
    weights = _as_float(weights)
    segment_mask = _as_bool(segment_mask)
    _check_prefix_mask(segment_mask, "segment_mask", at_least_one=False)

    w = torch.where(segment_mask, weights, torch.zeros_like(weights))
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(
            "weights must be finite and >= 0 on valid segments (use e.g. abs() or a softmax "
            "on signed attributions)"
        )
    peak = w.amax(dim=1, keepdim=True) if w.shape[1] else w.sum(dim=1, keepdim=True)
    w = w / torch.where(peak > 0, peak, torch.ones_like(peak))  # in [0, 1]: sums neither over-
    w = torch.where(peak > 0, w, segment_mask.to(w.dtype))  # nor underflow; all-zero -> uniform
    total = w.sum(dim=1, keepdim=True)
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    credit = _as_float(rewards, like=w) - _as_float(baseline, like=w)
    return torch.where(segment_mask, w * credit[:, None], torch.zeros_like(w))


# --------------------------------------------------------------------------------------
# Segments <-> tokens
# --------------------------------------------------------------------------------------


def boundaries_to_segment_ids(
    boundaries: list[list[int]], response_len: int, device: torch.device | str | None = None
) -> Tensor:
    """Map token boundaries to a per-token segment index.

    Token ``t`` of row ``b`` gets ``k-1`` when ``b_{k-1} <= t < b_k``, and ``-1`` at or beyond
    the row's last boundary (padding). A row ``[0]`` (or ``[]``) is an empty response.

    Args:
        boundaries: per row ``[0, b_1, ..., b_n]``, strictly increasing, ``b_n <= response_len``.
        response_len: ``T``, the padded response length.
        device: where to put the result.

    Returns:
        segment_ids ``(B, T)`` long.
    """
    if isinstance(response_len, bool) or not isinstance(response_len, int) or response_len < 0:
        raise ValueError(f"response_len must be a non-negative int, got {response_len!r}")
    segment_ids = torch.full((len(boundaries), response_len), -1, dtype=torch.long)
    for row, bounds in enumerate(boundaries):
        bounds = list(bounds)
        if not bounds:
            continue
        if bounds[0] != 0:
            raise ValueError(f"boundaries[{row}] must start at 0, got {bounds}")
        if any(b <= a for a, b in zip(bounds[:-1], bounds[1:])):
            raise ValueError(
                f"boundaries[{row}] must be strictly increasing (empty segments are dropped "
                f"when spans become boundaries), got {bounds}"
            )
        if bounds[-1] > response_len:
            raise ValueError(
                f"boundaries[{row}] ends at {bounds[-1]}, beyond response_len={response_len}"
            )
        lengths = torch.tensor([b - a for a, b in zip(bounds[:-1], bounds[1:])], dtype=torch.long)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), lengths)
        segment_ids[row, : bounds[-1]] = ids
    return segment_ids.to(device) if device is not None else segment_ids


def segments_to_tokens(
    segment_values: Tensor, segment_ids: Tensor, response_mask: Tensor
) -> Tensor:
    """Give every response token the value of its segment.

    Args:
        segment_values: ``(B, S)``.
        segment_ids: ``(B, T)`` long, in ``[-1, S)``.
        response_mask: ``(B, T)``.

    Returns:
        token_values ``(B, T)``: ``segment_values[b, segment_ids[b, t]]``, 0 where the mask is
        False or ``segment_ids == -1``.
    """
    _check_ndim(segment_values, 2, "segment_values", "(B, S)")
    _check_ndim(segment_ids, 2, "segment_ids", "(B, T)")
    if segment_ids.shape[0] != segment_values.shape[0]:
        raise ValueError(
            f"segment_ids (B, T) = {tuple(segment_ids.shape)} and segment_values (B, S) = "
            f"{tuple(segment_values.shape)} disagree on B"
        )
    _check_shape(response_mask, tuple(segment_ids.shape), "response_mask", "(B, T)")
    if segment_ids.dtype.is_floating_point or segment_ids.dtype == torch.bool:
        raise TypeError(f"segment_ids must be an integer tensor, got {segment_ids.dtype}")
    num_segments = segment_values.shape[1]
    if segment_ids.numel() and (
        int(segment_ids.min()) < -1 or int(segment_ids.max()) >= num_segments
    ):
        raise ValueError(
            f"segment_ids must lie in [-1, S) = [-1, {num_segments}), got range "
            f"[{int(segment_ids.min())}, {int(segment_ids.max())}]"
        )
    valid = _as_bool(response_mask) & (segment_ids >= 0)
    if num_segments == 0:
        return torch.zeros(segment_ids.shape, dtype=segment_values.dtype, device=segment_ids.device)
    gathered = segment_values.gather(1, segment_ids.clamp_min(0).long())
    return torch.where(valid, gathered, torch.zeros_like(gathered))


# --------------------------------------------------------------------------------------
# Masked statistics
# --------------------------------------------------------------------------------------


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is True (0 when there are none).

    Args:
        x: any shape; mask: same shape; dim: reduce over this dim, or over everything if None.
    """
    _check_shape(mask, tuple(x.shape), "mask", "(same as x)")
    mask = _as_bool(mask)
    kept = torch.where(mask, x, torch.zeros_like(x))
    if dim is None:
        return kept.sum() / mask.sum().clamp_min(1)
    return kept.sum(dim=dim, keepdim=keepdim) / mask.sum(dim=dim, keepdim=keepdim).clamp_min(1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True, dim: int | None = None) -> Tensor:
    """Variance of ``x`` over positions where ``mask`` is True.

    ``unbiased`` applies Bessel's correction ``n / (n - 1)``. With fewer than two valid
    positions the variance is 0 (not NaN).
    """
    _check_shape(mask, tuple(x.shape), "mask", "(same as x)")
    mask = _as_bool(mask)
    keep = dim is not None
    mean = masked_mean(x, mask, dim=dim, keepdim=keep)
    centered = torch.where(mask, x - mean, torch.zeros_like(x))
    count = mask.sum() if dim is None else mask.sum(dim=dim)
    sq = (centered**2).sum() if dim is None else (centered**2).sum(dim=dim)
    var = sq / count.clamp_min(1)
    if unbiased:
        var = torch.where(count > 1, var * count / (count - 1).clamp_min(1), torch.zeros_like(var))
    return var


def masked_whiten(
    x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8, min_std: float = 0.0
) -> Tensor:
    """Whiten ``x`` over the masked positions: ``(x - mean) / sqrt(var + eps)``; 0 on padding.

    ``shift_mean=False`` adds the mean back (rescale only). ``min_std`` floors the std so that a
    batch of near-zero values is not blown up to unit variance (default: no floor).
    """
    mask = _as_bool(mask)
    mean = masked_mean(x, mask)
    var = masked_var(x, mask, unbiased=True).clamp_min(min_std**2)
    whitened = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


def group_mean_std(
    rewards: Tensor, group_ids: Tensor, leave_one_out: bool = False
) -> tuple[Tensor, Tensor]:
    """Per-prompt group statistics of the rewards, broadcast back to the rows.

    Groups are the rows that share a ``group_id`` (any integers, in any order). The std is
    GRPO's: ``torch.std`` with Bessel's correction over the group, as TRL's ``GRPOTrainer``
    (``nanstd``) computes it. A group of one row has std 0 (TRL gets NaN there and zeroes the
    advantage afterwards; the resulting advantage is 0 either way).

    With ``leave_one_out`` the mean of row ``i`` excludes the row itself (RLOO baseline:
    ``(sum_g - r_i) / (n_g - 1)``). A group of one row has no other rows: its baseline is the
    row's own reward, so its advantage is 0 as without leave-one-out (no signal from a prompt
    sampled once, instead of a baseline-free REINFORCE term). The std is the full group's.

    Args:
        rewards: ``(B,)`` float.
        group_ids: ``(B,)`` integer.

    Returns:
        mean ``(B,)`` and std ``(B,)``.
    """
    _check_ndim(rewards, 1, "rewards", "(B,)")
    _check_shape(group_ids, tuple(rewards.shape), "group_ids", "(B,)")
    if group_ids.dtype.is_floating_point or group_ids.dtype == torch.bool:
        raise TypeError(f"group_ids must be an integer tensor (B,), got {group_ids.dtype}")
    rewards = _as_float(rewards)
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite; give unscorable completions a reward (e.g. 0)")

    _, inverse = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inverse.max()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    count = count.index_add(0, inverse, torch.ones_like(rewards))[inverse]
    total = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    total = total.index_add(0, inverse, rewards)[inverse]
    mean = total / count

    sq = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    sq = sq.index_add(0, inverse, (rewards - mean) ** 2)[inverse]
    var = sq / count
    var = torch.where(count > 1, var * (count / (count - 1).clamp_min(1)), torch.zeros_like(var))
    std = torch.sqrt(var)

    if leave_one_out:
        others = (count - 1).clamp_min(1)
        mean = torch.where(count > 1, (total - rewards) / others, rewards)
    return mean, std


def _batch_std(rewards: Tensor) -> Tensor:
    """Unbiased std of all rewards ``(B,)`` -> scalar, computed as TRL's ``nanstd``; 0 for B < 2."""
    count = rewards.numel()
    if count < 2:
        return torch.zeros((), dtype=rewards.dtype, device=rewards.device)
    var = ((rewards - rewards.mean()) ** 2).mean()
    return torch.sqrt(var * (count / (count - 1)))


# --------------------------------------------------------------------------------------
# GRPO (uniform credit)
# --------------------------------------------------------------------------------------


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
    _check_ndim(response_mask, 2, "response_mask", "(B, T)")
    _check_shape(rewards, (response_mask.shape[0],), "rewards", "(B,)")
    if scale_rewards is True:
        scale_rewards = "group"
    elif scale_rewards is False:
        scale_rewards = "none"
    if scale_rewards not in ("group", "batch", "none"):
        raise ValueError(
            f"scale_rewards must be one of 'group', 'batch', 'none', got {scale_rewards!r}"
        )
    rewards = _as_float(rewards)
    mean, std = group_mean_std(rewards, group_ids, leave_one_out=leave_one_out)
    if scale_rewards == "batch":
        std = _batch_std(rewards).expand_as(rewards)
    advantages = rewards - mean
    if scale_rewards != "none":
        advantages = advantages / (std + eps)
    mask = _as_bool(response_mask)
    return torch.where(mask, advantages[:, None].expand_as(mask), torch.zeros((), dtype=mean.dtype))


# --------------------------------------------------------------------------------------
# Advantage normalisation (registry)
# --------------------------------------------------------------------------------------

Normalizer = Callable[..., Tensor]
_NORMALIZERS: dict[str, Normalizer] = {}


def register_normalizer(name: str) -> Callable[[Normalizer], Normalizer]:
    """Decorator: register ``fn(advantages, response_mask, rewards, group_ids, *, eps, min_std)``.

    The function gets token advantages ``(B, T)``, ``response_mask (B, T)``, ``rewards (B,)``,
    ``group_ids (B,)`` (or None) and returns normalised advantages ``(B, T)``, 0 on padding. Its
    keyword defaults for ``eps`` and ``min_std`` are used when the caller passes None.
    """

    def decorator(fn: Normalizer) -> Normalizer:
        if name in _NORMALIZERS:
            raise ValueError(f"normalizer {name!r} is already registered")
        _NORMALIZERS[name] = fn
        return fn

    return decorator


def get_normalizer(name: str) -> Normalizer:
    """Look up a registered normalizer; unknown names list the valid ones."""
    try:
        return _NORMALIZERS[name]
    except KeyError:
        valid = ", ".join(sorted(_NORMALIZERS))
        raise ValueError(f"unknown advantage normalization {name!r}; valid: {valid}") from None


def _divide(advantages: Tensor, response_mask: Tensor, std: Tensor, eps: float) -> Tensor:
    """``advantages / (std + eps)`` on response tokens, 0 elsewhere (std: scalar or ``(B, 1)``)."""
    mask = _as_bool(response_mask)
    return torch.where(mask, advantages / (std + eps), torch.zeros_like(advantages))


@register_normalizer("none")
def _normalize_none(
    advantages: Tensor,
    response_mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor | None,
    *,
    eps: float = 1e-4,
    min_std: float = 0.0,
) -> Tensor:
    """Leave advantages as they are (``eps``/``min_std`` unused); padding zeroed."""
    mask = _as_bool(response_mask)
    return torch.where(mask, advantages, torch.zeros_like(advantages))


@register_normalizer("batch_std")
def _normalize_batch_std(
    advantages: Tensor,
    response_mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor | None,
    *,
    eps: float = 1e-4,
    min_std: float = 0.1,
) -> Tensor:
    """Divide by ``max(std of the batch's rewards, min_std) + eps``.

    The std is over rows (one reward per completion, unbiased), not tokens, so long responses
    do not weigh more. The ``min_std`` floor (default 0.1) keeps a batch whose rewards all agree
    (std 0) from multiplying value-based credit by ``1 / eps``: at most ``x 1/min_std``.
    """
    std = _batch_std(_as_float(rewards, like=advantages)).clamp_min(min_std)
    return _divide(advantages, response_mask, std, eps)


@register_normalizer("whiten")
def _normalize_whiten(
    advantages: Tensor,
    response_mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor | None,
    *,
    eps: float = 1e-8,
    min_std: float = 0.0,
) -> Tensor:
    """Masked whitening over all response tokens of the batch (mean 0, std 1).

    ``min_std`` floors the token std (default none): whitening otherwise blows near-zero
    advantages up to unit variance.
    """
    return masked_whiten(advantages, response_mask, shift_mean=True, eps=eps, min_std=min_std)


@register_normalizer("group_std")
def _normalize_group_std(
    advantages: Tensor,
    response_mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor | None,
    *,
    eps: float = 1e-4,
    min_std: float = 0.0,
) -> Tensor:
    """Divide each row by ``max(its group's reward std, min_std) + eps`` (GRPO's scaling).

    Only meaningful for uniform credit, where a group whose rewards agree has advantage 0
    anyway; with the default ``min_std = 0`` this reproduces GRPO exactly. Value-based credit
    is non-zero in such groups and gets multiplied by ``1 / eps = 10^4`` (docs/method.md, failure modes):
    use ``batch_std`` or ``whiten`` for it, or set ``min_std`` (e.g. 0.1).
    """
    if group_ids is None:
        raise ValueError("normalization 'group_std' needs group_ids (B,)")
    _, std = group_mean_std(_as_float(rewards, like=advantages), group_ids)
    std = std.clamp_min(min_std)
    return _divide(advantages, response_mask, std[:, None], eps)


@register_normalizer("group_or_batch_std")
def _normalize_group_or_batch_std(
    advantages: Tensor,
    response_mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor | None,
    *,
    eps: float = 1e-4,
    min_std: float = 0.1,
) -> Tensor:
    """GRPO's per-group scaling where it is safe: divide each row by its group's reward std, or,
    where that std is below ``min_std`` (a group whose rewards agree), by
    ``max(std of the batch's rewards, min_std)``.

    Uniform credit is then scaled exactly as GRPO scales it (its advantage is 0 in a group whose
    rewards agree), while value-based credit in such a group, which redistributes within each
    trace, is never multiplied by ``1 / eps`` (docs/method.md, failure modes).
    """
    if group_ids is None:
        raise ValueError("normalization 'group_or_batch_std' needs group_ids (B,)")
    r = _as_float(rewards, like=advantages)
    _, std = group_mean_std(r, group_ids)
    fallback = _batch_std(r).clamp_min(min_std)
    std = torch.where(std < min_std, fallback, std)
    return _divide(advantages, response_mask, std[:, None], eps)


def normalize_advantages(
    advantages: Tensor,
    response_mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor | None,
    mode: str,
    eps: float | None = None,
    min_std: float | None = None,
) -> Tensor:
    """Normalise token advantages with a registered normalizer.

    Modes: ``"none"``; ``"batch_std"`` (divide by the std of the batch's rewards, floored at
    ``min_std = 0.1``); ``"whiten"`` (masked whitening over tokens); ``"group_std"`` (divide by
    each group's reward std + eps; for uniform credit only, see :func:`_normalize_group_std`).
    ``eps`` / ``min_std`` = None use the mode's defaults (``eps``: 1e-4 added to a std; 1e-8
    added to the variance for ``whiten``).

    Args:
        advantages: ``(B, T)``; response_mask: ``(B, T)``; rewards: ``(B,)``;
        group_ids: ``(B,)`` integer (needed by ``group_std`` only).

    Returns:
        normalised advantages ``(B, T)``, 0 on padding.
    """
    normalizer = get_normalizer(mode)
    _check_ndim(advantages, 2, "advantages", "(B, T)")
    _check_shape(response_mask, tuple(advantages.shape), "response_mask", "(B, T)")
    _check_shape(rewards, (advantages.shape[0],), "rewards", "(B,)")
    if group_ids is not None:
        _check_shape(group_ids, (advantages.shape[0],), "group_ids", "(B,)")
    kwargs = {}
    if eps is not None:
        kwargs["eps"] = eps
    if min_std is not None:
        kwargs["min_std"] = min_std
    return normalizer(_as_float(advantages), response_mask, rewards, group_ids, **kwargs)


# --------------------------------------------------------------------------------------
# Reweighting GRPO by segment (credit.form = reweight)
# --------------------------------------------------------------------------------------

SIGMA_RULES = ("softmax", "linear", "rank")
"""How :func:`reweight_coefficients` turns aligned value changes into weights (docs/method.md)."""


def segment_token_counts(segment_ids: Tensor, response_mask: Tensor, num_segments: int) -> Tensor:
    """How many response tokens each segment holds.

    Args:
        segment_ids: ``(B, T)`` long, ``-1`` on padding; response_mask: ``(B, T)``.
        num_segments: ``S``.

    Returns:
        counts ``(B, S)`` float (0 for segments a row does not have).
    """
    _check_ndim(segment_ids, 2, "segment_ids", "(B, T)")
    _check_shape(response_mask, tuple(segment_ids.shape), "response_mask", "(B, T)")
    valid = _as_bool(response_mask) & (segment_ids >= 0)
    counts = torch.zeros(segment_ids.shape[0], num_segments, device=segment_ids.device)
    return counts.scatter_add(1, segment_ids.clamp_min(0).long(), valid.to(counts.dtype))


def reweight_coefficients(
    segment_rewards: Tensor,
    segment_mask: Tensor,
    segment_lengths: Tensor,
    direction: Tensor,
    rule: str = "softmax",
    temperature: float = 0.1,
) -> Tensor:
    """Normalised redistribution coefficients ``sigma_k >= 0`` of each row's segments.

    A segment's *aligned change* is ``u_k = sign(A_GRPO) * r_k``: its value change
    ``r_k = V(s_k) - V(s_{k-1})``, positive when it moved the value the way the outcome went
    (up in a trace better than its group, down in a worse one). Rules, each then scaled so that
    sigma averages 1 over the row's tokens (``sum_k len_k sigma_k = sum_k len_k``):

    - ``softmax``: ``sigma_k ∝ exp(u_k / temperature)``;
    - ``linear``: ``sigma_k ∝ max(0, 1 + (u_k - mean_tokens(u)) / temperature)`` (clipped linear);
    - ``rank``: ``sigma_k ∝ rank of u_k`` among the row's segments (1 = least aligned, ties share
      their mean rank); ``temperature`` is unused.

    Rows whose direction is 0 (an agreeing group: GRPO's advantage is 0) and rows with one
    segment get sigma = 1.

    Args:
        segment_rewards: ``(B, S)`` value changes ``r_k`` (:func:`redistribute`).
        segment_mask: ``(B, S)`` prefix mask.
        segment_lengths: ``(B, S)`` tokens per segment (:func:`segment_token_counts`); a valid
            segment without tokens weighs nothing in the average.
        direction: ``(B,)`` the sign (or any value; only its sign is read) of GRPO's advantage.
        rule: one of :data:`SIGMA_RULES`; temperature: > 0.

    Returns:
        sigma ``(B, S)``, >= 0, token-weighted mean 1 on each row with tokens; 0 on padding.
    """
    if rule not in SIGMA_RULES:
        raise ValueError(f"unknown sigma rule {rule!r}; valid: {', '.join(SIGMA_RULES)}")
    if not temperature > 0:
        raise ValueError(f"reweight temperature must be > 0, got {temperature}")
    _check_ndim(segment_rewards, 2, "segment_rewards", "(B, S)")
    shape = tuple(segment_rewards.shape)
    _check_shape(segment_mask, shape, "segment_mask", "(B, S)")
    _check_shape(segment_lengths, shape, "segment_lengths", "(B, S)")
    _check_shape(direction, (shape[0],), "direction", "(B,)")
    r = _as_float(segment_rewards)
    mask = _as_bool(segment_mask)
    lengths = torch.where(mask, _as_float(segment_lengths, like=r), torch.zeros_like(r))
    sign = torch.sign(_as_float(direction, like=r))
    aligned = torch.where(mask, sign[:, None] * r, torch.zeros_like(r))
    total = lengths.sum(dim=1, keepdim=True)

    if rule == "softmax":
        shifted = aligned / temperature
        peak = torch.where(mask, shifted, torch.full_like(shifted, -torch.inf)).amax(
            dim=1, keepdim=True
        )
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        raw = torch.where(mask, torch.exp(shifted - peak), torch.zeros_like(r))
    elif rule == "linear":
        mean = (lengths * aligned).sum(dim=1, keepdim=True) / total.clamp_min(1e-12)
        raw = (1 + (aligned - mean) / temperature).clamp_min(0)
    else:  # rank: 1 + number below + half the ties (the mean rank of a tie)
        below = (aligned[:, None, :] < aligned[:, :, None]) & mask[:, None, :]
        ties = (aligned[:, None, :] == aligned[:, :, None]) & mask[:, None, :]
        raw = 1 + below.sum(dim=2).to(r.dtype) + (ties.sum(dim=2).to(r.dtype) - 1) / 2
    raw = torch.where(mask, raw, torch.zeros_like(raw))
    weighted = (lengths * raw).sum(dim=1, keepdim=True)
    sigma = torch.where(weighted > 0, raw * total / weighted.clamp_min(1e-30), torch.ones_like(r))
    keep_one = (sign == 0) | (mask.sum(dim=1) <= 1)
    sigma = torch.where(keep_one[:, None], torch.ones_like(sigma), sigma)
    return torch.where(mask, sigma, torch.zeros_like(sigma))


def reweight_grpo(
    grpo: Tensor,
    sigma: Tensor,
    segment_mask: Tensor,
    handover_weight: float = 1.0,
) -> Tensor:
    """GRPO's advantage reweighted by segment: ``A_k = (1 + w (sigma_k - 1)) * A_GRPO``.

    The sign of every segment's advantage is GRPO's; only its size moves between the segments of
    a trace. ``w = 0`` (or sigma = 1) returns ``A_GRPO`` on every segment exactly.

    Args:
        grpo: ``(B,)`` GRPO's advantage of each row (``R - mean(R_group)``, before scaling).
        sigma: ``(B, S)`` from :func:`reweight_coefficients`; segment_mask: ``(B, S)``.
        handover_weight: ``w`` in [0, 1].

    Returns:
        segment advantages ``(B, S)``, 0 on padding.
    """
    if not 0.0 <= handover_weight <= 1.0:
        raise ValueError(f"handover_weight={handover_weight} must be in [0, 1]")
    mask = _as_bool(segment_mask)
    adv = _as_float(grpo, like=sigma)[:, None].expand_as(sigma)
    if handover_weight > 0.0:
        adv = (1 + handover_weight * (sigma - 1)) * adv
    return torch.where(mask, adv, torch.zeros_like(adv))


# --------------------------------------------------------------------------------------
# Values straight to tokens (a convenience over token_credit)
# --------------------------------------------------------------------------------------


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
    """Values of the segment boundaries -> normalised token advantages.

    redistribute -> segment GAE -> every token of segment ``k`` gets ``A_k`` -> normalise.

    Args:
        values: ``(B, S+1)``, ``values[b, k] = V(s_k)``; value_mask: ``(B, S+1)`` prefix mask.
        rewards: ``(B,)``.
        segment_ids: ``(B, T)`` long from :func:`boundaries_to_segment_ids`; row ``b`` must use
            exactly segments ``0 .. n_b - 1`` where ``n_b = value_mask[b].sum() - 1``.
        response_mask: ``(B, T)``.
        lam: GAE lambda in ``[0, 1]``.
        normalization: a registered normalizer (``none``, ``batch_std``, ``whiten``,
            ``group_std``); see :func:`normalize_advantages`.
        group_ids: ``(B,)`` integer, needed for ``group_std``.

    Returns:
        token advantages ``(B, T)``, 0 on padding.
    """
    get_normalizer(normalization)  # fail before any work on a typo
    _check_ndim(segment_ids, 2, "segment_ids", "(B, T)")
    if segment_ids.shape[0] != values.shape[0]:
        raise ValueError(
            f"segment_ids (B, T) = {tuple(segment_ids.shape)} and values (B, S+1) = "
            f"{tuple(values.shape)} disagree on B"
        )
    num_segments = _as_bool(value_mask).sum(dim=1) - 1
    used = segment_ids.max(dim=1).values + 1 if segment_ids.shape[1] else num_segments * 0
    if bool((used != num_segments).any()):
        row = int((used != num_segments).nonzero()[0])
        raise ValueError(
            f"row {row}: segment_ids use {int(used[row])} segments but value_mask gives "
            f"{int(num_segments[row])} (n + 1 values for n segments); build both from the same "
            "boundaries"
        )
    out = token_credit(
        Values(values, value_mask, lam=lam),
        rewards,
        group_ids,
        segment_ids,
        response_mask,
        normalization,
        eps=eps,
        min_std=min_std,
    )
    return out.advantages


# --------------------------------------------------------------------------------------
# The contract between credit methods and the algebra
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Values:
    """A value method's estimate: ``V(s_k)`` at every segment boundary of every row.

    Attributes:
        values: ``(B, S+1)``, ``values[b, k] = V(s_k)`` (what sits at ``s_n`` is replaced by R).
        mask: ``(B, S+1)`` prefix mask, at least ``s_0`` per row.
        lam: GAE lambda over segments: a float in [0, 1], or ``(B, S)`` per boundary
            (:func:`segment_gae`).
        anchor: ``(B,)`` or None. Shift each row so that ``V(s_0)`` is ``anchor`` (the group's
            mean reward: every trace keeps GRPO's total ``R - anchor``; :func:`anchor_values`).
        handover_weight: in [0, 1]: the credit is ``A_gr + handover_weight (A - A_gr)`` with
            ``A_gr`` GRPO's segment advantages ``R - mean(R_group)``; 0 gives GRPO exactly.
        form: ``"redistribute"`` (the values' GAE advantages, above) or ``"reweight"``: GRPO's
            advantage times ``1 + handover_weight (sigma_k - 1)``, sigma from the values'
            changes (:func:`reweight_coefficients`; ``lam`` is not used).
        sigma_rule, sigma_temperature: :func:`reweight_coefficients`'s ``rule`` and
            ``temperature`` (reweight only).
        segment_lengths: ``(B, S)`` tokens per segment, for reweight's token average where the
            caller's ``segment_ids`` are not tokens (TRL's segment layout); None: counted from
            ``segment_ids``.
    """

    values: Tensor
    mask: Tensor
    lam: float | Tensor = 1.0
    anchor: Tensor | None = None
    handover_weight: float = 1.0
    form: str = "redistribute"
    sigma_rule: str = "softmax"
    sigma_temperature: float = 0.1
    segment_lengths: Tensor | None = None


@dataclass(frozen=True)
class Weights:
    """An attribution method's estimate: how to split ``R - mean(R_group)`` over segments.

    Attributes:
        weights: ``(B, S)`` non-negative; renormalised over each row's valid segments.
        mask: ``(B, S)`` prefix mask of valid segments.
    """

    weights: Tensor
    mask: Tensor


@dataclass(frozen=True)
class Cost:
    """What an estimate cost beyond the step's own sampling and forward pass."""

    extra_forward_tokens: float = 0.0  # tokens run through a forward pass for the estimate
    extra_backward_tokens: float = 0.0  # ... of which also through a backward pass
    extra_generated_tokens: float = 0.0  # tokens sampled for it (they count against budgets)

    def metrics(self) -> dict[str, float]:
        return {
            "credit/extra_forward_tokens": float(self.extra_forward_tokens),
            "credit/extra_backward_tokens": float(self.extra_backward_tokens),
            "credit/extra_generated_tokens": float(self.extra_generated_tokens),
        }


@dataclass(frozen=True)
class TokenCredit:
    """The algebra's output for one batch."""

    advantages: Tensor  # (B, T) normalised, 0 on padding
    segment_advantages: Tensor  # (B, S) before normalisation
    segment_mask: Tensor  # (B, S) bool
    segment_rewards: Tensor  # (B, S) redistributed rewards r_k
    values: Tensor | None = None  # (B, S+1) the values credit used (Values only)


# normalizer with a std floor -> how GRPO scales its own share of value credit (TRL's
# scale_rewards "group" and "batch", no floor; see token_credit)
_GRPO_SCALING = {"group_or_batch_std": "group_std", "batch_std": "batch_std"}


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
    """The one path from a method's estimate to token advantages.

    Values: anchor -> redistribute -> segment GAE -> hand-over from GRPO by ``handover_weight``;
    with ``form="reweight"``: anchor -> redistribute -> GRPO's advantage times the blended
    coefficients of :func:`reweight_coefficients` (:func:`reweight_grpo`).
    Weights: ``r_k = w_k (R - mean(R_group))`` -> segment GAE with lambda 0.
    Then every token of segment ``k`` gets ``A_k`` and the batch is normalised.

    Args:
        estimate: :class:`Values` or :class:`Weights` over ``S`` segments.
        rewards: ``(B,)``; group_ids: ``(B,)`` integer.
        segment_ids: ``(B, T)`` long, ``-1`` on padding, row ``b`` using segments ``0..n_b-1``.
        response_mask: ``(B, T)``.
        normalization: a registered normalizer name (:func:`normalize_advantages`); ``eps`` /
            ``min_std``: its settings (None: the normalizer's defaults).

    Returns:
        :class:`TokenCredit`.
    """
    get_normalizer(normalization)  # fail before any work on a typo
    rewards = _as_float(rewards)

    def group_mean() -> Tensor:
        if group_ids is None:
            raise ValueError("the hand-over to GRPO and weights need group_ids (B,)")
        return group_mean_std(rewards, group_ids.to(rewards.device))[0]

    values = None
    grpo = None  # (B, S) GRPO's advantage R - mean(R_group) on every segment (Values only)
    if isinstance(estimate, Values):
        values = estimate.values
        if estimate.anchor is not None:
            values = anchor_values(values, estimate.mask, estimate.anchor)
        seg_adv, seg_mask, seg_rewards = segment_advantages_from_values(
            values, estimate.mask, rewards.to(values.device), estimate.lam
        )
        trust = float(estimate.handover_weight)
        if not 0.0 <= trust <= 1.0:
            raise ValueError(f"Values.handover_weight={trust} must be in [0, 1]")
        if estimate.form not in ("redistribute", "reweight"):
            raise ValueError(f"Values.form={estimate.form!r}; valid: redistribute, reweight")
        # GRPO's share is kept for the blend and for the split normalisation below
        keep_grpo = trust < 1.0 or (normalization in _GRPO_SCALING and group_ids is not None)
        if keep_grpo or estimate.form == "reweight":
            grpo_rows = (rewards - group_mean()).to(seg_adv.device)  # (B,)
        if keep_grpo:
            grpo = grpo_rows[:, None].expand_as(seg_adv)
            grpo = torch.where(seg_mask, grpo, torch.zeros_like(grpo))
        if estimate.form == "reweight":
            lengths = estimate.segment_lengths
            if lengths is None:
                lengths = segment_token_counts(
                    segment_ids.to(seg_adv.device), response_mask, seg_adv.shape[1]
                )
            sigma = reweight_coefficients(
                seg_rewards,
                seg_mask,
                lengths.to(seg_adv.device),
                grpo_rows,
                estimate.sigma_rule,
                estimate.sigma_temperature,
            )
            seg_adv = reweight_grpo(grpo_rows, sigma, seg_mask, trust)
        elif trust < 1.0:
            seg_adv = grpo if trust == 0.0 else grpo + trust * (seg_adv - grpo)
    elif isinstance(estimate, Weights):
        seg_mask = _as_bool(estimate.mask)
        seg_rewards = weights_to_segment_rewards(
            estimate.weights, seg_mask, rewards.to(estimate.weights.device), group_mean()
        )
        seg_adv = segment_gae(seg_rewards, seg_mask, 0.0)
    else:
        raise TypeError(f"estimate must be Values or Weights, got {type(estimate).__name__}")
    tokens = segments_to_tokens(seg_adv, segment_ids.to(seg_adv.device), response_mask)
    r = rewards.to(tokens.device)
    advantages = normalize_advantages(
        tokens, response_mask, r, group_ids, normalization, eps=eps, min_std=min_std
    )
    if grpo is not None and normalization in _GRPO_SCALING:
        # Value credit is GRPO's advantage plus its departure from it. Where the std floor of
        # the normalizer changed a row's divisor, GRPO's share is divided as GRPO divides it
        # (its group's or the batch's std + eps, however small: harmless there, its numerator
        # is as small) and only the departure keeps the floor that stops value credit from
        # being divided by ~0. Where the credit is GRPO's (w = 0, or uniform) this is GRPO bit
        # for bit at any reward scale; rows the floor did not touch are as before.
        floor = (
            get_normalizer(normalization).__kwdefaults__["min_std"] if min_std is None else min_std
        )
        rf = r.to(tokens.dtype)
        if normalization == "group_or_batch_std":
            std = group_mean_std(rf, group_ids.to(rf.device))[1]
        else:
            std = _batch_std(rf).expand_as(rf)
        floored = std < floor
        if bool(floored.any()):
            base = segments_to_tokens(grpo, segment_ids.to(seg_adv.device), response_mask)
            split = normalize_advantages(
                base,
                response_mask,
                r,
                group_ids,
                _GRPO_SCALING[normalization],
                eps=eps,
                min_std=0.0,
            ) + normalize_advantages(
                tokens - base, response_mask, r, group_ids, normalization, eps=eps, min_std=min_std
            )
            advantages = torch.where(floored[:, None], split, advantages)
    return TokenCredit(advantages, seg_adv, seg_mask, seg_rewards, values)
