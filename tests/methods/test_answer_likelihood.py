"""answer_likelihood: probes, packed == unpacked log-probs, values, answer sources, fallbacks."""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import warnings

import pytest
import torch

import credit_reference
from rredcot.algebra import credit, normalization
from rredcot.config import AnswerLikelihoodConfig, CreditConfig, HandoverConfig, ValueHeadConfig
from rredcot.config.io import from_dict
from rredcot.methods.answer_likelihood import answer_values
from rredcot.methods.answer_probes import (
    ProbeFormat,
    answer_renderings,
    build_probes,
    correct_answers,
    probe_answers,
    probe_text,
    resolve_cue,
    thought_closed,
    uses_think_tags,
    wants_eos,
)
from rredcot.methods.base import CreditContext, CreditRows, get_credit
from rredcot.methods.guard import prediction_slope
from rredcot.methods.probe_logprobs import (
    _trunk_and_head,
    packed_probe_logprobs,
    unpacked_probe_logprobs,
)
from rredcot.models import build_tiny_llama
from rredcot.sampling.batch import GroupPeers
from rredcot.segment import get_segmenter
from rredcot.tasks import get_task
from rredcot.tasks.answers import answers_match, equivalent_renderings, extract_boxed
from rredcot.tasks.arithmetic import ArithmeticTask
from rredcot.tasks.base import Problem, Verdict
from text_batches import batch_from_texts, traces_batch
from tiny_lms import eval_llama


@pytest.fixture(scope="module")
def wide_task():
    # operands up to 30: prompts of different lengths, so the prompts are left-padded
    return get_task("arithmetic", num_steps=3, max_operand=30)


@pytest.fixture(scope="module")
def trace_batch(char_tokenizer, wide_task):
    """Gold and error-injected traces (several segments each), two per prompt."""
    problems = wide_task.train_problems(5, seed=1)
    errors = [(None, i % 3) for i in range(len(problems))]
    batch = traces_batch(char_tokenizer, wide_task, problems, errors, random.Random(0), 2)
    lengths = batch.attention_mask[:, : batch.prompt_len].sum(-1)
    assert len(set(lengths.tolist())) > 1, "the test needs prompts of different lengths"
    return batch


def _two_answers(batch):
    return [[p.answer, str(int(p.answer) + 1)] for p in batch.problems]


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_packed_logprobs_equal_unpacked(char_tokenizer, wide_task, trace_batch, impl):
    policy = eval_llama(char_tokenizer, impl)
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
    policy = eval_llama(char_tokenizer)
    probes, _ = build_probes(trace_batch, char_tokenizer, wide_task, _two_answers(trace_batch))
    whole, _ = packed_probe_logprobs(policy, trace_batch, probes)
    small, _ = packed_probe_logprobs(policy, trace_batch, probes, max_batch_tokens=64)
    for a, b in zip(whole, small):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_values_match_a_plain_forward_of_the_text(char_tokenizer, wide_task, trace_batch):
    policy = eval_llama(char_tokenizer)
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


def test_per_token_values_read_each_probe_per_token(char_tokenizer, wide_task, trace_batch):
    """estimator=per_token: V(s_k) = exp(mean log pi(probe | s_k)), the probe's per-token
    probability, from the same probes as the probability form."""
    policy = eval_llama(char_tokenizer)
    prob, mask, _ = answer_values(policy, char_tokenizer, wide_task, trace_batch)
    tok, tok_mask, stats = answer_values(
        policy, char_tokenizer, wide_task, trace_batch, estimator="per_token"
    )
    assert torch.equal(mask, tok_mask)
    n = trace_batch.num_segments
    torch.testing.assert_close(tok[torch.arange(trace_batch.size), n], trace_batch.rewards)
    for row in range(trace_batch.size):
        m = len(f"A:{trace_batch.problems[row].answer}") + 1  # one probe a boundary, EOS ended
        for k in range(int(n[row])):
            log_p = math.log(max(float(prob[row, k]), 1e-38))
            assert float(tok[row, k]) == pytest.approx(math.exp(log_p / m), rel=1e-3)
    # a probability below 1 is never above its own per-token probability
    before_last = mask & (torch.arange(mask.shape[1]) < n.unsqueeze(1))
    assert bool((tok[before_last] >= prob[before_last]).all())
    assert stats["credit/probes"] == float(before_last.sum())


