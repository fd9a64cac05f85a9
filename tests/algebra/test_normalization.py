"""algebra.normalization's group statistics that the trainer records."""

from __future__ import annotations

import torch

from rredcot.algebra.normalization import zero_variance_groups


def test_zero_variance_groups_counts_the_groups_whose_rewards_are_all_equal():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    group_ids = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    # group 0 all right, group 2 all wrong, group 3 one row: 3 of 4 give GRPO no signal
    assert zero_variance_groups(rewards, group_ids) == 0.75


def test_zero_variance_groups_reads_group_ids_in_any_order():
    rewards = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert zero_variance_groups(rewards, torch.tensor([7, 3, 7, 3])) == 0.0
    assert zero_variance_groups(rewards, torch.tensor([7, 3, 3, 7])) == 1.0


def test_zero_variance_groups_of_no_rows_is_zero():
    assert zero_variance_groups(torch.zeros(0), torch.zeros(0, dtype=torch.long)) == 0.0
