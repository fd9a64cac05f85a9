"""The value head distilling the continuation-likelihood estimator (credit.value_head.teacher):
teacher steps give the estimator's credit and train the head on its values; the steps between
use the head alone and cost no extra forward."""

from __future__ import annotations

import json
import random

import pytest
import torch

from metrics_doc import undocumented
from rredcot.config import CreditConfig
from rredcot.config.io import from_dict
from rredcot.methods.base import CreditContext, build_credit
from rredcot.models import build_tiny_llama
from rredcot.sampling.forward import fill_forward
from rredcot.segment import get_segmenter
from rredcot.tasks import get_task
from text_batches import traces_batch

CHEAP = {  # rredcot.methods.auto.CHEAP_SETTINGS, with the hand-over off so values move credit
    "lam": 0.0,
    "anchor": "none",
    "handover": {"mode": "off", "smoothing": 0.5},
    "continuation_likelihood": {"window": 1},
}


@pytest.fixture(scope="module")
def task():
    return get_task("arithmetic", num_steps=3, max_operand=30)


@pytest.fixture(scope="module")
def policy(char_tokenizer):
    return build_tiny_llama(char_tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)


@pytest.fixture(scope="module")
def batch(char_tokenizer, task, policy):
    """Two prompts x three completions (gold, gold, error-injected), with hidden states."""
    problems = task.train_problems(2, seed=3)
    errors = [(None, None, 1)] * len(problems)
    b = traces_batch(char_tokenizer, task, problems, errors, random.Random(1), group_size=3)
    return fill_forward(policy.eval(), b, hidden_layers=(-1,))


def _method(name, policy, tokenizer, task, **value_head):
    cfg = from_dict(CreditConfig, {**CHEAP, "value_head": value_head})
    ctx = CreditContext(
        policy=policy, tokenizer=tokenizer, task=task, segmenter=get_segmenter("newline")
    )
    return build_credit(name, cfg, ctx)


def _teacher_head(policy, tokenizer, task, every=1, **value_head):
    return _method(
        "value_head",
        policy,
        tokenizer,
        task,
        teacher="continuation_likelihood",
        teacher_every=every,
        **value_head,
    )


def _step(method, batch):
    """rows -> estimate -> credit -> update, as the trainer runs them."""
    rows = method.rows(batch)
    est = method.estimate(rows)
    out = method.credit_output(rows, est, batch.segment_ids, batch.response_mask)
    return out, method.update(rows, est)


def test_config_validates_the_teacher_options(policy, char_tokenizer, task):
    with pytest.raises(ValueError, match="value_head.teacher="):
        from_dict(CreditConfig, {"value_head": {"teacher": "monte_carlo"}})
    with pytest.raises(ValueError, match="teacher_every=0"):
        from_dict(CreditConfig, {"value_head": {"teacher_every": 0}})
    with pytest.raises(ValueError, match="scope=all"):
        from_dict(
            CreditConfig,
            {
                "value_head": {"teacher": "continuation_likelihood"},
                "continuation_likelihood": {"scope": "all_wrong"},
            },
        )
    assert _method("value_head", policy, char_tokenizer, task).teacher is None  # default: none


def test_a_teacher_step_is_the_estimators_credit_and_its_values_are_the_targets(
    policy, char_tokenizer, task, batch, monkeypatch
):
    head = _teacher_head(policy, char_tokenizer, task, every=2)
    teacher = _method("continuation_likelihood", policy, char_tokenizer, task)
    expected = teacher.compute(batch)
    seen = {}
    fit = head.fit.fit
    monkeypatch.setattr(head.fit, "fit", lambda entry: seen.update(entry) or fit(entry))
    out, stats = _step(head, batch)
    assert torch.equal(out.advantages, expected.advantages)
    assert out.advantages.abs().sum() > 0  # the values moved credit (not GRPO's zeros)
    tokens = out.metrics["credit/extra_forward_tokens"]
    assert tokens == expected.metrics["credit/extra_forward_tokens"] > 0
    assert out.metrics["value/teacher_ran"] == 1.0
    assert out.metrics["value/teacher_mse"] >= 0.0
    assert undocumented(set(out.metrics) | set(stats)) == []
    # the head's targets: the teacher's values at every boundary k < n
    values, mask = expected.values, expected.value_mask
    n = mask.sum(1) - 1
    target_mask = mask & (torch.arange(mask.shape[1])[None, :] < n[:, None])
    assert torch.equal(seen["target_mask"], target_mask)
    assert torch.allclose(seen["targets"][target_mask], values[target_mask].float())
    assert head.steps == 1