def test_per_token_takes_the_best_probe_of_a_boundary():
    """Two probes at one boundary: the probability form sums them (capped at 1), the per-token
    form takes the larger per-token probability."""
    from rredcot.methods.answer_likelihood import _values_from_probes
    from rredcot.methods.probe_logprobs import Probe

    batch = dataclasses.make_dataclass("B", ["num_segments", "size", "rewards"])(
        torch.tensor([2]), 1, torch.tensor([1.0])
    )
    probes = [Probe(0, 0, 0, (1, 2)), Probe(0, 0, 0, (3,)), Probe(0, 1, 4, (5,))]
    logprobs = [
        torch.log(torch.tensor([0.5, 0.5])),
        torch.log(torch.tensor([0.9])),
        torch.log(torch.tensor([0.2])),
    ]
    prob, _ = _values_from_probes(batch, probes, logprobs)
    tok, mask = _values_from_probes(batch, probes, logprobs, "per_token")
    torch.testing.assert_close(prob, torch.tensor([[1.0, 0.2, 1.0]]))  # 0.25 + 0.9 capped
    torch.testing.assert_close(tok, torch.tensor([[0.9, 0.2, 1.0]]))
    assert bool(mask.all())
    with pytest.raises(ValueError, match="estimator='mean'"):
        _values_from_probes(batch, probes, logprobs, "mean")


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
    # row 1 alone on its process (TRL: a group may span processes) reads row 0's answer from
    # its peers; without them its group has no correct answer
    alone = batch.select([1])
    assert correct_answers(alone, "group") == [[]]
    peer = GroupPeers([0], [1.0], [(1, 2)], [[0, 2]], [str(p0.answer)], [True])
    assert correct_answers(alone.replace(peers=peer), "group") == [[p0.answer]]
    wrong_peer = dataclasses.replace(peer, rewards=[0.0])
    assert correct_answers(alone.replace(peers=wrong_peer), "group") == [[]]

    policy = eval_llama(char_tokenizer)
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
    policy = eval_llama(char_tokenizer)
    expected, _, _ = answer_values(policy, char_tokenizer, wide_task, trace_batch)
    with pytest.warns(UserWarning, match="packed probe pass failed"):
        got, _, stats = answer_values(_Reject4D(policy), char_tokenizer, wide_task, trace_batch)
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-4)
    assert stats["credit/probe_packed"] == 0
    with pytest.raises(ValueError, match="4D"):
        answer_values(_Reject4D(policy), char_tokenizer, wide_task, trace_batch, packing="packed")


def test_method_detects_a_model_that_ignores_the_mask(char_tokenizer, wide_task, trace_batch):
    policy = eval_llama(char_tokenizer)
    expected, _, _ = answer_values(policy, char_tokenizer, wide_task, trace_batch)
    ignoring = _Ignore4D(policy)
    wrong, _, _ = answer_values(ignoring, char_tokenizer, wide_task, trace_batch, packing="packed")
    assert not torch.allclose(
        wrong, expected, rtol=1e-3, atol=0
    )  # the mask is what makes packing right
    ctx = CreditContext(policy=ignoring, tokenizer=char_tokenizer, task=wide_task)
    method = get_credit("answer_likelihood")(CreditConfig(lam=0.0, anchor="none"), ctx)
    with pytest.warns(UserWarning, match="differ from unpacked"):
        out = method.compute(trace_batch)
    torch.testing.assert_close(out.values, expected, atol=1e-6, rtol=1e-4)
    assert out.metrics["credit/probe_packed"] == 0


def test_method_through_the_registry(char_tokenizer, wide_task, trace_batch):
    policy = eval_llama(char_tokenizer)
    policy.train()
    ctx = CreditContext(policy=policy, tokenizer=char_tokenizer, task=wide_task)
    unguarded = CreditConfig(
        lam=0.0, normalization="none", anchor="none", handover=HandoverConfig(mode="off")
    )
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


