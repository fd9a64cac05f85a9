"""Tests of the credit algebra (src/rredcot/algebra/credit.py) against python-loop references."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import credit_reference
from credit_reference import grpo_advantages, token_advantages_from_values
from rredcot.algebra import credit, normalization, shared_prefixes
from rredcot.algebra.credit import (
    redistribute,
    segment_advantages_from_values,
    segment_gae,
    weights_to_segment_rewards,
)
from rredcot.algebra.layout import boundaries_to_segment_ids, segments_to_tokens
from rredcot.algebra.normalization import (
    get_normalizer,
    group_mean_std,
    masked_mean,
    masked_var,
    masked_whiten,
    normalize_advantages,
    register_normalizer,
)

F64 = torch.float64
PROPS = settings(max_examples=40, deadline=None)
finite = st.floats(-3.0, 3.0, allow_nan=False, allow_infinity=False)


# --------------------------------------------------------------------------------------
# Random padded batches and python references
# --------------------------------------------------------------------------------------


@st.composite
def value_batches(draw, max_b: int = 5, max_s: int = 6):
    """A padded batch: n_b segments per row, values V(s_0..s_S), rewards, token boundaries."""
    b = draw(st.integers(1, max_b))
    s = draw(st.integers(0, max_s))
    n = [draw(st.integers(0, s)) for _ in range(b)]
    values = [[draw(finite) for _ in range(s + 1)] for _ in range(b)]
    rewards = [draw(finite) for _ in range(b)]
    boundaries = []
    for n_b in n:
        lengths = [draw(st.integers(1, 4)) for _ in range(n_b)]
        boundaries.append([0] + [sum(lengths[: i + 1]) for i in range(n_b)])
    t = max(bounds[-1] for bounds in boundaries) + draw(st.integers(0, 3))
    return {"n": n, "values": values, "rewards": rewards, "boundaries": boundaries, "T": t}


def as_tensors(batch, dtype=F64):
    n = batch["n"]
    s1 = len(batch["values"][0])
    values = torch.tensor(batch["values"], dtype=dtype)
    value_mask = torch.arange(s1)[None, :] <= torch.tensor(n)[:, None]
    rewards = torch.tensor(batch["rewards"], dtype=dtype)
    lengths = torch.tensor([bounds[-1] for bounds in batch["boundaries"]])
    response_mask = torch.arange(batch["T"])[None, :] < lengths[:, None]
    return values, value_mask, rewards, response_mask


def ref_rewards(values_row, n, reward):
    v = list(values_row[: n + 1])
    v[n] = reward
    return [v[k] - v[k - 1] for k in range(1, n + 1)]


def ref_gae(r, lam):
    return [sum(lam ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))]


def trl_grpo_reference(rewards, num_generations, scale_rewards):
    """TRL 1.16 GRPOTrainer._generate_and_score_completions ('sum_then_normalize'), verbatim
    apart from reading rewards directly; groups are contiguous blocks of num_generations."""

    def nanstd(tensor, dim=None):  # trl.trainer.utils.nanstd
        mean = torch.nanmean(tensor, dim=dim, keepdim=True)
        variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
        count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
        correction = count / (count - 1)
        correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
        variance *= correction
        std = torch.sqrt(variance)
        return std.squeeze(dim) if dim is not None else std.squeeze()

    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        if num_generations > 1:
            std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
            std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
        else:
            std_rewards = torch.zeros_like(rewards)
    else:
        std_rewards = nanstd(rewards).expand_as(rewards)
    advantages = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        advantages = advantages / (std_rewards + 1e-4)
    return torch.nan_to_num(advantages, nan=0.0)


# --------------------------------------------------------------------------------------
# redistribute / segment_gae
# --------------------------------------------------------------------------------------


@PROPS
@given(value_batches())
def test_redistribute_matches_loop_and_telescopes(batch):
    values, value_mask, rewards, _ = as_tensors(batch)
    seg_rewards, seg_mask = redistribute(values, value_mask, rewards)
    s = values.shape[1] - 1
    assert seg_rewards.shape == seg_mask.shape == (len(batch["n"]), s)
    for b, n_b in enumerate(batch["n"]):
        ref = ref_rewards(batch["values"][b], n_b, batch["rewards"][b])
        assert seg_mask[b].tolist() == [True] * n_b + [False] * (s - n_b)
        assert seg_rewards[b, :n_b].tolist() == ref
        assert seg_rewards[b, n_b:].tolist() == [0.0] * (s - n_b)
        expected_sum = batch["rewards"][b] - batch["values"][b][0] if n_b else 0.0
        assert math.isclose(float(seg_rewards[b].sum()), expected_sum, abs_tol=1e-12)


@PROPS
@given(value_batches(), st.floats(-2.0, 2.0))
def test_anchored_values_telescope_to_the_baseline(batch, shift):
    """Anchoring moves V(s_0) to the baseline, keeps the increments, and ignores any per-row
    offset of the estimates (a wrong guess of how hard the prompt is)."""
    values, value_mask, rewards, _ = as_tensors(batch)
    baseline = rewards.flip(0) * 0.5
    anchored = credit.anchor_values(values, value_mask, baseline)
    offset = credit.anchor_values(values + shift, value_mask, baseline)
    torch.testing.assert_close(offset, anchored, rtol=0, atol=1e-9)
    seg_rewards, _ = redistribute(anchored, value_mask, rewards)
    for b, n_b in enumerate(batch["n"]):
        assert float(anchored[b, 0]) == float(baseline[b])
        assert anchored[b, n_b + 1 :].tolist() == [0.0] * (values.shape[1] - n_b - 1)
        expected_sum = float(rewards[b] - baseline[b]) if n_b else 0.0
        assert math.isclose(float(seg_rewards[b].sum()), expected_sum, abs_tol=1e-9)
        raw, _ = redistribute(values, value_mask, rewards)
        # every segment but the last keeps the estimator's own increment
        torch.testing.assert_close(seg_rewards[b, : n_b - 1], raw[b, : n_b - 1], rtol=0, atol=1e-9)


@PROPS
@given(value_batches(), st.floats(0.0, 1.0))
def test_segment_gae_matches_loop(batch, lam):
    values, value_mask, rewards, _ = as_tensors(batch)
    adv, seg_mask, seg_rewards = segment_advantages_from_values(values, value_mask, rewards, lam)
    for b, n_b in enumerate(batch["n"]):
        ref = ref_gae(ref_rewards(batch["values"][b], n_b, batch["rewards"][b]), lam)
        torch.testing.assert_close(adv[b, :n_b], torch.tensor(ref, dtype=F64), rtol=0, atol=1e-12)
        assert adv[b, n_b:].tolist() == [0.0] * (adv.shape[1] - n_b)


@PROPS
@given(value_batches())
def test_lambda_extremes(batch):
    values, value_mask, rewards, _ = as_tensors(batch)
    seg_rewards, seg_mask = redistribute(values, value_mask, rewards)
    assert torch.equal(segment_gae(seg_rewards, seg_mask, 0.0), seg_rewards)  # A_k = r_k
    adv1 = segment_gae(seg_rewards, seg_mask, 1.0)
    for b, n_b in enumerate(batch["n"]):
        # A_k = R - V(s_(k-1)) for k = 1..n
        expected = [batch["rewards"][b] - batch["values"][b][k - 1] for k in range(1, n_b + 1)]
        torch.testing.assert_close(
            adv1[b, :n_b], torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12
        )


def test_segment_gae_small_worked_example():
    # V = 0.5, 0.6, 0.2, (R = 1): r = 0.1, -0.4, 0.8; lam = 0.5: A = 0.1 - 0.2 + 0.2, -0.4 + 0.4, 0.8
    values = torch.tensor([[0.5, 0.6, 0.2, 123.0]], dtype=F64)
    mask = torch.ones_like(values, dtype=torch.bool)
    adv, _, r = segment_advantages_from_values(values, mask, torch.tensor([1.0], dtype=F64), 0.5)
    torch.testing.assert_close(r, torch.tensor([[0.1, -0.4, 0.8]], dtype=F64))
    torch.testing.assert_close(adv, torch.tensor([[0.1, 0.0, 0.8]], dtype=F64))


# --------------------------------------------------------------------------------------
# segments <-> tokens
# --------------------------------------------------------------------------------------


@PROPS
@given(value_batches(), st.data())
def test_segment_ids_cover_every_token_once(batch, data):
    ids = boundaries_to_segment_ids(batch["boundaries"], batch["T"])
    assert ids.shape == (len(batch["n"]), batch["T"]) and ids.dtype == torch.long
    for b, bounds in enumerate(batch["boundaries"]):
        row = ids[b].tolist()
        for k in range(1, len(bounds)):  # segment k-1 is exactly tokens [b_(k-1), b_k)
            assert [t for t, i in enumerate(row) if i == k - 1] == list(
                range(bounds[k - 1], bounds[k])
            )
        assert row[bounds[-1] :] == [-1] * (batch["T"] - bounds[-1])
        assert all(0 <= i < len(bounds) - 1 for i in row[: bounds[-1]])

    # segments_to_tokens against a loop, with an arbitrary (not necessarily prefix) mask
    s = max(1, max(batch["n"]))
    seg_values = torch.tensor(
        [[data.draw(finite) for _ in range(s)] for _ in batch["n"]], dtype=F64
    )
    mask = torch.tensor(
        [[data.draw(st.booleans()) for _ in range(batch["T"])] for _ in batch["n"]],
        dtype=torch.bool,
    ).reshape(len(batch["n"]), batch["T"])
    tokens = segments_to_tokens(seg_values, ids, mask)
    for b in range(len(batch["n"])):
        for t in range(batch["T"]):
            i = int(ids[b, t])
            expected = float(seg_values[b, i]) if mask[b, t] and i >= 0 else 0.0
            assert float(tokens[b, t]) == expected


# --------------------------------------------------------------------------------------
# padding never leaks
# --------------------------------------------------------------------------------------


@PROPS
@given(value_batches(), st.floats(0.0, 1.0), st.sampled_from(["none", "batch_std", "whiten"]))
def test_padding_never_leaks(batch, lam, normalization):
    values, value_mask, rewards, response_mask = as_tensors(batch)
    ids = boundaries_to_segment_ids(batch["boundaries"], batch["T"])

    def run(v):
        seg_rewards, seg_mask = redistribute(v, value_mask, rewards)
        seg_adv = segment_gae(seg_rewards, seg_mask, lam)
        tokens = token_advantages_from_values(
            v, value_mask, rewards, ids, response_mask, lam, normalization
        )
        return seg_rewards, seg_adv, tokens

    clean = run(values)
    # garbage in the padding, and in V(s_n) (which is overwritten by R)
    garbage = values.clone()
    garbage[~value_mask] = float("nan")
    n = torch.tensor(batch["n"])
    garbage[torch.arange(len(n)), n] = 1e30
    dirty = run(garbage)
    for a, b in zip(clean, dirty):
        assert torch.equal(a, b)
    seg_mask = value_mask[:, 1:]
    assert torch.all(clean[0][~seg_mask] == 0) and torch.all(clean[1][~seg_mask] == 0)
    assert torch.all(clean[2][~response_mask] == 0)
    assert torch.isfinite(clean[2]).all()


def test_padding_of_tokens_does_not_leak_into_normalizers():
    adv = torch.tensor([[1.0, -1.0, 0.5, 0.0]], dtype=F64).repeat(2, 1)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0], dtype=F64)
    groups = torch.tensor([0, 0])
    for mode in ["none", "batch_std", "whiten", "group_std"]:
        clean = normalize_advantages(adv, mask, rewards, groups, mode)
        dirty = normalize_advantages(
            adv.masked_fill(~mask, float("nan")), mask, rewards, groups, mode
        )
        assert torch.equal(clean, dirty), mode
        assert torch.all(clean[~mask] == 0), mode


# --------------------------------------------------------------------------------------
# group statistics and GRPO
# --------------------------------------------------------------------------------------


@PROPS
@given(
    st.lists(st.lists(finite, min_size=1, max_size=5), min_size=1, max_size=5),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_group_mean_std_matches_loop(groups, leave_one_out, rnd):
    rows = [(g, r) for g, rs in enumerate(groups) for r in rs]
    rnd.shuffle(rows)  # groups need not be contiguous
    group_ids = torch.tensor([10 * g + 3 for g, _ in rows])
    rewards = torch.tensor([r for _, r in rows], dtype=F64)
    mean, std = group_mean_std(rewards, group_ids, leave_one_out=leave_one_out)
    for i, (g, r) in enumerate(rows):
        members = groups[g]
        m = sum(members) / len(members)
        if leave_one_out:
            m = (sum(members) - r) / (len(members) - 1) if len(members) > 1 else r
        var = (
            sum((x - sum(members) / len(members)) ** 2 for x in members) / (len(members) - 1)
            if len(members) > 1
            else 0.0
        )
        assert math.isclose(float(mean[i]), m, rel_tol=1e-12, abs_tol=1e-12)
        assert math.isclose(float(std[i]), math.sqrt(var), rel_tol=1e-9, abs_tol=1e-9)


@pytest.mark.parametrize("scale_rewards", ["group", "batch", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grpo_matches_trl(scale_rewards, dtype):
    gen = torch.Generator().manual_seed(0)
    num_generations, num_prompts = 4, 6
    rewards = torch.rand(num_prompts * num_generations, generator=gen, dtype=dtype)
    rewards[:4] = 1.0  # a zero-variance group
    rewards[4:8] = torch.tensor([0.0, 1.0, 1.0, 0.0], dtype=dtype)  # a binary group
    group_ids = torch.arange(num_prompts).repeat_interleave(num_generations)
    lengths = torch.randint(0, 7, (rewards.numel(),), generator=gen)
    mask = torch.arange(6)[None, :] < lengths[:, None]
    ours = grpo_advantages(rewards, group_ids, mask, scale_rewards=scale_rewards)
    ref = trl_grpo_reference(rewards, num_generations, scale_rewards)
    assert ours.dtype == dtype
    # TRL's nanstd computes Bessel's factor count / (count - 1) from integer counts, i.e. in
    # float32 even for float64 rewards: agreement there is to float32 precision only.
    tol = {"rtol": 1e-7, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 0, "atol": 1e-6}
    torch.testing.assert_close(ours, torch.where(mask, ref[:, None], 0.0), **tol)
    # the same rows, shuffled, give the same advantages row by row
    perm = torch.randperm(rewards.numel(), generator=gen)
    shuffled = grpo_advantages(rewards[perm], group_ids[perm], mask[perm], scale_rewards)
    torch.testing.assert_close(shuffled, ours[perm], rtol=0, atol=1e-12 if dtype == F64 else 1e-6)
    # TRL's boolean spellings
    if scale_rewards != "batch":
        flag = scale_rewards == "group"
        assert torch.equal(grpo_advantages(rewards, group_ids, mask, scale_rewards=flag), ours)


def test_grpo_zero_variance_and_singleton_groups_give_zero():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.7])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 2])  # all-correct, all-wrong, a singleton
    mask = torch.ones(6, 3, dtype=torch.bool)
    for scale in ["group", "batch", "none"]:
        for loo in [False, True]:
            adv = grpo_advantages(rewards, group_ids, mask, scale_rewards=scale, leave_one_out=loo)
            assert torch.equal(adv, torch.zeros(6, 3)), (scale, loo)
    with pytest.raises(ValueError, match="'group', 'batch', 'none'"):
        grpo_advantages(rewards, group_ids, mask, scale_rewards="std")


def test_grpo_leave_one_out_baseline():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=F64)
    group_ids = torch.zeros(4, dtype=torch.long)
    mask = torch.ones(4, 1, dtype=torch.bool)
    adv = grpo_advantages(rewards, group_ids, mask, scale_rewards="none", leave_one_out=True)
    # RLOO: R_i - mean of the other three
    assert adv[:, 0].tolist() == pytest.approx([1 - 1 / 3, -2 / 3, -2 / 3, 1 - 1 / 3])


@PROPS
@given(
    st.integers(1, 4),
    st.integers(1, 5),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_uniform_credit_equals_grpo_exactly(num_prompts, group_size, binary, rnd):
    """values = group mean reward at every boundary, lam = 1, group_std == GRPO, bit for bit."""
    b = num_prompts * group_size
    if binary:  # includes all-agree groups (zero std)
        rewards = torch.tensor([float(rnd.random() < 0.5) for _ in range(b)], dtype=F64)
    else:
        rewards = torch.tensor([rnd.uniform(-1, 1) for _ in range(b)], dtype=F64)
    if rnd.random() < 0.3:  # one prompt whose samples all agree
        rewards[:group_size] = 1.0
    group_ids = torch.arange(num_prompts).repeat_interleave(group_size)
    perm = torch.tensor(rnd.sample(range(b), b))
    rewards, group_ids = rewards[perm], group_ids[perm]

    n = [rnd.randint(0, 4) for _ in range(b)]
    boundaries = []
    for n_b in n:
        cuts = sorted(rnd.sample(range(1, 12), n_b))
        boundaries.append([0] + cuts)
    t = max(bounds[-1] for bounds in boundaries) + 1
    segment_ids = boundaries_to_segment_ids(boundaries, t)
    response_mask = torch.arange(t)[None, :] < torch.tensor([x[-1] for x in boundaries])[:, None]

    mean, _ = group_mean_std(rewards, group_ids)
    value_mask = torch.arange(5)[None, :] <= torch.tensor(n)[:, None]
    values = mean[:, None].expand(b, 5).clone()

    uniform = token_advantages_from_values(
        values, value_mask, rewards, segment_ids, response_mask, 1.0, "group_std", group_ids
    )
    grpo = grpo_advantages(rewards, group_ids, response_mask, scale_rewards="group")
    assert torch.equal(uniform, grpo)
    assert torch.isfinite(uniform).all()


# --------------------------------------------------------------------------------------
# masked statistics and normalizers
# --------------------------------------------------------------------------------------


def test_masked_statistics():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, -7.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    kept = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0], dtype=F64)
    assert float(masked_mean(x, mask)) == pytest.approx(3.0)
    assert float(masked_var(x, mask)) == pytest.approx(float(kept.var()))
    assert float(masked_var(x, mask, unbiased=False)) == pytest.approx(
        float(kept.var(unbiased=False))
    )
    assert masked_mean(x, mask, dim=1).tolist() == pytest.approx([2.0, 4.5])
    assert masked_var(x, mask, dim=1).tolist() == pytest.approx([1.0, 0.5])
    # no valid entries, or one: 0, not NaN
    none = torch.zeros_like(mask)
    assert float(masked_mean(x, none)) == 0.0 and float(masked_var(x, none)) == 0.0
    one = torch.zeros_like(mask)
    one[0, 0] = True
    assert float(masked_var(x, one)) == 0.0
    assert torch.equal(masked_whiten(x, one), torch.zeros_like(x))
    with pytest.raises(ValueError, match="mask"):
        masked_mean(x, mask[:, :2])


@PROPS
@given(value_batches(max_b=6), st.booleans())
def test_whiten_gives_mean_zero_std_one(batch, shift_mean):
    values, value_mask, rewards, response_mask = as_tensors(batch)
    adv = torch.randn(response_mask.shape, dtype=F64, generator=torch.Generator().manual_seed(1))
    out = masked_whiten(adv, response_mask, shift_mean=shift_mean)
    assert torch.all(out[~response_mask] == 0)
    if int(response_mask.sum()) >= 2 and float(masked_var(adv, response_mask)) > 1e-3:
        mean = float(masked_mean(adv, response_mask))
        expected_mean = 0.0 if shift_mean else mean
        assert float(masked_mean(out, response_mask)) == pytest.approx(expected_mean, abs=1e-9)
        centered = out - (0.0 if shift_mean else mean)
        # whitening divides by sqrt(var + eps), eps = 1e-8: the variance is var / (var + eps)
        var = float(masked_var(adv, response_mask))
        assert float(masked_var(centered, response_mask)) == pytest.approx(
            var / (var + 1e-8), rel=1e-6
        )
        via_registry = normalize_advantages(adv, response_mask, rewards, None, "whiten")
        assert torch.equal(via_registry, masked_whiten(adv, response_mask))


def test_batch_std_uses_rows_and_floors_zero_variance():
    adv = torch.tensor([[0.3, 0.3, 0.0], [-0.2, 0.0, 0.0], [0.1, 0.1, 0.1]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    rewards = torch.tensor([1.0, 0.0, 0.0], dtype=F64)
    out = normalize_advantages(adv, mask, rewards, None, "batch_std")
    expected = torch.where(mask, adv / (rewards.std() + 1e-4), 0.0)  # std over rows, not tokens
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    # all rewards agree: the floor (0.1) caps the scale at x ~10, not x 10^4
    constant = torch.zeros(3, dtype=F64)
    out = normalize_advantages(adv, mask, constant, None, "batch_std")
    torch.testing.assert_close(out, torch.where(mask, adv / (0.1 + 1e-4), 0.0), rtol=0, atol=1e-12)
    assert float(out.abs().max()) < 3.0
    # a single row has no std: the floor applies as well
    out1 = normalize_advantages(adv[:1], mask[:1], rewards[:1], None, "batch_std", min_std=0.5)
    torch.testing.assert_close(out1, torch.where(mask[:1], adv[:1] / (0.5 + 1e-4), 0.0))


def test_group_std_blows_up_value_credit_without_floor():
    """docs/method.md, failure modes: value-based credit in a zero-std group is multiplied by 1/eps."""
    adv = torch.tensor([[0.3], [-0.2], [0.5], [-0.5]], dtype=F64)
    mask = torch.ones(4, 1, dtype=torch.bool)
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0], dtype=F64)
    group_ids = torch.tensor([0, 0, 1, 1])
    out = normalize_advantages(adv, mask, rewards, group_ids, "group_std")
    torch.testing.assert_close(out[:2], adv[:2] / 1e-4)  # the blow-up the floor exists for
    torch.testing.assert_close(out[2:], adv[2:] / (math.sqrt(0.5) + 1e-4))
    floored = normalize_advantages(adv, mask, rewards, group_ids, "group_std", min_std=0.1)
    torch.testing.assert_close(floored[:2], adv[:2] / (0.1 + 1e-4))
    torch.testing.assert_close(floored[2:], out[2:])  # groups above the floor are unchanged
    with pytest.raises(ValueError, match="group_ids"):
        normalize_advantages(adv, mask, rewards, None, "group_std")


def test_group_or_batch_std_is_grpo_where_safe():
    """Groups with spread-out rewards are scaled by their own std (as GRPO), groups whose rewards
    agree by the batch's std, never by eps."""
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    adv = torch.tensor([[0.2, 0.1], [-0.3, 0.0], [0.5, 0.5], [-0.5, -0.5]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]])
    out = normalize_advantages(adv, mask, rewards, group_ids, "group_or_batch_std")
    batch_std = float(rewards.std())
    grpo = normalize_advantages(adv, mask, rewards, group_ids, "group_std")
    torch.testing.assert_close(out[2:], grpo[2:])  # group 1 (std 0.707): GRPO's scaling
    torch.testing.assert_close(out[:2], adv[:2] * mask[:2] / (batch_std + 1e-4))
    same = torch.ones(4)  # every reward equal: the batch std is 0, floored at 0.1
    torch.testing.assert_close(
        normalize_advantages(adv, mask, same, group_ids, "group_or_batch_std"),
        adv * mask / (0.1 + 1e-4),
    )
    with pytest.raises(ValueError, match="group_ids"):
        normalize_advantages(adv, mask, rewards, None, "group_or_batch_std")


