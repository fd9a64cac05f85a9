"""The update's row policies (src/rredcot/training/row_policies.py): the tail floor, the
agreeing groups' draw to a budget, and the step's one call over them."""

from __future__ import annotations

import pytest
import torch

from rredcot.training.row_policies import (
    agreeing_rows,
    apply_row_draw,
    budget_keep_probabilities,
    credited_columns,
    drop_small_tails,
    forwarded_columns,
    last_positions,
    row_credit_sizes,
    sample_rows_to_budget,
    update_rows,
)


def test_small_tails_are_dropped_and_nothing_before_the_last_large_advantage():
    """Each row keeps every advantage up to its last |A| >= floor (small ones before it
    included), 0 after it and on padding; a row with none is all 0; floor 0 changes nothing."""
    adv = torch.tensor(
        [
            [0.5, 0.001, -0.2, 0.002, 0.7],
            [0.001, -0.002, 0.003, 0.0, 0.0],
            [-0.3, 0.0, 0.0, 0.0, 0.0],
        ]
    )
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0]])
    out = drop_small_tails(adv, mask, 0.01)
    expected = torch.tensor(
        [[0.5, 0.001, -0.2, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0], [-0.3, 0.0, 0.0, 0.0, 0.0]]
    )
    assert torch.equal(out, expected)  # the padded 0.7 does not keep row 0's tail
    assert drop_small_tails(adv, mask, 0.0) is adv
    assert drop_small_tails(adv, mask, 0.2)[0].tolist() == pytest.approx([0.5, 0.001, -0.2, 0, 0])


def test_agreeing_rows_are_those_of_groups_with_one_reward():
    rewards = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.5])
    groups = torch.tensor([7, 7, 3, 3, 5, 5, 9])
    assert agreeing_rows(rewards, groups).tolist() == [True, True, False, False, True, True, True]


def _budget_case():
    """Five rows: 0-3 eligible (3 credits nothing), 4 not; row lengths 4, 2, 4, 3, 4."""
    adv = torch.tensor(
        [
            [0.4, -0.2, 0.1, 0.3, 0.0],
            [2.0, 1.0, 0.0, 0.0, 0.0],
            [0.05, 0.0, -0.05, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [0.7, 0.7, 0.7, 0.7, 0.0],
        ]
    )
    mask = torch.tensor(
        [[1, 1, 1, 1, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 0, 0]] + [[1] * 4 + [0]]
    )
    return adv, mask, torch.tensor([True, True, True, True, False])


def test_budgeted_rows_cost_the_budget_and_keep_the_gradient_unbiased():
    """Keep probabilities spend exactly the budget in expectation (credited tokens up to each
    row's last non-zero advantage), follow norm / sqrt(length) below the cap, and the draws
    average to the advantages; ineligible rows pass through untouched."""
    adv, mask, eligible = _budget_case()
    tokens = torch.tensor([4.0, 2.0, 3.0, 0.0])  # row 2's last credited token is its third
    norms = adv[:4].double().norm(dim=1)
    for fraction in (0.2, 0.5, 0.9):
        out, keep = sample_rows_to_budget(
            adv, mask, eligible, fraction, torch.Generator().manual_seed(0)
        )
        spent = float((keep[:4] * tokens.double()).sum())
        assert spent == pytest.approx(fraction * float(tokens.sum()), rel=1e-9)
        assert keep[4] == 1 and torch.equal(out[4], adv[4])
        assert keep[3] == 0 and not out[3].any()
        free = (keep[:3] < 1).nonzero().flatten().tolist()
        ratios = [float(keep[i] / (norms[i] / tokens[i].double().sqrt())) for i in free]
        assert ratios == pytest.approx([ratios[0]] * len(ratios), rel=1e-9)
    _, keep = sample_rows_to_budget(adv, mask, eligible, 0.9, torch.Generator().manual_seed(0))
    assert keep[1] == 1  # the largest credit is capped at certainty
    gen = torch.Generator().manual_seed(1)
    draws = torch.stack(
        [sample_rows_to_budget(adv, mask, eligible, 0.5, gen)[0] for _ in range(20000)]
    )
    torch.testing.assert_close(draws.mean(0), adv, atol=0.02, rtol=0.03)
    kept_rows = (draws[:, :3] != 0).any(-1).float().mean(0)
    torch.testing.assert_close(
        kept_rows.double(),
        sample_rows_to_budget(adv, mask, eligible, 0.5)[1][:3],
        atol=0.02,
        rtol=0,
    )


def test_a_full_budget_changes_nothing_and_a_bad_fraction_is_refused():
    adv, mask, eligible = _budget_case()
    out, keep = sample_rows_to_budget(adv, mask, eligible, 1.0)
    assert out is adv and bool((keep == 1).all())
    out, keep = sample_rows_to_budget(adv, mask, torch.zeros(5, dtype=torch.bool), 0.3)
    assert torch.equal(out, adv) and bool((keep == 1).all())
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError, match=r"fraction=.* must be in \(0, 1\]"):
            sample_rows_to_budget(adv, mask, eligible, bad)


