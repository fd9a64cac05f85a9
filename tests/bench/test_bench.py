"""Benchmarks: the statistics by hand, variants, re-segmentation, and each command end to end on
a tiny random policy with a task whose ground truth is known exactly."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass

import pytest
import torch
import yaml

import rredcot.training.trainer as trainer_module
from rredcot.bench.configs import LEARN_LR, CreditBenchConfig
from rredcot.bench.credit import credit_markdown, fit_method, merge_credit_reports, resegment
from rredcot.bench.learn import (
    LearnBenchConfig,
    accuracy_at_second,
    bootstrap_trace_cov,
    run_learn_bench,
    time_averaged_accuracy,
    train_config,
)
from rredcot.bench.overhead import PHASES, OverheadBenchConfig, run_overhead_bench
from rredcot.bench.report import fmt, interpolate_runs, markdown_table
from rredcot.bench.variants import parse_set, parse_variants
from rredcot.cli.commands import main
from rredcot.config import TrainConfig
from rredcot.explain.scores import per_trace_spearman, sign_agreement, spearman, value_errors
from rredcot.tasks import Verdict, register_task
from rredcot.tasks.base import Problem, Task


@dataclass
class _NoParams:
    pass


class _FirstCharTask(Task):
    """Reward 1 iff the completion's first character has an even code point. The first token
    decides the outcome, so ``V(s_k) = R`` exactly for every ``k >= 1``: the exact advantages are
    ``r_1 = R - V(s_0)`` and ``r_k = 0`` after, and the first line holds every wrong trace's
    first error. A random policy gets varied rewards."""

    Params = _NoParams

    def _problems(self, n, seed, split):
        return [Problem(f"{seed}:{split}:{i}=?\n", "0") for i in range(n)]

    def train_problems(self, n, seed):
        return self._problems(n, seed, "train")

    def eval_problems(self, n, seed):
        return self._problems(n, seed, "eval")

    def verify(self, problem, completion):
        ok = bool(completion) and ord(completion[0]) % 2 == 0
        return Verdict(float(ok), completion[:1], -1 if ok else 0, "even" if ok else "odd")


register_task("bench_first_char")(_FirstCharTask)


class _FirstCharUnlabelledWrong(_FirstCharTask):
    """The same outcome, but a wrong trace has no step label (``first_error_step`` None)."""

    def verify(self, problem, completion):
        v = super().verify(problem, completion)
        return v if v.reward == 1.0 else Verdict(v.reward, v.answer, None, v.reason)


class _FirstCharNoLabels(_FirstCharTask):
    """No step labels at all."""

    def verify(self, problem, completion):
        v = super().verify(problem, completion)
        return Verdict(v.reward, v.answer, None, v.reason)


register_task("bench_first_char_unlabelled_wrong")(_FirstCharUnlabelledWrong)
register_task("bench_first_char_no_labels")(_FirstCharNoLabels)

QUIET = dict(log=lambda *_: None)


# ---------------------------------------------------------------------------------------------
# statistics


def test_spearman_matches_a_hand_computed_example_with_ties():
    # ranks x = [1, 2.5, 2.5, 4, 5], ranks y = [2, 1, 3.5, 3.5, 5]; centred products sum to
    # 7.25 and both centred sums of squares are 9.5.
    x = torch.tensor([1.0, 2.0, 2.0, 3.0, 4.0])
    y = torch.tensor([2.0, 1.0, 3.0, 3.0, 5.0])
    assert spearman(x, y) == pytest.approx(7.25 / 9.5, abs=1e-12)
    assert spearman(y, x) == pytest.approx(7.25 / 9.5, abs=1e-12)
    assert spearman(x, torch.exp(x)) == pytest.approx(1.0)
    assert spearman(x, -x) == pytest.approx(-1.0)
    assert math.isnan(spearman(x, torch.ones(5)))  # constant side
    assert math.isnan(spearman(torch.tensor([1.0]), torch.tensor([2.0])))
    # float noise ties: 0.1 + 0.2 and 0.3 share a rank
    assert spearman(torch.tensor([0.1 + 0.2, 0.3, 1.0]), torch.tensor([0.0, 0.0, 1.0])) == 1.0
    with pytest.raises(ValueError, match="equal lengths"):
        spearman(x, y[:3])


def test_sign_agreement_counts_zero_predictions_half():
    pred = torch.tensor([1.0, -1.0, 0.0, 2.0])
    truth = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the last one is left out
    assert sign_agreement(pred, truth) == pytest.approx(1.5 / 3)
    assert math.isnan(sign_agreement(pred, torch.zeros(4)))
    # a prediction within the tolerance of 0 counts one half, whatever its sign
    tiny = torch.tensor([1e-12, -1e-12, 2.0])
    assert sign_agreement(tiny, torch.tensor([1.0, 1.0, 1.0])) == pytest.approx(2.0 / 3)


def test_per_trace_spearman_skips_constant_truth_and_scores_constant_credit_zero():
    preds = [[1.0, 2.0, 3.0], [5.0, 5.0, 5.0], [1.0], [1.0, 2.0]]
    truths = [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0], [1.0], [3.0, 3.0]]
    mean, used = per_trace_spearman(preds, truths)
    assert used == 2
    assert mean == pytest.approx(0.5)


def test_value_errors_by_hand():
    mse, ece = value_errors([[0.2, 0.8]], [[0.0, 1.0]])
    assert mse == pytest.approx(0.04)
    assert ece == pytest.approx(0.2)  # two bins, each off by 0.2


def test_bootstrap_trace_cov_matches_its_expectation():
    g = torch.randn(5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mean = g.mean(0)
    per_unit = float(((g - mean) ** 2).sum(-1).mean())  # (1/N) sum ||g_i - g_bar||^2
    var, mean_sq = bootstrap_trace_cov(g, minibatch=2, draws=40_000, seed=1)
    assert mean_sq == pytest.approx(float(mean @ mean), rel=1e-9)
    assert var == pytest.approx(per_unit / 2, rel=0.03)
    # a minibatch of one unit: exactly the per-unit spread, in expectation
    var1, _ = bootstrap_trace_cov(g, minibatch=1, draws=40_000, seed=2)
    assert var1 == pytest.approx(per_unit, rel=0.03)


# ---------------------------------------------------------------------------------------------
# variants, report helpers


def test_parse_variants_names_methods_and_overrides():
    vs = parse_variants(
        "uniform, vh0=value_head:lam=0:separate_answer=true:handover.mode=off, value_head:lr=1e-5"
    )
    assert [v.name for v in vs] == ["uniform", "vh0", "value_head:lr=1e-5"]
    assert [v.method for v in vs] == ["uniform", "value_head", "value_head"]
    assert vs[1].overrides == {
        "credit.lam": "0",
        "credit.separate_answer": "true",
        "credit.handover.mode": "off",
    }
    c = vs[1].credit_config({"credit.lam": "0.7", "credit.min_chars": "3"})
    assert (c.lam, c.separate_answer, c.handover.mode, c.min_chars) == (0.0, True, "off", 3)
    assert vs[2].train_overrides({"steps": "5"}) == {
        "steps": "5",
        "lr": "1e-5",
        "credit_method": "value_head",
    }
    assert parse_set(["lam=0.5", "sampling.temperature=0.7"]) == {
        "credit.lam": "0.5",
        "sampling.temperature": "0.7",
    }


def test_parse_variants_keeps_a_segmenters_own_options():
    (merge, entropy) = parse_variants(
        "m=value_head:segmenter=newline+merge:fraction=0.5:lam=0,"
        "e=value_head:lam=0.5:segmenter=entropy:top=0.2"
    )
    assert merge.overrides == {"credit.segmenter": "newline+merge:fraction=0.5", "credit.lam": "0"}
    assert merge.credit_config().segmenter == "newline+merge:fraction=0.5"
    assert entropy.overrides == {"credit.lam": "0.5", "credit.segmenter": "entropy:top=0.2"}


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nope", "unknown credit method"),
        ("value_head:fraction=0.5", "unknown variant key 'fraction'"),
        ("value_head:segmenter=newline+merge:bogus=1", "newline\\+merge: give target=N"),
        ("value_head:bogus=1", "unknown variant key"),
        ("value_head:lam", "not key=value"),
        ("value_head:lam=2", "lam"),
        ("a=uniform,a=value_head", "named twice"),
        ("", "no methods"),
    ],
)
def test_parse_variants_rejects_bad_specs(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_variants(spec)


def test_report_helpers():
    table = markdown_table(["a", "bb"], [[fmt(1.23456), fmt(None)], [fmt(float("nan")), "x|y"]])
    assert table.splitlines()[0] == "| a     | bb   |"
    assert "| 1.235 | –    |" in table and "x\\|y" in table
    grid, mean, std = interpolate_runs([([0, 10], [0.0, 1.0]), ([0, 5, 20], [0.0, 1.0, 1.0])], 3)
    assert grid.tolist() == [0.0, 5.0, 10.0]
    assert mean.tolist() == pytest.approx([0.0, 0.75, 1.0])
    assert std.tolist() == pytest.approx([0.0, math.sqrt(0.125), 0.0])


# ---------------------------------------------------------------------------------------------
# re-segmentation


def test_resegment_equals_sampling_with_that_segmenter(tiny_policy, char_tokenizer):
    from rredcot.sampling.rollout import build_rollout_batch
    from rredcot.segment import get_segmenter

    task = _FirstCharTask()
    problems = task.eval_problems(2, seed=0)

    def sample(strategy):
        torch.manual_seed(3)
        batch, _ = build_rollout_batch(
            tiny_policy,
            char_tokenizer,
            task,
            problems,
            get_segmenter(strategy),
            num_generations=3,
            max_new_tokens=14,
        )
        return batch

    coarse, fine = sample("tokens:6"), sample("tokens:3")
    assert coarse.completions == fine.completions
    redone = resegment(coarse, char_tokenizer, get_segmenter("tokens:3"))
    assert redone.boundaries == fine.boundaries
    assert redone.segment_char_starts == fine.segment_char_starts
    assert torch.equal(redone.segment_ids, fine.segment_ids)
    assert redone.boundaries != coarse.boundaries
    assert torch.equal(redone.input_ids, coarse.input_ids)


def _sampled_at_0_7(policy, tokenizer, seed: int):
    """6 completions of 2 first-char prompts at temperature 0.7, cut every 6 tokens."""
    from rredcot.sampling.rollout import build_rollout_batch
    from rredcot.segment import get_segmenter

    torch.manual_seed(seed)
    batch, _ = build_rollout_batch(
        policy,
        tokenizer,
        _FirstCharTask(),
        _FirstCharTask().eval_problems(2, seed=0),
        get_segmenter("tokens:6"),
        num_generations=3,
        max_new_tokens=14,
        temperature=0.7,
    )
    return batch


def test_resegment_with_an_entropy_strategy_reads_the_policys_entropies(
    tiny_policy, char_tokenizer
):
    """The credit bench cuts entropy strategies at the entropies the trainer reads from its
    forward (at the sampling temperature); without the policy it says what is missing."""
    from rredcot.sampling.forward import policy_forward
    from rredcot.sampling.rollout import segment_batch
    from rredcot.segment import get_segmenter

    batch = _sampled_at_0_7(tiny_policy, char_tokenizer, seed=3)
    entropy = get_segmenter("entropy:top=0.3,min=1")
    redone = resegment(batch, char_tokenizer, entropy, tiny_policy, temperature=0.7)
    with torch.no_grad():
        ent = policy_forward(
            tiny_policy,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_len,
            with_entropy=True,
            temperature=0.7,
        ).entropy
    assert redone.boundaries == segment_batch(batch, char_tokenizer, entropy, ent).boundaries
    assert max(len(b) - 1 for b in redone.boundaries) > 1
    with pytest.raises(ValueError, match="entropies"):
        resegment(batch, char_tokenizer, entropy)


def test_fit_batches_are_cut_and_scored_at_the_sampling_temperature(tiny_policy, char_tokenizer):
    """A learned method is fitted on batches cut by the entropy strategy and carrying the old
    log-probs and hidden states of one scoring pass at the sampling temperature, as in training."""
    from rredcot.bench.configs import CreditBenchConfig
    from rredcot.sampling.forward import policy_forward
    from rredcot.sampling.rollout import segment_batch
    from rredcot.segment import get_segmenter

    batch = _sampled_at_0_7(tiny_policy, char_tokenizer, seed=4)

    class Recorder:
        name, needs_hidden_states, hidden_layers, learns = "recorder", True, (-1,), True

        def state_dict(self):
            return {"w": torch.zeros(1)}

        def pretrain(self, next_batch, steps):
            self.seen = [next_batch() for _ in range(steps)]
            return {}

    entropy = get_segmenter("entropy:top=0.3,min=1")
    cfg = CreditBenchConfig(checkpoint="x", temperature=0.7)
    recorder = Recorder()
    fit_method(recorder, "r", [batch], None, cfg, tiny_policy, char_tokenizer, entropy, print)
    (seen,) = recorder.seen
    with torch.no_grad():
        fwd = policy_forward(
            tiny_policy,
            batch.input_ids,
            batch.attention_mask,
            batch.prompt_len,
            hidden_layers=(-1,),
            with_entropy=True,
            temperature=0.7,
        )
    assert seen.boundaries == segment_batch(batch, char_tokenizer, entropy, fwd.entropy).boundaries
    mask = batch.response_mask.bool()
    torch.testing.assert_close(seen.old_logprobs[mask], fwd.logprobs[mask])
    assert seen.hidden_states is not None


def _credit_report(segmenter: str, chance: float, **config) -> dict:
    rows = [
        {"method": m, "segmenter": segmenter, "error_acc": e, "chance_error_acc": chance}
        for m, e in (("ground_truth", 0.7), ("uniform", 0.3))
    ]
    return {
        "config": {"segmenters": segmenter, "out": f"runs/{segmenter}", "mc_k": 8, **config},
        "policy": "p",
        "task": "t",
        "num_traces": 48,
        "mean_reward": 0.25,
        "sample_seconds": 4.0,
        "comparison_lam": 0.0,
        "ground_truth": {segmenter: {"k": 8}},
        "results": rows,
        "examples": {segmenter: f"examples_{segmenter}.html"},
    }


def test_merged_credit_reports_hold_every_segmenter_with_its_own_chance():
    merged = merge_credit_reports(
        [_credit_report("newline", 0.35, seed=0), _credit_report("entropy", 0.2, seed=0)]
    )
    assert merged["config"]["segmenters"] == "newline,entropy"
    assert [(r["method"], r["segmenter"]) for r in merged["results"]] == [
        ("ground_truth", "newline"),
        ("uniform", "newline"),
        ("ground_truth", "entropy"),
        ("uniform", "entropy"),
    ]
    assert set(merged["ground_truth"]) == set(merged["examples"]) == {"newline", "entropy"}
    md = credit_markdown(merged)
    assert "random blame scores error_acc 0.350 (newline), 0.200 (entropy)." in md
    assert "error_acc 0.350." in credit_markdown(_credit_report("newline", 0.35))
    with pytest.raises(ValueError, match="differ in seed"):
        merge_credit_reports([_credit_report("a", 0.3, seed=0), _credit_report("b", 0.3, seed=1)])
    other = _credit_report("b", 0.3)
    other["mean_reward"] = 0.5
    with pytest.raises(ValueError, match="sampled different traces"):
        merge_credit_reports([_credit_report("a", 0.3), other])
    with pytest.raises(ValueError, match="'a' is in more than one report"):
        merge_credit_reports([_credit_report("a", 0.3), _credit_report("a", 0.3)])


# ---------------------------------------------------------------------------------------------
# the commands end to end


def test_bench_credit_end_to_end(init_dir, tmp_path, capsys):
    out = tmp_path / "credit"
    methods = "uniform,mc=monte_carlo:monte_carlo.rollouts=16,value_head,first_last,attention"
    argv = ["bench", "credit", "--checkpoint", str(init_dir), "--task", "bench_first_char"]
    argv += ["--methods", methods, "--segmenter", "tokens:4,tokens:8", "--prompts", "3"]
    argv += ["--samples", "4", "--mc-k", "16", "--value-fit-batches", "1"]
    argv += ["--value-fit-prompts", "2", "--max-new-tokens", "12", "--out", str(out)]
    assert main(argv) == 0
    assert "| method" in capsys.readouterr().out  # the table is printed
    report = json.loads((out / "credit.json").read_text())
    assert report["num_traces"] == 12 and 0 < report["mean_reward"] < 1
    rows = {(r["method"], r["segmenter"]): r for r in report["results"]}
    names = ["ground_truth", "uniform", "mc", "value_head", "first_last", "attention"]
    assert set(rows) == {(m, s) for m in names for s in ("tokens:4", "tokens:8")}
    for seg in ("tokens:4", "tokens:8"):
        gt, mc, uni, fl = (rows[(m, seg)] for m in ("ground_truth", "mc", "uniform", "first_last"))
        # exact values after s_0: the ground truth blames the first segment of every wrong trace
        assert gt["error_acc"] == 1.0 and gt["correct_acc"] == 1.0
        # 16 Monte Carlo rollouts agree with 32 in sign everywhere and rank nearly alike
        assert mc["sign_agreement"] == 1.0 and mc["error_acc"] == 1.0
        assert mc["spearman_pooled"] > 0.9
        assert mc["extra_generated_tokens_per_trace"] > 0
        # uniform at lambda 0 puts everything on the last segment: never the first error
        assert uni["error_acc"] < mc["error_acc"]
        assert uni["time_ratio_to_uniform"] == 1.0
        # first_last splits evenly between two segments: a fair tie scores exactly 1/2
        assert fl["error_acc"] == pytest.approx(0.5)
        assert fl["value_mse"] is None and mc["value_mse"] >= 0
        # attention weights need eager attention, switched on for that method only
        assert rows[("attention", seg)]["extra_forward_tokens_per_trace"] > 0
        assert rows[("value_head", seg)]["fit"]["value_pretrain/steps"] == 1.0
        for key in ("spearman_trace_mean", "seconds_per_trace", "extra_forward_tokens_per_trace"):
            assert key in mc
    md = (out / "credit.md").read_text()
    assert all(name in md for name in names)
    page = (out / report["examples"]["tokens:4"]).read_text()
    assert "ground truth V_MC" in page and "first_last" in page


def _oracle_truth_argv(init_dir, out, task, methods="uniform,oracle"):
    argv = ["bench", "credit", "--checkpoint", str(init_dir), "--task", task]
    argv += ["--methods", methods, "--segmenter", "tokens:4", "--prompts", "3", "--samples", "4"]
    argv += ["--value-fit-batches", "0", "--max-new-tokens", "12", "--out", str(out)]
    return argv + ["--ground_truth", "oracle", "--set", "credit.oracle.values=pooled"]


def test_bench_credit_against_the_oracle(init_dir, tmp_path, capsys):
    out = tmp_path / "credit"
    methods = "uniform,oracle,mc=monte_carlo:monte_carlo.rollouts=8"
    assert main(_oracle_truth_argv(init_dir, out, "bench_first_char", methods)) == 0
    report = json.loads((out / "credit.json").read_text())
    rows = {r["method"]: r for r in report["results"]}
    gt = report["ground_truth"]["tokens:4"]
    assert gt["ground_truth"] == "oracle, pooled values" and gt["judged_traces"] == 12
    assert "k" not in gt and gt["extra_generated_tokens"] == 0  # the labels cost no generation
    # the oracle method scored against its own values: exact agreement
    oracle = rows["oracle"]
    assert oracle["spearman_pooled"] == pytest.approx(1.0) and oracle["value_mse"] == 0.0
    assert oracle["sign_agreement"] == 1.0 and oracle["num_traces"] == 12
    # every wrong trace's first error is its first line: the labels blame it, uniform never does
    assert rows["ground_truth"]["error_acc"] == 1.0 and rows["uniform"]["error_acc"] == 0.0
    assert rows["mc"]["error_acc"] == 1.0 and rows["mc"]["extra_generated_tokens_per_trace"] > 0
    md = (out / "credit.md").read_text()
    assert "first-wrong-line labels (credit.oracle.values=pooled)" in md and "12 traces" in md
    assert (
        "ground truth oracle, pooled values" in (out / report["examples"]["tokens:4"]).read_text()
    )


class _Killed(Exception):
    pass


def _timing_free(rows):
    timed = ("seconds_per_trace", "credit_seconds_per_trace", "time_ratio_to_uniform", "timed_in")
    return [
        {k: v for k, v in r.items() if k not in timed}
        | ({"fit": {k: v for k, v in r["fit"].items() if k != "seconds"}} if r.get("fit") else {})
        for r in rows
    ]


def test_bench_credit_resumes_a_killed_run_and_adds_methods_without_scoring_twice(
    init_dir, tmp_path, monkeypatch
):
    from rredcot.bench import credit

    methods = "uniform,oracle,value_head"

    def argv(out):  # the value head fits on one batch (a later flag wins)
        fit = ["--value-fit-batches", "1", "--value-fit-prompts", "2"]
        return _oracle_truth_argv(init_dir, out, "bench_first_char", methods) + fit

    assert main(argv(tmp_path / "whole")) == 0  # the reference: one uninterrupted run
    whole = json.loads((tmp_path / "whole" / "credit.json").read_text())

    real, scored = credit._method_row, []

    def method_row(bench, variant, *args):
        if variant.name == kill_at:
            raise _Killed
        scored.append(variant.name)
        return real(bench, variant, *args)

    monkeypatch.setattr(credit, "_method_row", method_row)
    out = tmp_path / "killed"
    kill_at = "value_head"
    with pytest.raises(_Killed):
        main(argv(out))
    assert scored == ["uniform", "oracle"] and not (out / "credit.json").exists()
    kept = json.loads((out / credit.ROWS).read_text())["rows"]
    first_oracle = next(r["row"] for k, r in kept.items() if "|oracle|" in k)
    kill_at, scored[:] = None, []
    assert main(argv(out)) == 0  # the same command again
    # oracle's row is read back, not scored again; uniform, the time reference, is timed again
    assert scored == ["uniform", "value_head"]
    report = json.loads((out / "credit.json").read_text())
    assert _timing_free(report["results"]) == _timing_free(whole["results"])
    rows = {r["method"]: r for r in report["results"]}
    # each row's time ratio is against uniform timed in the run that timed the row
    assert rows["oracle"]["timed_in"] == first_oracle["timed_in"]
    assert rows["oracle"]["time_ratio_to_uniform"] == first_oracle["time_ratio_to_uniform"]
    assert rows["value_head"]["timed_in"] == rows["uniform"]["timed_in"]
    assert rows["value_head"]["time_ratio_to_uniform"] == pytest.approx(
        rows["value_head"]["seconds_per_trace"] / rows["uniform"]["seconds_per_trace"]
    )
    md = (out / "credit.md").read_text()
    assert rows["oracle"]["timed_in"] != rows["uniform"]["timed_in"] and "timed in 2 runs" in md
    assert "timed in" not in (tmp_path / "whole" / "credit.md").read_text()
    assert (out / report["examples"]["tokens:4"]).read_text().count("value_head") >= 1
    assert (out / report["examples"]["tokens:4"]).read_text().count("oracle") >= 1

    # a later run with one more method scores only that one
    scored[:] = []
    assert main(argv(out) + ["--methods", methods + ",first_last"]) == 0
    assert scored == ["uniform", "first_last"]
    report = json.loads((out / "credit.json").read_text())
    assert [r["method"] for r in report["results"]][-1] == "first_last"
    assert _timing_free(report["results"][:-1]) == _timing_free(whole["results"])

    # rows of other traces (another seed) are never reused
    scored[:] = []
    assert main(argv(out) + ["--seed", "5"]) == 0
    assert scored == ["uniform", "oracle", "value_head"]


def test_bench_credit_against_the_oracle_scores_only_judged_traces(init_dir, tmp_path):
    # a wrong trace without a step label cut by the cap, or ended on its own with the blame of
    # ended traces off, gets GRPO's credit from the oracle: it is no truth, and is not scored
    out = tmp_path / "credit"
    argv = _oracle_truth_argv(init_dir, out, "bench_first_char_unlabelled_wrong")
    argv += ["--set", "credit.oracle.ended_unlabelled=grpo"]
    assert main(argv) == 0
    report = json.loads((out / "credit.json").read_text())
    right = round(report["mean_reward"] * report["num_traces"])
    assert 0 < right < report["num_traces"] == 12
    assert report["ground_truth"]["tokens:4"]["judged_traces"] == right
    for row in report["results"]:
        assert row["num_traces"] == right, row["method"]


def test_bench_credit_against_the_oracle_refuses_a_task_without_labels(init_dir, tmp_path, capsys):
    out = tmp_path / "credit"
    assert main(_oracle_truth_argv(init_dir, out, "bench_first_char_no_labels")) == 2
    err = capsys.readouterr().err
    assert "none of the 12 traces has step labels" in err and "--ground_truth monte_carlo" in err
    assert not (out / "credit.json").exists()


def test_bench_credit_refuses_an_unknown_ground_truth(tmp_path):
    with pytest.raises(ValueError, match="ground-truth='mc'; valid: monte_carlo, oracle"):
        CreditBenchConfig(checkpoint="x", ground_truth="mc")


def test_bench_credit_rejects_train_overrides(init_dir, tmp_path, capsys):
    argv = [
        "bench",
        "credit",
        "--checkpoint",
        str(init_dir),
        "--set",
        "lr=1",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 2
    assert "credit.*" in capsys.readouterr().err


def test_bench_without_subcommand_prints_help(capsys):
    assert main(["bench"]) == 2
    assert "credit" in capsys.readouterr().out


def _tiny_train_overrides() -> dict[str, str]:
    return {
        "prompts_per_step": "1",
        "sampling.num_generations": "3",
        "sampling.max_new_tokens": "8",
        "eval_size": "3",
        "checkpoint_every": "1",
    }


@pytest.mark.slow
def test_bench_learn_stops_at_the_budget_and_resumes(init_dir, tmp_path):
    cfg = LearnBenchConfig(
        methods="uniform,mc=monte_carlo:monte_carlo.rollouts=2",
        seeds=1,
        budget_tokens=40,
        init=str(init_dir),
        out=str(tmp_path / "learn"),
        steps_max=50,
        eval_every=1,
        task="bench_first_char",
        overrides=_tiny_train_overrides(),
        variance_probes=2,
        variance_prompts=2,
        variance_minibatch=1,
        variance_bootstrap=50,
    )
    report = run_learn_bench(cfg, **QUIET)
    runs = {r["variant"]: r for r in report["runs"]}
    for name in ("uniform", "mc"):
        run_dir = tmp_path / "learn" / "runs" / name / "seed0"
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        used = [r["tokens_generated"] + r["extra_tokens_generated"] for r in records]
        # the run stops at the first step that reaches the budget, well before steps_max
        assert used[-1] >= 40 and all(u < 40 for u in used[:-1])
        assert runs[name]["stopped_by_budget"] and runs[name]["steps"] < 50
        probes = [json.loads(x) for x in (run_dir / "variance.jsonl").read_text().splitlines()]
        assert [p["fraction"] for p in probes] == [0.0, 1.0]
        assert probes[0]["budget_tokens_used"] == 0 and probes[1]["budget_tokens_used"] >= 40
        assert all(p["grad_var_trace"] >= 0 and p["groups"] == 2 for p in probes)
    # Monte Carlo pays for its continuations out of the same budget: fewer policy tokens
    assert runs["mc"]["extra_tokens_generated"] > 0
    assert runs["mc"]["tokens_generated"] < runs["uniform"]["tokens_generated"]
    learn = json.loads((tmp_path / "learn" / "learn.json").read_text())
    summary = {s["variant"]: s for s in learn["summary"]}
    for key in (
        "final_accuracy_mean",
        "final_accuracy_std",
        "any_below_warm_start",
        "tokens_to_target_mean",
        "target_reached",
        "grad_variance",
        "extra_generated_tokens_mean",
    ):
        assert key in summary["uniform"]
    assert summary["mc"]["extra_generated_tokens_mean"] == runs["mc"]["extra_tokens_generated"]
    # paired against the first variant, seed by seed, on the final and the mean accuracy
    curves = learn["curves"]
    acc = {name: curves[name]["0"]["accuracy"] for name in ("uniform", "mc")}
    paired = summary["mc"]["final_vs_reference"]
    assert summary["mc"]["reference"] == "uniform"
    assert paired["per_seed"]["0"] == pytest.approx(acc["mc"][-1] - acc["uniform"][-1])
    assert summary["uniform"]["final_vs_reference"]["mean"] == 0.0
    mean_after_start = sum(acc["mc"][1:]) / len(acc["mc"][1:])
    assert summary["mc"]["mean_accuracy"]["0"] == pytest.approx(mean_after_start)
    # and against its own start: whether it learned at all (a lead can come from falling less)
    over_start = summary["mc"]["mean_accuracy_vs_start"]["per_seed"]["0"]
    assert over_start == pytest.approx(mean_after_start - acc["mc"][0])
    for png in ("accuracy_vs_tokens.png", "accuracy_vs_wallclock.png", "grad_variance.png"):
        assert (tmp_path / "learn" / png).stat().st_size > 1000
    assert "| uniform" in (tmp_path / "learn" / "learn.md").read_text()

    # a second call skips complete runs; a run without result.json resumes from its checkpoint
    (tmp_path / "learn" / "runs" / "uniform" / "seed0" / "result.json").unlink()
    lines = []
    again = run_learn_bench(cfg, log=lines.append)
    assert any("mc seed 0: complete, skipped" in line for line in lines)
    assert any("resumed from" in str(line) for line in lines)
    again_runs = {r["variant"]: r for r in again["runs"]}
    assert again_runs["uniform"]["steps"] == runs["uniform"]["steps"]
    assert again_runs["uniform"]["tokens_generated"] == runs["uniform"]["tokens_generated"]
    # other settings in the same directory would mix two experiments: refused
    with pytest.raises(ValueError, match="other settings.*max_tokens_generated"):
        run_learn_bench(dataclasses.replace(cfg, budget_tokens=80), **QUIET)


class _FakeClock:
    """``time`` for the trainer: every ``perf_counter`` call is 0.25 s after the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 0.25
        return self.now