@pytest.mark.parametrize("kind", ["binary", "continuous", "small_spread"])
@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_handover_weight_zero_is_grpo_at_any_reward_scale(kind, dtype):
    """At w = 0 value credit under group_or_batch_std equals uniform (GRPO) credit bit for bit,
    whatever the rewards' scale; a group whose std is below credit.agreeing_std (0.016 here)
    keeps GRPO's scaling of GRPO's share, and only value credit falls back to the batch std."""
    gen = torch.Generator().manual_seed(0)
    G, P = 8, 4
    if kind == "binary":
        rewards = (torch.rand(P * G, generator=gen) < 0.5).to(dtype)
        rewards[:G] = 1.0  # an agreeing group
    elif kind == "continuous":
        rewards = torch.rand(P * G, generator=gen, dtype=dtype)
    else:  # group std ~0.016, as a shaped reward on an untrained policy gives
        rewards = 0.5 + 0.016 * torch.randn(P * G, generator=gen, dtype=dtype)
    group_ids = torch.arange(P).repeat_interleave(G)
    n = torch.randint(1, 5, (P * G,), generator=gen)
    boundaries = [[0, *range(3, 3 * int(k) + 1, 3)] for k in n]
    T = 3 * int(n.max()) + 2
    segment_ids = boundaries_to_segment_ids(boundaries, T)
    response_mask = segment_ids >= 0
    value_mask = torch.arange(int(n.max()) + 1)[None, :] <= n[:, None]
    values = torch.rand(value_mask.shape, generator=gen, dtype=dtype)
    mean, _ = group_mean_std(rewards, group_ids)
    uniform = credit_reference.token_credit(
        credit.Values(mean[:, None].expand_as(values).clone(), value_mask, lam=1.0),
        rewards,
        group_ids,
        segment_ids,
        response_mask,
        "group_std",
    ).advantages
    grpo = grpo_advantages(rewards, group_ids, response_mask, scale_rewards="group")
    assert torch.equal(uniform, grpo)

    def blended(w, lam=0.5):
        est = credit.Values(
            credit.anchor_values(values, value_mask, mean), value_mask, lam=lam, handover_weight=w
        )
        out = credit_reference.token_credit(
            est,
            rewards,
            group_ids,
            segment_ids,
            response_mask,
            "group_or_batch_std",
            min_std=0.1,
        )
        return out.advantages

    assert torch.equal(blended(0.0), uniform)
    # the value head's shared-prefix values with nothing shared and no trust (w = 0 enters as
    # the fallback weight, lam 1 at every unknown boundary): GRPO too
    counts = torch.ones_like(value_mask, dtype=torch.long)
    counts[:, 0] = G
    shared, lam = shared_prefixes.combine_shared_prefix(
        mean[:, None].expand_as(values), counts, values, value_mask, 0.0
    )
    prefix = credit_reference.token_credit(
        credit.Values(shared, value_mask, lam=lam),
        rewards,
        group_ids,
        segment_ids,
        response_mask,
        "group_or_batch_std",
        min_std=0.1,
    ).advantages
    assert torch.equal(prefix, uniform)
    # TRL's scale_rewards="batch" (batch_std): GRPO's share by the batch's std, unfloored
    batch_grpo = grpo_advantages(rewards, group_ids, response_mask, scale_rewards="batch")
    for est in (
        credit.Values(mean[:, None].expand_as(values).clone(), value_mask, lam=1.0),  # uniform
        credit.Values(
            credit.anchor_values(values, value_mask, mean), value_mask, lam=0.5, handover_weight=0.0
        ),
    ):
        out = credit_reference.token_credit(
            est, rewards, group_ids, segment_ids, response_mask, "batch_std"
        ).advantages
        assert torch.equal(out, batch_grpo)
    # continuous in w: a small weight stays near GRPO (the old rule jumped to the batch std)
    step = (blended(1e-3) - uniform).abs().max()
    assert step < 1e-2 * uniform.abs().max()


