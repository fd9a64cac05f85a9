"""``rredcot diagnose``: every figure checked against a value worked out by hand on small
hand-built cases (rewards, segment labels and token probabilities set by the test), and one
end-to-end run of the command on a tiny model."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from rredcot.diagnose import (
    KIND,
    DiagnoseConfig,
    DiagnoseReport,
    agreement_by_group_size,
    chunk_from_batch,
    clopper_pearson,
    gradient_figures,
    grpo_advantages,
    grpo_gradient_mass,
    label_shares,
    per_unit_sums,
    ratio_interval,
    step_credit_figures,
    token_kinds,
    trace_figures,
    verdict,
)
from rredcot.errors import UserError
from rredcot.segment import Segmenter
from rredcot.tasks import get_task
from rredcot.tasks.base import Problem
from text_batches import batch_from_texts

# ---------------------------------------------------------------------------------------------
# pure figures


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    # group 0: mean 0.25, unbiased std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5; group 1 agrees
    expected = torch.tensor([1.5, -0.5, -0.5, -0.5, 0.0, 0.0, 0.0, 0.0])
    assert torch.allclose(grpo_advantages(rewards, groups), expected)


def test_grpo_gradient_mass_by_hand():
    adv = torch.tensor([1.5, -0.5])
    p = torch.tensor([[0.9, 0.5, 1.0], [0.2, 0.99, 0.3]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    expected = torch.tensor([[0.15, 0.75, 0.0], [0.4, 0.005, 0.0]])
    assert torch.allclose(grpo_gradient_mass(adv, p, mask), expected, atol=1e-6)


def test_token_kinds_by_hand():
    seg = torch.tensor(
        [
            [0, 0, 1, 1, 2, 3, 3, 4, -1],  # wrong, first error in segment 2, answer segment 4
            [0, 0, 1, 1, 1, 2, -1, -1, -1],  # right, answer segment 2
            [0, 1, 1, 2, 2, -1, -1, -1, -1],  # wrong, no label, answer segment 2
            [0, 0, 0, 1, 1, -1, -1, -1, -1],  # wrong, the answer line is the first error
        ]
    )
    kinds = token_kinds(seg, torch.tensor([0.0, 1.0, 0.0, 0.0]), [2, None, None, 1], [4, 2, 2, 1])
    cp, fe, ae, wa = (
        KIND[k] for k in ("correct_prefix", "first_error", "after_error", "wrong_answer")
    )
    rs, ra, wu = KIND["right_steps"], KIND["right_answer"], KIND["wrong_unlabelled"]
    assert kinds[0].tolist() == [cp, cp, cp, cp, fe, ae, ae, wa, -1]
    assert kinds[1].tolist() == [rs, rs, rs, rs, rs, ra, -1, -1, -1]
    assert kinds[2].tolist() == [wu, wu, wu, wa, wa, -1, -1, -1, -1]
    assert kinds[3].tolist() == [cp, cp, cp, fe, fe, -1, -1, -1, -1]


def test_per_unit_sums_and_shares_by_hand():
    labels = torch.tensor([[0, 1, 1, -1], [2, 2, 0, 0]])
    weights = torch.tensor([[1.0, 2.0, 3.0, 100.0], [4.0, 5.0, 6.0, 7.0]])
    sums = per_unit_sums(labels, weights, torch.tensor([1, 0]), num_units=2, num_labels=3)
    assert sums.tolist() == [[13.0, 0.0, 9.0], [1.0, 5.0, 0.0]]  # the -1 entry is left out
    assert np.allclose(label_shares(sums), [14 / 28, 5 / 28, 9 / 28])


def test_ratio_interval_point_and_degenerate_bootstrap():
    num = np.array([[1.0, 3.0], [2.0, 2.0], [0.0, 4.0]])
    point, lo, hi = ratio_interval(num, reps=500, seed=1)
    assert np.allclose(point, [3 / 12, 9 / 12])
    assert np.all(lo <= point) and np.all(point <= hi)
    # every unit has the same ratio: every resample gives it, so the interval is a point
    same = np.array([[1.0, 3.0], [2.0, 6.0]])
    point, lo, hi = ratio_interval(same, reps=200, seed=0)
    assert np.allclose(point, [0.25, 0.75]) and np.allclose(lo, point) and np.allclose(hi, point)
    # an explicit denominator: uncertain decisions per trace, 7 over 4 traces
    point, _, _ = ratio_interval(np.array([[7.0], [0.0]]), np.array([2.0, 2.0]), reps=0)
    assert point[0] == pytest.approx(1.75)


def test_clopper_pearson_edges_by_hand():
    lo, hi = clopper_pearson(3, 3)  # all three agree: lower = (alpha / 2)^(1/n)
    assert lo == pytest.approx(0.025 ** (1 / 3)) and hi == pytest.approx(1.0)
    lo, hi = clopper_pearson(0, 5)  # none: upper = 1 - (alpha / 2)^(1/n)
    assert lo == pytest.approx(0.0) and hi == pytest.approx(1 - 0.025 ** (1 / 5))


def test_agreement_by_group_size_exact_subsets_by_hand():
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2])
    rows = agreement_by_group_size(rewards, groups, [2, 4], reps=200)
    g2, g4 = rows
    # G' = 2 of 4: [1,0,0,0] agrees with probability (C(1,2) + C(3,2)) / C(4,2) = 3/6 (all
    # wrong); [1,1,1,1] always (all right); [1,1,0,0] (C(2,2) + C(2,2)) / 6 = 1/3 (half each)
    assert g2["agree"] == pytest.approx((0.5 + 1 + 1 / 3) / 3)
    assert g2["all_wrong"] == pytest.approx((0.5 + 0 + 1 / 6) / 3)
    assert g2["all_right"] == pytest.approx((0 + 1 + 1 / 6) / 3)
    assert g2["interval"] == "bootstrap over prompts"
    # G = 4: one group of three agrees (all right), Clopper-Pearson
    assert g4["agree"] == pytest.approx(1 / 3) and g4["all_right"] == pytest.approx(1 / 3)
    assert g4["all_wrong"] == 0.0
    assert g4["agree_ci"] == pytest.approx(list(clopper_pearson(1, 3)))
    assert g4["interval"] == "clopper-pearson"


def test_step_credit_figures_by_hand():
    # one wrong trace, 3 segments of 2, 1 and 2 tokens; V(s_0..s_3) = 0.5, 0.6, 0.0, R = 0
    values = torch.tensor([[0.5, 0.6, 0.0, 0.7]])  # V(s_n) is replaced by R = 0
    mask = torch.ones(1, 4, dtype=torch.bool)
    seg = torch.tensor([[0, 0, 1, 2, 2]])
    p = torch.tensor([[0.9, 0.8, 0.3, 0.99, 0.5]])
    f = step_credit_figures(
        values,
        mask,
        torch.tensor([0.0]),
        seg,
        torch.ones(1, 5),
        p,
        torch.tensor([-0.5]),
        prefix_ends=[1],  # the first wrong segment is segment 1 (0-based)
    )
    # r = (0.1, -0.6, 0.0); outcome advantage R - V(s_0) = -0.5 on each of 5 tokens
    assert f["outcome_sq"][0] == pytest.approx(5 * 0.25)
    assert f["step_sq"][0] == pytest.approx(2 * 0.01 + 0.36)
    assert 1 - f["step_sq"][0] / f["outcome_sq"][0] == pytest.approx(1 - 0.38 / 1.25)
    # 1 - p = (0.1, 0.2, 0.7, 0.01, 0.5); weighted by (1 - p)^2 = (.01, .04, .49, .0001, .25)
    assert f["outcome_sq_grad"][0] == pytest.approx(0.25 * 0.7901)
    assert f["step_sq_grad"][0] == pytest.approx(0.01 * 0.05 + 0.36 * 0.49)
    # |A| = 0.5; prefix = segment 0 (2 tokens)
    assert f["prefix_tokens"][0] == 2 and f["tokens"][0] == 5
    assert f["grpo_blame"][0] == pytest.approx(0.5 * 1.51)
    assert f["grpo_prefix"][0] == pytest.approx(0.5 * 0.3)
    assert f["step_blame"][0] == pytest.approx(0.6 * 0.7)  # only the slip's segment is blamed
    assert f["step_prefix"][0] == pytest.approx(0.0)


def test_verdict_rules():
    long_chain = {  # the 12-step figures of benchmarks/long_chain_gradient_share.py
        "mean_reward": 0.6,
        "all_wrong": 0.1,
        "all_right": 0.15,
        "prefix_share": 0.10,
        "prefix_tokens": 0.43,
        "error_share": 0.44,
        "uncertain_per_trace": 0.8,
        "uncertain_p": 0.5,
        "variance_removed": None,
    }
    head, reasons = verdict(long_chain)
    assert head == "credit assignment has little to win here"
    assert any("only 10% of GRPO's gradient" in r and "44%" in r for r in reasons)
    blind = dict(long_chain, all_wrong=0.34, prefix_share=0.4, uncertain_per_trace=5.0)
    head, reasons = verdict(blind)
    assert head == "finer credit is likely to help this run"
    assert any(r.startswith("+ 34% of groups are all wrong") for r in reasons)
    hopeless = dict(long_chain, mean_reward=0.01, all_wrong=0.95, prefix_share=None)
    head, reasons = verdict(hopeless)
    assert head == "credit assignment has little to win here"
    assert any("solves only 1%" in r for r in reasons)
    assert not any("all wrong" in r for r in reasons)  # no signal to learn from in them


def test_verdict_recommends_references_only_where_measured():
    """The reference baseline was measured on arithmetic chains with the tiny character model,
    whose warm-starts are cut-short supervised training on the same gold traces (recommended
    there with that condition), and on SmolLM2, where its lead was the model copying the task
    generator's solution template (a note for a language model, not a recommendation); elsewhere
    the verdict says it was not measured."""
    blind = {"mean_reward": 0.3, "all_wrong": 0.4, "all_right": 0.0, "has_references": True}
    tiny = dict(blind, task="arithmetic", model_kind="character")
    head, reasons = verdict(tiny)
    (ref,) = [r for r in reasons if "--references.mode sft" in r]
    assert ref.startswith("+ ") and "--references.sft_coef 1" in ref
    assert "warm-start is supervised training on those same reference traces" in ref
    # measured on SmolLM2 (word problems it never trained on): a language-model run is like it
    for pretrained in ("word_problems", "arithmetic"):
        _, reasons = verdict(dict(blind, task=pretrained, model_kind="language_model"))
        (ref,) = [r for r in reasons if "--references.mode sft" in r]
        assert not ref.startswith("+"), ref
        assert "SmolLM2-135M-Instruct on word problems" in ref and "copying that template" in ref
        assert "warm-start is supervised training" not in ref
    for other in (
        dict(blind, task="word_problems"),  # the model's kind unknown
        blind,  # unknown
    ):
        head, reasons = verdict(other)
        (ref,) = [r for r in reasons if "--references.mode sft" in r]
        assert not ref.startswith("+"), ref
        assert "has not been measured on a model or task like this one" in ref
        assert "--references.sft_coef 1" not in ref
    head, reasons = verdict(dict(tiny, has_references=False))
    assert not any("--references.mode" in r for r in reasons)


# ---------------------------------------------------------------------------------------------
# the aggregation over a hand-built batch with probabilities set by the test


@pytest.fixture
def hand_chunk(char_tokenizer):
    task = get_task("arithmetic", num_steps=2)
    problem = Problem(prompt="2+3*4=?\n", answer="20")
    texts = [
        "2+3=5\n5*4=20\nA:20",  # right
        "2+3=5\n5*4=21\nA:21",  # wrong from line 1 (0-based)
        "2+3=6\n6*4=24\nA:24",  # wrong from line 0 ...
        "2+3=6\n6*4=24\nA:24",  # ... in a group that is all wrong: no GRPO update
    ]
    segmenter = Segmenter("newline", separate_answer=True)
    batch = batch_from_texts(
        char_tokenizer, task, [problem] * 4, texts, segmenter=segmenter, group_size=2
    )
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 0.0]
    assert [v.first_error_step for v in batch.verdicts] == [-1, 1, 0, 0]
    assert batch.boundaries[0] == [0, 6, 13, 18]  # "2+3=5\n" | "5*4=20\n" | "A:20" + EOS
    assert batch.boundaries[1] == [0, 6, 13, 18]
    token_p = torch.full(batch.response_mask.shape, 0.9)
    token_p[1, 6:13] = 0.4  # the slip's line: the policy was unsure there
    entropy = torch.full(batch.response_mask.shape, 0.5)
    return chunk_from_batch(batch, 0, token_p, entropy, segmenter)


def test_gradient_figures_by_hand(hand_chunk):
    cfg = DiagnoseConfig(position_bins=2, max_positions=3, bootstrap=50)
    g = gradient_figures([hand_chunk], cfg, num_units=2)
    assert g["wrong_traces"] == 1 and g["right_traces"] == 1 and g["labelled_wrong_traces"] == 1
    # mixed group only (rows 0, 1), |A| equal for both: mass = sum of 1 - p
    # right row: 13 step tokens x 0.1 = 1.3, 5 answer tokens x 0.1 = 0.5
    # wrong row: prefix 6 x 0.1 = 0.6, slip 7 x 0.6 = 4.2, answer 5 x 0.1 = 0.5; total 7.1
    mass = {k: v["mass"]["value"] for k, v in g["kinds"].items()}
    tokens = {k: v["tokens"]["value"] for k, v in g["kinds"].items()}
    expected_mass = {
        "right_steps": 1.3 / 7.1,
        "right_answer": 0.5 / 7.1,
        "correct_prefix": 0.6 / 7.1,
        "first_error": 4.2 / 7.1,
        "after_error": 0.0,
        "wrong_answer": 0.5 / 7.1,
        "wrong_unlabelled": 0.0,
    }
    expected_tokens = {
        "right_steps": 13 / 36,
        "right_answer": 5 / 36,
        "correct_prefix": 6 / 36,
        "first_error": 7 / 36,
        "after_error": 0.0,
        "wrong_answer": 5 / 36,
        "wrong_unlabelled": 0.0,
    }
    assert mass == pytest.approx(expected_mass)
    assert tokens == pytest.approx(expected_tokens)
    wrong = g["wrong_kinds"]
    assert wrong["correct_prefix"]["mass"]["value"] == pytest.approx(0.6 / 5.3)
    assert wrong["first_error"]["mass"]["value"] == pytest.approx(4.2 / 5.3)
    assert wrong["correct_prefix"]["tokens"]["value"] == pytest.approx(6 / 18)
    assert g["kinds"]["first_error"]["mean_1_minus_p"] == pytest.approx(0.6)
    assert g["kinds"]["first_error"]["uncertain_share"] == pytest.approx(1.0)
    # relative position, 2 bins of 9 tokens: wrong row 0.6 + 3 x 0.6 | 4 x 0.6 + 0.5,
    # right row 0.9 | 0.9
    pos = [b["mass"]["value"] for b in g["positions"]]
    assert pos == pytest.approx([3.3 / 7.1, 3.8 / 7.1])
    # segment position: segments 1, 2, 3 = (0.6 + 0.6) / 7.1, (4.2 + 0.7) / 7.1, (0.5 + 0.5) / 7.1
    seg = [b["mass"]["value"] for b in g["segments"]]
    assert seg == pytest.approx([1.2 / 7.1, 4.9 / 7.1, 1.0 / 7.1])
    by_kind = g["mass_by_position_and_kind"]
    assert by_kind["first_error"] == pytest.approx([1.8 / 7.1, 2.4 / 7.1])


def test_trace_figures_by_hand(hand_chunk):
    cfg = DiagnoseConfig(position_bins=2, bootstrap=50)
    t = trace_figures([hand_chunk], cfg, num_units=2)
    # every trace: only the slip's 7 tokens have p < 0.5, so 7 decisions over 4 traces
    assert t["uncertain_per_trace"]["value"] == pytest.approx(7 / 4)
    assert t["traces_without_uncertain"] == pytest.approx(3 / 4)
    assert t["mean_entropy"] == pytest.approx(0.5)
    assert t["tokens_per_trace"] == pytest.approx(18.0)
    one = [b["value"] for b in t["one_minus_p_by_position"]]
    # bin 0: 36 tokens of 0.1 and 3 slip tokens at 0.6 instead; bin 1: 4 slip tokens
    assert one == pytest.approx([(33 * 0.1 + 3 * 0.6) / 36, (32 * 0.1 + 4 * 0.6) / 36])


# ---------------------------------------------------------------------------------------------
# the command


def test_config_refuses_bad_sizes_before_loading():
    with pytest.raises(ValueError, match="group-sizes"):
        DiagnoseConfig(group_sizes="1,4")
    with pytest.raises(ValueError, match="samples must be >= 2"):
        DiagnoseConfig(samples=1, group_sizes="2")
    with pytest.raises(ValueError, match="16 > --samples 8"):  # not dropped silently (issue 39)
        DiagnoseConfig(samples=8, group_sizes="2,4,16")
    assert DiagnoseConfig(samples=8, group_sizes="2,4,8").group_size_list() == [2, 4, 8]
    assert DiagnoseConfig(samples=4).group_size_list() == [2, 4]  # the default list, cut to G


def test_cli_end_to_end_on_a_tiny_model(init_dir, tmp_path, capsys):
    from rredcot.cli.commands import main

    out = tmp_path / "diag"
    argv = ["diagnose", "--policy", str(init_dir), "--task.num_steps", "2", "--prompts", "3"]
    argv += ["--samples", "4", "--group-sizes", "2", "--max-new-tokens", "12", "--mc-traces", "2"]
    argv += ["--mc-k", "2", "--bootstrap", "50", "--out", str(out), "--progress", "false"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("# rredcot diagnose: ")
    report = json.loads((out / "diagnose.json").read_text())
    again = DiagnoseReport.from_json(out / "diagnose.json")  # the JSON holds the whole report
    assert again.summary() == (out / "diagnose.md").read_text() and again.summary() in printed
    assert (out / "diagnose.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert report["settings"]["traces"] == 12 and report["settings"]["max_new_tokens"] == 12
    assert [r["group_size"] for r in report["groups"]["by_group_size"]] == [2, 4]
    assert report["verdict"] in printed and report["reasons"]
    trace = report["trace"]
    assert 0 <= trace["uncertain_per_trace"]["value"] <= 12
    assert report["monte_carlo"]["traces"] == 2 and report["monte_carlo"]["k"] == 2
    assert report["estimators"][0]["method"] == "uniform"
    shares = [b["tokens"] for b in report["gradient"]["positions"]]
    if any(x is not None for x in shares):  # a group with differing rewards was sampled
        assert math.fsum(shares) == pytest.approx(1.0)


def test_run_directory_source_and_value_head_estimator(init_dir, tmp_path):
    """A run directory gives the policy, the task, the sampling settings and (with
    --value-head-run) the trained value head that is scored against the Monte Carlo values."""
    from helpers import micro_config
    from rredcot.diagnose import diagnose_source
    from rredcot.training.trainer import train

    run = tmp_path / "run"
    train(micro_config(init_dir, run, credit_method="value_head", steps=1), given=set())
    cfg = DiagnoseConfig(
        policy=str(run),
        value_head_run=str(run),
        prompts=2,
        samples=4,
        group_sizes="2",
        mc_traces=2,
        mc_k=2,
        bootstrap=20,
        progress=False,
    )
    report = diagnose_source(cfg, log=lambda *a: None)
    s = report.settings
    assert s["task"] == "arithmetic" and s["task_params"]["num_steps"] == 2  # the run's task
    assert s["max_new_tokens"] == 16  # the run's sampling.max_new_tokens
    assert [e["method"] for e in report.estimators] == ["uniform", "value_head"]
    assert report.estimators[1]["value_mse"] is not None  # the head has values to compare

    # refused before the policy loads (this policy does not even exist)
    wrong = DiagnoseConfig(
        **{**dataclasses.asdict(cfg), "policy": "/nonexistent", "value_head_run": str(init_dir)}
    )
    with pytest.raises(UserError, match="not a run directory of a value_head run"):
        diagnose_source(wrong, log=lambda *a: None)


def test_token_probabilities_in_row_chunks_match_one_forward(monkeypatch, char_tokenizer):
    """The forward is split by rows to bound the logits' memory; the figures do not change."""
    import rredcot.diagnose.measure as diagnose_module
    from helpers import make_rollout_batch
    from rredcot.models import build_tiny_llama

    policy = build_tiny_llama(char_tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    batch = make_rollout_batch(
        policy, char_tokenizer, get_task("arithmetic", num_steps=2), num_prompts=3
    )
    p_one, h_one = diagnose_module.token_probabilities(policy, batch, temperature=0.7)
    vocab = policy.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(diagnose_module, "LOGIT_BUDGET", 5 * batch.response_len * vocab)
    p_rows, h_rows = diagnose_module.token_probabilities(policy, batch, temperature=0.7)
    assert batch.size > 5  # so the second call ran in several chunks
    assert torch.allclose(p_one, p_rows, atol=1e-6) and torch.allclose(h_one, h_rows, atol=1e-5)


def test_process_reward_function_is_scored(tiny_policy, char_tokenizer):
    """--process-reward-function: the step scorer's values are scored against Monte Carlo."""
    from rredcot.diagnose import diagnose

    cfg = DiagnoseConfig(
        prompts=2,
        samples=4,
        group_sizes="2",
        max_new_tokens=12,
        mc_traces=2,
        mc_k=2,
        bootstrap=20,
        progress=False,
        process_reward_function="prm_scores:chain_scores",
    )
    task = get_task("arithmetic", num_steps=2)
    report = diagnose(tiny_policy, char_tokenizer, task, cfg, log=lambda *a: None)
    names = [e["method"] for e in report.estimators]
    assert names == ["uniform", "process_reward"]
    assert report.estimators[1]["value_mse"] is not None