@pytest.mark.slow
def test_bench_learn_budget_seconds_stops_on_training_time_and_resumes(
    init_dir, tmp_path, monkeypatch
):
    monkeypatch.setattr(trainer_module, "time", _FakeClock())
    cfg = LearnBenchConfig(
        methods="uniform,vh=value_head",
        seeds=1,
        budget_tokens=0,  # time is the only budget
        budget_seconds=5.0,
        init=str(init_dir),
        out=str(tmp_path / "learn"),
        steps_max=50,
        eval_every=2,
        task="bench_first_char",
        overrides=_tiny_train_overrides(),
    )
    report = run_learn_bench(cfg, **QUIET)
    for name in ("uniform", "vh"):
        run_dir = tmp_path / "learn" / "runs" / name / "seed0"
        records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
        steps = records[1:]
        # the run's clock is the sum of its steps' seconds (evaluation is outside the step)
        assert [r["time/train_seconds"] for r in steps] == pytest.approx(
            [sum(r["step_seconds"] for r in steps[: i + 1]) for i in range(len(steps))]
        )
        # it stops after the first step that reaches the budget, well before steps_max
        seconds = [r["time/train_seconds"] for r in steps]
        assert seconds[-1] >= 5.0 and all(t < 5.0 for t in seconds[:-1])
        assert 1 < len(steps) < 50 and steps[-1]["eval_accuracy"] is not None
        # compute counts every step (forward-token equivalents), summed
        assert steps[-1]["compute/used"] == pytest.approx(sum(r["compute/step"] for r in steps))
        assert all(r["compute/step"] > r["rollout/tokens"] for r in steps)
    runs = {r["variant"]: r for r in report["runs"]}
    assert runs["uniform"]["stopped_by_budget"] and runs["vh"]["stopped_by_budget"]
    summary = {
        s["variant"]: s
        for s in json.loads((tmp_path / "learn" / "learn.json").read_text())["summary"]
    }
    assert summary["vh"]["accuracy_at_reference_seconds_vs_reference"]["per_seed"].keys() == {"0"}
    assert "time-avg acc over uniform's s" in (tmp_path / "learn" / "learn.md").read_text()
    # a resumed run respects the budget it already spent: no step more
    run_dir = tmp_path / "learn" / "runs" / "uniform" / "seed0"
    (run_dir / "result.json").unlink()
    again = {r["variant"]: r for r in run_learn_bench(cfg, **QUIET)["runs"]}
    assert again["uniform"]["steps"] == runs["uniform"]["steps"]
    # the bench's budgets reach the trainer as its config
    more = dataclasses.replace(cfg, budget_seconds=8.0)
    tcfg = train_config(more, parse_variants("uniform")[0], 0, str(init_dir), run_dir)
    assert tcfg.max_train_seconds == 8.0 and tcfg.max_tokens_generated == 0
    with pytest.raises(ValueError, match="no budget"):
        LearnBenchConfig(budget_tokens=0)


