"""process_reward (issue 15, item 5): a user's step scores or a frozen Hugging Face PRM as the
value source, through the same anchor, hand-over and normalisation as the other value methods."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

import credit_reference
import prm_scores
from metrics_doc import undocumented
from rredcot.config import CreditConfig, ProcessRewardConfig, TrainConfig
from rredcot.config.io import from_dict, load_yaml
from rredcot.integrations._batch import rollout_batch_from_tensors
from rredcot.methods.base import CreditContext, build_credit, credit_options
from rredcot.methods.process_reward import PRMScorer, ProcessRewardCredit, segment_ends
from rredcot.segment import get_segmenter
from rredcot.tasks.base import Problem
from tiny_lms import save_prm

SCORES_FILE = Path(prm_scores.__file__).resolve()
CHAIN = "prm_scores:chain_scores"

PROMPTS = ["2+3 then *4", "7-1 then +2 then *2"]
TEXTS, REWARDS = prm_scores.TEXTS, prm_scores.REWARDS
GROUPS = [0, 0, 0, 1, 1, 1]


def text_batch(tokenizer, texts=TEXTS, rewards=REWARDS):
    """A segmented RolloutBatch of fixed completions (prompts left-padded, EOS at the end)."""
    prompts = [PROMPTS[g] for g in GROUPS]
    p_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    c_ids = [
        tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for t in texts
    ]
    P, T = max(map(len, p_ids)), max(map(len, c_ids))
    prompt = torch.full((len(texts), P), tokenizer.pad_token_id)
    prompt_mask = torch.zeros(len(texts), P, dtype=torch.long)
    comp = torch.full((len(texts), T), tokenizer.pad_token_id)
    comp_mask = torch.zeros(len(texts), T, dtype=torch.long)
    for row, (p, c) in enumerate(zip(p_ids, c_ids)):
        prompt[row, P - len(p) :] = torch.tensor(p)
        prompt_mask[row, P - len(p) :] = 1
        comp[row, : len(c)] = torch.tensor(c)
        comp_mask[row, : len(c)] = 1
    return rollout_batch_from_tensors(
        prompt_ids=prompt,
        prompt_mask=prompt_mask,
        completion_ids=comp,
        completion_mask=comp_mask,
        rewards=torch.tensor(rewards),
        group_ids=torch.tensor(GROUPS),
        tokenizer=tokenizer,
        segmenter=get_segmenter("newline"),
        problems=[Problem(p, "") for p in prompts],
    )


def method(tokenizer, device="cpu", **credit_fields):
    cfg = from_dict(CreditConfig, credit_fields)
    return build_credit(
        "process_reward",
        cfg,
        CreditContext(policy=None, tokenizer=tokenizer, device=torch.device(device)),
    )


def segment_credit(out, batch) -> list[list[float]]:
    """Each row's token advantages, one per segment (checked constant within a segment)."""
    rows = []
    for row, bounds in enumerate(batch.boundaries):
        segs = [out.advantages[row, a:b] for a, b in zip(bounds[:-1], bounds[1:])]
        for seg in segs:
            assert torch.allclose(seg, seg[0].expand_as(seg))
        rows.append([float(s[0]) for s in segs])
    return rows


# ---------------------------------------------------------------------------------------------
# registration and options


def test_registered_with_its_options_and_needs_a_source(char_tokenizer):
    assert credit_options("process_reward") is ProcessRewardConfig
    assert isinstance(CreditConfig().process_reward, ProcessRewardConfig)
    with pytest.raises(ValueError, match="needs a value source"):
        method(char_tokenizer)
    with pytest.raises(ValueError, match="not both"):
        ProcessRewardConfig(function=CHAIN, model="some/prm")
    with pytest.raises(ValueError, match="module:callable"):
        ProcessRewardConfig(function="prm_scores.chain_scores")
    with pytest.raises(ValueError, match="kind"):
        ProcessRewardConfig(model="x", kind="causal_lm")
    with pytest.raises(ValueError, match="max_length"):
        ProcessRewardConfig(max_length=-1)


def test_function_sources_by_module_or_file_and_their_errors(char_tokenizer):
    by_module = method(char_tokenizer, process_reward={"function": CHAIN})
    by_file = method(char_tokenizer, process_reward={"function": f"{SCORES_FILE}:chain_scores"})
    assert by_module.function is prm_scores.chain_scores and callable(by_file.function)
    with pytest.raises(ValueError, match="cannot import 'no_such_module'"):
        method(char_tokenizer, process_reward={"function": "no_such_module:f"})
    with pytest.raises(ValueError, match="has no attribute 'missing'"):
        method(char_tokenizer, process_reward={"function": "prm_scores:missing"})
    with pytest.raises(ValueError, match="not a callable"):
        method(char_tokenizer, process_reward={"function": "prm_scores:not_callable"})


