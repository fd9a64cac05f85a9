"""continuation_likelihood's cheap scoring (reuse_reference, window, stop_below, scope) against
the exact estimator on a tiny real model: where they must agree, they do; the cost counters."""

from __future__ import annotations

import math
import random

import pytest
import torch

from rredcot.config import CreditConfig
from rredcot.config.io import from_dict
from rredcot.methods.base import CreditContext, get_credit
from rredcot.methods.continuation_likelihood import (
    cheap_values_from_scorer,
    continuation_values,
    groups_in_scope,
    reference_paths,
)
from rredcot.methods.probe_logprobs import packed_probe_logprobs, probe_pass_tokens
from rredcot.segment import get_segmenter
from rredcot.tasks import get_task
from text_batches import traces_batch
from tiny_lms import eval_llama


@pytest.fixture(scope="module")
def task():
    return get_task("arithmetic", num_steps=4, max_operand=30)


@pytest.fixture(scope="module")
def batch(char_tokenizer, task):
    """Group 0: gold, gold, an error at line 2 (mixed); group 1: errors at lines 1, 2, 3 (all
    wrong)."""
    problems = task.train_problems(2, seed=3)
    errors = [(None, None, 2), (1, 2, 3)]
    out = traces_batch(char_tokenizer, task, problems, errors, random.Random(1), group_size=3)
    assert out.rewards.tolist() == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    return out


@pytest.fixture(scope="module")
def policy(char_tokenizer):
    return eval_llama(char_tokenizer)


def _values(policy, tok, task, batch, **options):
    return continuation_values(
        policy, tok, task, batch, get_segmenter("newline"), packing="packed", **options
    )


@pytest.mark.parametrize("estimator", ["importance", "per_token"])
def test_reuse_reference_gives_the_exact_values_with_fewer_tokens(
    char_tokenizer, task, batch, policy, estimator
):
    exact, mask, exact_stats = _values(policy, char_tokenizer, task, batch, estimator=estimator)
    cheap, cheap_mask, stats = _values(
        policy, char_tokenizer, task, batch, reuse_reference=True, estimator=estimator
    )
    assert torch.equal(mask, cheap_mask)
    assert torch.allclose(cheap[mask], exact[mask], rtol=1e-4, atol=1e-7)
    # the gold rows' prefixes are all the reference's: read from its pass, not probed
    assert stats["credit/continuations_from_reference"] >= 2 * 4
    assert stats["credit/continuations_probed"] < exact_stats["credit/continuations_probed"]
    assert stats["credit/extra_forward_tokens"] < exact_stats["credit/extra_forward_tokens"]


def test_window_splices_the_reference_pass_onto_a_short_probe(char_tokenizer, task, batch, policy):
    seg = get_segmenter("newline")
    paths = reference_paths(batch, char_tokenizer, task, seg)
    values, mask, _ = _values(policy, char_tokenizer, task, batch, window=1, source="reference")
    P = batch.prompt_len
    prompt = batch.input_ids[0, :P][batch.attention_mask[0, :P].bool()].tolist()

    def plain(seq: list[int], start: int) -> float:  # log pi(seq[start:] | seq[:start])
        with torch.no_grad():
            logp = torch.log_softmax(policy(input_ids=torch.tensor([seq])).logits[0].float(), -1)
        return float(sum(logp[i - 1, seq[i]] for i in range(start, len(seq))))

    row = 2  # wrong from line 2 on: its boundary 2 is off the reference path
    ids, rb = paths[int(batch.group_ids[row])]
    b = batch.boundaries[row]
    prefix = prompt + batch.input_ids[row, P : P + b[2]].tolist()
    head = list(ids[rb[2] : rb[3]])
    expected = plain(prefix + head, len(prefix)) + plain(prompt + list(ids), len(prompt) + rb[3])
    assert float(values[row, 2]) == pytest.approx(math.exp(expected), rel=1e-3, abs=1e-12)
    # a window as long as every remainder is the exact estimate
    exact, _, _ = _values(policy, char_tokenizer, task, batch, source="reference")
    wide, _, _ = _values(policy, char_tokenizer, task, batch, window=99, source="reference")
    assert torch.allclose(wide[mask], exact[mask], rtol=1e-4, atol=1e-7)