def test_a_compute_budget_stops_the_run_at_the_step_that_reaches_it(init_dir, tmp_path):
    from helpers import micro_config
    from rredcot.training.trainer import Trainer, step_compute

    # the weights: a sampled token 1 forward, a scored one 1 per pass, a trained one 3 (forward
    # and backward), the credit's forwards 1, backwards 2, generated 1: 10 sampled tokens, 12
    # scored twice (2 of them a luffy reference's, never sampled), 20 trained
    assert step_compute(10, 4, 2, 12, 20, 5, 1, 3) == 10 + 2 * 12 + 3 * 20 + 5 + 2 * 1 + 3
    free = micro_config(init_dir, tmp_path / "free", steps=4)
    Trainer(free, **QUIET).train()
    steps = [json.loads(x) for x in (tmp_path / "free" / "metrics.jsonl").read_text().splitlines()]
    used = [r["compute/used"] for r in steps[1:]]
    budget = (used[1] + used[2]) / 2  # reached during step 3
    capped = micro_config(init_dir, tmp_path / "capped", steps=4, max_compute=budget)
    result = Trainer(capped, **QUIET).train()
    assert result["steps"] == 3 and result["stopped_by_budget"]


def test_per_second_scores_of_hand_made_curves():
    # the reference ends at 10 s; the method is evaluated at 0, 4, 12 s
    ref = {"seconds": [0.0, 5.0, 10.0], "accuracy": [0.5, 0.6, 0.7]}
    method = {"seconds": [0.0, 4.0, 12.0], "accuracy": [0.5, 0.8, 0.9]}
    # read linearly between the evaluations that bracket the second: 10 s is 6/8 of [4, 12]
    assert accuracy_at_second(method, 10.0) == pytest.approx(0.8 + 0.1 * 6 / 8)
    assert accuracy_at_second(method, 2.0) == pytest.approx(0.65)
    assert accuracy_at_second(method, 4.0) == 0.8 and accuracy_at_second(method, 12.0) == 0.9
    assert accuracy_at_second(method, 0.0) == 0.5
    # area: 0.5 over [0, 4] and 0.8 over [4, 10], divided by 10
    assert time_averaged_accuracy(method, 10.0) == pytest.approx((0.5 * 4 + 0.8 * 6) / 10)
    assert time_averaged_accuracy(ref, 10.0) == pytest.approx((0.5 * 5 + 0.6 * 5) / 10)
    # a run that ended sooner holds its last evaluation
    short = {"seconds": [0.0, 2.0], "accuracy": [0.5, 0.4]}
    assert time_averaged_accuracy(short, 10.0) == pytest.approx((0.5 * 2 + 0.4 * 8) / 10)
    assert accuracy_at_second(short, 10.0) == 0.4