def test_normalizer_registry():
    with pytest.raises(ValueError, match="batch_std.*group_or_batch_std.*group_std.*none.*whiten"):
        get_normalizer("batch-std")
    with pytest.raises(
        ValueError, match="valid: batch_std, group_or_batch_std, group_std, none, whiten"
    ):
        normalize_advantages(torch.zeros(1, 1), torch.ones(1, 1), torch.zeros(1), None, "std")
    with pytest.raises(ValueError, match="already registered"):
        register_normalizer("whiten")(lambda *a, **k: a[0])

    @register_normalizer("_test_half")
    def half(rewards, group_ids, *, eps=0.0, min_std=0.0):
        return normalization.Scale(divisor=torch.full_like(rewards, 2.0))

    try:
        out = normalize_advantages(
            torch.ones(1, 2), torch.tensor([[1, 0]]), torch.zeros(1), None, "_test_half"
        )
        assert out.tolist() == [[0.5, 0.0]]
    finally:
        del normalization._NORMALIZERS["_test_half"]


# --------------------------------------------------------------------------------------
# attribution weights
# --------------------------------------------------------------------------------------


@PROPS
@given(value_batches(), st.data())
def test_weights_to_segment_rewards(batch, data):
    values, value_mask, rewards, _ = as_tensors(batch)
    seg_mask = value_mask[:, 1:]
    s = seg_mask.shape[1]
    weights = torch.tensor(
        [[data.draw(st.floats(0.0, 5.0)) for _ in range(s)] for _ in batch["n"]], dtype=F64
    ).reshape(len(batch["n"]), s)
    baseline = values[:, 0]
    r = weights_to_segment_rewards(
        weights.masked_fill(~seg_mask, -7.0), seg_mask, rewards, baseline
    )
    for b, n_b in enumerate(batch["n"]):
        assert r[b, n_b:].tolist() == [0.0] * (s - n_b)
        if n_b == 0:
            continue
        credit_b = batch["rewards"][b] - batch["values"][b][0]
        assert float(r[b].sum()) == pytest.approx(credit_b, abs=1e-9)
        w = weights[b, :n_b].tolist()
        w = [x / sum(w) for x in w] if sum(w) > 0 else [1 / n_b] * n_b
        torch.testing.assert_close(
            r[b, :n_b], torch.tensor(w, dtype=F64) * credit_b, rtol=1e-9, atol=1e-12
        )


