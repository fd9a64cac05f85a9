"""The benchmark-only oracle: values from the verifier's first-wrong-step label."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from rredcot.config import CreditConfig, OracleConfig, SamplingConfig
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


def _all_wrong_group_and_gold_group(char_tokenizer, arithmetic_task):
    """Group 0: two traces wrong at step 1 (rewards agree); group 1: two gold traces."""
    problems = arithmetic_task.train_problems(2, seed=3)
    wrong = arithmetic_task.inject_error(problems[0], step=1)
    gold = arithmetic_task.gold_completion(problems[1])
    rows = [problems[0], problems[0], problems[1], problems[1]]
    return batch_from_texts(
        char_tokenizer, arithmetic_task, rows, [wrong, wrong, gold, gold], group_size=2
    )


def test_group_oracle_is_blind_where_rewards_agree_and_pooled_is_not(
    char_tokenizer, arithmetic_task
):
    batch = _all_wrong_group_and_gold_group(char_tokenizer, arithmetic_task)
    seg = {}
    for values in ("group", "pooled"):
        config = CreditConfig(normalization="none", oracle=OracleConfig(values=values))
        method = build_credit("oracle", config, CreditContext(None, char_tokenizer))
        seg[values] = method.compute(batch).segment_advantages
    assert seg["group"].abs().sum() == 0  # both groups' rewards agree: no credit anywhere
    # pooled: p(0) = 1/2 over the batch, p(1) = 1/2 (every trace gets line 0 right), p(2) = 1
    # (only the gold ones): the wrong traces' blame -1/2 lands on segment 2, their step 1
    n = len(batch.boundaries[0]) - 1
    assert seg["pooled"][0, :n].tolist() == pytest.approx([0.0, -0.5] + [0.0] * (n - 2))
    assert seg["pooled"][2, :n].tolist() == pytest.approx([0.0, 0.5] + [0.0] * (n - 2))


def test_monte_carlo_oracle_rolls_out_only_still_right_prefixes_for_free(
    monkeypatch, char_tokenizer, arithmetic_task, tiny_policy
):
    from test_monte_carlo import Script

    from rredcot.methods import monte_carlo

    batch = _all_wrong_group_and_gold_group(char_tokenizer, arithmetic_task)
    # k gold lines done: k + 1 of the 4 continuations finish the gold trace, the rest fail.
    # Script asserts that every prefix it continues is a gold prefix: a prefix holding the
    # first wrong line is never rolled out.
    script = Script(char_tokenizer, arithmetic_task, batch.problems, lambda k: k + 1)
    monkeypatch.setattr(monte_carlo, "generate_from_ids", script)
    config = CreditConfig(
        normalization="none", oracle=OracleConfig(values="monte_carlo", rollouts=4)
    )
    sampling = SamplingConfig(max_new_tokens=64)
    context = CreditContext(tiny_policy, char_tokenizer, task=arithmetic_task, sampling=sampling)
    method = build_credit("oracle", config, context)
    est = method.estimate(method.rows(batch))
    values = est.credit.values
    n = len(batch.boundaries[0]) - 1
    # wrong traces: V(s_0) = 1/4, V(s_1) = 2/4, then 0 from the segment holding step 1 on
    assert values[0, :n].tolist() == pytest.approx([0.25, 0.5] + [0.0] * (n - 2))
    # gold traces: (k + 1) / 4 at every boundary
    assert values[2, :n].tolist() == pytest.approx([(k + 1) / 4 for k in range(n)])
    # unique prefixes: s_0, s_1 of problem 0 and s_0..s_{n-1} of problem 1
    assert len(script.prefixes) == 2 + n == est.metrics["credit/oracle_mc_prefixes"]
    assert est.metrics["credit/oracle_generated_tokens"] > 0
    assert est.cost.extra_generated_tokens == 0  # a ceiling: reported, never charged
    # the all-wrong group now gets credit: blame on its wrong step, credit for its right one
    seg = method.compute(batch).segment_advantages
    assert seg[0, :n].tolist() == pytest.approx([0.25, -0.5] + [0.0] * (n - 2))


def test_oracle_options_are_checked():
    with pytest.raises(ValueError, match="credit.oracle.values='best'; valid: group, pooled"):
        OracleConfig(values="best")
    with pytest.raises(ValueError, match="monte_carlo needs the task"):
        build_credit(
            "oracle",
            CreditConfig(oracle=OracleConfig(values="monte_carlo")),
            CreditContext(None, None),
        )


def test_monte_carlo_oracle_in_training_reports_but_does_not_charge_its_rollouts(
    init_dir, tmp_path
):
    from helpers import micro_config
    from rredcot.training.trainer import Trainer

    cfg = micro_config(
        init_dir,
        tmp_path / "run",
        credit_method="oracle",
        steps=1,
        max_tokens_generated=10_000,
        credit=CreditConfig(oracle=OracleConfig(values="monte_carlo", rollouts=2)),
    )
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    record = trainer.train_step(1)
    assert record["credit/oracle_generated_tokens"] > 0
    assert record["extra_tokens_generated"] == 0
    assert record["tokens_generated"] == trainer.tokens_generated  # rollouts only


def _unlabelled_third_row(char_tokenizer, arithmetic_task, ended: bool, failed: bool):
    """A group of three: the gold trace, one wrong at step 1, and a two-line trace whose second
    line stops short, with no step label; ``ended``: it ends with EOS (else the cap cut it);
    ``failed``: its reward set to 0 (the rewards then 1, 0, 0)."""
    problems = arithmetic_task.train_problems(1, seed=3)
    gold = arithmetic_task.gold_completion(problems[0])
    wrong = arithmetic_task.inject_error(problems[0], step=1)
    short = gold.split("\n")[0] + "\n" + gold.split("\n")[1][:2]  # two lines, the second short
    batch = batch_from_texts(
        char_tokenizer,
        arithmetic_task,
        problems * 3,
        [gold, wrong, short],
        group_size=3,
        cut_rows=() if ended else (2,),
    )
    verdicts = list(batch.verdicts)
    if failed:
        verdicts[2] = dataclasses.replace(verdicts[2], first_error_step=None, reward=0.0)
        return batch.replace(verdicts=verdicts, rewards=torch.tensor([1.0, 0.0, 0.0]))
    verdicts[2] = dataclasses.replace(verdicts[2], first_error_step=None)
    return batch.replace(verdicts=verdicts)


def _oracle(char_tokenizer, **options):
    config = CreditConfig(normalization="none", oracle=OracleConfig(**options))
    return build_credit("oracle", config, CreditContext(None, char_tokenizer))


def test_a_row_without_a_label_gets_grpo_credit_on_every_segment(char_tokenizer, arithmetic_task):
    """An unknown label (a trace cut short, no step labels) is no blame on its last segment:
    lambda 1 through its boundaries gives every segment ``R - mean(R_group)``, as GRPO does."""
    batch = _unlabelled_third_row(char_tokenizer, arithmetic_task, ended=False, failed=False)
    out = _oracle(char_tokenizer).compute(batch)
    assert out.metrics["credit/oracle_labelled_fraction"] == pytest.approx(2 / 3)
    n = int(batch.num_segments[2])
    assert n == 2
    grpo = float(batch.rewards[2] - batch.rewards.mean())
    assert out.segment_advantages[2, :n].tolist() == pytest.approx([grpo] * n)
    assert torch.isfinite(out.advantages).all() and torch.isfinite(out.values).all()


def test_a_failed_unlabelled_trace_that_ended_is_wrong_at_its_last_line(
    char_tokenizer, arithmetic_task
):
    """The same unlabelled row, but ended by EOS (it stopped without a right answer): blamed at
    its last segment like a labelled trace (no unjudged refuge), unless ended_unlabelled=grpo;
    cut by the token cap it keeps GRPO's credit (the test above)."""
    batch = _unlabelled_third_row(char_tokenizer, arithmetic_task, ended=True, failed=True)
    n = int(batch.num_segments[2])
    assert n == 2
    blamed = _oracle(char_tokenizer, ended_unlabelled="last_segment").compute(batch)
    assert blamed.metrics["credit/oracle_labelled_fraction"] == 1.0
    # p(0) = 1/3; p(1) = 1/3 (every row has its first line right); the stopped row's last
    # segment holds its error: V(s_1) = p(1), V(s_2) = R = 0.
    assert blamed.segment_advantages[2, :n].tolist() == pytest.approx([0.0, -1 / 3])
    grpo = _oracle(char_tokenizer, ended_unlabelled="grpo").compute(batch)
    assert grpo.metrics["credit/oracle_labelled_fraction"] == pytest.approx(2 / 3)
    assert grpo.segment_advantages[2, :n].tolist() == pytest.approx([-1 / 3] * n)
    with pytest.raises(ValueError, match="ended_unlabelled='x'; valid: last_segment, grpo"):
        OracleConfig(ended_unlabelled="x")


def test_a_failed_unlabelled_trace_cut_by_the_cap_is_blamed_only_when_asked(
    char_tokenizer, arithmetic_task
):
    """capped_unlabelled: a trace cut by the token cap (no EOS) keeps GRPO's credit by default,
    and is blamed at its last segment with capped_unlabelled=last_segment."""
    batch = _unlabelled_third_row(char_tokenizer, arithmetic_task, ended=False, failed=True)
    n = int(batch.num_segments[2])

    def segments(capped):
        out = _oracle(char_tokenizer, capped_unlabelled=capped).compute(batch)
        return out.segment_advantages[2, :n].tolist()

    assert segments("grpo") == pytest.approx([-1 / 3] * n)
    assert segments("last_segment") == pytest.approx([0.0, -1 / 3])
    with pytest.raises(ValueError, match="capped_unlabelled='x'; valid: last_segment, grpo"):
        OracleConfig(capped_unlabelled="x")