# ---------------------------------------------------------------------------------------------
# the user function: the contract and the algebra, by hand


def test_function_gets_prompt_completion_and_segment_ends(char_tokenizer):
    batch = text_batch(char_tokenizer)
    prm_scores.CALLS.clear()
    method(char_tokenizer, process_reward={"function": CHAIN}).boundary_values(batch)[:2]
    assert len(prm_scores.CALLS) == len(TEXTS)
    for row, (prompt, completion, ends) in enumerate(prm_scores.CALLS):
        assert prompt == PROMPTS[GROUPS[row]] and completion == TEXTS[row]
        assert ends == segment_ends(batch, row) and ends[-1] == len(completion)
        starts = [0, *ends[:-1]]
        # the segments are the completion's lines, the answer line merged into the step before
        assert "".join(completion[a:b] for a, b in zip(starts, ends)) == completion
        assert len(ends) == len(batch.boundaries[row]) - 1
    assert [len(c[2]) for c in prm_scores.CALLS] == [2, 2, 1, 3, 2, 3]


def test_redistribution_of_known_scores_exactly(char_tokenizer):
    """lam = 0, no hand-over: segment k gets V(s_k) - V(s_{k-1}), V(s_0) = the group's mean
    reward, V(s_n) = R, the scores in between."""
    batch = text_batch(char_tokenizer)
    m = method(
        char_tokenizer,
        lam=0.0,
        normalization="none",
        handover={"mode": "off"},
        process_reward={"function": CHAIN},
    )
    out = m.compute(batch)
    g0, g1 = 1 / 3, 2 / 3
    got = segment_credit(out, batch)
    for row, (g, e) in enumerate(zip(got, prm_scores.CHAIN_CREDIT)):
        assert g == pytest.approx(e, abs=1e-6), row
        assert sum(g) == pytest.approx(REWARDS[row] - (g0 if GROUPS[row] == 0 else g1))
    assert out.values[0, :2].tolist() == pytest.approx([g0, 0.9])
    assert out.metrics["credit/prm_calls"] == 6.0
    assert out.metrics["credit/extra_forward_tokens"] == 0.0  # a function's cost is its own
    assert out.metrics["credit/prm_boundaries"] == 1 + 1 + 0 + 2 + 1 + 2


def test_handover_starts_as_grpo_and_earns_the_measured_slope(char_tokenizer):
    batch = text_batch(char_tokenizer)
    m = method(char_tokenizer, normalization="none", process_reward={"function": CHAIN})
    first = m.compute(batch)
    grpo = [
        [REWARDS[r] - (1 / 3 if GROUPS[r] == 0 else 2 / 3)] * (len(b) - 1)
        for r, b in enumerate(batch.boundaries)
    ]
    for g, e in zip(segment_credit(first, batch), grpo):
        assert g == pytest.approx(e, abs=1e-6)  # w = 0: GRPO exactly
    assert first.metrics["credit/handover_weight"] == 0.0

    credit_reference.learn(m, batch)
    # slope of e = R - ḡ on d = V(s_{n-1}) - ḡ over the rows (d = 0 for one-segment rows)
    g = [1 / 3] * 3 + [2 / 3] * 3
    last = [0.9, 0.1, g[2], 0.9, 0.9, 0.9]
    d = [v - m_ for v, m_ in zip(last, g)]
    e = [r - m_ for r, m_ in zip(REWARDS, g)]
    slope = sum(a * b for a, b in zip(e, d)) / sum(x * x for x in d)
    assert 0 < slope < 1
    w = 0.1 * slope  # EMA from 0 with smoothing 0.9
    assert m.guard.reliability == pytest.approx(w)
    assert m.state_dict() == {"version": 1, "reliability": pytest.approx(w), "num_updates": 1}

    second = m.compute(batch)  # lam = 1: A_k = (R - ḡ) - w (V(s_{k-1}) - ḡ)
    values = [[g[r], *s] for r, s in enumerate([[0.9], [0.1], [], [0.9, 0.9], [0.9], [0.9, 0.9]])]
    for row, got in enumerate(segment_credit(second, batch)):
        want = [(REWARDS[row] - g[row]) - w * (v - g[row]) for v in values[row]]
        assert got == pytest.approx(want, abs=1e-6), row

    fresh = method(char_tokenizer, process_reward={"function": CHAIN})
    fresh.load_state_dict(m.state_dict())
    assert fresh.guard.reliability == pytest.approx(w) and fresh.guard.num_updates == 1


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("too_few", "returned 1 scores for 2 segments"),
        ("not_finite", "score 1 is nan"),
        ("out_of_range", r"outside \[0, 1\]"),
        ("a_string", "returned a str"),
    ],
)
def test_bad_function_output_names_the_function_and_the_fix(char_tokenizer, name, match):
    m = method(char_tokenizer, process_reward={"function": f"prm_scores:{name}"})
    with pytest.raises(ValueError, match=match) as err:
        m.compute(text_batch(char_tokenizer))
    text = str(err.value)
    assert f"prm_scores:{name}" in text and "row 0" in text
    assert "one score in [0, 1] per segment" in text