def test_weights_validation_and_uniform_fallback():
    seg_mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    r = weights_to_segment_rewards(
        torch.zeros(1, 4), seg_mask, torch.tensor([1.0]), torch.tensor([0.25])
    )
    torch.testing.assert_close(r, torch.tensor([[0.25, 0.25, 0.25, 0.0]]))
    # tiny (subnormal) and huge weights still renormalise to sum 1 (found by hypothesis)
    for scale in [1e-300, 1e300]:
        r = weights_to_segment_rewards(
            torch.tensor([[3.0, 1.0, 0.0, 9.0]], dtype=F64) * scale,
            seg_mask,
            torch.tensor([1.0], dtype=F64),
            torch.tensor([0.0], dtype=F64),
        )
        torch.testing.assert_close(r, torch.tensor([[0.75, 0.25, 0.0, 0.0]], dtype=F64))
    for bad in [-0.1, float("nan"), float("inf")]:
        with pytest.raises(ValueError, match=">= 0"):
            weights_to_segment_rewards(
                torch.tensor([[0.5, bad, 0.5, 0.0]]), seg_mask, torch.ones(1), torch.zeros(1)
            )


# --------------------------------------------------------------------------------------
# the entry point, dtypes, errors
# --------------------------------------------------------------------------------------


@PROPS
@given(value_batches(), st.floats(0.0, 1.0))
def test_token_advantages_is_the_composition(batch, lam):
    values, value_mask, rewards, response_mask = as_tensors(batch)
    ids = boundaries_to_segment_ids(batch["boundaries"], batch["T"])
    out = token_advantages_from_values(values, value_mask, rewards, ids, response_mask, lam, "none")
    for b, bounds in enumerate(batch["boundaries"]):
        adv = ref_gae(ref_rewards(batch["values"][b], batch["n"][b], batch["rewards"][b]), lam)
        expected = [adv[int(ids[b, t])] if t < bounds[-1] else 0.0 for t in range(batch["T"])]
        torch.testing.assert_close(out[b], torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)


