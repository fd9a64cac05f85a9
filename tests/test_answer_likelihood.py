"""answer_likelihood: probes, packed == unpacked log-probs, values, answer sources, fallbacks."""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from rredcot.config import CreditConfig
from rredcot.methods.answer_likelihood import (
    _trunk_and_head,
    answer_values,
    build_probes,
    correct_answers,
    packed_probe_logprobs,
    unpacked_probe_logprobs,
)
from rredcot.methods.base import CreditContext, get_credit
from rredcot.models import build_tiny_llama
from rredcot.tasks import get_task
from text_batches import batch_from_texts


@pytest.fixture(scope="module")
def wide_task():
    # operands up to 30: prompts of different lengths, so the prompts are left-padded
    return get_task("arithmetic", num_steps=3, max_operand=30)


@pytest.fixture(scope="module")
def trace_batch(char_tokenizer, wide_task):
    """Gold and error-injected traces (several segments each), two per prompt."""
    problems = wide_task.train_problems(5, seed=1)
    rows, texts = [], []
    rng = random.Random(0)
    for i, p in enumerate(problems):
        rows += [p, p]
        texts += [wide_task.gold_completion(p), wide_task.inject_error(p, i % 3, rng=rng)]
    batch = batch_from_texts(char_tokenizer, wide_task, rows, texts, group_size=2)
    lengths = batch.attention_mask[:, : batch.prompt_len].sum(-1)
    assert len(set(lengths.tolist())) > 1, "the test needs prompts of different lengths"
    return batch


def _policy(tokenizer, impl="eager"):
    return build_tiny_llama(
        tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0, attn_implementation=impl
    ).eval()


def _two_answers(batch):
    return [[p.answer, str(int(p.answer) + 1)] for p in batch.problems]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_packed_logprobs_equal_unpacked(char_tokenizer, wide_task, trace_batch, impl):
    policy = _policy(char_tokenizer, impl)
    probes, probed = build_probes(trace_batch, char_tokenizer, wide_task, _two_answers(trace_batch))
    assert probed == [list(range(len(b) - 1)) for b in trace_batch.boundaries]
    assert len(probes) == 2 * sum(len(b) - 1 for b in trace_batch.boundaries)

    assert _trunk_and_head(policy) is not None  # checked once per model, before the hooks
    calls, full = [], []
    hook = policy.get_decoder().register_forward_hook(
        lambda m, a, kw, out: calls.append(kw["input_ids"].shape), with_kwargs=True
    )
    full_hook = policy.register_forward_hook(lambda m, a, out: full.append(1))
    packed, packed_tokens = packed_probe_logprobs(policy, trace_batch, probes)
    hook.remove()
    full_hook.remove()
    assert calls == [calls[0]] and calls[0][0] == trace_batch.size  # one row per trace, one pass
    assert not full  # the trunk only: no (rows, length, vocabulary) logits
    plain, plain_tokens = unpacked_probe_logprobs(policy, trace_batch, probes)
    for p, a, b in zip(probes, packed, plain):
        assert a.shape == (len(p.ids),)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # the context is encoded once per trace instead of once per probe
    assert packed_tokens < plain_tokens
    # the probes do see different prefixes
    by_k = {}
    for p, a in zip(probes, packed):
        if p.row == 0 and p.ids == probes[0].ids:
            by_k[p.k] = float(a.sum())
    assert len(set(by_k.values())) == len(by_k) > 1