@pytest.mark.slow
def test_bench_learn_runs_auto_and_skips_it_when_complete(init_dir, tmp_path):
    cfg = LearnBenchConfig(
        methods="uniform,auto",
        seeds=1,
        budget_tokens=40,
        init=str(init_dir),
        out=str(tmp_path / "learn"),
        steps_max=3,
        eval_every=1,
        task="bench_first_char",
        overrides=_tiny_train_overrides(),
        variance_probes=0,
    )
    run_learn_bench(cfg, **QUIET)
    run_dir = tmp_path / "learn" / "runs" / "auto" / "seed0"
    choice = json.loads((run_dir / "credit_choice.json").read_text())
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["credit_method"] == choice["method"] != "auto"
    # the saved run holds the resolved method: a second call still knows it as "auto"
    lines = []
    run_learn_bench(cfg, log=lines.append)
    assert any("auto seed 0: complete, skipped" in line for line in lines)
    with pytest.raises(ValueError, match="training run starts"):
        parse_variants("auto")


def test_bench_overhead_structure(init_dir, tmp_path):
    cfg = OverheadBenchConfig(
        methods="uniform,value_head",
        steps=2,
        warmup=1,
        init=str(init_dir),
        out=str(tmp_path / "overhead"),
        task="bench_first_char",
        overrides=_tiny_train_overrides(),
    )
    report = run_overhead_bench(cfg, **QUIET)
    saved = json.loads((tmp_path / "overhead" / "overhead.json").read_text())
    methods = {m["method"]: m for m in saved["methods"]}
    assert set(methods) == {"uniform", "value_head"}
    assert methods["uniform"]["ratio"] == 1.0 and methods["uniform"]["ratio_paired"] == 1.0
    assert methods["uniform"]["ratio_own_phases"] == 1.0
    vh = methods["value_head"]
    assert vh["steps"] == 2 and set(vh["median_phase_seconds"]) == set(PHASES)
    assert vh["ratio"] == pytest.approx(
        vh["median_step_seconds"] / methods["uniform"]["median_step_seconds"]
    )
    assert "meets_target" in vh and vh["target"] == 1.05
    records = report["records"]
    assert len(records) == 3 * 2
    # the order rotates each round, and with the policies reset to the warm-start both methods
    # sample exactly the same completions in a round
    assert [r["method"] for r in records[:4]] == ["uniform", "value_head", "value_head", "uniform"]
    for r in range(3):
        tokens = {x["rollout_tokens"] for x in records if x["round"] == r}
        assert len(tokens) == 1
    assert "value_head" in (tmp_path / "overhead" / "overhead.md").read_text()