def test_float32_works_and_matches_float64():
    gen = torch.Generator().manual_seed(3)
    values = torch.rand(4, 5, generator=gen, dtype=F64)
    n = torch.tensor([4, 2, 0, 3])
    value_mask = torch.arange(5)[None, :] <= n[:, None]
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64)
    boundaries = [[0, 2, 3, 5, 8], [0, 4, 6], [0], [0, 1, 2, 3]]
    ids = boundaries_to_segment_ids(boundaries, 9)
    mask = ids >= 0
    group_ids = torch.tensor([0, 0, 1, 1])
    for mode in ["none", "batch_std", "whiten", "group_std"]:
        out64 = token_advantages_from_values(
            values, value_mask, rewards, ids, mask, 0.7, mode, group_ids, min_std=0.1
        )
        out32 = token_advantages_from_values(
            values.float(),
            value_mask,
            rewards.float(),
            ids,
            mask,
            0.7,
            mode,
            group_ids,
            min_std=0.1,
        )
        assert out32.dtype == torch.float32 and out64.dtype == F64
        torch.testing.assert_close(out32.double(), out64, rtol=1e-5, atol=1e-5)
    # integer / float masks and integer rewards are accepted
    out = token_advantages_from_values(
        values.float(),
        value_mask.long(),
        torch.tensor([1, 0, 1, 0]),
        ids,
        mask.float(),
        0.0,
        "none",
    )
    assert out.dtype == torch.float32 and torch.all(out[~mask] == 0)


