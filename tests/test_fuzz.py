"""Fuzzing (issue 13): segmentation, the credit algebra and every verifier on adversarial input.

About 5,000 cases in all by default (each drawn text goes through every segmenter, or every
verifier); set ``RREDCOT_FUZZ_EXAMPLES=N`` to draw N inputs per test instead, e.g.
``RREDCOT_FUZZ_EXAMPLES=10000 pytest tests/test_fuzz.py``.

Invariants: spans cover the text exactly; boundaries are strictly increasing from 0 to T; the
redistributed rewards telescope to ``R - V(s_0)`` (``R - baseline`` when anchored); advantages are
finite and zero on padding; a verifier never raises, returns a finite reward in [0, 1] and a
reason, and the arithmetic evaluator returns a finite float or raises only its own error.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import credit_reference
from rredcot.algebra import credit, normalization
from rredcot.segment import Segmenter, list_segmenters, spans_to_boundaries
from rredcot.tasks import Problem, Verdict, get_task

_OVERRIDE = int(os.environ.get("RREDCOT_FUZZ_EXAMPLES", "0"))


def fuzz(examples: int):
    """``settings`` with ``examples`` cases (or the environment's count)."""
    return settings(
        max_examples=_OVERRIDE or examples,
        deadline=None,
        derandomize=not _OVERRIDE,  # CI: the same cases every run; a long fuzz explores
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        database=None,
    )


# Text that stresses parsers: markers of every strategy and answer format, math, brackets,
# line ends of every kind, unicode, and long runs of one character.
PIECES = [
    "\n",
    "\r\n",
    "\r",
    "\n\n",
    " ",
    "\t",
    ". ",
    "? ",
    "Step 1: ",
    "First, ",
    "Then ",
    "So ",
    "Therefore ",
    "#### ",
    "A: ",
    "Answer: ",
    "The answer is ",
    "\\boxed{",
    "\\fbox ",
    "{",
    "}",
    "$",
    "$$",
    "\\(",
    "\\)",
    "<<",
    ">>",
    "=",
    "3.14",
    "1,000",
    "-7",
    "1/2",
    "50%",
    "e.g. ",
    "Mr. ",
    "…",
    "é",
    "中文",
    "🙂",
    "\u200b",
    "\x00",
    "<answer>",
    "</answer>",
    "**",
    "(",
    ")",
]


PIECES += ["\n" * 30, " " * 50, "(" * 40, ")" * 40, "{" * 30, "-" * 50, "\\boxed{" * 20, "=" * 9]


def traces(max_pieces: int = 30):
    """Concatenated pieces and single characters of any kind (cheap to draw, so thousands of
    cases stay fast)."""
    return st.lists(st.one_of(st.sampled_from(PIECES), st.characters()), max_size=max_pieces).map(
        "".join
    )


# ---------------------------------------------------------------------------------------------
# segmentation

STRATEGIES = [
    "newline",
    "paragraph",
    "sentence",
    "step",
    "step:^\\s*\\d+[.)]",
    "keywords",
    "keywords:So|Then|Wait",
    "tokens:1",
    "tokens:3",
    "entropy",
    "entropy:threshold=1.0,min=2,max=8",
    "keywords+entropy",
    "newline+merge",
    "newline+merge:target=2",
]
OPTIONS = st.fixed_dictionaries(
    {
        "min_chars": st.sampled_from([0, 0, 1, 5, 40]),
        "max_segments": st.sampled_from([None, None, 1, 2, 4]),
        "separate_answer": st.booleans(),
    }
)


def test_every_segmenter_is_fuzzed():
    assert {u.split(":")[0].split("[")[0] for u in list_segmenters()} == {
        s.split(":")[0] for s in STRATEGIES
    }


def _char_offsets(text: str) -> list[tuple[int, int]]:
    return [(i, i + 1) for i in range(len(text))]


@fuzz(200)
@given(text=traces(), options=OPTIONS, seed=st.integers(0, 2**16))
def test_fuzz_segmentation(text, options, seed):
    """Every strategy on each drawn text (12 segmentations a case; entropy strategies get
    random per-token entropies)."""
    import random

    offsets = _char_offsets(text)
    rng = random.Random(seed)
    entropies = [rng.uniform(0.0, 3.0) for _ in offsets]
    for strategy in STRATEGIES:
        segmenter = Segmenter(strategy, options["min_chars"], options["max_segments"],
                              options["separate_answer"])  # fmt: skip
        ent = entropies if segmenter.uses_entropy else None
        spans = segmenter.split(text, offsets if segmenter.uses_tokens else None, entropies=ent)
        if not text:
            assert spans == []
            continue
        assert spans[0][0] == 0 and spans[-1][1] == len(text), strategy
        assert all(s < e for s, e in spans)
        assert all(e == s for (_, e), (s, _) in zip(spans, spans[1:]))
        # every segment but the first starts on non-whitespace (segment.py's conventions)
        assert all(not text[s].isspace() for s, _ in spans[1:]), (strategy, text, spans)
        if options["max_segments"] is not None:
            assert len(spans) <= options["max_segments"]
        bounds = spans_to_boundaries(spans, offsets)
        assert bounds[0] == 0 and bounds[-1] == len(offsets)
        assert all(a < b for a, b in zip(bounds, bounds[1:]))
        assert segmenter.boundaries(text, offsets, entropies=ent) == bounds


# ---------------------------------------------------------------------------------------------
# the credit algebra

finite = st.floats(-10.0, 10.0, allow_nan=False, allow_subnormal=False)


@st.composite
def value_batches(draw):
    rows = draw(st.integers(1, 5))
    n = draw(st.lists(st.integers(1, 6), min_size=rows, max_size=rows))
    S = max(n)
    values = torch.zeros(rows, S + 1)
    mask = torch.zeros(rows, S + 1, dtype=torch.bool)
    for b, nb in enumerate(n):
        for k in range(nb + 1):
            values[b, k] = draw(finite)
            mask[b, k] = True
    rewards = torch.tensor(draw(st.lists(st.sampled_from([0.0, 1.0]) | finite,
                                         min_size=rows, max_size=rows)))  # fmt: skip
    lengths = [draw(st.integers(nb, nb + 4)) for nb in n]
    boundaries = []
    for nb, T_b in zip(n, lengths):
        cuts = sorted(draw(st.sets(st.integers(1, T_b - 1), min_size=nb - 1, max_size=nb - 1))) \
            if nb > 1 else []  # fmt: skip
        boundaries.append([0, *cuts, T_b])
    return values, mask, rewards, n, boundaries, lengths


@fuzz(60)
@given(value_batches(), st.floats(0.0, 1.0), st.floats(-2.0, 2.0))
def test_fuzz_credit_telescopes_and_stays_finite(batch, lam, baseline_value):
    values, mask, rewards, n, boundaries, lengths = batch
    seg_rewards, seg_mask = credit.redistribute(values, mask, rewards)
    for b, nb in enumerate(n):
        total = float(seg_rewards[b, :nb].sum())
        assert total == pytest.approx(float(rewards[b] - values[b, 0]), abs=1e-4)
        assert not seg_mask[b, nb:].any() and seg_mask[b, :nb].all()
    baseline = torch.full_like(rewards, baseline_value)
    anchored = credit.anchor_values(values, mask, baseline)
    anchored_rewards, _ = credit.redistribute(anchored, mask, rewards)
    for b, nb in enumerate(n):
        total = float(anchored_rewards[b, :nb].sum())
        assert total == pytest.approx(float(rewards[b]) - baseline_value, abs=1e-4)
    adv = credit.segment_gae(seg_rewards, seg_mask, lam)
    assert torch.isfinite(adv).all() and (adv[~seg_mask] == 0).all()
    if lam == 1.0:
        for b, nb in enumerate(n):
            for k in range(nb):
                expected = float(rewards[b] - values[b, k])
                assert float(adv[b, k]) == pytest.approx(expected, abs=1e-4)

    T = max(lengths)
    ids = credit.boundaries_to_segment_ids(boundaries, T)
    response_mask = torch.zeros(len(n), T)
    for b, T_b in enumerate(lengths):
        response_mask[b, :T_b] = 1
    tokens = credit.segments_to_tokens(adv, ids, response_mask)
    assert (tokens[response_mask == 0] == 0).all()
    group_ids = torch.arange(len(n)) // 2
    for mode in ("none", "batch_std", "whiten", "group_std", "group_or_batch_std"):
        out = normalization.normalize_advantages(tokens, response_mask, rewards, group_ids, mode)
        assert torch.isfinite(out).all() and (out[response_mask == 0] == 0).all(), mode


@fuzz(60)
@given(st.lists(st.sampled_from([0.0, 1.0]) | finite, min_size=1, max_size=12), st.integers(1, 4))
def test_fuzz_grpo_advantages_are_finite_and_a_group_of_one_learns_nothing(rewards, group):
    rewards_t = torch.tensor(rewards)
    group_ids = torch.arange(len(rewards)) // group
    mask = torch.ones(len(rewards), 3)
    adv = credit_reference.grpo_advantages(rewards_t, group_ids, mask)
    assert torch.isfinite(adv).all()
    if group == 1:  # sampling.num_generations=1: every advantage is 0 (the warning's reason)
        assert (adv == 0).all()


# ---------------------------------------------------------------------------------------------
# verifiers


def _check_verdict(verdict: Verdict) -> None:
    assert isinstance(verdict, Verdict)
    assert isinstance(verdict.reward, float) and math.isfinite(verdict.reward)
    assert 0.0 <= verdict.reward <= 1.0
    assert isinstance(verdict.reason, str) and verdict.reason
    assert "verifier error" not in verdict.reason
    assert verdict.first_error_step is None or verdict.first_error_step >= -1


NUMBERS = st.one_of(
    st.integers(0, 10**6).map(str),
    st.sampled_from(["1,000", "12,345,678", ".5", "0.25", "3.", "1e5", "00", "1,00", "9" * 400]),
)
EXPR_TOKENS = [
    *["1", "2", "7", "48", "0", "0.5", ".25", "1,000", "3.14", "10**400"],
    *["+", "-", "*", "/", "//", "**", "^", "%", "×", "÷", " ", "(", ")", "(", ")"],
    *["x", "$", ",", ".", "(-8)**0.5", "5/0", "(" * 40, ")" * 40, "-" * 40, "**".join("2" * 30)],
]


def expressions(max_tokens: int = 25):
    """Token soup that is mostly arithmetic: nesting, signs, powers, odd numbers, junk."""
    return st.lists(st.sampled_from(EXPR_TOKENS), min_size=1, max_size=max_tokens).map("".join)


@fuzz(300)
@given(expressions())
def test_fuzz_step_evaluator_returns_a_number_or_its_own_error(expr):
    from rredcot.tasks.gsm8k_steps import UnparseableExpression, evaluate

    try:
        value = evaluate(expr)
    except UnparseableExpression:
        return
    assert isinstance(value, float) and math.isfinite(value)


@st.composite
def gsm8k_completions(draw) -> str:
    lines = []
    for _ in range(draw(st.integers(0, 3))):
        left, right = draw(expressions(12)), draw(expressions(4))
        after = draw(st.sampled_from(["", "5", " 5 apples", "%", "5/0", "-3", " $4.50", "1/2"]))
        lines.append(f"{draw(traces(3))}<<{left}={right}>>{after}{draw(traces(3))}")
    lines.append(draw(st.sampled_from(["#### ", "A: ", "", "The answer is "])) + draw(NUMBERS))
    return "\n".join(lines)


_GSM8K = None


def _gsm8k_task():
    global _GSM8K
    if _GSM8K is None:
        from pathlib import Path

        data = Path(__file__).parent / "fixtures" / "data" / "gsm8k" / "train.jsonl"
        _GSM8K = get_task("gsm8k", data=str(data), verifier="exact")
    return _GSM8K


@fuzz(100)
@given(gsm8k_completions(), NUMBERS)
def test_fuzz_gsm8k_verifier(completion, reference):
    from rredcot.tasks.gsm8k_steps import check_lines

    _check_verdict(_gsm8k_task().verify(Problem("q", reference), completion))
    for check in check_lines(completion):
        assert check.status in ("ok", "wrong", "unparseable", "unchecked")


ANSWER_FORMATS = ["gsm8k", "boxed", "last_number", "raw"]
_TASKS: dict = {}


def _tasks() -> dict:
    """Every built-in task's verifier (reasoning-gym when installed) and a problem, built once."""
    if not _TASKS:
        from pathlib import Path

        data = Path(__file__).parent / "fixtures" / "data" / "gsm8k" / "train.jsonl"
        _TASKS["arithmetic"] = get_task("arithmetic", num_steps=3)
        _TASKS["gsm8k"] = _gsm8k_task()
        _TASKS["last_number"] = get_task(
            "dataset", data=str(data), answer_format="last_number", verifier="exact"
        )
        with contextlib.suppress(ImportError):  # the optional reasoning-gym extra
            _TASKS["reasoning_gym"] = get_task(
                "reasoning_gym", dataset_name="chain_sum", size=4, eval_size=2, seed=0
            )
        for name, task in _TASKS.items():
            _TASKS[name] = (task, task.train_problems(1, seed=0)[0])
    return _TASKS


@fuzz(200)
@given(traces(), st.one_of(NUMBERS, traces(3)))
def test_fuzz_every_verifier_on_any_text(text, reference):
    """Each drawn text through answer extraction and every task's verifier, as the completion,
    after a gold trace, and inside answer tags."""
    from rredcot.tasks.answers import (
        check_answer,
        extract_completion_answer,
        extract_reference,
        normalize_answer,
    )

    answer = extract_completion_answer(text)
    assert answer is None or (isinstance(answer, str) and answer)
    for fmt in ANSWER_FORMATS:
        extracted = extract_reference(text, fmt)
        assert extracted is None or isinstance(extracted, str)
    assert isinstance(normalize_answer(text), str)
    matched, failure = check_answer(answer, reference or "0", "exact")
    assert isinstance(matched, bool) and failure is None
    for name, (task, problem) in _tasks().items():
        if name in ("gsm8k", "last_number"):
            problem = Problem("q", reference or "0")
        gold = task.gold_completion(problem) or ""
        for completion in (text, gold + text, f"<answer>{text}</answer>"):
            _check_verdict(task.verify(problem, completion))


@fuzz(8)
@given(traces(8), st.sampled_from(["\\frac{1}{2}", "x^2+1", "\\sqrt{2}", "[1, 2]", "3"]))
def test_fuzz_math_verify_in_its_worker(text, reference):
    """Through the worker process: bounded, never raising, a bool or a timeout reason."""
    pytest.importorskip("math_verify")
    from rredcot.tasks.answers import TIMEOUT_REASON, check_answer

    matched, failure = check_answer(text, reference, "math_verify", timeout=10)
    assert isinstance(matched, bool)
    assert failure is None or failure.startswith(TIMEOUT_REASON)
