"""The benchmark-only oracle: values from the verifier's first-wrong-step label."""

from __future__ import annotations

import math

import pytest
import torch

from rredcot.config import CreditConfig
from rredcot.methods.base import CreditContext, build_credit
from rredcot.methods.oracle import completed_lines, first_error_segment, oracle_values
from text_batches import batch_from_texts


def test_completed_lines_and_error_segment():
    text = "1+2=3\n3*2=6\nA:6"
    starts = [0, 6, 12]  # newline segmentation: one line per segment
    assert completed_lines(text, starts) == [0, 1, 2, 3]
    assert [first_error_segment(text, starts, e) for e in (0, 1, 2, 3)] == [1, 2, 3, 3]
    merged = [0, 6]  # the answer line merged into the last step
    assert completed_lines(text, merged) == [0, 1, 3]
    assert first_error_segment(text, merged, 2) == 2


def test_oracle_values_follow_the_group_success_rate_and_drop_to_zero_at_the_error():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0])
    right = [math.inf, 1.0, 0.0, math.inf]  # sample 1 errs on line 1, sample 2 on line 0
    done = [[0, 1, 2, 3]] * 4
    err = [None, 2, 1, None]
    values, mask = oracle_values(rewards, groups, right, done, err)
    assert mask.all()
    # p(0) = 2/4; p(1) = rows with >= 1 right lines {0, 1, 3}: 2/3; p(2) = {0, 3}: 1
    assert values[0].tolist() == pytest.approx([0.5, 2 / 3, 1.0, 1.0])
    assert values[1].tolist() == pytest.approx([0.5, 2 / 3, 0.0, 0.0])
    assert values[2].tolist() == pytest.approx([0.5, 0.0, 0.0, 0.0])


def test_oracle_blames_the_segment_with_the_first_wrong_step(char_tokenizer, arithmetic_task):
    problems = arithmetic_task.train_problems(1, seed=3)
    gold = arithmetic_task.gold_completion(problems[0])
    wrong = arithmetic_task.inject_error(problems[0], step=1)
    texts = [gold, wrong, gold, wrong]
    batch = batch_from_texts(char_tokenizer, arithmetic_task, problems * 4, texts, group_size=4)
    method = build_credit(
        "oracle", CreditConfig(normalization="none"), CreditContext(None, char_tokenizer)
    )
    out = method.compute(batch)
    assert out.metrics["credit/oracle_labelled_fraction"] == 1.0
    seg = out.segment_advantages
    n = len(batch.boundaries[1]) - 1
    assert n >= 3
    # p(0) = p(1) = 1/2 (every sample gets step 0 right), p(m >= 2) = 1 (only the gold ones).
    # The wrong trace: all its blame on segment 2 (its step 1), nothing before or after.
    assert seg[1, :n].tolist() == pytest.approx([0.0, -0.5] + [0.0] * (n - 2))
    # The gold trace: the credit where its success rate rose, at the step the others got wrong.
    assert seg[0, :n].tolist() == pytest.approx([0.0, 0.5] + [0.0] * (n - 2))
