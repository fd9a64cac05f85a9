"""Free Monte Carlo values from the group's shared prefixes, and the per-boundary lambda that
lets credit stop at known boundaries and pass through unknown ones."""

from __future__ import annotations

import random

import pytest
import torch

from rredcot.algebra import credit, normalization, shared_prefixes


def _random_tree_batch(rng: random.Random, groups: int, size: int, steps: int):
    """Rows whose tokens are one 'step' token per segment from a tiny alphabet, so prefixes
    are often shared; boundaries after every token."""
    ids, lengths, group_ids = [], [], []
    for g in range(groups):
        for _ in range(size):
            n = rng.randint(1, steps)
            ids.append([rng.choice([5, 6]) if rng.random() < 0.3 else 5 for _ in range(n)])
            lengths.append(n)
            group_ids.append(g)
    T = max(lengths)
    response_ids = torch.zeros(len(ids), T, dtype=torch.long)
    mask = torch.zeros(len(ids), T)
    for row, toks in enumerate(ids):
        response_ids[row, : len(toks)] = torch.tensor(toks)
        mask[row, : len(toks)] = 1
    boundaries = [list(range(n + 1)) for n in lengths]
    return response_ids, mask, boundaries, torch.tensor(group_ids), ids


@pytest.mark.parametrize("seed", range(5))
def test_shared_prefix_values_match_a_plain_loop(seed):
    rng = random.Random(seed)
    response_ids, mask, boundaries, group_ids, ids = _random_tree_batch(rng, 3, 6, 5)
    rewards = torch.tensor([float(rng.random() < 0.5) for _ in ids])
    prefix_ids = shared_prefixes.shared_prefix_ids(response_ids, mask, boundaries, group_ids)
    values, counts = shared_prefixes.shared_prefix_values(prefix_ids, rewards)
    for row, toks in enumerate(ids):
        for k, b in enumerate(boundaries[row]):
            sharers = [
                j
                for j, other in enumerate(ids)
                if int(group_ids[j]) == int(group_ids[row])
                and len(other) >= b
                and other[:b] == toks[:b]
            ]
            assert counts[row, k] == len(sharers)
            assert values[row, k] == pytest.approx(float(rewards[sharers].mean()))
        assert (prefix_ids[row, len(boundaries[row]) :] == -1).all()
        assert (counts[row, len(boundaries[row]) :] == 0).all()
    # s_0 is the whole group: its value is the group mean reward
    mean, _ = normalization.group_mean_std(rewards, group_ids)
    assert torch.allclose(values[:, 0], mean)


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_segment_gae_with_a_constant_lambda_tensor_equals_the_float(lam):
    torch.manual_seed(0)
    r = torch.randn(4, 5)
    mask = torch.arange(5)[None, :] < torch.tensor([5, 3, 1, 0])[:, None]
    as_float = credit.segment_gae(r, mask, lam)
    as_tensor = credit.segment_gae(r, mask, torch.full((4, 5), lam))
    assert torch.equal(as_float, as_tensor)