def test_a_step_between_uses_the_head_and_costs_nothing(
    policy, char_tokenizer, task, batch, monkeypatch
):
    head = _teacher_head(policy, char_tokenizer, task, every=2)
    _step(head, batch)  # step 0: the teacher's
    calls = []
    rows = head.teacher.rows
    monkeypatch.setattr(head.teacher, "rows", lambda b: calls.append(1) or rows(b))
    before = [p.detach().clone() for p in head.head.parameters()]
    out, stats = _step(head, batch)  # step 1: the head's
    assert calls == []
    assert out.metrics["credit/extra_forward_tokens"] == 0.0
    assert out.metrics["value/teacher_ran"] == 0.0
    assert "value/loss" not in stats  # nothing to learn from
    assert all(torch.equal(a, b) for a, b in zip(before, head.head.parameters()))
    assert undocumented(set(out.metrics) | set(stats)) == []
    _step(head, batch)  # step 2: the teacher's again
    assert calls == [1]


def test_the_heads_distance_to_the_teacher_shrinks(policy, char_tokenizer, task, batch):
    head = _teacher_head(policy, char_tokenizer, task, lr=1e-2)
    mse = [_step(head, batch)[0].metrics["value/teacher_mse"] for _ in range(5)]
    assert mse[-1] < 0.5 * mse[0]
    assert all(b <= a + 1e-6 for a, b in zip(mse, mse[1:]))


def test_the_step_count_survives_a_resume(policy, char_tokenizer, task, batch):
    head = _teacher_head(policy, char_tokenizer, task, every=3)
    _step(head, batch)
    again = _teacher_head(policy, char_tokenizer, task, every=3)
    again.load_state_dict(head.state_dict())
    assert again.steps == 1 and not again.teacher_due


def test_a_training_run_bills_the_teacher_on_its_steps_only(init_dir, tmp_path):
    from helpers import micro_config
    from rredcot.training.trainer import Trainer

    cfg = micro_config(init_dir, tmp_path / "run", credit_method="value_head", steps=3)
    cfg.credit.value_head.teacher = "continuation_likelihood"
    cfg.credit.value_head.teacher_every = 2
    Trainer(cfg, log=lambda *_: None).train()
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    recs = [r for r in map(json.loads, lines) if "value/teacher_ran" in r]
    assert [r["value/teacher_ran"] for r in recs] == [1.0, 0.0, 1.0]
    assert [r["credit/extra_forward_tokens"] > 0 for r in recs] == [True, False, True]
    assert all(undocumented(set(r)) == [] for r in recs)


def test_bench_credit_scores_the_distilled_head(init_dir, tmp_path, capsys):
    from rredcot.cli.commands import main

    out = tmp_path / "credit"
    methods = "uniform,vh_t=value_head:value_head.teacher=continuation_likelihood:lam=0"
    argv = ["bench", "credit", "--checkpoint", str(init_dir), "--task", "arithmetic"]
    argv += ["--task.num_steps", "2", "--methods", methods, "--segmenter", "newline"]
    argv += ["--prompts", "2", "--samples", "4", "--mc-k", "4", "--value-fit-batches", "2"]
    argv += ["--value-fit-prompts", "2", "--max-new-tokens", "16", "--out", str(out)]
    assert main(argv) == 0
    report = json.loads((out / "credit.json").read_text())
    row = next(r for r in report["results"] if r["method"] == "vh_t")
    assert row["fit"]["value_pretrain/teacher_steps"] == 2.0
    assert row["fit"]["value_pretrain/teacher_mse_last"] >= 0.0
    assert row["extra_forward_tokens_per_trace"] == 0.0  # the head's values, not the teacher's
    assert row["value_mse"] is not None