# ---------------------------------------------------------------------------------------------
# Hugging Face PRMs: tiny Llama classifiers built here, saved, loaded with from_pretrained


@pytest.fixture(scope="module")
def seq_prm(tmp_path_factory, char_tokenizer):
    return save_prm(tmp_path_factory.mktemp("seq_prm"), "sequence", char_tokenizer)


@pytest.fixture(scope="module")
def token_prm(tmp_path_factory, char_tokenizer):
    return save_prm(tmp_path_factory.mktemp("token_prm"), "token", char_tokenizer)


def _prefix_texts(batch):
    """Per row, the PRM input text of every interior prefix s_k (k < n)."""
    out = []
    for row in range(batch.size):
        ends = segment_ends(batch, row)[:-1]
        head = batch.problems[row].prompt + "\n"
        out.append([head + batch.completions[row][:e] for e in ends])
    return out


def _positive(logits):
    return float(torch.softmax(logits.float(), dim=-1)[-1])


def test_sequence_classification_prm_scores_every_prefix(char_tokenizer, seq_prm):
    from transformers import AutoModelForSequenceClassification

    batch = text_batch(char_tokenizer)
    m = method(
        char_tokenizer,
        lam=0.0,
        handover={"mode": "off"},
        normalization="none",
        process_reward={"model": seq_prm, "chunk_tokens": 64},  # several forwards, padded
    )
    assert m.scorer.kind == "sequence_classification"
    assert not any(p.requires_grad for p in m.scorer.model.parameters())  # frozen
    values, mask = m.boundary_values(batch)[:2]
    ref = AutoModelForSequenceClassification.from_pretrained(seq_prm).eval()
    tokens = 0
    for row, texts in enumerate(_prefix_texts(batch)):
        for k, text in enumerate(texts, start=1):
            ids = char_tokenizer(text)["input_ids"]
            tokens += len(ids)
            with torch.no_grad():
                want = _positive(ref(torch.tensor([ids])).logits[0])
            assert float(values[row, k]) == pytest.approx(want, abs=1e-5), (row, k)
    interior = [
        float(values[r, k])
        for r, t in enumerate(_prefix_texts(batch))
        for k in range(1, len(t) + 1)
    ]
    assert len(set(round(v, 6) for v in interior)) > 1  # the scores depend on the prefix
    out = m.compute(batch)
    assert out.cost.extra_forward_tokens == tokens and out.cost.extra_generated_tokens == 0
    assert out.metrics["credit/extra_forward_tokens"] == tokens
    # the same algebra: segment k gets V(s_k) - V(s_{k-1}) (lam 0)
    for row, got in enumerate(segment_credit(out, batch)):
        n = len(batch.boundaries[row]) - 1
        v = [float(values[row, k]) for k in range(n)] + [REWARDS[row]]
        v[0] = 1 / 3 if GROUPS[row] == 0 else 2 / 3
        assert got == pytest.approx([b - a for a, b in zip(v[:-1], v[1:])], abs=1e-6)


def test_positive_label_picks_the_class(char_tokenizer, seq_prm):
    batch = text_batch(char_tokenizer)
    good = method(char_tokenizer, process_reward={"model": seq_prm}).boundary_values(batch)[:2][0]
    bad = method(
        char_tokenizer, process_reward={"model": seq_prm, "positive_label": "LABEL_0"}
    ).boundary_values(batch)[:2][0]
    assert float(good[0, 1] + bad[0, 1]) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="its labels: LABEL_0, LABEL_1"):
        method(char_tokenizer, process_reward={"model": seq_prm, "positive_label": "+"})
    with pytest.raises(ValueError, match="out of range"):
        method(char_tokenizer, process_reward={"model": seq_prm, "positive_index": 2})