def test_clear_errors():
    values = torch.zeros(2, 3)
    good_mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    rewards = torch.zeros(2)
    with pytest.raises(ValueError, match=r"value_mask must have shape \(B, S\+1\)"):
        redistribute(values, good_mask[:, :2], rewards)
    with pytest.raises(ValueError, match=r"rewards must have shape \(B,\)"):
        redistribute(values, good_mask, torch.zeros(3))
    with pytest.raises(ValueError, match=r"values must have shape \(B, S\+1\)"):
        redistribute(torch.zeros(2), good_mask, rewards)
    with pytest.raises(ValueError, match="prefix mask"):
        redistribute(values, torch.tensor([[1, 0, 1], [1, 1, 1]], dtype=torch.bool), rewards)
    with pytest.raises(ValueError, match="at least one True per row"):
        redistribute(values, torch.tensor([[0, 0, 0], [1, 1, 1]], dtype=torch.bool), rewards)
    seg_rewards, seg_mask = redistribute(values, good_mask, rewards)
    for lam in [-0.1, 1.5, float("nan")]:
        with pytest.raises(ValueError, match=r"lam must be in \[0, 1\]"):
            segment_gae(seg_rewards, seg_mask, lam)
    with pytest.raises(TypeError, match="lam"):
        segment_gae(seg_rewards, seg_mask, "0.5")
    with pytest.raises(ValueError, match="prefix mask"):
        segment_gae(seg_rewards, torch.tensor([[0, 1], [1, 1]]), 0.5)
    with pytest.raises(ValueError, match="unknown advantage normalization 'std'"):
        token_advantages_from_values(
            values,
            good_mask,
            rewards,
            torch.zeros(2, 1, dtype=torch.long),
            torch.ones(2, 1),
            0.5,
            "std",
        )
    # segment ids built from other boundaries than the values
    ids = boundaries_to_segment_ids([[0, 2], [0, 2]], 2)
    with pytest.raises(
        ValueError, match="row 1: segment_ids use 1 segments but value_mask gives 2"
    ):
        token_advantages_from_values(values, good_mask, rewards, ids, ids >= 0, 0.5, "none")
    with pytest.raises(ValueError, match="rewards must be finite"):
        group_mean_std(torch.tensor([1.0, float("nan")]), torch.tensor([0, 0]))
    with pytest.raises(TypeError, match="group_ids must be an integer"):
        group_mean_std(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]))
