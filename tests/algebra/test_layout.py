"""algebra.layout: each token's segment and each prefix's shared state."""

from __future__ import annotations

import pytest
import torch

from rredcot.algebra import credit, layout, shared_prefixes
from rredcot.algebra.layout import (
    boundaries_to_segment_ids,
    segment_token_counts,
    segments_to_tokens,
    shared_prefix_ids,
)


def test_the_paths_before_algebra_layout_give_the_same_functions():
    for name in ("boundaries_to_segment_ids", "segments_to_tokens", "segment_token_counts"):
        assert getattr(credit, name) is getattr(layout, name)
    assert shared_prefixes.shared_prefix_ids is layout.shared_prefix_ids


def test_boundaries_edge_cases():
    ids = boundaries_to_segment_ids([[0], [], [0, 3]], 3)
    assert ids.tolist() == [[-1, -1, -1], [-1, -1, -1], [0, 0, 0]]
    assert boundaries_to_segment_ids([], 4).shape == (0, 4)
    assert boundaries_to_segment_ids([[0, 1]], 0 + 1).tolist() == [[0]]


@pytest.mark.parametrize(
    "bounds, match",
    [
        ([[1, 3]], "start at 0"),
        ([[0, 2, 2]], "strictly increasing"),
        ([[0, 3, 2]], "strictly increasing"),
        ([[0, 5]], "beyond response_len"),
    ],
)
def test_boundaries_validation(bounds, match):
    with pytest.raises(ValueError, match=match):
        boundaries_to_segment_ids(bounds, 4)


def test_segments_to_tokens_rejects_out_of_range_ids():
    with pytest.raises(ValueError, match=r"\[-1, S\)"):
        segments_to_tokens(torch.zeros(1, 2), torch.tensor([[0, 2]]), torch.ones(1, 2))
    with pytest.raises(TypeError, match="integer"):
        segments_to_tokens(torch.zeros(1, 2), torch.tensor([[0.0, 1.0]]), torch.ones(1, 2))


def test_segment_token_counts_counts_each_segments_response_tokens():
    ids = boundaries_to_segment_ids([[0, 2, 3], [0, 1]], 4)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    assert segment_token_counts(ids, mask, 3).tolist() == [[2.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_prefixes_of_different_groups_are_never_shared():
    ids = torch.tensor([[1, 2], [1, 2]])
    mask = torch.ones(2, 2)
    prefix_ids = shared_prefix_ids(ids, mask, [[0, 1, 2], [0, 1, 2]], torch.tensor([0, 1]))
    assert set(prefix_ids[0].tolist()).isdisjoint(prefix_ids[1].tolist())
    with pytest.raises(ValueError, match="past its"):
        shared_prefix_ids(
            ids, torch.tensor([[1, 0], [1, 1]]), [[0, 2], [0, 2]], torch.tensor([0, 0])
        )