def test_token_classification_prm_reads_each_step_end_in_one_forward(char_tokenizer, token_prm):
    from transformers import AutoModelForTokenClassification

    batch = text_batch(char_tokenizer)
    m = method(char_tokenizer, process_reward={"model": token_prm})
    assert m.scorer.kind == "token_classification"
    values, _ = m.boundary_values(batch)[:2]
    ref = AutoModelForTokenClassification.from_pretrained(token_prm).eval()
    for row, texts in enumerate(_prefix_texts(batch)):
        for k, text in enumerate(texts, start=1):
            ids = char_tokenizer(text)["input_ids"]  # causal: the prefix alone, its last token
            with torch.no_grad():
                want = _positive(ref(torch.tensor([ids])).logits[0, -1])
            assert float(values[row, k]) == pytest.approx(want, abs=1e-5), (row, k)
    # one forward per completion, up to its last interior boundary (s_n is not scored)
    est = m.estimate(m.rows(batch))
    assert est.cost.extra_forward_tokens == sum(
        len(char_tokenizer(texts[-1])["input_ids"]) for texts in _prefix_texts(batch) if texts
    )

    # too long for max_length: one left-truncated prefix per boundary
    short = method(char_tokenizer, process_reward={"model": token_prm, "max_length": 12})
    values, _ = short.boundary_values(batch)[:2]
    for row, texts in enumerate(_prefix_texts(batch)):
        for k, text in enumerate(texts, start=1):
            ids = char_tokenizer(text)["input_ids"][-12:]
            with torch.no_grad():
                want = _positive(ref(torch.tensor([ids])).logits[0, -1])
            assert float(values[row, k]) == pytest.approx(want, abs=1e-5), (row, k)


def test_step_separator_rewrites_the_steps(char_tokenizer, token_prm):
    scorer = PRMScorer(ProcessRewardConfig(model=token_prm, step_separator=" ;"))
    text, ends = scorer._text("Q", "2+3=5\n5*4=20\nA:20", [6, 17])
    assert text == "Q\n2+3=5 ;5*4=20\nA:20 ;" and ends == [9, len(text)]


def test_a_model_of_another_kind_is_refused_with_the_fix(char_tokenizer, init_dir):
    with pytest.raises(ValueError, match="process_reward.kind=sequence_classification"):
        method(char_tokenizer, process_reward={"model": str(init_dir)})


# ---------------------------------------------------------------------------------------------
# the core trainer: `rredcot train --credit process_reward ...`


def test_rredcot_train_with_a_function_source(init_dir, tmp_path):
    from rredcot.cli.commands import main

    out = tmp_path / "run"
    argv = [
        "train",
        "--init", str(init_dir),
        "--out", str(out),
        "--credit", "process_reward",
        "--credit.process_reward.function", f"{SCORES_FILE}:chain_scores",
        "--credit.lam", "0.5",
        "--steps", "2",
        "--prompts_per_step", "2",
        "--sampling.num_generations", "4",
        "--sampling.max_new_tokens", "16",
        "--eval_size", "2",
        "--eval_every", "0",
        "--checkpoint_every", "2",
        "--progress", "false",
        "--task.num_steps", "2",
    ]  # fmt: skip
    assert main(argv) == 0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "credit/prm_calls" in r]
    assert len(steps) == 2
    assert all(r["credit/prm_calls"] > 0 for r in steps)
    assert all("credit/handover_reliability" in r and "credit/handover_weight" in r for r in steps)
    assert not any(k.startswith("value/") for r in steps for k in r)  # the value head's only
    assert undocumented({k for r in steps for k in r}) == []  # every key in docs/metrics.md
    saved = load_yaml(out / "config.yaml", TrainConfig)
    assert saved.credit_method == "process_reward"
    assert saved.credit.process_reward.function.endswith("prm_scores.py:chain_scores")


def test_yaml_nests_the_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "credit_method": "process_reward",
                "credit": {"process_reward": {"model": "my/prm", "step_separator": "\n"}},
            }
        )
    )
    cfg = load_yaml(path, TrainConfig)
    assert cfg.credit.process_reward.model == "my/prm"
    assert cfg.credit.process_reward.step_separator == "\n"


def test_the_method_is_a_process_reward_credit(char_tokenizer):
    m = method(char_tokenizer, process_reward={"function": CHAIN})
    assert isinstance(m, ProcessRewardCredit) and m.scorer is None
    assert m.default_normalization == "group_or_batch_std" and not m.needs_hidden_states
    out = m.compute(text_batch(char_tokenizer))  # the default normalisation: finite, masked
    assert torch.isfinite(out.advantages).all()


def test_a_single_output_is_read_through_a_sigmoid(char_tokenizer, tmp_path):
    from transformers import AutoModelForSequenceClassification

    prm = save_prm(tmp_path / "one", "sequence", char_tokenizer, num_labels=1)
    batch = text_batch(char_tokenizer)
    values, _ = method(char_tokenizer, process_reward={"model": prm}).boundary_values(batch)[:2]
    ref = AutoModelForSequenceClassification.from_pretrained(prm).eval()
    ids = char_tokenizer(_prefix_texts(batch)[0][0])["input_ids"]
    with torch.no_grad():
        want = float(torch.sigmoid(ref(torch.tensor([ids])).logits[0, 0]))
    assert float(values[0, 1]) == pytest.approx(want, abs=1e-5)
