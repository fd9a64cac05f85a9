"""Segment ids in verl's layout: from the response ids (trainer side, :func:`segment_responses`)
to each row's boundaries (estimator side, :func:`boundaries_from_segment_ids`), holes of a
multi-turn response (tool outputs) included. No verl import."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rredcot.integrations._batch import segment_completions, span_mask
from rredcot.sampling.batch import segment_layout
from rredcot.segment import Segmenter

__all__ = [
    "boundaries_from_segment_ids",
    "fill_segment_holes",
    "num_segments_of",
    "segment_responses",
]


def segment_responses(
    responses: Tensor,
    response_mask: Tensor,
    tokenizer,
    segmenter: Segmenter,
    eos_token_ids: Any = None,
) -> Tensor:
    """``(B, T)`` long segment ids of verl's response tokens (``-1`` on padding).

    A multi-turn response whose mask has holes (tool outputs between the policy's turns) is
    segmented as the one text it is, up to its last real token: hole tokens keep the id of the
    segment they fall in (they stay inside the states ``s_k``; the estimator gives them no
    advantage, as verl's mask says). ``-1`` after the last real token.

    Args:
        responses: ``(B, T)`` response ids (``data.batch["responses"]``).
        response_mask: ``(B, T)`` 1 on the policy's tokens.
        tokenizer: the policy's tokenizer; segmenter: how to cut the decoded text.
    """
    span = span_mask(response_mask)
    boundaries, _, _ = segment_completions(responses, span, tokenizer, segmenter, eos_token_ids)
    return segment_layout(boundaries, span.to(responses.device))[0]


def fill_segment_holes(segment_ids: Tensor, response_mask: Tensor) -> Tensor:
    """Segment ids with the holes inside each row's span (``-1`` before its last real token)
    given the id of the segment they sit in (the one before; 0 at the start); -1 after."""
    ids = segment_ids.long().clone()
    valid = ids >= 0
    T = ids.shape[1]
    cols = torch.arange(T, device=ids.device).unsqueeze(0).expand_as(ids)
    last_valid = torch.where(valid, cols, torch.full_like(cols, -1)).cummax(dim=1).values
    prev = ids.gather(1, last_valid.clamp(min=0))
    prev = torch.where(last_valid >= 0, prev, torch.zeros_like(prev))
    span = span_mask(valid.long()).bool()
    return torch.where(span, torch.where(valid, ids, prev), torch.full_like(ids, -1))


def boundaries_from_segment_ids(segment_ids: Tensor, response_mask: Tensor) -> list[list[int]]:
    """Per row ``[0, b_1, ..., n_tokens]`` from segment ids (``0, 0, 1, 1, 2, ...`` over the
    row's span, up to its last real token). Holes (``-1`` inside the span, e.g. multi-turn tool
    outputs) belong to the segment they sit in."""
    span = span_mask(response_mask).bool()
    segment_ids = torch.where(span, segment_ids.long(), torch.full_like(segment_ids.long(), -1))
    filled = fill_segment_holes(segment_ids, response_mask)
    out = []
    lengths = (filled >= 0).sum(-1).tolist()
    rows = filled.tolist()
    for row, n in enumerate(lengths):
        ids = rows[row][:n]
        if not ids:
            out.append([0])
            continue
        steps = [b - a for a, b in zip(ids[:-1], ids[1:])]
        if ids[0] != 0 or any(s not in (0, 1) for s in steps):
            raise ValueError(
                f"segment_ids row {row} must count segments 0, 1, 2, ... over its response "
                f"tokens (-1 only on padding and masked holes); got "
                f"{ids[:12]}{'...' if len(ids) > 12 else ''}"
            )
        out.append([0, *(t for t in range(1, n) if ids[t] != ids[t - 1]), n])
    return out


def num_segments_of(segment_ids: Tensor, response_mask: Tensor) -> Tensor:
    """``(B,)`` segments per row from verl-layout segment ids (holes allowed)."""
    return torch.tensor(
        [len(b) - 1 for b in boundaries_from_segment_ids(segment_ids, response_mask)]
    )