@pytest.mark.slow
def test_warm_policy_judges_a_finished_chain(warm_checkpoint, arithmetic_task):
    """Where answer likelihood does work on a warm start trained without early answers: right
    before the answer line it is the model's probability of writing the reference answer, high
    after a correct chain and low after a chain whose last result is wrong. Before that, the model
    never answers early, so every intermediate value is near 0 (docs/method.md, failure modes; an
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


# ---------------------------------------------------------------------------------------------
# probes that suit reasoning models


class BoxedArithmetic(ArithmeticTask):
    """The arithmetic problems, answered the way a reasoning model answers: ``\\boxed{15}``
    (or ``\\boxed{15.0}``) after ``</think>``."""

    def render_answer(self, answer: str) -> str:
        return f"\\boxed{{{answer}}}"

    def verify(self, problem, completion):
        got = extract_boxed(completion) if isinstance(completion, str) else None
        ok = answers_match(got, problem.answer, "exact")
        return Verdict(float(ok), got, None, "correct" if ok else "wrong")


def think_trace(task, problem, steps=None, answer=None) -> str:
    """``<think>\\n<step lines>\\n</think>\\n\\nThe final answer is \\boxed{<answer>}``."""
    lines = task.gold_steps(problem) if steps is None else steps
    answer = problem.answer if answer is None else answer
    return f"<think>\n{chr(10).join(lines)}\n</think>\n\nThe final answer is \\boxed{{{answer}}}"


@pytest.fixture(scope="module")
def think_model(char_tokenizer):
    return train_think_model(char_tokenizer)


def train_think_model(char_tokenizer):
    """A tiny Llama taught to reason in think tags (10-20 s on one thread): 2-step additions,
    the thought closed after all steps (70%) or after the first one (30%, like the warm-start's
    early answers), the answer written ``15`` or ``15.0`` with equal odds. Returns the model (in
    eval mode) and its task."""
    task = BoxedArithmetic(num_steps=2, operators="+", max_operand=5)
    rng = random.Random(0)
    torch.manual_seed(0)
    problems = task.train_problems(2000, seed=0)
    model = build_tiny_llama(char_tokenizer, hidden_size=48, num_layers=2, num_heads=4, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eos = char_tokenizer.eos_token_id
    for _ in range(150):
        seqs = []
        for p in rng.sample(problems, 16):
            steps = task.gold_steps(p)[: 1 if rng.random() < 0.3 else None]
            answer = p.answer + (".0" if rng.random() < 0.5 else "")
            text = p.prompt + think_trace(task, p, steps, answer)
            seqs.append(char_tokenizer(text)["input_ids"] + [eos])
        L = max(map(len, seqs))
        ids = torch.full((len(seqs), L), char_tokenizer.pad_token_id)
        labels = torch.full((len(seqs), L), -100)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = labels[i, : len(s)] = torch.tensor(s)
        loss = model(input_ids=ids, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), task


def _think_batch(tokenizer, task, problems, texts):
    """Newline segments with the answer line on its own: boundaries before and after
    ``</think>``."""
    seg = get_segmenter("newline", separate_answer=True)
    return batch_from_texts(tokenizer, task, problems, texts, seg, group_size=len(problems))


def _column_at(batch, row, char):
    """The boundary index whose prefix ends at character ``char`` of the completion."""
    starts = batch.segment_char_starts[row]
    return starts.index(char)


@pytest.mark.slow
def test_think_cue_scores_a_reasoning_trace_the_plain_probe_cannot(char_tokenizer, think_model):
    """The done criterion of issue 14: the plain probe (the answer right after the prefix) gives
    a model that thinks in tags ~0 at every boundary inside its thought; the think-closing cue
    gives it non-trivial probabilities there, and ``auto`` picks the cue from a tokenizer that
    knows ``</think>``."""
    model, task = think_model
    problems = task.train_problems(12, seed=7)
    texts = [think_trace(task, p) for p in problems]
    batch = _think_batch(char_tokenizer, task, problems, texts)
    assert batch.rewards.tolist() == [1.0] * 12
    plain, _, _ = answer_values(
        model, char_tokenizer, task, batch, probe=ProbeFormat(cue="task", renderings=True)
    )
    think, _, stats = answer_values(
        model, char_tokenizer, task, batch, probe=ProbeFormat(cue="think", renderings=True)
    )
    assert stats["credit/probe_think_cue"] == 1
    # the boundary right before </think> (all steps written, thought still open) and the one
    # right after it (the probe then leaves </think> out)
    before = [_column_at(batch, r, texts[r].index("</think>")) for r in range(12)]
    after = [_column_at(batch, r, texts[r].index("The final")) for r in range(12)]
    rows = torch.arange(12)
    n = batch.num_segments
    inside = torch.arange(plain.shape[1]).unsqueeze(0) < torch.tensor(before).unsqueeze(1) + 1
    assert float(plain[inside].max()) < 1e-6  # the plain probe: ~0 everywhere in the thought
    assert float(think[rows, before].mean()) > 0.1
    assert float(think[rows, after].mean()) > 0.1
    assert bool((think[rows, before] > 1e3 * plain[rows, before]).all())
    assert bool((n > torch.tensor(after)).all())
    # auto: a tokenizer whose vocabulary (or chat template) knows </think> gets the think cue
    assert resolve_cue("auto", char_tokenizer) == "task"
    thinking = copy.deepcopy(char_tokenizer)
    thinking.add_tokens(["<think>", "</think>"])
    assert uses_think_tags(thinking) and resolve_cue("auto", thinking) == "think"
    templated = copy.deepcopy(char_tokenizer)
    templated.chat_template = "{{ messages[0]['content'] }}<think>\n</think>"
    assert resolve_cue("auto", templated) == "think"


def test_missing_renderings_under_estimate(char_tokenizer, think_model):
    """The measured example of the module docstring: a model that writes ``15`` and ``15.0``
    about equally often gets about half the value from the reference rendering alone."""
    model, task = think_model
    problems = task.train_problems(12, seed=7)
    texts = [think_trace(task, p) for p in problems]
    batch = _think_batch(char_tokenizer, task, problems, texts)
    answers = probe_answers(batch, task, "reference", renderings=True)
    assert answers[0] == [problems[0].answer, problems[0].answer + ".0", "$" + problems[0].answer]
    only, _, s1 = answer_values(
        model, char_tokenizer, task, batch, probe=ProbeFormat("think", renderings=False)
    )
    every, _, s2 = answer_values(
        model, char_tokenizer, task, batch, probe=ProbeFormat("think", renderings=True)
    )
    assert s1["credit/answers_per_row"] == 1 and s2["credit/answers_per_row"] == 3
    rows = torch.arange(12)
    before = [_column_at(batch, r, texts[r].index("</think>")) for r in range(12)]
    ratio = float(only[rows, before].mean()) / float(every[rows, before].mean())
    assert 0.3 < ratio < 0.8, ratio  # the renderings carry a large share of the probability
    assert bool((every >= only - 1e-7).all())  # adding renderings never lowers the estimate


def test_probe_text_rules(char_tokenizer, wide_task):
    task = BoxedArithmetic(num_steps=2)
    # the task's own answer line, on a line of its own
    assert probe_text(wide_task, "15", "task", tail="3+4=7\n") == "A:15"
    assert probe_text(wide_task, "15", "task", tail="3+4=7") == "\nA:15"
    assert probe_text(wide_task, "15", "task", tail="7\n\n") == "A:15"
    # closing the thought; without </think> once the prefix has closed it
    cue = "</think>\n\nThe final answer is \\boxed{15}"
    assert probe_text(task, "15", "think", tail="=7\n") == cue
    assert probe_text(task, "15", "think", tail="=7") == "\n" + cue
    assert probe_text(task, "15", "think", tail="</think>\n", closed=True) == cue[9:]
    assert probe_text(task, "15", "think", tail="k>\n\n", closed=True) == cue[10:]
    assert thought_closed("<think>\na\n</think>\n") and not thought_closed("<think>\na\n")
    assert not thought_closed("</think><think>b") and not thought_closed("no tags")
    # a literal cue: the answer follows, open braces are closed
    assert probe_text(task, "15", "Answer: $\\boxed{", tail="x") == "Answer: $\\boxed{15}"
    with pytest.raises(ValueError, match="resolved cue"):
        probe_text(task, "15", "auto")
    # eos: auto only where the probe does not end in a closing bracket or tag
    assert wants_eos("A:15", "auto") and not wants_eos("\\boxed{15}", "auto")
    assert not wants_eos("<answer>15</answer>", "auto") and wants_eos("\\boxed{15}", "true")
    assert not wants_eos("A:15", "false")


def test_probes_follow_the_format(char_tokenizer):
    task = BoxedArithmetic(num_steps=2, operators="+", max_operand=5)
    problems = task.train_problems(2, seed=3)
    texts = [think_trace(task, p) for p in problems]
    batch = _think_batch(char_tokenizer, task, problems, texts)
    answers = [[p.answer] for p in problems]
    eos = char_tokenizer.eos_token_id
    probes, _ = build_probes(batch, char_tokenizer, task, answers, ProbeFormat("think", "auto"))
    decoded = {char_tokenizer.decode(p.ids) for p in probes if p.row == 0}
    assert f"</think>\n\nThe final answer is \\boxed{{{problems[0].answer}}}" in decoded
    assert f"The final answer is \\boxed{{{problems[0].answer}}}" in decoded  # after </think>\n\n
    assert all(p.ids[-1] != eos for p in probes)  # auto: the closing brace ends the answer
    with_eos, _ = build_probes(batch, char_tokenizer, task, answers, ProbeFormat("think", "true"))
    assert all(p.ids[-1] == eos for p in with_eos) and len(with_eos) == len(probes)
    # without eos, a probe that extends another one at the same boundary is counted by it
    plain = get_task("arithmetic", num_steps=2)
    short, _ = build_probes(
        batch, char_tokenizer, plain, [["1", "15"], ["2"]], ProbeFormat("task", "false")
    )
    assert {char_tokenizer.decode(p.ids) for p in short if p.row == 0 and p.k == 0} == {"A:1"}
    full, _ = build_probes(
        batch, char_tokenizer, plain, [["1", "15"], ["2"]], ProbeFormat("task", "true")
    )
    assert len([p for p in full if p.row == 0 and p.k == 0]) == 2


def test_renderings_are_the_ones_the_verifier_accepts(tmp_path, wide_task):
    boxed = BoxedArithmetic(num_steps=2)
    problem = boxed.train_problems(1, seed=0)[0]
    a = problem.answer
    assert answer_renderings(boxed, problem, a) == [a, f"{a}.0", f"${a}"]
    # the arithmetic verifier takes an integer answer line only: no renderings there
    assert answer_renderings(wide_task, wide_task.train_problems(1, seed=0)[0], "7") == ["7"]
    data = tmp_path / "d.jsonl"
    data.write_text(
        '{"question": "q", "answer": "so #### 1000"}\n{"question": "r", "answer": "#### 2"}\n'
    )
    gsm = get_task("gsm8k", data=str(data), eval_fraction=0.5, verifier="exact")
    p = Problem("q", "1000")
    assert answer_renderings(gsm, p, "1000") == ["1000", "1000.0", "$1000", "1,000", "$1,000"]
    assert equivalent_renderings("0.75") == ["0.75", "$0.75", "3/4", "\\frac{3}{4}"]
    assert equivalent_renderings("-3") == ["-3", "-3.0", "-$3"]
    assert equivalent_renderings("Paris") == ["Paris"]


# ---------------------------------------------------------------------------------------------
# safe credit


@pytest.fixture
def mixed_trace_batch(trace_batch):
    """Groups of two with mixed and with agreeing outcomes."""
    batch = copy.copy(trace_batch)
    batch = batch.replace(rewards=torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0]))
    return batch


def _method(policy, tokenizer, task, **cfg):
    """``cfg``: ``CreditConfig`` fields, sections as dicts (``handover=dict(mode="off")``)."""
    ctx = CreditContext(policy=policy, tokenizer=tokenizer, task=task)
    return get_credit("answer_likelihood")(from_dict(CreditConfig, cfg), ctx)


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_handover_zero_is_uniform_grpo_bit_for_bit(
    char_tokenizer, wide_task, mixed_trace_batch, lam
):
    policy = eval_llama(char_tokenizer)
    method = _method(policy, char_tokenizer, wide_task, lam=lam)
    assert method.guard.weight == 0.0  # no reliability measured yet
    out = method.compute(mixed_trace_batch)
    uniform = get_credit("uniform")(CreditConfig(lam=lam), CreditContext(policy, char_tokenizer))
    ref = uniform.compute(mixed_trace_batch)
    assert torch.equal(out.advantages, ref.advantages)
    assert torch.equal(out.segment_advantages, ref.segment_advantages)
    grpo = credit_reference.grpo_advantages(
        mixed_trace_batch.rewards, mixed_trace_batch.group_ids, mixed_trace_batch.response_mask
    )
    assert torch.equal(out.advantages, grpo)
    assert out.metrics["credit/handover_weight"] == 0.0 and out.values is not None


def test_anchored_values_give_each_trace_grpos_total(char_tokenizer, wide_task, mixed_trace_batch):
    policy = eval_llama(char_tokenizer)
    method = _method(
        policy, char_tokenizer, wide_task, lam=0.0, normalization="none", handover=dict(mode="off")
    )
    raw, mask, _ = answer_values(policy, char_tokenizer, wide_task, mixed_trace_batch)
    out = method.compute(mixed_trace_batch)
    mean, _ = normalization.group_mean_std(mixed_trace_batch.rewards, mixed_trace_batch.group_ids)
    torch.testing.assert_close(out.values[:, 0], mean)  # V'(s_0) = the group's mean reward
    total = (out.segment_advantages * out.segment_mask).sum(-1)
    torch.testing.assert_close(total, mixed_trace_batch.rewards - mean, atol=1e-6, rtol=0)
    # the estimator still decides how the total is spread over the segments
    n = mixed_trace_batch.num_segments
    inner = torch.arange(raw.shape[1]).unsqueeze(0) < n.unsqueeze(1)
    gain = torch.where(inner, raw - raw[:, :1], 0.0)
    torch.testing.assert_close(torch.where(inner, out.values - mean[:, None], 0.0), gain)


@pytest.fixture(scope="module")
def think_groups(char_tokenizer, think_model):
    """Think traces of 6 problems x 2 samples: both right (rows 0-3), one right and one with a
    wrong last step (rows 4-7), both wrong (rows 8-11)."""
    model, task = think_model
    problems = task.train_problems(6, seed=11)
    rows, texts = [], []
    for i, p in enumerate(problems):
        for j in range(2):
            wrong = i >= 4 or (i >= 2 and j == 1)
            steps = task.gold_steps(p)
            if wrong:
                lhs, rhs = steps[-1].split("=")
                steps = [*steps[:-1], f"{lhs}={int(rhs) + 3}"]
            rows.append(p)
            texts.append(think_trace(task, p, steps, str(int(p.answer) + 3) if wrong else None))
    seg = get_segmenter("newline")
    batch = batch_from_texts(char_tokenizer, task, rows, texts, seg, group_size=2)
    assert batch.rewards.tolist() == [1.0] * 4 + [1.0, 0.0] * 2 + [0.0] * 4
    return batch


def test_reliability_is_the_slope_measured_after_the_credit(
    char_tokenizer, think_model, think_groups
):
    model, task = think_model
    batch = think_groups
    method = _method(
        model,
        char_tokenizer,
        task,
        answer_likelihood=dict(cue="think"),
        handover=dict(smoothing=0.5),
    )
    calls = []
    hook = model.get_decoder().register_forward_hook(lambda m, a, out: calls.append(1))
    rows = method.rows(batch)
    estimate = method.estimate(rows)
    first = method.credit_output(rows, estimate, batch.segment_ids, batch.response_mask)
    probed = len(calls)
    stats = method.update(rows, estimate)  # scores the values the credit used: no new forward
    hook.remove()
    assert probed >= 1 and len(calls) == probed
    mean, _ = normalization.group_mean_std(batch.rewards, batch.group_ids)
    expected = prediction_slope(first.values, first.value_mask, batch.rewards, mean)
    assert expected == expected and stats["credit/handover_slope"] == pytest.approx(expected)
    assert method.guard.reliability == pytest.approx(0.5 * min(max(expected, 0.0), 1.0))
    assert first.metrics["credit/handover_weight"] == 0.0
    # the next step blends by the measured reliability
    method.guard.reliability = 0.25
    off = _method(
        model, char_tokenizer, task, answer_likelihood=dict(cue="think"), handover=dict(mode="off")
    )
    uniform = get_credit("uniform")(CreditConfig(), CreditContext(model, char_tokenizer))
    out = method.compute(batch)
    seg = (
        0.25 * off.compute(batch).segment_advantages
        + 0.75 * uniform.compute(batch).segment_advantages
    )
    torch.testing.assert_close(out.segment_advantages, seg)
    assert not torch.allclose(out.segment_advantages, uniform.compute(batch).segment_advantages)
    assert out.metrics["credit/handover_weight"] == 0.25
    # state round trip and pretraining on fresh batches
    again = _method(model, char_tokenizer, task, answer_likelihood=dict(cue="think"))
    again.load_state_dict(method.state_dict())
    assert again.guard.reliability == 0.25 and again.guard.num_updates == 1
    fit = again.pretrain(lambda: batch, 2)
    assert fit["value_pretrain/steps"] == 2 and again.guard.num_updates == 3
    assert fit["value_pretrain/slope_mean"] == pytest.approx(expected)
    with pytest.raises(ValueError, match="version"):
        again.load_state_dict({"version": 9})
    again.load_state_dict({})  # a run saved before the hand-over: nothing earned, nothing lost
    assert again.guard.reliability == pytest.approx(fit["value_pretrain/reliability"])


def test_values_that_hardly_depart_earn_no_reliability(
    char_tokenizer, wide_task, mixed_trace_batch
):
    """An untrained policy puts ~0 on every probe: its departures from the group mean are tiny,
    however well they correlate with the outcomes, so its reliability is not measured and the
    credit stays GRPO's."""
    policy = eval_llama(char_tokenizer)
    method = _method(policy, char_tokenizer, wide_task)
    method.compute(mixed_trace_batch)
    stats = credit_reference.learn(method, mixed_trace_batch)
    assert math.isnan(stats["credit/handover_slope"]) and method.guard.reliability == 0.0
    # departures under 0.01 RMS do not count, however well they point
    mask = torch.ones(2, 3, dtype=torch.bool)  # s_0, s_1 = s_{n-1}, s_n
    rewards, base = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5])
    clear = torch.tensor([[0.5, 0.9, 1.0], [0.5, 0.1, 0.0]])  # departures +-0.4
    assert prediction_slope(clear, mask, rewards, base, min_rms=0.01) == pytest.approx(1.25)
    faint = torch.tensor([[0.5, 0.5001, 1.0], [0.5, 0.4999, 0.0]])  # departures +-1e-4
    assert prediction_slope(faint, mask, rewards, base) == pytest.approx(5000, rel=1e-3)
    assert math.isnan(prediction_slope(faint, mask, rewards, base, min_rms=0.01))