def test_packing_chunks_agree(char_tokenizer, wide_task, trace_batch):
    policy = _policy(char_tokenizer)
    probes, _ = build_probes(trace_batch, char_tokenizer, wide_task, _two_answers(trace_batch))
    whole, _ = packed_probe_logprobs(policy, trace_batch, probes)
    small, _ = packed_probe_logprobs(policy, trace_batch, probes, max_batch_tokens=64)
    for a, b in zip(whole, small):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_values_match_a_plain_forward_of_the_text(char_tokenizer, wide_task, trace_batch):
    policy = _policy(char_tokenizer)
    values, mask, stats = answer_values(policy, char_tokenizer, wide_task, trace_batch)
    n = trace_batch.num_segments
    assert values.shape == mask.shape == (trace_batch.size, int(n.max()) + 1)
    assert torch.equal(mask, torch.arange(values.shape[1]) <= n.unsqueeze(1))
    torch.testing.assert_close(values[torch.arange(trace_batch.size), n], trace_batch.rewards)
    assert bool(((values >= 0) & (values <= 1)).all())
    P = trace_batch.prompt_len
    eos = char_tokenizer.eos_token_id
    for row in (0, 3):
        problem = trace_batch.problems[row]
        for k, b in enumerate(trace_batch.boundaries[row][:-1]):
            response = char_tokenizer.decode(trace_batch.input_ids[row, P : P + b])
            context = problem.prompt + response  # both end with a newline
            probe = f"A:{problem.answer}"
            ids = char_tokenizer(context + probe)["input_ids"] + [eos]
            m = len(probe) + 1
            with torch.no_grad():
                logp = torch.log_softmax(policy(torch.tensor([ids])).logits[0, :-1], -1)
            target = torch.tensor(ids[1:])
            lp = logp[torch.arange(len(ids) - 1), target][-m:].sum()
            assert float(values[row, k]) == pytest.approx(float(lp.exp()), rel=1e-4, abs=1e-9)
    assert stats["credit/extra_generated_tokens"] == 0
    assert stats["credit/probe_packed"] == 1
    # probe tokens: "A:<answer><eos>" per boundary; forwarded = probes + re-encoded contexts
    expected_probe_tokens = sum(
        (len(b) - 1) * (len(f"A:{p.answer}") + 1)
        for b, p in zip(trace_batch.boundaries, trace_batch.problems)
    )
    assert stats["credit/probe_tokens"] == expected_probe_tokens
    contexts = sum(
        int(trace_batch.attention_mask[r, :P].sum()) + trace_batch.boundaries[r][-2]
        for r in range(trace_batch.size)
    )
    assert stats["credit/extra_forward_tokens"] == expected_probe_tokens + contexts


def test_probe_gets_a_newline_when_the_prefix_lacks_one(char_tokenizer, wide_task):
    problem = wide_task.train_problems(1, seed=3)[0]
    batch = batch_from_texts(
        char_tokenizer, wide_task, [problem], [wide_task.gold_completion(problem)], "tokens:4"
    )
    probes, _ = build_probes(batch, char_tokenizer, wide_task, [[problem.answer]])
    nl = char_tokenizer.convert_tokens_to_ids("\n")
    text = batch.completions[0]
    for p in probes:
        prefix = problem.prompt + text[: p.b]
        expected = ("" if prefix.endswith("\n") else "\n") + f"A:{problem.answer}"
        assert char_tokenizer.decode(p.ids[:-1]) == expected
        assert p.ids[-1] == char_tokenizer.eos_token_id
        assert (p.ids[0] == nl) == (not prefix.endswith("\n"))
    assert probes[0].ids[0] != nl  # s_0: the prompt ends with a newline
    assert any(p.ids[0] == nl for p in probes)  # mid-line token boundaries


def test_answer_sources(char_tokenizer, wide_task):
    problems = wide_task.train_problems(2, seed=5)
    p0, p1 = problems
    wrong0 = wide_task.inject_error(p0, 1)
    rows = [p0, p0, p1, p1]
    texts = [wide_task.gold_completion(p0), wrong0, wrong0.replace("A:", "A:1"), "oops"]
    batch = batch_from_texts(char_tokenizer, wide_task, rows, texts, group_size=2)
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert correct_answers(batch, "reference") == [[p0.answer]] * 2 + [[p1.answer]] * 2
    assert correct_answers(batch, "group") == [[p0.answer], [p0.answer], [], []]
    assert correct_answers(batch, "both") == [[p0.answer]] * 2 + [[p1.answer]] * 2
    with pytest.raises(ValueError, match="reference, group or both"):
        correct_answers(batch, "gold")

    policy = _policy(char_tokenizer)
    ref, _, _ = answer_values(policy, char_tokenizer, wide_task, batch, answer_source="reference")
    grp, mask, stats = answer_values(
        policy, char_tokenizer, wide_task, batch, answer_source="group"
    )
    # a group without a correct sample has no answer to probe: V = 0 before s_n
    n = batch.num_segments
    for row in (2, 3):
        assert bool((grp[row, : int(n[row])] == 0).all())
    torch.testing.assert_close(grp[:2], ref[:2])
    assert bool((ref[2:, 0] > 0).all())
    assert stats["credit/empty_answer_sets"] == 2


