"""credit.form=reweight: GRPO's advantage moved between a trace's segments, never flipped."""

from __future__ import annotations

import pytest
import torch

import credit_reference
from rredcot.algebra import credit, normalization
from rredcot.algebra.credit import Values
from rredcot.config import CreditConfig, ReweightConfig
from rredcot.methods.base import (
    CreditContext,
    CreditMethod,
    CreditRows,
    Estimate,
    UniformCredit,
    uniform_values,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0])
GROUPS = torch.tensor([0, 0, 0, 1, 1, 1])
BOUNDS = [[0, 3, 5, 9], [0, 2, 7], [0, 4, 6, 8], [0, 9], [0, 1, 2, 3], [0, 5, 9]]


def _layout():
    segment_ids = credit.boundaries_to_segment_ids(BOUNDS, 9)
    response_mask = segment_ids >= 0
    n = torch.tensor([len(b) - 1 for b in BOUNDS])
    value_mask = torch.arange(4)[None, :] <= n[:, None]
    return segment_ids, response_mask, value_mask


def _random_values(value_mask, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.where(value_mask, torch.rand(value_mask.shape, generator=g), 0.0)


def _uniform_advantages(segment_ids, response_mask):
    n = torch.tensor([len(b) - 1 for b in BOUNDS])
    uv, umask = uniform_values(REWARDS, GROUPS, n)
    out = credit_reference.token_credit(
        Values(uv, umask, lam=1.0), REWARDS, GROUPS, segment_ids, response_mask, "group_std"
    )
    return out.advantages


def test_reweight_at_handover_zero_is_grpo_bit_for_bit():
    segment_ids, response_mask, value_mask = _layout()
    grpo = _uniform_advantages(segment_ids, response_mask)
    for rule in credit.SIGMA_RULES:
        est = Values(
            credit.anchor_values(
                _random_values(value_mask),
                value_mask,
                normalization.group_mean_std(REWARDS, GROUPS)[0],
            ),
            value_mask,
            handover_weight=0.0,
            form="reweight",
            sigma_rule=rule,
        )
        out = credit_reference.token_credit(
            est, REWARDS, GROUPS, segment_ids, response_mask, "group_std"
        )
        assert torch.equal(out.advantages, grpo), rule


def test_reweight_with_flat_values_is_grpo_bit_for_bit():
    # constant values inside a trace: every change is 0 except the outcome's; a one-segment
    # trace and a trace of an agreeing group get sigma = 1 whatever the values
    segment_ids, response_mask, value_mask = _layout()
    sigma = credit.reweight_coefficients(
        torch.zeros(6, 3), value_mask[:, 1:], torch.ones(6, 3), REWARDS - 0.5
    )
    lengths = credit.segment_token_counts(segment_ids, response_mask, 3)
    assert torch.equal(sigma, value_mask[:, 1:].float())
    grpo_row = REWARDS - normalization.group_mean_std(REWARDS, GROUPS)[0]
    seg = credit.reweight_grpo(grpo_row, sigma, value_mask[:, 1:], 1.0)
    tokens = credit.segments_to_tokens(seg, segment_ids, response_mask)
    out = normalization.normalize_advantages(tokens, response_mask, REWARDS, GROUPS, "group_std")
    assert torch.equal(out, _uniform_advantages(segment_ids, response_mask))
    assert torch.equal(lengths.sum(1), response_mask.sum(1).float())


@pytest.mark.parametrize("rule", credit.SIGMA_RULES)
def test_sigma_is_nonnegative_token_mean_one_and_favours_aligned_changes(rule):
    # row 0 won: its second segment raised the value most; row 1 lost: its first segment
    # dropped the value most
    r = torch.tensor([[0.1, 0.6, 0.0], [-0.7, 0.1, -0.1]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    lengths = torch.tensor([[3.0, 2.0, 4.0], [1.0, 5.0, 2.0]])
    sigma = credit.reweight_coefficients(r, mask, lengths, torch.tensor([0.5, -0.5]), rule, 0.2)
    assert bool((sigma >= 0).all())
    torch.testing.assert_close((sigma * lengths).sum(1), lengths.sum(1))
    assert int(sigma[0].argmax()) == 1 and int(sigma[1].argmax()) == 0
    seg = credit.reweight_grpo(torch.tensor([0.5, -0.5]), sigma, mask, 1.0)
    assert bool((seg[0] >= 0).all()) and bool((seg[1] <= 0).all())  # the sign is GRPO's
    half = credit.reweight_grpo(torch.tensor([0.5, -0.5]), sigma, mask, 0.5)
    torch.testing.assert_close(half, (seg + torch.tensor([[0.5], [-0.5]])) / 2)


def test_rank_ties_share_their_mean_rank_and_padding_is_zero():
    r = torch.tensor([[0.2, 0.2, -0.1, 9.0]])
    mask = torch.tensor([[True, True, True, False]])
    sigma = credit.reweight_coefficients(r, mask, torch.ones(1, 4), torch.ones(1), "rank")
    # ranks 2.5, 2.5, 1 over 3 tokens -> scaled to mean 1
    torch.testing.assert_close(sigma, torch.tensor([[2.5, 2.5, 1.0, 0.0]]) * 3 / 6)


def test_bad_rule_and_temperature_are_named():
    with pytest.raises(ValueError, match="valid: softmax, linear, rank"):
        credit.reweight_coefficients(
            torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), torch.ones(1), "cubic"
        )
    with pytest.raises(ValueError, match="credit.form='reweighted' must be"):
        CreditConfig(form="reweighted")
    with pytest.raises(ValueError, match="credit.reweight.rule"):
        ReweightConfig(rule="cubic")


class _FixedValues(CreditMethod):
    """A value source that returns given values, with the hand-over weight given."""

    name = "fixed"

    def __init__(self, config, values, mask, w):
        super().__init__(config, CreditContext(policy=None, tokenizer=None))
        self._v, self._m, self._w = values, mask, w

    def estimate(self, rows):
        return Estimate(Values(self._v, self._m, lam=self.lam, handover_weight=self._w))


def test_the_method_path_applies_the_form_and_scales_as_grpo():
    segment_ids, response_mask, value_mask = _layout()
    values = _random_values(value_mask, seed=3)
    grpo = _uniform_advantages(segment_ids, response_mask)
    config = CreditConfig(form="reweight")
    method = _FixedValues(config, values, value_mask, 0.0)
    rows = CreditRows.from_tensors(REWARDS, GROUPS, segment_ids, response_mask)
    out = method.credit_output(rows, method.estimate(rows), segment_ids, response_mask)
    assert torch.equal(out.advantages, grpo)  # w = 0: GRPO exactly, with GRPO's group std
    moved = _FixedValues(config, values, value_mask, 1.0)
    out = moved.credit_output(rows, moved.estimate(rows), segment_ids, response_mask)
    assert not torch.equal(out.advantages, grpo)
    assert bool((out.advantages * grpo >= 0).all())  # never a flipped sign
    # each trace keeps GRPO's total over its tokens
    torch.testing.assert_close(out.advantages.sum(1), grpo.sum(1))
    # uniform ignores the form
    uni = UniformCredit(config, CreditContext(policy=None, tokenizer=None))
    est = Estimate(Values(*_uniform_values(), lam=1.0))
    assert torch.equal(uni.credit_output(rows, est, segment_ids, response_mask).advantages, grpo)


def _uniform_values():
    return uniform_values(REWARDS, GROUPS, torch.tensor([len(b) - 1 for b in BOUNDS]))


def test_credit_bench_compares_reweight_as_grpo_times_sigma():
    from rredcot.explain.scores import comparison_advantages
    from rredcot.methods.base import CreditOutput
    from rredcot.sampling.batch import RolloutBatch

    segment_ids, response_mask, value_mask = _layout()
    values = _random_values(value_mask, seed=5)
    batch = RolloutBatch(
        input_ids=torch.zeros(6, 10, dtype=torch.long),
        attention_mask=torch.ones(6, 10, dtype=torch.long),
        prompt_len=1,
        response_mask=response_mask.float(),
        rewards=REWARDS,
        group_ids=GROUPS,
        boundaries=BOUNDS,
        segment_ids=segment_ids,
    )
    out = CreditOutput(
        advantages=torch.zeros(6, 9),
        segment_advantages=torch.zeros(6, 3),
        segment_mask=value_mask[:, 1:],
        values=values,
        value_mask=value_mask,
    )
    method = _FixedValues(CreditConfig(form="reweight"), values, value_mask, 0.0)
    adv = comparison_advantages(out, REWARDS, 0.0, method, batch)
    grpo = (REWARDS - normalization.group_mean_std(REWARDS, GROUPS)[0]).double()
    assert bool((adv * grpo[:, None] >= 0).all())  # GRPO's sign on every segment
    lengths = credit.segment_token_counts(segment_ids, response_mask, 3).double()
    torch.testing.assert_close((adv * lengths).sum(1), grpo * lengths.sum(1))
    # the redistribute form is compared through its values at the comparison lambda
    plain = _FixedValues(CreditConfig(), values, value_mask, 0.0)
    redistributed = comparison_advantages(out, REWARDS, 0.0, plain, batch)
    assert not torch.allclose(adv, redistributed)