def test_stop_below_probes_the_departure_only_where_its_value_is_small(
    char_tokenizer, task, batch, policy
):
    exact, mask, exact_stats = _values(policy, char_tokenizer, task, batch, reuse_reference=True)
    # a threshold below every value stops nothing: the exact values
    never, _, stats = _values(policy, char_tokenizer, task, batch, stop_below=1e-300)
    assert torch.allclose(never[mask], exact[mask], rtol=1e-4, atol=1e-12)
    assert stats["credit/continuations_stopped"] == 0
    # a threshold above every value stops every off-path trace at its first probed boundary
    stop, _, stats = _values(policy, char_tokenizer, task, batch, stop_below=0.999999)
    paths = reference_paths(batch, char_tokenizer, task, get_segmenter("newline"))
    P, n = batch.prompt_len, batch.num_segments.tolist()
    departed = 0
    for row in range(2, 6):
        ids, rb = paths[int(batch.group_ids[row])]
        b = batch.boundaries[row]
        response = tuple(batch.input_ids[row, P : P + b[-1]].tolist())
        first = next(k for k in range(n[row] + 1) if response[: b[k]] != ids[: rb[k]])
        departed += first < n[row]
        for k in range(first, n[row]):
            assert float(stop[row, k]) == pytest.approx(float(exact[row, first]), rel=1e-4)
    assert departed == 3  # row 5's only wrong line is its last
    assert stats["credit/continuations_stopped"] > 0
    assert stats["credit/continuations_probed"] == departed  # one each (reference only)
    assert stats["credit/continuations_probed"] < exact_stats["credit/continuations_probed"]


def _credit_scoped_and_full(tok, task, batch, policy, scope: str):
    """The method's credit (lambda 0, no anchor, no hand-over) with ``scope``, and with every
    group scored."""
    ctx = CreditContext(policy=policy, tokenizer=tok, task=task, segmenter=get_segmenter("newline"))
    cfg = {"lam": 0.0, "anchor": "none", "handover": {"mode": "off"}}
    method = get_credit("continuation_likelihood")
    scoped = method(
        from_dict(CreditConfig, {**cfg, "continuation_likelihood": {"scope": scope}}), ctx
    )
    return scoped.compute(batch), method(from_dict(CreditConfig, cfg), ctx).compute(batch)


def test_all_wrong_scope_scores_only_all_wrong_groups(char_tokenizer, task, batch, policy):
    exact, mask, _ = _values(policy, char_tokenizer, task, batch)
    scoped, _, stats = _values(policy, char_tokenizer, task, batch, scope="all_wrong")
    assert stats["credit/continuation_rows"] == 3
    assert torch.allclose(scoped[3:][mask[3:]], exact[3:][mask[3:]], rtol=1e-4, atol=1e-7)
    n = batch.num_segments
    for row in range(3):  # the mixed group: its mean reward at every boundary, R at s_n
        assert scoped[row, : int(n[row])].eq(2 / 3).all()
        assert float(scoped[row, int(n[row])]) == float(batch.rewards[row])
    # through the method: GRPO's credit on the mixed group's rows, the values' elsewhere
    out, full = _credit_scoped_and_full(char_tokenizer, task, batch, policy, "all_wrong")
    seg_mask = out.segment_mask
    grpo = batch.rewards - torch.tensor([2 / 3] * 3 + [0.0] * 3)
    for row in range(3):
        assert torch.allclose(out.segment_advantages[row][seg_mask[row]], grpo[row].expand(4))
    assert torch.allclose(out.segment_advantages[3:], full.segment_advantages[3:], atol=1e-6)
    assert not torch.allclose(out.segment_advantages[:3], full.segment_advantages[:3], atol=1e-6)