def test_never_divides_by_a_near_zero_group_std(char_tokenizer, think_model, think_groups):
    """Rows 0-3 and 8-11 agree on their outcome; the estimator still moves credit between their
    segments, and that credit is divided by the batch's reward std, not by ~0."""
    model, task = think_model
    batch = think_groups
    cfg = {"answer_likelihood": {"cue": "think"}, "lam": 0.0, "handover": {"mode": "off"}}
    method = _method(model, char_tokenizer, task, **cfg)
    assert method.normalization == "group_or_batch_std"
    out = method.compute(batch)
    unscaled = _method(model, char_tokenizer, task, **cfg, normalization="none").compute(batch)
    agree = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])
    assert float(unscaled.advantages[agree].abs().max()) > 0.01  # credit moved inside the trace
    std = float(batch.rewards.std())
    torch.testing.assert_close(out.advantages[agree], unscaled.advantages[agree] / (std + 1e-4))
    assert float(out.advantages.abs().max()) < 10.0


# ---------------------------------------------------------------------------------------------
# memory


def test_logit_slices_and_chunks_give_the_same_logprobs(char_tokenizer, wide_task, trace_batch):
    policy = eval_llama(char_tokenizer)
    probes, _ = build_probes(trace_batch, char_tokenizer, wide_task, _two_answers(trace_batch))
    whole, _ = packed_probe_logprobs(policy, trace_batch, probes)
    # small chunks of rows, and 1 MiB slices of logits (~2,600 positions of this vocabulary)
    tiny, _ = packed_probe_logprobs(policy, trace_batch, probes, max_batch_tokens=50, logits_mb=1)
    plain, _ = unpacked_probe_logprobs(
        policy, trace_batch, probes, max_batch_tokens=50, logits_mb=1
    )
    for a, b, c in zip(whole, tiny, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        torch.testing.assert_close(a, c, atol=1e-5, rtol=0)


def _bpe_tokenizer(texts: list[str], vocab_size: int = 300):
    """A byte-level BPE trained here on ``texts`` (pad 0, eos 1, unk 2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<eos>", "<unk>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def test_logits_exist_only_for_scored_positions_at_152k_vocabulary(wide_task):
    """A 152k vocabulary (synthetic tiny Llama, locally trained BPE): the probe pass runs the
    trunk once per chunk and the output head only on the scored positions, at most
    ``logits_mb`` MiB of fp32 logits at a time; the log-probs equal a plain full forward's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    corpus = [p.prompt + wide_task.gold_completion(p) for p in wide_task.train_problems(200, 0)]
    tok = _bpe_tokenizer(corpus)
    vocab = 152_000
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    problems = wide_task.train_problems(6, seed=2)
    texts = [wide_task.gold_completion(p) for p in problems]
    batch = batch_from_texts(tok, wide_task, problems, texts)
    probes, _ = build_probes(batch, tok, wide_task, [[p.answer] for p in problems])
    assert _trunk_and_head(model) is not None
    head_rows, full = [], []
    hooks = [
        model.get_output_embeddings().register_forward_hook(
            lambda m, a, out: head_rows.append(out.shape[0])
        ),
        model.register_forward_hook(lambda m, a, out: full.append(1)),
    ]
    got, _ = packed_probe_logprobs(model, batch, probes, logits_mb=4)
    for h in hooks:
        h.remove()
    per_slice = (4 << 20) // (4 * vocab)  # 6 positions of 152k fp32 logits
    scored = sum(len(p.ids) for p in probes)
    assert not full and sum(head_rows) == scored and max(head_rows) <= per_slice
    with pytest.warns(UserWarning, match="full logits"):  # the full-vocabulary reference
        ref, _ = unpacked_probe_logprobs(_FullLogits(model), batch, probes)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


class _FullLogits(torch.nn.Module):
    """A model seen without its trunk/head split: probes are scored from its full logits."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner
        self.config = inner.config

    def forward(self, **kw):
        return self.inner(**kw)


# ---------------------------------------------------------------------------------------------
# the estimator as a value-head feature


def test_value_head_reads_the_answer_likelihood_feature(char_tokenizer, think_model, think_groups):
    from rredcot.methods.value_head import NUM_LOGPROB_FEATURES
    from rredcot.sampling.forward import fill_forward

    model, task = think_model
    batch = fill_forward(model, copy.copy(think_groups), hidden_layers=(-1,))
    cfg = CreditConfig(
        value_head=ValueHeadConfig(alik_feature=True),
        answer_likelihood=AnswerLikelihoodConfig(cue="think"),
    )
    ctx = CreditContext(policy=model, tokenizer=char_tokenizer, task=task)
    method = get_credit("value_head")(cfg, ctx)
    assert method.extra_size == NUM_LOGPROB_FEATURES + 2
    assert _trunk_and_head(model) is not None  # its one-time check runs before the hook
    calls = []
    hook = model.get_decoder().register_forward_hook(lambda m, a, out: calls.append(1))
    rows = method.rows(batch)
    feats, mask = rows.features, rows.value_mask
    estimate = method.estimate(rows)
    out = method.credit_output(rows, estimate, batch.segment_ids, batch.response_mask)
    method.update(rows, estimate)
    hook.remove()
    assert len(calls) == 1  # one packed probe forward per batch, in the rows credit and update read
    values, vmask, _ = answer_values(model, char_tokenizer, task, batch, probe=ProbeFormat("think"))
    n = batch.num_segments
    alik = feats[..., -2:]
    cols = torch.arange(mask.shape[1]).unsqueeze(0)
    inner = cols < n.unsqueeze(1)
    torch.testing.assert_close(alik[..., 0][inner], values[inner])  # V(s_k), k < n
    assert bool((alik[~inner] == 0).all())  # s_n (where answer_values holds R) and padding
    assert float(alik[..., 0].max()) > 0.05
    assert out.advantages.shape == batch.response_mask.shape
    _, _, stats = answer_values(model, char_tokenizer, task, batch, probe=ProbeFormat("think"))
    assert out.metrics["credit/extra_forward_tokens"] == stats["credit/extra_forward_tokens"] > 0
    with pytest.raises(ValueError, match="needs the task"):
        get_credit("value_head")(cfg, CreditContext(policy=model, tokenizer=char_tokenizer))


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("eos", "maybe", "answer_likelihood.eos='maybe' must be auto, true or false"),
        ("cue", "", "answer_likelihood.cue is empty"),
        ("estimator", "log", "answer_likelihood.estimator='log' must be probability or per_token"),
        ("chunk_tokens", 0, "answer_likelihood.chunk_tokens=0 must be >= 1"),
        ("logits_mb", 0, "answer_likelihood.logits_mb=0 must be >= 1"),
    ],
)
def test_config_names_the_fix(field, value, message):
    with pytest.raises(ValueError, match=message):
        AnswerLikelihoodConfig(**{field: value})
    assert AnswerLikelihoodConfig(eos=False).eos == "false"  # a YAML boolean
    assert ProbeFormat.from_config(AnswerLikelihoodConfig(cue="think")) == ProbeFormat("think")
    assert ProbeFormat.from_config(CreditConfig().answer_likelihood) == ProbeFormat()


def test_values_given_by_an_integration_are_anchored_and_scored(wide_task, mixed_trace_batch):
    """TRL and verl compute the probe values elsewhere and hand them over in the rows: the
    estimate anchors them (the policy is not needed) and the update scores what it used."""
    batch = mixed_trace_batch
    n = batch.num_segments
    S1 = int(n.max()) + 1
    mask = torch.arange(S1).unsqueeze(0) <= n.unsqueeze(1)
    steps = torch.arange(S1, dtype=torch.float).unsqueeze(0) / S1
    raw = torch.where(mask, 0.2 + 0.5 * steps * batch.rewards.unsqueeze(1), 0.0)
    ctx = CreditContext(policy=None, tokenizer=None, task=wide_task)
    method = get_credit("answer_likelihood")(
        CreditConfig(lam=0.0, handover=HandoverConfig(mode="off")), ctx
    )
    rows = CreditRows.from_tensors(
        batch.rewards, batch.group_ids, batch.segment_ids, batch.response_mask, values=raw
    )
    est = method.estimate(rows)
    out = method.credit_output(rows, est, batch.segment_ids, batch.response_mask)
    mean, _ = normalization.group_mean_std(batch.rewards, batch.group_ids)
    torch.testing.assert_close(out.values, credit.anchor_values(raw, mask, mean))
    stats = method.update(rows, est)
    expected = prediction_slope(out.values, mask, batch.rewards, mean)
    assert (
        stats["credit/handover_slope"] == pytest.approx(expected) and method.guard.num_updates == 1
    )
