"""rredcot.sampling.batch: the one layout of a batch's segments (segment_layout,
RolloutBatch.with_segments), and the old import paths of what left rollout.py."""

from __future__ import annotations

import torch

from rredcot.algebra.credit import boundaries_to_segment_ids
from rredcot.algebra.shared_prefixes import shared_prefix_ids
from rredcot.sampling import forward, rollout
from rredcot.sampling.batch import RolloutBatch, segment_layout
from rredcot.tasks import base


def _rows():
    response_ids = torch.tensor([[5, 6, 7, 0], [5, 6, 8, 9], [4, 4, 0, 0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0]])
    boundaries = [[0, 2, 3], [0, 2, 4], [0, 2]]
    group_ids = torch.tensor([0, 0, 1])
    return response_ids, mask, boundaries, group_ids


def _batch(boundaries, segment_ids, prefix_ids=None) -> RolloutBatch:
    """``_rows()`` as a batch behind a 2-token prompt, laid out as given."""
    ids, mask, _, groups = _rows()
    prompt = torch.ones(3, 2, dtype=torch.long)
    return RolloutBatch(
        input_ids=torch.cat([prompt, ids], dim=1),
        attention_mask=torch.cat([prompt, mask.long()], dim=1),
        prompt_len=2,
        response_mask=mask,
        rewards=torch.zeros(3),
        group_ids=groups,
        boundaries=boundaries,
        segment_ids=segment_ids,
        prefix_ids=prefix_ids,
    )


def test_segment_layout_is_segment_ids_and_the_groups_shared_prefixes():
    ids, mask, bounds, groups = _rows()
    segment_ids, prefix_ids = segment_layout(bounds, mask, ids, groups)
    assert segment_ids.equal(boundaries_to_segment_ids(bounds, 4))
    assert prefix_ids.equal(shared_prefix_ids(ids, mask, bounds, groups))
    assert prefix_ids[0, 1] == prefix_ids[1, 1]  # the two rows of group 0 share "5 6"
    only_ids, none = segment_layout(bounds, mask)  # rows not laid out as a group's
    assert only_ids.equal(segment_ids) and none is None


def test_with_segments_lays_out_every_segment_field():
    ids, mask, bounds, groups = _rows()
    whole = [[0, int(n)] for n in mask.sum(-1)]
    batch = _batch(whole, segment_layout(whole, mask)[0])
    starts = [[0, 2, 3], [0, 2, 4], [0]]
    cut = batch.with_segments(bounds, starts)
    assert cut.boundaries == bounds and cut.segment_char_starts == starts
    segment_ids, prefix_ids = segment_layout(bounds, mask, ids, groups)
    assert cut.segment_ids.equal(segment_ids) and cut.prefix_ids.equal(prefix_ids)
    assert batch.prefix_ids is None  # frozen: the batch it came from is unchanged


def test_a_selected_sub_batch_has_prefix_ids_as_wide_as_its_rows():
    """``select`` keeps the layout ``segment_batch`` makes: prefix ids ``(B', S'+1)`` for the
    widest row kept (a credit method checks them against the boundaries' mask)."""
    ids, mask, bounds, groups = _rows()
    segment_ids, prefix_ids = segment_layout(bounds, mask, ids, groups)
    batch = _batch(bounds, segment_ids, prefix_ids)
    last = batch.select([2])  # one segment: two boundaries
    assert last.prefix_ids.equal(prefix_ids[2:, :2])
    assert last.boundary_positions()[1].shape == last.prefix_ids.shape
    assert batch.select([0, 2]).prefix_ids.equal(prefix_ids[[0, 2]])


def test_what_left_rollout_keeps_its_path_there():
    for name in forward.__all__:
        if name in ("prompt_groups", "shared_prompt_forward", "shared_prompt_unsupported_reason"):
            continue
        assert getattr(rollout, name) is getattr(forward, name), name
    assert rollout.checked_verify is base.checked_verify