def test_lambda_one_at_a_boundary_makes_its_value_cancel():
    values = torch.tensor([[0.5, 0.7, 0.2, 0.9]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    lam = torch.tensor([[0.0, 1.0, 0.0]])  # s_2 unknown
    rewards = torch.tensor([1.0])
    a, _, _ = credit.segment_advantages_from_values(values, mask, rewards, lam)
    changed = values.clone()
    changed[0, 2] = -3.0
    b, _, _ = credit.segment_advantages_from_values(changed, mask, rewards, lam)
    assert torch.allclose(a[0, :2], b[0, :2])  # segments 1, 2 do not see V(s_2)
    assert a[0, 1] == pytest.approx(1.0 - 0.7)  # segment 2 runs on to s_3 := R
    with pytest.raises(ValueError, match="lam"):
        credit.segment_gae(torch.zeros(1, 3), mask[:, 1:], torch.tensor([[0.0, 2.0, 0.0]]))


def test_nothing_shared_and_no_fallback_is_grpo():
    """Rows that share only s_0 with weight 0 get R - mean(R_group) on every segment."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    ids = torch.tensor([[1, 2, 3], [4, 5, 6], [1, 2, 3], [7, 8, 9]])
    bounds = [[0, 1, 2, 3]] * 4
    prefix_ids = shared_prefixes.shared_prefix_ids(ids, torch.ones(4, 3), bounds, group_ids)
    shared, counts = shared_prefixes.shared_prefix_values(prefix_ids, rewards)
    mask = torch.ones(4, 4, dtype=torch.bool)
    head = torch.rand(4, 4)
    values, lam = shared_prefixes.combine_shared_prefix(shared, counts, head, mask, 0.0)
    adv, _, _ = credit.segment_advantages_from_values(values, mask, rewards, lam)
    mean, _ = normalization.group_mean_std(rewards, group_ids)
    assert torch.allclose(adv, (rewards - mean)[:, None].expand(-1, 3))
    # with weight w the head's changes serve as baselines: unbiased lambda-1 credit
    values_w, lam_w = shared_prefixes.combine_shared_prefix(shared, counts, head, mask, 0.5)
    adv_w, _, _ = credit.segment_advantages_from_values(values_w, mask, rewards, lam_w)
    expected = rewards[:, None] - (mean[:, None] + 0.5 * (head[:, :3] - head[:, :1]))
    assert torch.allclose(adv_w, expected)


def test_a_shared_chain_blames_the_step_where_a_sample_left_it():
    """Three samples agree on two steps; one then goes wrong (and fails), the others finish
    the same way and succeed: the blame lands on the wrong sample's third step, the steps it
    shared with the group get the group's gain, and every trace keeps GRPO's total."""
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 9, 9]])
    bounds = [[0, 1, 2, 3, 4]] * 3
    rewards = torch.tensor([1.0, 1.0, 0.0])
    group_ids = torch.zeros(3, dtype=torch.long)
    prefix_ids = shared_prefixes.shared_prefix_ids(ids, torch.ones(3, 4), bounds, group_ids)
    shared, counts = shared_prefixes.shared_prefix_values(prefix_ids, rewards)
    mask = torch.ones(3, 5, dtype=torch.bool)
    values, lam = shared_prefixes.combine_shared_prefix(
        shared, counts, torch.zeros(3, 5), mask, 0.0
    )
    adv, _, seg_r = credit.segment_advantages_from_values(values, mask, rewards, lam)
    assert torch.allclose(adv[2], torch.tensor([0.0, 0.0, -2 / 3, -2 / 3]))
    assert torch.allclose(adv[0], torch.tensor([0.0, 0.0, 1 / 3, 0.0]))
    mean = rewards.mean()
    assert torch.allclose(seg_r.sum(1), rewards - mean)
    with pytest.raises(ValueError, match="min_count"):
        shared_prefixes.combine_shared_prefix(
            shared, counts, torch.zeros(3, 5), mask, 0.0, min_count=0
        )
    # min_count 1 trusts the wrong sample's own prefixes: all its blame on the step it left
    values1, lam1 = shared_prefixes.combine_shared_prefix(
        shared, counts, torch.zeros(3, 5), mask, 0.0, min_count=1
    )
    adv1, _, _ = credit.segment_advantages_from_values(values1, mask, rewards, lam1)
    assert torch.allclose(adv1[2], torch.tensor([0.0, 0.0, -2 / 3, 0.0]))


def test_credit_moved_back_onto_a_shared_prefix_sums_to_zero_over_its_samples():
    """Why lambda 0 at known boundaries loses nothing: with any lambda there, the extra credit
    that flows back onto a shared segment sums to zero over the samples sharing it (they hold the
    same tokens there, so the update is the same)."""
    ids = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 9, 9], [1, 7, 7, 7]])
    bounds = [[0, 1, 2, 3, 4]] * 4
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0])
    prefix_ids = shared_prefixes.shared_prefix_ids(
        ids, torch.ones(4, 4), bounds, torch.zeros(4).long()
    )
    shared, counts = shared_prefixes.shared_prefix_values(prefix_ids, rewards)
    mask = torch.ones(4, 5, dtype=torch.bool)
    values, lam = shared_prefixes.combine_shared_prefix(
        shared, counts, torch.zeros(4, 5), mask, 0.0
    )
    a0, _, _ = credit.segment_advantages_from_values(values, mask, rewards, lam)
    lam_half = torch.where(lam == 0, torch.full_like(lam, 0.5), lam)
    a5, _, _ = credit.segment_advantages_from_values(values, mask, rewards, lam_half)
    for k in range(4):  # segment k+1, shared by the rows whose prefix ids agree at s_(k+1)
        for pid in prefix_ids[:, k + 1].unique():
            rows = prefix_ids[:, k + 1] == pid
            if rows.sum() >= 2:
                assert float((a5[rows, k] - a0[rows, k]).sum()) == pytest.approx(0.0, abs=1e-6)
    assert not torch.allclose(a0, a5)  # the rows' credit does differ