def test_bench_peer_workers_and_summary(init_dir, tmp_path):
    """Both workers of ``bench peer`` in this process (the command runs each in its own), on a
    tiny random policy; then the summary and the page."""
    from rredcot.bench.configs import parse_trl_overrides
    from rredcot.bench.peer import (
        PHASES as PEER_PHASES,
    )
    from rredcot.bench.peer import (
        PeerBenchConfig,
        _worker_command,
        peer_markdown,
        run_rredcot,
        run_trl,
        summarise,
    )

    cfg = PeerBenchConfig(
        model=str(init_dir),
        task="arithmetic",
        task_args={"num_steps": 2},
        prompts=2,
        generations=2,
        max_new_tokens=6,
        steps=2,
        warmup=1,
        repeats=1,
        threads=1,
        out=str(tmp_path),
    )
    runs = [run_rredcot(cfg, **QUIET), run_trl(cfg, **QUIET)]
    for run in runs:
        assert [s["step"] for s in run["steps"]] == [1, 2, 3]
        assert [s["timed"] for s in run["steps"]] == [False, True, True]
        for s in run["steps"]:
            assert s["step_seconds"] > 0 and s["generation"] > 0 and s["cpu_seconds"] > 0
            assert s["generation"] + s["scoring"] + s["update"] == pytest.approx(s["step_seconds"])
            assert 0 < s["completion_tokens"] <= 4 * 6
        assert run["peak_rss"] >= run["rss_after_setup"] > 0
    summary = summarise(runs, batch=4)
    for which in ("rredcot", "trl"):
        assert summary[which]["timed_steps"] == 2
        assert set(summary[which]["median_phase_seconds"]) == set(PEER_PHASES)
    assert summary["ratio_rredcot_over_trl"]["completions_per_cpu_second"] == pytest.approx(
        summary["trl"]["median_cpu_seconds"] / summary["rredcot"]["median_cpu_seconds"]
    )
    ratio = summary["ratio_rredcot_over_trl"]["completions_per_second"]
    assert ratio == pytest.approx(
        summary["trl"]["median_step_seconds"] / summary["rredcot"]["median_step_seconds"]
    )
    page = peer_markdown(
        {"summary": summary, "config": dataclasses.asdict(cfg), "model": "m", "max_new_tokens": 6}
    )
    assert "completions / s" in page and "rredcot / TRL" in page and "CPU s / step" in page
    command = _worker_command("trl", cfg, tmp_path / "r.json")
    assert command[1:5] == ["-m", "rredcot.bench.peer", "--worker", "trl"]
    assert parse_trl_overrides(["bf16=true", "loss_type=grpo"]) == {
        "bf16": True,
        "loss_type": "grpo",
    }
    with pytest.raises(ValueError, match="not GRPOConfig fields"):
        parse_trl_overrides(["nonsense=1"])


def test_learn_bench_learning_rate_is_the_reported_one_unless_overridden(tmp_path):
    def lr_of(spec: str, **kwargs) -> float:
        cfg = LearnBenchConfig(methods=spec, out=str(tmp_path), **kwargs)
        (variant,) = parse_variants(spec)
        return train_config(cfg, variant, 100, "init", tmp_path / "run").lr

    assert lr_of("uniform") == LEARN_LR
    assert lr_of("uniform", lr=3e-5) == 3e-5
    assert lr_of("uniform", overrides={"lr": "7e-5"}) == 7e-5  # --set lr=...
    assert lr_of("value_head:lr=2e-4") == 2e-4  # the variant's own wins
    assert lr_of("uniform", lr=None) == TrainConfig().lr  # None: the train config's