def test_budgeted_rows_drawn_in_parts_equal_the_one_batch_draw():
    """Rows split across processes: each part's sizes gathered, the keep probabilities and one
    uniform draw over every row, each part applying its slice, give exactly the one-batch draw
    of the same generator (what rredcot train does under several processes)."""
    adv, mask, eligible = _budget_case()
    whole, keep = sample_rows_to_budget(adv, mask, eligible, 0.5, torch.Generator().manual_seed(7))
    parts = [slice(0, 2), slice(2, 5)]
    sizes = [row_credit_sizes(adv[p], mask[p]) for p in parts]
    tokens, norm = (torch.cat(column) for column in zip(*sizes))
    every = budget_keep_probabilities(tokens, norm, eligible, 0.5)
    torch.testing.assert_close(every, keep, rtol=0, atol=0)
    draw = torch.rand(5, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    split = torch.cat([apply_row_draw(adv[p], every[p], draw[p]) for p in parts])
    assert torch.equal(split, whole)
    # a part drawn on its own (its own budget, its own draw) is not the same draw
    alone = sample_rows_to_budget(adv[2:], mask[2:], eligible[2:], 0.5)[1]
    assert not torch.allclose(alone, keep[2:])


def _one_process(columns):
    return 0, [c.cpu() for c in columns]


def test_update_rows_is_the_tail_floor_then_the_budgeted_draw():
    """The step's one call: the tails cut, then the agreeing rows drawn with the generator, the
    same advantages as the public stages in that order; fraction 1 draws nothing."""
    adv, mask, _ = _budget_case()
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2])
    eligible = agreeing_rows(rewards, groups)
    cut = drop_small_tails(adv, mask, 0.06)
    expected, _ = sample_rows_to_budget(cut, mask, eligible, 0.5, torch.Generator().manual_seed(3))
    out, counts = update_rows(
        adv,
        mask,
        rewards,
        groups,
        tail_floor=0.06,
        agreeing_fraction=0.5,
        gather=_one_process,
        generator=torch.Generator().manual_seed(3),
    )
    assert torch.equal(out, expected)
    credited = (cut != 0).any(dim=1) & eligible
    assert int(counts["credited"]) == int(credited.sum())
    assert int(counts["kept"]) == int(((out != 0).any(dim=1) & credited).sum())
    whole, none = update_rows(
        adv,
        mask,
        rewards,
        groups,
        tail_floor=0.0,
        agreeing_fraction=1.0,
        gather=_one_process,
        generator=torch.Generator(),
    )
    assert whole is adv and none == {}


def test_credited_columns_reach_each_rows_last_credited_token():
    adv, mask, _ = _budget_case()
    rows = torch.tensor([4, 0, 2, 3])
    expected = last_positions((adv[rows] != 0) & (mask[rows] != 0))
    assert credited_columns(adv, mask, rows).tolist() == expected.tolist() == [4, 4, 3, 0]


def test_forwarded_columns_are_every_column_or_cut_after_the_last_credited_token():
    adv = torch.tensor([[0.5, 0.0, 0.2, 0.0, 0.0], [0.0] * 5, [0.1, 0.1, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0] * 5, [1.0] * 5, [1.0, 1.0, 1.0, 0.0, 0.0]])
    assert forwarded_columns(adv, mask, cut=False).tolist() == [5, 5, 5]
    cut = forwarded_columns(adv, mask, cut=True)
    assert cut.tolist() == credited_columns(adv, mask, torch.arange(3)).tolist() == [3, 0, 2]