class _Reject4D(torch.nn.Module):
    """A model whose attention takes no custom 4D mask (it raises)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, input_ids, attention_mask=None, **kw):
        if attention_mask is not None and attention_mask.dim() == 4:
            raise ValueError("4D attention masks are not supported")
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kw)


class _Ignore4D(_Reject4D):
    """A model that silently drops a custom 4D mask (plain causal attention instead)."""

    def forward(self, input_ids, attention_mask=None, **kw):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return self.inner(input_ids=input_ids, attention_mask=attention_mask, **kw)


def test_falls_back_when_4d_masks_are_rejected(char_tokenizer, wide_task, trace_batch):
    policy = _policy(char_tokenizer)
    expected, _, _ = answer_values(policy, char_tokenizer, wide_task, trace_batch)
    with pytest.warns(UserWarning, match="packed probe pass failed"):
        got, _, stats = answer_values(_Reject4D(policy), char_tokenizer, wide_task, trace_batch)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)
    assert stats["credit/probe_packed"] == 0
    with pytest.raises(ValueError, match="4D"):
        answer_values(_Reject4D(policy), char_tokenizer, wide_task, trace_batch, packing="packed")


def test_method_detects_a_model_that_ignores_the_mask(char_tokenizer, wide_task, trace_batch):
    policy = _policy(char_tokenizer)
    expected, _, _ = answer_values(policy, char_tokenizer, wide_task, trace_batch)
    ignoring = _Ignore4D(policy)
    wrong, _, _ = answer_values(ignoring, char_tokenizer, wide_task, trace_batch, packing="packed")
    assert not torch.allclose(
        wrong, expected, rtol=1e-3, atol=0
    )  # the mask is what makes packing right
    ctx = CreditContext(policy=ignoring, tokenizer=char_tokenizer, task=wide_task)
    method = get_credit("answer_likelihood")(CreditConfig(lam=0.0, value_anchor="none"), ctx)
    with pytest.warns(UserWarning, match="differ from unpacked"):
        out = method.compute(trace_batch)
    torch.testing.assert_close(out.values, expected, atol=1e-6, rtol=1e-4)
    assert out.metrics["credit/probe_packed"] == 0


def test_method_through_the_registry(char_tokenizer, wide_task, trace_batch):
    policy = _policy(char_tokenizer)
    policy.train()
    ctx = CreditContext(policy=policy, tokenizer=char_tokenizer, task=wide_task)
    unguarded = CreditConfig(lam=0.0, normalization="none", value_anchor="none", handover="off")
    method = get_credit("answer_likelihood")(unguarded, ctx)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = method.compute(trace_batch)
    assert policy.training  # restored after the probe pass
    values, _, _ = answer_values(policy, char_tokenizer, wide_task, trace_batch)
    torch.testing.assert_close(out.values, values)
    assert out.advantages.shape == trace_batch.response_mask.shape
    # lambda = 0: the segment credits telescope to R - V(s_0)
    total = (out.segment_advantages * out.segment_mask).sum(-1)
    torch.testing.assert_close(total, trace_batch.rewards - values[:, 0], atol=1e-6, rtol=0)
    assert out.metrics["credit/extra_forward_tokens"] > out.metrics["credit/probe_tokens"] > 0
    assert out.metrics["credit/extra_generated_tokens"] == 0
    with pytest.raises(ValueError, match="needs the task"):
        get_credit("answer_likelihood")(CreditConfig(), CreditContext(policy, char_tokenizer))


def test_warm_policy_judges_a_finished_chain(warm_checkpoint, arithmetic_task):
    """Where answer likelihood does work on a warm start trained without early answers: right
    before the answer line it is the model's probability of writing the reference answer, high
    after a correct chain and low after a chain whose last result is wrong. Before that, the model
    never answers early, so every intermediate value is near 0 (DESIGN.md section 7; an
    ``early_answer_prob`` warm start is needed to judge partial chains)."""
    from rredcot.models import load_policy
    from rredcot.segment import get_segmenter

    policy, tokenizer = load_policy(warm_checkpoint)
    problems = arithmetic_task.train_problems(12, seed=3)
    gold = [arithmetic_task.gold_completion(p) for p in problems]
    wrong = [
        arithmetic_task.inject_error(p, 2, rng=random.Random(i)) for i, p in enumerate(problems)
    ]
    segmenter = get_segmenter("newline", separate_answer=True)
    batch = batch_from_texts(
        tokenizer, arithmetic_task, problems + problems, gold + wrong, segmenter
    )
    assert all(len(b) == 5 for b in batch.boundaries)  # 3 steps, the answer line, s_0..s_4
    values, _, stats = answer_values(policy, tokenizer, arithmetic_task, batch)
    before_answer = values[:, 3]
    assert float(before_answer[:12].mean()) > 0.5
    assert float(before_answer[12:].mean()) < 0.1
    assert float(values[:, :3].max()) < 0.1
    assert stats["credit/probe_packed"] == 1
