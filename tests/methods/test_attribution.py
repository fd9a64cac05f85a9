"""Attribution baselines: first_last, gradient (grad x input) and attention mass.

The batch is built by hand from gold and corrupted arithmetic traces (a random tiny model writes
no line breaks, so its own samples would have a single segment): real character tokenizer, real
segmenter, real tiny Llama. A random model cannot be made to "need" one segment, so the model-based
methods are checked on their mechanics: against an independent per-row computation, a finite
difference, and the invariants every weight method must keep.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rredcot.algebra import credit, normalization
from rredcot.config import CreditConfig
from rredcot.methods.attribution import (
    answer_line_starts,
    attention_token_scores,
    first_last_weights,
    gradient_token_scores,
    tokens_to_segment_weights,
)
from rredcot.methods.base import CreditContext, get_credit
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.rollout import encode_prompts
from rredcot.segment import get_segmenter, token_offsets


def build_batch(tokenizer, task, rows, separate_answer=False) -> RolloutBatch:
    """A RolloutBatch from ``rows = [(problem, completion or None, group)]``; ``None`` is a
    skipped sample (all-zero response mask, no segments). Responses end with eos, as sampled."""
    segmenter = get_segmenter("newline", separate_answer=separate_answer)
    prompt_ids, prompt_mask = encode_prompts(tokenizer, [p.prompt for p, _, _ in rows], "cpu")
    P = prompt_ids.shape[1]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    responses = [
        [] if c is None else tokenizer(c, add_special_tokens=False)["input_ids"] + [eos]
        for _, c, _ in rows
    ]
    T = max(len(r) for r in responses)
    response_ids = torch.full((len(rows), T), pad)
    response_mask = torch.zeros(len(rows), T)
    boundaries, rewards, starts, verdicts = [], [], [], []
    for i, ((problem, completion, _), ids) in enumerate(zip(rows, responses, strict=True)):
        response_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        response_mask[i, : len(ids)] = 1
        if completion is None:
            bounds = [0]
            starts.append([])
            verdicts.append(None)
            rewards.append(0.0)
        else:
            offsets = token_offsets(tokenizer, ids[:-1])
            bounds = segmenter.boundaries(completion, offsets) if completion else [0]
            char_starts = [offsets[b][0] if b < len(offsets) else len(completion) for b in bounds]
            bounds = bounds[:-1] + [len(ids)] if len(bounds) > 1 else [0, len(ids)]
            verdict = task.verify(problem, completion)
            verdicts.append(verdict)
            rewards.append(float(verdict.reward))
            starts.append(char_starts[: len(bounds) - 1])
        boundaries.append(bounds)
    return RolloutBatch(
        input_ids=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        prompt_len=P,
        response_mask=response_mask,
        rewards=torch.tensor(rewards),
        group_ids=torch.tensor([g for _, _, g in rows]),
        boundaries=boundaries,
        segment_ids=credit.boundaries_to_segment_ids(boundaries, T),
        segment_char_starts=starts,
        verdicts=verdicts,
        problems=[p for p, _, _ in rows],
        completions=["" if c is None else c for _, c, _ in rows],
    )


@pytest.fixture(scope="module")
def task():
    from rredcot.tasks import get_task

    return get_task("arithmetic", num_steps=3)


@pytest.fixture(scope="module")
def rows(task):
    p = task.train_problems(3, seed=1)
    gold = [task.gold_completion(q) for q in p]
    return [
        (p[0], gold[0], 0),  # 3 segments (answer merged into the last step)
        (p[0], task.inject_error(p[0], 1), 0),  # wrong from step 1
        (p[1], gold[1], 1),
        (p[1], "A:" + p[1].answer, 1),  # one line: one segment, nothing before its answer
        (p[2], None, 2),  # skipped sample: no segments
        (p[2], gold[2].rsplit("\n", 2)[0] + "\n", 2),  # truncated: 2 lines, trailing newline
    ]


@pytest.fixture
def batch(char_tokenizer, task, rows):
    return build_batch(char_tokenizer, task, rows)


def make_method(name, policy, tokenizer, **config):
    cfg = CreditConfig(**config)
    return get_credit(name)(cfg, CreditContext(policy=policy, tokenizer=tokenizer))


def valid_mask(batch):
    n = batch.num_segments
    return torch.arange(int(n.max())).unsqueeze(0) < n.unsqueeze(1)


# ---------------------------------------------------------------------------------------------
# pure helpers


def test_first_last_weights_exact():
    w = first_last_weights(torch.tensor([0, 1, 2, 3, 5]))
    expected = torch.tensor(
        [
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [1.0, 0.0, 0.0, 0.0, 0.0],
            [0.5, 0.5, 0.0, 0.0, 0.0],
            [0.5, 0.0, 0.5, 0.0, 0.0],
            [0.5, 0.0, 0.0, 0.0, 0.5],
        ]
    )
    assert torch.equal(w, expected)
    assert first_last_weights(torch.tensor([], dtype=torch.long)).shape == (0, 0)


def test_tokens_to_segment_weights_sums_normalises_and_falls_back_to_uniform():
    scores = torch.tensor([[1.0, 3.0, 2.0, 2.0, 9.0], [0.0, 0.0, 0.0, 5.0, 5.0], [7.0] * 5])
    segment_ids = torch.tensor([[0, 0, 1, 2, -1], [0, 1, 1, -1, -1], [-1] * 5])
    w = tokens_to_segment_weights(scores, segment_ids, torch.tensor([3, 2, 0]))
    expected = torch.tensor([[0.5, 0.25, 0.25], [0.5, 0.5, 0.0], [0.0, 0.0, 0.0]])
    torch.testing.assert_close(w, expected)


def test_answer_line_starts_point_at_the_last_line(char_tokenizer, batch):
    lengths = [int(x) for x in batch.response_mask.sum(-1)]
    starts = answer_line_starts(char_tokenizer, batch.input_ids, batch.prompt_len, lengths)
    P = batch.prompt_len
    texts = [
        char_tokenizer.decode(batch.input_ids[i, P + starts[i] : P + lengths[i]]) for i in range(6)
    ]
    for i in (0, 1, 2):
        assert texts[i] == batch.completions[i].split("\n")[-1] + "<eos>"
        assert texts[i].startswith("A:")
    assert starts[3] == 0  # a single line: nothing before the answer
    lines = batch.completions[0].split("\n")
    assert batch.segment_char_starts[0] == [0, len(lines[0]) + 1, len(lines[0]) + len(lines[1]) + 2]
    assert starts[4] == 0 and lengths[4] == 0
    last_step = batch.completions[5].rstrip().split("\n")[-1]
    assert texts[5] == last_step + "\n<eos>"  # last non-blank line, trailing newline included


# ---------------------------------------------------------------------------------------------
# the three methods through the registry


@pytest.mark.parametrize("name", ["first_last", "gradient", "attention"])
def test_weights_are_distributions_over_valid_segments(name, tiny_policy, char_tokenizer, batch):
    w = make_method(name, tiny_policy, char_tokenizer).weights_and_cost(batch)[0]
    mask = valid_mask(batch)
    assert w.shape == mask.shape == (6, 3)
    assert bool((w >= 0).all())
    assert bool((w[~mask] == 0).all())
    sums = w.sum(-1)
    torch.testing.assert_close(sums[[0, 1, 2, 3, 5]], torch.ones(5))
    assert float(sums[4]) == 0.0  # no segments
    assert torch.equal(w[3], torch.tensor([1.0, 0.0, 0.0]))  # one segment gets everything
    if name != "first_last":  # model-based weights are informative, not degenerate
        assert bool((w[[0, 1, 2]] > 0).all())


def test_first_last_on_a_batch(tiny_policy, char_tokenizer, batch):
    method = make_method("first_last", tiny_policy, char_tokenizer)
    w = method.weights_and_cost(batch)[0]
    assert torch.equal(w[0], torch.tensor([0.5, 0.0, 0.5]))
    assert torch.equal(w[5], torch.tensor([0.5, 0.5, 0.0]))  # two segments
    out = method.compute(batch)
    assert out.metrics["credit/extra_forward_tokens"] == 0.0
    assert out.metrics["credit/extra_generated_tokens"] == 0.0


def _row_inputs(batch, row):
    """One row without its padding: ``(ids (1, l), prompt_len, length, segment_ids)``."""
    P = batch.prompt_len
    n_prompt = int(batch.attention_mask[row, :P].sum())
    length = int(batch.response_mask[row].sum())
    ids = batch.input_ids[row, P - n_prompt : P + length].unsqueeze(0)
    return ids, n_prompt, length, batch.segment_ids[row, :length]


def _per_segment(token_scores, segment_ids, n):
    sums = torch.zeros(n, dtype=torch.float64).index_add_(0, segment_ids, token_scores.double())
    return (sums / sums.sum()).float()


def test_gradient_matches_a_manual_autograd_per_row(tiny_policy, char_tokenizer, batch):
    w = make_method("gradient", tiny_policy, char_tokenizer).weights_and_cost(batch)[0]
    for row in (0, 1):
        ids, p, length, seg = _row_inputs(batch, row)
        a = answer_line_starts(char_tokenizer, ids, p, [length])[0]
        emb = tiny_policy.get_input_embeddings().weight[ids[0]].detach().clone()
        emb.requires_grad_(True)
        logits = tiny_policy(inputs_embeds=emb.unsqueeze(0)).logits[0]
        logp = F.log_softmax(logits[p + a - 1 : p + length - 1], dim=-1)
        target = logp.gather(-1, ids[0, p + a : p + length].unsqueeze(-1)).sum()
        (g,) = torch.autograd.grad(target, emb)
        scores = (g * emb.detach()).sum(-1).abs()[p : p + a]
        expected = _per_segment(scores, seg[:a], len(batch.boundaries[row]) - 1)
        torch.testing.assert_close(w[row], expected, atol=1e-5, rtol=1e-4)


def test_gradient_score_is_a_directional_derivative(tiny_policy, char_tokenizer, batch):
    """The score of token t is |d/ds log p(answer | e_t scaled by 1+s)| at s=0, computed here by
    forward-mode AD (an independent path; finite differences drown in the model's fp32 casts)."""
    tiny_policy.eval()
    row = 1
    ids, p, length, _ = _row_inputs(batch, row)
    a = answer_line_starts(char_tokenizer, ids, p, [length])[0]
    scores = gradient_token_scores(tiny_policy, ids, torch.ones_like(ids), p, [a], [length])[0]
    base = tiny_policy.get_input_embeddings().weight[ids[0]].detach()

    def answer_logprob(s, t):
        scale = torch.ones(len(base), 1).index_put((torch.tensor([p + t]),), 1 + s)
        logits = tiny_policy(inputs_embeds=(base * scale).unsqueeze(0)).logits[0]
        logp = F.log_softmax(logits[p + a - 1 : p + length - 1], dim=-1)
        return logp.gather(-1, ids[0, p + a : p + length].unsqueeze(-1)).sum()

    for t in (0, a // 2, a - 1):
        _, derivative = torch.func.jvp(
            lambda s, t=t: answer_logprob(s, t), (torch.zeros(()),), (torch.ones(()),)
        )
        torch.testing.assert_close(scores[t], derivative.abs(), atol=1e-7, rtol=1e-4)
    assert bool((scores[a:] == 0).all())  # the answer line and padding are not attributed
    assert float(scores[:a].sum()) > 0


def test_attention_matches_a_manual_aggregation_per_row(tiny_policy, char_tokenizer, batch):
    w = make_method("attention", tiny_policy, char_tokenizer).weights_and_cost(batch)[0]
    for row in (0, 2):
        ids, p, length, seg = _row_inputs(batch, row)
        a = answer_line_starts(char_tokenizer, ids, p, [length])[0]
        with torch.no_grad():
            att = tiny_policy(input_ids=ids, output_attentions=True).attentions
        mass = torch.zeros(a)
        for layer in att:  # (1, H, l, l)
            for head in layer[0]:
                for q in range(p + a - 1, p + length - 1):  # positions predicting the answer
                    mass += head[q, p : p + a]
        expected = _per_segment(mass, seg[:a], len(batch.boundaries[row]) - 1)
        torch.testing.assert_close(w[row], expected, atol=1e-5, rtol=1e-4)


def test_attention_scores_drop_prompt_and_answer_line(tiny_policy, char_tokenizer, batch):
    lengths = [int(x) for x in batch.response_mask.sum(-1)]
    starts = answer_line_starts(char_tokenizer, batch.input_ids, batch.prompt_len, lengths)
    rows = [0, 1, 2]
    with torch.no_grad():
        scores = attention_token_scores(
            tiny_policy,
            batch.input_ids[rows],
            batch.attention_mask[rows],
            batch.prompt_len,
            [starts[i] for i in rows],
            [lengths[i] for i in rows],
        )
    for i in rows:
        assert bool((scores[i, : starts[i]] > 0).all())
        assert bool((scores[i, starts[i] :] == 0).all())
        # Each query's attention sums to 1 over everything; the kept part is a strict share.
        assert 0 < float(scores[i].sum()) < lengths[i] - starts[i]


def test_answer_only_segment_gets_no_weight(tiny_policy, char_tokenizer, task, rows):
    batch = build_batch(char_tokenizer, task, rows[:3], separate_answer=True)
    assert batch.boundaries[0][-2] > 0 and len(batch.boundaries[0]) == 5  # 3 steps + answer
    for name in ("gradient", "attention"):
        w = make_method(name, tiny_policy, char_tokenizer).weights_and_cost(batch)[0]
        assert bool((w[:, 3] == 0).all())
        assert bool((w[:, :3] > 0).all())
        torch.testing.assert_close(w.sum(-1), torch.ones(3))


@pytest.mark.parametrize("name", ["gradient", "attention"])
def test_micro_batching_and_padding_do_not_change_weights(name, tiny_policy, char_tokenizer, batch):
    method = make_method(name, tiny_policy, char_tokenizer)
    method.micro_batch_size = 1
    one = method.weights_and_cost(batch)[0]
    method.micro_batch_size = 16
    torch.testing.assert_close(method.weights_and_cost(batch)[0], one, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["gradient", "attention"])
def test_extra_forwards_take_at_most_micro_batch_tokens(name, tiny_policy, char_tokenizer, batch):
    """The context's token budget (the run's micro_batch_tokens) bounds each extra forward
    (rows x padded width, at least one row), and the weights are those of one forward."""
    whole = make_method(name, tiny_policy, char_tokenizer).weights_and_cost(batch)[0]
    budget = batch.prompt_len + int(batch.response_mask.sum(-1).max())  # one longest row
    context = CreditContext(policy=tiny_policy, tokenizer=char_tokenizer, micro_batch_tokens=budget)
    method = get_credit(name)(CreditConfig(), context)
    shapes = []
    scores = method.token_scores
    method.token_scores = lambda policy, ids, *rest: (
        shapes.append(ids.shape) or scores(policy, ids, *rest)
    )
    torch.testing.assert_close(method.weights_and_cost(batch)[0], whole, atol=1e-5, rtol=1e-4)
    assert len(shapes) >= 2, shapes  # the batch's model rows do not fit one budget
    assert all(rows == 1 or rows * width <= budget for rows, width in shapes), (budget, shapes)


@pytest.mark.parametrize("name", ["gradient", "attention"])
def test_no_parameter_grads_and_mode_restored(name, tiny_policy, char_tokenizer, batch):
    tiny_policy.train()
    out = make_method(name, tiny_policy, char_tokenizer).compute(batch)
    assert all(p.grad is None for p in tiny_policy.parameters())
    assert tiny_policy.training
    assert not out.advantages.requires_grad
    assert out.metrics["credit/extra_generated_tokens"] == 0.0
    # Only rows with two or more segments and text before the answer line need the model.
    tokens = float(batch.attention_mask[[0, 1, 2, 5]].sum())
    assert out.metrics["credit/extra_forward_tokens"] == tokens
    backward = out.metrics["credit/extra_backward_tokens"]
    assert backward == (tokens if name == "gradient" else 0.0)


def test_attention_without_weights_is_a_clear_error(char_tokenizer, batch):
    from rredcot.models import build_tiny_llama

    sdpa = build_tiny_llama(
        char_tokenizer, hidden_size=32, num_layers=2, num_heads=2, attn_implementation="sdpa"
    )
    method = make_method("attention", sdpa, char_tokenizer)
    with pytest.raises(RuntimeError, match=r"--model.attn_implementation eager") as err:
        method.compute(batch)
    assert "sdpa" in str(err.value)
    sdpa.set_attn_implementation("eager")  # the fix the message names
    assert torch.isfinite(method.weights_and_cost(batch)[0]).all()


@pytest.mark.parametrize("name", ["first_last", "gradient", "attention"])
def test_advantages_split_r_minus_group_mean(name, tiny_policy, char_tokenizer, batch):
    """Through the base class: ``r_k = w_k (R - mean_group)``, used as the segment advantage
    directly (no GAE over r_k, whatever credit.lam is), broadcast to the segment's tokens."""
    method = make_method(name, tiny_policy, char_tokenizer, normalization="none", lam=0.5)
    out = method.compute(batch)
    mean, _ = normalization.group_mean_std(batch.rewards, batch.group_ids)
    assert batch.rewards[[0, 2]].tolist() == [1.0, 1.0]  # gold traces are right
    assert batch.rewards[[1, 5]].tolist() == [0.0, 0.0]  # corrupted / truncated are wrong
    w = method.weights_and_cost(batch)[0]
    torch.testing.assert_close(out.segment_advantages, w * (batch.rewards - mean)[:, None])
    sums = out.segment_advantages.sum(-1)
    has = batch.num_segments > 0
    torch.testing.assert_close(sums[has], (batch.rewards - mean)[has])
    assert float(sums[4]) == 0.0
    ids = batch.segment_ids
    expected = torch.where(
        ids >= 0, out.segment_advantages.gather(1, ids.clamp(min=0)), torch.zeros(())
    )
    torch.testing.assert_close(out.advantages, expected)
