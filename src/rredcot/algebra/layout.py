"""Where each token's segment and each prefix's shared state are: the layout of a batch's segments.

A response of ``T`` tokens cut at boundaries ``[0, b_1, ..., b_n]`` (``segment.spans_to_boundaries``)
is laid out as

- ``segment_ids (B, T)`` long: the 0-based segment of each response token, ``-1`` on padding
  (:func:`boundaries_to_segment_ids`); :func:`segments_to_tokens` gives every token its segment's
  value, :func:`segment_token_counts` counts each segment's tokens;
- ``prefix_ids (B, S+1)`` long: one id per prefix ``s_k``, shared by the rows of a group whose
  first ``b_k`` tokens are the same (:func:`shared_prefix_ids`; the free Monte Carlo values of
  ``algebra.shared_prefixes`` read them), ``-1`` on padding.

``sampling.batch.segment_layout`` lays out every batch with them; the credit algebra
(``algebra.credit``) spreads segment credit over tokens with them. Pure tensor functions, torch
only; the layout conventions are ``algebra.credit``'s (docs/architecture.md).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rredcot.algebra.tensor_checks import as_bool, check_ndim, check_shape

__all__ = [
    "boundaries_to_segment_ids",
    "fit_columns",
    "segment_token_counts",
    "segments_to_tokens",
    "shared_prefix_ids",
]


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


def fit_columns(t: Tensor, width: int, fill: float = 0) -> Tensor:
    """``t`` with dim 1 padded with ``fill`` (or cut) to ``width`` columns (further dims kept)."""
    if t.shape[1] >= width:
        return t[:, :width]
    pad = t.new_full((t.shape[0], width - t.shape[1], *t.shape[2:]), fill)
    return torch.cat([t, pad], dim=1)


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
    check_ndim(segment_values, 2, "segment_values", "(B, S)")
    check_ndim(segment_ids, 2, "segment_ids", "(B, T)")
    if segment_ids.shape[0] != segment_values.shape[0]:
        raise ValueError(
            f"segment_ids (B, T) = {tuple(segment_ids.shape)} and segment_values (B, S) = "
            f"{tuple(segment_values.shape)} disagree on B"
        )
    check_shape(response_mask, tuple(segment_ids.shape), "response_mask", "(B, T)")
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
    valid = as_bool(response_mask) & (segment_ids >= 0)
    if num_segments == 0:
        return torch.zeros(segment_ids.shape, dtype=segment_values.dtype, device=segment_ids.device)
    gathered = segment_values.gather(1, segment_ids.clamp_min(0).long())
    return torch.where(valid, gathered, torch.zeros_like(gathered))


def segment_token_counts(segment_ids: Tensor, response_mask: Tensor, num_segments: int) -> Tensor:
    """How many response tokens each segment holds.

    Args:
        segment_ids: ``(B, T)`` long, ``-1`` on padding; response_mask: ``(B, T)``.
        num_segments: ``S``.

    Returns:
        counts ``(B, S)`` float (0 for segments a row does not have).
    """
    check_ndim(segment_ids, 2, "segment_ids", "(B, T)")
    check_shape(response_mask, tuple(segment_ids.shape), "response_mask", "(B, T)")
    valid = as_bool(response_mask) & (segment_ids >= 0)
    counts = torch.zeros(segment_ids.shape[0], num_segments, device=segment_ids.device)
    return counts.scatter_add(1, segment_ids.clamp_min(0).long(), valid.to(counts.dtype))


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
    check_ndim(response_ids, 2, "response_ids", "(B, T)")
    check_shape(response_mask, tuple(response_ids.shape), "response_mask", "(B, T)")
    check_shape(group_ids, (response_ids.shape[0],), "group_ids", "(B,)")
    if len(boundaries) != response_ids.shape[0]:
        raise ValueError(
            f"boundaries has {len(boundaries)} rows, response_ids {response_ids.shape[0]}"
        )
    S = max((len(b) - 1 for b in boundaries), default=0)
    ids = torch.full((len(boundaries), S + 1), -1, dtype=torch.long)
    lengths = as_bool(response_mask).sum(dim=1).tolist()
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