def test_groups_in_scope_picks_each_kind_of_group():
    # groups: 0 mixed, 1 all wrong, 2 all right (R >= 1 is correct)
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.2, 1.0, 1.5])
    gids = torch.tensor([0, 0, 1, 1, 2, 2])
    assert groups_in_scope(rewards, gids, "all") == {0, 1, 2}
    assert groups_in_scope(rewards, gids, "all_wrong") == {1}
    assert groups_in_scope(rewards, gids, "mixed") == {0}
    assert groups_in_scope(rewards, gids, "any_wrong") == {0, 1}
    with pytest.raises(ValueError, match="all, all_wrong, mixed, any_wrong"):
        groups_in_scope(rewards, gids, "some")


def test_mixed_scope_scores_the_groups_grpo_credits_and_leaves_the_rest_at_zero(
    char_tokenizer, task, batch, policy
):
    exact, mask, _ = _values(policy, char_tokenizer, task, batch)
    scoped, _, stats = _values(policy, char_tokenizer, task, batch, scope="mixed")
    assert stats["credit/continuation_rows"] == 3
    assert torch.allclose(scoped[:3][mask[:3]], exact[:3][mask[:3]], rtol=1e-4, atol=1e-7)
    assert scoped[3:][mask[3:]].eq(0.0).all()  # the all-wrong group: its mean reward, 0
    out, full = _credit_scoped_and_full(char_tokenizer, task, batch, policy, "mixed")
    # no gradient where GRPO has none: the update forwards no more rows than GRPO's
    assert out.advantages[3:].eq(0.0).all()
    assert torch.allclose(out.segment_advantages[:3], full.segment_advantages[:3], atol=1e-6)
    assert not full.advantages[3:].eq(0.0).all()


def test_scope_names_the_valid_choices():
    with pytest.raises(ValueError, match="all, all_wrong, mixed, any_wrong"):
        from_dict(CreditConfig, {"continuation_likelihood": {"scope": "wrong_only"}})


def test_forward_token_counter_is_what_the_packed_passes_forward(
    char_tokenizer, task, batch, policy
):
    seg = get_segmenter("newline")
    paths = reference_paths(batch, char_tokenizer, task, seg)
    calls: list[list] = []

    def score(probes):
        calls.append(list(probes))
        return packed_probe_logprobs(policy, batch, probes)[0]

    options = {"window": 1, "stop_below": 1e-3}
    with torch.no_grad():
        cheap_values_from_scorer(batch, paths, score, **options)
    _, _, stats = _values(policy, char_tokenizer, task, batch, **options)
    expected = sum(probe_pass_tokens(batch, probes)[0] for probes in calls)
    assert stats["credit/extra_forward_tokens"] == expected
    assert stats["credit/continuation_tokens"] == sum(
        len(p.ids) for probes in calls[1:] for p in probes
    )


def test_bad_cheap_options_fail_with_the_field_name():
    with pytest.raises(ValueError, match="continuation_likelihood.scope"):
        from_dict(CreditConfig, {"continuation_likelihood": {"scope": "wrong"}})
    with pytest.raises(ValueError, match="continuation_likelihood.stop_below"):
        from_dict(CreditConfig, {"continuation_likelihood": {"stop_below": 1.0}})
    with pytest.raises(ValueError, match="continuation_likelihood.window"):
        from_dict(CreditConfig, {"continuation_likelihood": {"window": -1}})


def test_presets_name_their_settings_and_take_more():
    from rredcot.bench.variants import parse_variants
    from rredcot.methods.auto import CHEAP_SETTINGS, FLOW_SETTINGS

    flow, cheap, wide = parse_variants(
        "cl_flow,cl_cheap,cl_w2=cl_cheap:continuation_likelihood.window=2"
    )
    assert (flow.name, flow.method) == ("cl_flow", "continuation_likelihood")
    assert flow.credit_config().lam == 0.0 and flow.credit_config().anchor == "none"
    assert cheap.name == "cl_cheap" and set(CHEAP_SETTINGS) > set(FLOW_SETTINGS)
    options = cheap.credit_config().continuation_likelihood
    assert (options.window, options.stop_below, options.scope) == (1, 0.0, "all")
    assert wide.name == "cl_w2" and wide.credit_config().continuation_likelihood.window == 2
