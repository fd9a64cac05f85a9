"""continuation_likelihood: the lower bound, log-probs against a plain forward, the guards."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import credit_reference
from metrics_doc import undocumented
from rredcot.algebra import credit
from rredcot.config import CreditConfig
from rredcot.config.io import from_dict
from rredcot.methods.base import CreditContext, get_credit
from rredcot.methods.continuation_likelihood import (
    cheap_values_from_scorer,
    continuation_values,
    reference_remainders,
    values_from_scorer,
)
from rredcot.methods.probe_logprobs import Probe
from rredcot.sampling.batch import GroupPeers, RolloutBatch
from rredcot.segment import get_segmenter
from rredcot.tasks import get_task
from text_batches import traces_batch
from tiny_lms import eval_llama

# ---------------------------------------------------------------------------------------------
# A distribution we can enumerate: a first token t1 in {a, b}, then a final token t2 in
# {a, b, c}, then EOS. Correct when t2 is a or c. From prefix a the policy never writes c.
A, B, C, EOS = 1, 2, 3, 4
FIRST = {A: 0.6, B: 0.4}
SECOND = {A: {A: 0.7, B: 0.3, C: 0.0}, B: {A: 0.2, B: 0.5, C: 0.3}}


def _logp(prefix: tuple[int, ...], ids: tuple[int, ...]) -> list[float]:
    """Per-token log pi(ids | prefix) under the table (EOS after t2 with probability 1)."""
    out, seq = [], list(prefix)
    for t in ids:
        if len(seq) == 0:
            p = FIRST.get(t, 0.0)
        elif len(seq) == 1:
            p = SECOND[seq[0]].get(t, 0.0)
        else:
            p = 1.0 if t == EOS else 0.0
        out.append(math.log(p) if p > 0 else -math.inf)
        seq.append(t)
    return out


def _true_value(prefix: tuple[int, ...]) -> float:
    if len(prefix) == 0:
        return sum(FIRST[t] * _true_value((t,)) for t in FIRST)
    return SECOND[prefix[0]][A] + SECOND[prefix[0]][C]


def _group_batch(samples: list[tuple[int, int]]) -> RolloutBatch:
    """One group of completions ``t1 t2 EOS`` after a one-token prompt; segments [t1], [t2 EOS]."""
    G = len(samples)
    response = torch.tensor([[t1, t2, EOS] for t1, t2 in samples])
    input_ids = torch.cat([torch.zeros(G, 1, dtype=torch.long), response], dim=1)
    boundaries = [[0, 1, 3]] * G
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        prompt_len=1,
        response_mask=torch.ones(G, 3),
        rewards=torch.tensor([float(t2 in (A, C)) for _, t2 in samples]),
        group_ids=torch.zeros(G, dtype=torch.long),
        boundaries=boundaries,
        segment_ids=credit.boundaries_to_segment_ids(boundaries, 3),
    )


def _table_scorer(batch: RolloutBatch):
    def score(probes: list[Probe]) -> list[torch.Tensor]:
        out = []
        for p in probes:
            prefix = tuple(batch.input_ids[p.row, 1 : 1 + p.b].tolist())
            out.append(torch.tensor(_logp(prefix, p.ids), dtype=torch.float64))
        return out

    return score


def _expected_estimate(estimator: str, prefix_first: int, G: int = 2, clip: bool = True) -> float:
    """E[V_hat(s_1)] of row 0 given its first token, exactly: every group of G samples."""
    outcomes = [((t1, t2), FIRST[t1] * SECOND[t1][t2]) for t1 in FIRST for t2 in (A, B, C)]
    outcomes = [(o, p) for o, p in outcomes if p > 0]
    total = mass = 0.0
    for group in itertools.product(outcomes, repeat=G):
        if group[0][0][0] != prefix_first:
            continue
        weight = math.prod(p for _, p in group)
        batch = _group_batch([o for o, _ in group])
        values, _, _ = values_from_scorer(
            batch, {}, _table_scorer(batch), source="group", estimator=estimator, clip=clip
        )
        total += weight * float(values[0, 1])
        mass += weight
    return total / mass


def test_importance_estimate_is_a_lower_bound_in_expectation():
    # from b: V = p(a|b) + p(c|b) = 0.5. The other sample's proposal covers c only when its own
    # first token is b, so in expectation (G = 2: row 0 itself, and one other sample)
    # E = 1/2 [V(b)] + 1/2 [0.6 p(a|b) + 0.4 V(b)] = 0.25 + 0.5 * 0.32 = 0.41 < 0.5
    v_b = _true_value((B,))
    assert v_b == pytest.approx(0.5)
    expected = _expected_estimate("importance", B)
    assert expected == pytest.approx(0.41, abs=1e-6)
    assert expected <= v_b
    # from a every correct continuation is covered by every proposal: the raw importance sum is
    # unbiased; clipped to 1 (a ratio p(a|a) / q(a|b) = 3.5) it stays below: 0.612
    v_a = _true_value((A,))
    assert _expected_estimate("importance", A, clip=False) == pytest.approx(v_a, abs=1e-6)
    assert _expected_estimate("importance", A) == pytest.approx(0.612, abs=1e-6)
    assert _expected_estimate("importance", B, clip=False) == pytest.approx(0.41, abs=1e-6)


def test_sum_estimate_is_a_lower_bound_on_every_batch():
    rng = random.Random(0)
    outcomes = [(t1, t2) for t1 in FIRST for t2 in (A, B, C) if SECOND[t1][t2] > 0]
    for _ in range(40):
        samples = [rng.choice(outcomes) for _ in range(4)]
        batch = _group_batch(samples)
        values, _, _ = values_from_scorer(
            batch, {}, _table_scorer(batch), source="group", estimator="sum"
        )
        for row, (t1, _) in enumerate(samples):
            assert float(values[row, 1]) <= _true_value((t1,)) + 1e-6
            assert float(values[row, 0]) <= _true_value(()) + 1e-6


def test_a_reference_counts_exactly():
    # the reference "a a EOS" from prefix b: p(a EOS | b) = 0.2, on every batch
    batch = _group_batch([(B, B), (A, B)])  # no correct sample
    refs = {0: [(A, A, EOS), (A, EOS)]}
    values, _, _ = values_from_scorer(batch, refs, _table_scorer(batch), source="both")
    assert float(values[0, 1]) == pytest.approx(0.2)
    assert float(values[1, 1]) == pytest.approx(0.7)
    assert float(values[0, 0]) == pytest.approx(0.6 * 0.7)


def test_per_token_estimate_is_the_mean_geometric_probability_of_the_continuations():
    # from prefix b the correct continuations written are "a EOS" (row 1) and "c EOS" (row 2):
    # per token exp(log(0.2 * 1) / 2) and exp(log(0.3 * 1) / 2), averaged
    batch = _group_batch([(B, B), (B, A), (B, C)])
    values, _, _ = values_from_scorer(
        batch, {}, _table_scorer(batch), source="group", estimator="per_token"
    )
    expected = (math.sqrt(0.2) + math.sqrt(0.3)) / 2
    assert float(values[0, 1]) == pytest.approx(expected)
    # from the prompt: "b a EOS" and "b c EOS", three tokens each
    assert float(values[0, 0]) == pytest.approx(
        ((0.4 * 0.2) ** (1 / 3) + (0.4 * 0.3) ** (1 / 3)) / 2
    )
    # the reference counts as one more continuation: "a a EOS" from the prompt
    refs = {0: [(A, A, EOS), (A, EOS)]}
    values, _, _ = values_from_scorer(
        batch, refs, _table_scorer(batch), source="both", estimator="per_token"
    )
    three = [(0.6 * 0.7) ** (1 / 3), (0.4 * 0.2) ** (1 / 3), (0.4 * 0.3) ** (1 / 3)]
    assert float(values[0, 0]) == pytest.approx(sum(three) / 3)


def _held_by_one_process(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """``batch``'s ``rows`` as one process holds them under TRL: the group's other rows are
    its peers (``before``: rows of a process before this one)."""
    others = [r for r in range(batch.size) if r not in rows]
    response = batch.input_ids[:, batch.prompt_len :]
    peers = GroupPeers(
        group_ids=[int(batch.group_ids[r]) for r in others],
        rewards=[float(batch.rewards[r]) for r in others],
        responses=[tuple(response[r, : batch.boundaries[r][-1]].tolist()) for r in others],
        boundaries=[list(batch.boundaries[r]) for r in others],
        answers=[None] * len(others),
        before=[r < rows[0] for r in others],
    )
    return batch.select(rows).replace(peers=peers)


@pytest.mark.parametrize("estimator", ["importance", "sum", "per_token"])
@pytest.mark.parametrize("cheap", [False, True])
def test_a_group_split_over_processes_gets_the_values_of_the_whole_group(estimator, cheap):
    # six samples, three distinct correct continuations from the prompt and at most two
    # probed: which two is the order of every process's rows
    batch = _group_batch([(A, B), (B, C), (A, A), (B, B), (B, A), (A, A)])

    def values(b: RolloutBatch) -> torch.Tensor:
        options = {"source": "group", "estimator": estimator, "max_continuations": 2}
        if cheap:  # the window reads a continuation's tail from its source's own pass
            return cheap_values_from_scorer(
                b, {}, _table_scorer(b), window=1, scope="any_wrong", **options
            )[0]
        return values_from_scorer(b, {}, _table_scorer(b), **options)[0]

    whole = values(batch)
    for rows in ([0, 1, 2], [3, 4, 5], [2, 3]):
        part = values(_held_by_one_process(batch, rows))
        assert torch.allclose(part, whole[rows], atol=1e-6), (rows, part, whole[rows])
    # without its peers a process reads its own rows' continuations only
    alone = values(batch.select([3, 4, 5]))
    assert not torch.allclose(alone, whole[[3, 4, 5]], atol=1e-3)


def test_per_token_refuses_stop_below():
    with pytest.raises(ValueError, match="stop_below=0 or another estimator"):
        from_dict(
            CreditConfig,
            {"continuation_likelihood": {"estimator": "per_token", "stop_below": 0.1}},
            where="credit.",
        )
    batch = _group_batch([(B, A), (B, C)])  # and where the function is called directly
    with pytest.raises(ValueError, match="stop_below=0 or another estimator"):
        cheap_values_from_scorer(
            batch, {}, _table_scorer(batch), estimator="per_token", stop_below=0.1
        )


# ---------------------------------------------------------------------------------------------
# The policy's packed forward


@pytest.fixture(scope="module")
def task():
    return get_task("arithmetic", num_steps=3, max_operand=30)


@pytest.fixture(scope="module")
def groups(char_tokenizer, task):
    """Two prompts x three completions: gold, gold, and an error-injected one."""
    problems = task.train_problems(2, seed=3)
    errors = [(None, None, 1)] * len(problems)
    return traces_batch(char_tokenizer, task, problems, errors, random.Random(1), group_size=3)


def _plain_logp(policy, batch, row, b, ids) -> float:
    P = batch.prompt_len
    prompt = batch.input_ids[row, :P][batch.attention_mask[row, :P].bool()].tolist()
    seq = prompt + batch.input_ids[row, P : P + b].tolist() + list(ids)
    with torch.no_grad():
        logits = policy(input_ids=torch.tensor([seq])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    start = len(seq) - len(ids)
    return float(sum(logp[start - 1 + i, t] for i, t in enumerate(ids)))


@pytest.mark.parametrize("packing", ["packed", "unpacked"])
def test_values_equal_a_plain_forward_of_the_continuations(char_tokenizer, task, groups, packing):
    policy = eval_llama(char_tokenizer)
    seg = get_segmenter("newline")
    values, mask, stats = continuation_values(
        policy, char_tokenizer, task, groups, seg, estimator="sum", packing=packing
    )
    refs = reference_remainders(groups, char_tokenizer, task, seg)
    assert stats["credit/extra_forward_tokens"] > 0 and stats["credit/reference_groups"] == 2
    P = groups.prompt_len
    for row in (2, 5):  # the error-injected rows
        bounds = groups.boundaries[row]
        for k in range(len(bounds) - 1):
            # the gold samples' remainders are the reference's: one continuation, counted once
            gold = 0 if row < 3 else 3
            ref = refs[int(groups.group_ids[row])][k]
            end = groups.boundaries[gold][-1]
            assert (
                tuple(groups.input_ids[gold, P + groups.boundaries[gold][k] : P + end].tolist())
                == ref
            )
            expected = math.exp(_plain_logp(policy, groups, row, bounds[k], ref))
            assert float(values[row, k]) == pytest.approx(expected, rel=1e-3, abs=1e-9)
        assert float(values[row, len(bounds) - 1]) == float(groups.rewards[row])


def test_importance_weights_use_the_samples_own_prefix(char_tokenizer, task, groups):
    policy = eval_llama(char_tokenizer)
    seg = get_segmenter("newline")
    values, _, _ = continuation_values(
        policy, char_tokenizer, task, groups, seg, source="group", estimator="importance"
    )
    # the two gold samples of a group are the same text: at every boundary of a gold row the
    # prefix is their own, so each contributes exactly 1/G
    G = 3
    for row in (0, 1, 3, 4):
        n = len(groups.boundaries[row]) - 1
        for k in range(n):
            assert float(values[row, k]) == pytest.approx(2 / G, rel=1e-5)
    # the wrong row: (2/G) pi(u | its prefix) / pi(u | the gold prefix), below the gold rows
    row, gold = 2, 0
    P = groups.prompt_len
    k = len(groups.boundaries[row]) - 2
    u = tuple(groups.input_ids[gold, P + groups.boundaries[gold][k] :].tolist())
    u = u[: groups.boundaries[gold][-1] - groups.boundaries[gold][k]]
    ratio = math.exp(
        _plain_logp(policy, groups, row, groups.boundaries[row][k], u)
        - _plain_logp(policy, groups, gold, groups.boundaries[gold][k], u)
    )
    assert float(values[row, k]) == pytest.approx(min(1.0, 2 / G * ratio), rel=1e-3)


def _method(policy, tokenizer, task, **cfg):
    ctx = CreditContext(
        policy=policy, tokenizer=tokenizer, task=task, segmenter=get_segmenter("newline")
    )
    return get_credit("continuation_likelihood")(from_dict(CreditConfig, cfg), ctx)


@pytest.mark.parametrize("form", ["redistribute", "reweight"])
def test_handover_zero_is_uniform_grpo_bit_for_bit(char_tokenizer, task, groups, form):
    policy = eval_llama(char_tokenizer)
    method = _method(policy, char_tokenizer, task, lam=0.0, form=form)
    assert method.guard.weight == 0.0
    out = method.compute(groups)
    grpo = credit_reference.grpo_advantages(groups.rewards, groups.group_ids, groups.response_mask)
    assert torch.equal(out.advantages, grpo)
    assert out.metrics["credit/extra_forward_tokens"] > 0
    assert undocumented(set(out.metrics)) == []  # every key is in docs/metrics.md
    stats = credit_reference.learn(method, groups)  # the reliability is measured after the credit
    assert "credit/handover_slope" in stats


def test_needs_a_segmenter_and_valid_options(char_tokenizer, task):
    policy = eval_llama(char_tokenizer)
    with pytest.raises(ValueError, match="segmenter"):
        get_credit("continuation_likelihood")(
            CreditConfig(), CreditContext(policy=policy, tokenizer=char_tokenizer, task=task)
        )
    with pytest.raises(ValueError, match="continuation_likelihood.estimator"):
        from_dict(CreditConfig, {"continuation_likelihood": {"estimator": "mean"}})
