"""``--credit auto``: the rule (pure: the table of what was measured per second), and the
choice inside ``rredcot train`` from step 1's own batch: what it chooses, what it writes, that it
samples nothing extra, and that the run after it is the run of the method it chose."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from pathlib import Path

import pytest
import torch
import yaml

import rredcot
import rredcot.methods.auto as credit_choice
import rredcot.training.setup as train_setup
import rredcot.training.trainer as trainer_module
from helpers import ROOT, micro_config
from rredcot.config import CreditConfig, TrainConfig
from rredcot.diagnose import verdict
from rredcot.methods.auto import (
    FLOW_METHOD,
    FLOW_SETTINGS,
    MEASUREMENTS,
    Measurement,
    apply_choice,
    choose_credit,
    choose_from_rollouts,
    flow_flags,
    group_outcomes,
)
from rredcot.tasks import Verdict, register_task
from rredcot.tasks.arithmetic import ArithmeticTask
from rredcot.training.trainer import Trainer, train

RESULTS = ROOT / "benchmarks" / "results"

# ---------------------------------------------------------------------------------------------
# the rule


def test_group_outcomes_counts_all_wrong_and_all_right_groups():
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    figures = group_outcomes(rewards, groups)
    assert figures == {
        "mean_reward": 0.375,
        "all_wrong": 0.5,
        "all_right": 0.25,
        "groups": 4.0,
        "samples": 8.0,
    }
    with pytest.raises(ValueError, match="rejected every one"):
        group_outcomes(torch.zeros(0), torch.zeros(0, dtype=torch.long))


def _row(**changes) -> Measurement:
    """A measured row ahead of GRPO per second on a testbed at 40% all wrong, mean reward 0.3."""
    row = Measurement(
        testbed="a test bed",
        all_wrong=0.4,
        mean_reward=0.3,
        method=FLOW_METHOD,
        settings=FLOW_SETTINGS,
        variant="cl_cheap",
        needs_references=True,
        per_token=(0.03, 0.01),
        at_grpo_last_second=(0.03, 0.01),
        time_averaged=(0.025, 0.01),
        seeds=10,
        source="headroom/somewhere/learn.json",
    )
    return dataclasses.replace(row, **changes)


@pytest.mark.parametrize(
    ("mean", "wrong", "refs", "row", "method"),
    [
        (0.30, 0.40, True, _row(), FLOW_METHOD),  # like the testbed, ahead per second
        (0.30, 0.40 + 0.16, True, _row(), "uniform"),  # all-wrong share too far
        (0.30 + 0.16, 0.40, True, _row(), "uniform"),  # mean reward too far
        (0.30, 0.40, False, _row(), "uniform"),  # nothing for it to score
        (0.30, 0.40, True, _row(time_averaged=(0.025, 0.013)), "uniform"),  # within 2 s.e.
        (0.30, 0.40, True, _row(at_grpo_last_second=(-0.01, 0.001)), "uniform"),  # behind
        (0.30, 0.40, True, _row(seeds=2), "uniform"),  # ahead, but on a partial block
        (0.30, 0.40, False, _row(needs_references=False, method="value_head"), "value_head"),
    ],
)
def test_the_rule_chooses_a_method_only_where_it_was_measured_ahead_per_second(
    mean, wrong, refs, row, method
):
    choice = choose_credit({"mean_reward": mean, "all_wrong": wrong}, refs, (row,))
    assert choice.method == method
    assert choice.settings == (dict(row.settings) if method == row.method else {})
    assert f"{wrong:.0%} of its groups are all wrong" in choice.reason
    assert choice.figures["all_wrong"] == wrong and choice.figures["has_references"] == refs


def test_todays_table_runs_uniform_on_both_arithmetic_testbeds_and_says_which_row_decided():
    # the testbeds' own first-batch figures (auto_probe.txt): no row is ahead of GRPO per
    # second by two standard errors; the reason cites the one closest to GRPO (cl_cheap)
    default = choose_credit({"mean_reward": 0.40, "all_wrong": 0.28}, has_references=True)
    low = choose_credit({"mean_reward": 0.11, "all_wrong": 0.58}, has_references=True)
    assert default.method == low.method == "uniform" and default.settings == {}
    assert default.decided_by == "credit_price/block_arith4_default/learn.json"
    assert low.decided_by == "credit_price/block_arith12_low/learn.json"
    assert "-0.7 ± 0.7 at GRPO's last second" in default.reason
    assert "+0.5 ± 1.0 at GRPO's last second" in low.reason
    # adding a row measured ahead per second there (the cheap estimator, once measured)
    # changes the choice
    cheap = _row(all_wrong=0.28, mean_reward=0.40, settings={"lam": 0.0})
    chosen = choose_credit({"mean_reward": 0.40, "all_wrong": 0.28}, True, (*MEASUREMENTS, cheap))
    assert (chosen.method, chosen.settings, chosen.decided_by) == (
        FLOW_METHOD,
        {"lam": 0.0},
        cheap.source,
    )
    # a first batch of 16 groups measures its shares to about +-0.1: the bands widen by two
    # standard errors (the README's first command's step 1: 55% solved, 12% all wrong)
    first = {"mean_reward": 0.55, "all_wrong": 0.12}
    assert choose_credit(first, True).decided_by is None  # no batch size: the bare bands
    sized = choose_credit({**first, "groups": 16.0}, True)
    assert sized.decided_by == "credit_price/block_arith4_default/learn.json"
    # where nothing was measured: uniform, and it says so
    easy = choose_credit({"mean_reward": 0.9, "all_wrong": 0.0}, True)
    assert easy.method == "uniform" and easy.decided_by is None
    assert "no credit method was measured on a testbed like it" in easy.reason


@pytest.mark.parametrize("row", MEASUREMENTS, ids=lambda m: m.source)
def test_the_tables_figures_are_its_sources(row):
    report = json.loads((RESULTS / row.source).read_text())
    summary = {s["variant"]: s for s in report["summary"]}[row.variant]
    assert summary["method"] == row.method and summary["reference"] == "uniform"
    for figure, key in (
        (row.per_token, "mean_accuracy_vs_reference"),
        (row.at_grpo_last_second, "accuracy_at_reference_seconds_vs_reference"),
        (row.time_averaged, "time_averaged_accuracy_vs_reference"),
    ):
        paired = summary[key]
        assert figure == pytest.approx((paired["mean"], paired["sem"]), abs=1e-4), key
    assert len(summary["seeds"]) == row.seeds


def test_choose_from_rollouts_is_the_rule_on_a_batch():
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    choice = choose_from_rollouts(rewards, groups, True, (_row(all_wrong=0.5, mean_reward=0.4),))
    assert choice.method == FLOW_METHOD
    assert choice.figures["all_wrong"] == 0.5 and choice.figures["mean_reward"] == 0.375


def test_apply_choice_sets_the_nested_settings_and_the_result_is_the_bench_variant():
    cfg = TrainConfig()
    assert cfg.credit_method == "auto"  # the default
    apply_choice(cfg, choose_credit({"mean_reward": 0.3, "all_wrong": 0.4}, True, (_row(),)))
    assert cfg.credit_method == "continuation_likelihood"
    assert (cfg.credit.lam, cfg.credit.anchor, cfg.credit.handover.smoothing) == (0.0, "none", 0.5)
    # the flags the verdict prints are the same settings (the learn bench's cl_flow variant)
    assert flow_flags() == (
        "--credit continuation_likelihood --credit.lam 0 --credit.anchor none "
        "--credit.handover.smoothing 0.5"
    )


def test_diagnose_verdict_says_what_auto_runs_by_the_same_rule():
    _, reasons = verdict({"mean_reward": 0.11, "all_wrong": 0.58})
    assert any(flow_flags() in r and r.startswith("+") for r in reasons)  # per token
    said = [r for r in reasons if "--credit auto would run" in r]
    assert len(said) == 1 and "would run uniform" in said[0]
    assert "credit_price/block_arith12_low" in said[0]
    # with references, on a run like its testbeds (arithmetic, the tiny character model), the
    # reference baseline measured ahead of both is recommended; elsewhere only noted; without, not
    tiny = {"mean_reward": 0.11, "all_wrong": 0.58, "task": "arithmetic", "model_kind": "character"}
    _, on_tiny = verdict(tiny)
    assert any("--references.mode sft" in r and r.startswith("+") for r in on_tiny)
    assert not any("--references.mode sft" in r and r.startswith("+") for r in reasons)
    _, bare = verdict({**tiny, "has_references": False})
    assert not any("--references.mode" in r for r in bare)


# ---------------------------------------------------------------------------------------------
# the choice in `rredcot train`, from step 1's batch


class _HalfHopelessTask(ArithmeticTask):
    """Arithmetic where only answers ending in 0-2 can be solved, by completions of even length:
    most groups all wrong even from a random policy, and reference solutions (the arithmetic
    task's gold chains)."""

    def verify(self, problem, completion):
        solvable = int(problem.answer) % 10 < 3
        return Verdict(float(solvable and len(completion) % 2 == 0), None, None, "test")


class _ParityTask(ArithmeticTask):
    """Reward 1 for completions of even length: varied rewards from a random policy, few groups
    all wrong."""

    def verify(self, problem, completion):
        return Verdict(float(len(completion) % 2 == 0), None, None, "parity")


register_task("test_half_hopeless")(_HalfHopelessTask)
register_task("test_auto_parity")(_ParityTask)

STABLE = ("reward_mean", "policy_loss", "grad_norm", "tokens_generated", "eval_accuracy")


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _count_sampling(monkeypatch) -> list[int]:
    """Count the trainer's calls of the sampler (every rollout: steps, pretraining, probes)."""
    calls: list[int] = []
    real = trainer_module.sample_groups

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer_module, "sample_groups", counted)
    return calls


def test_auto_decides_from_step_ones_batch_and_with_todays_table_runs_uniform(
    init_dir, tmp_path, monkeypatch
):
    calls = _count_sampling(monkeypatch)
    run = tmp_path / "run"
    cfg = micro_config(init_dir, run, task="test_half_hopeless", credit_method="auto", steps=2)
    lines = []
    Trainer(cfg, log=lines.append).train()
    assert len(calls) == 2  # one batch per step: nothing sampled for the choice
    choice = json.loads((run / "credit_choice.json").read_text())
    assert choice["method"] == "uniform"  # nothing was measured ahead of GRPO per second
    figures = choice["figures"]
    assert figures["samples"] == 2 * 4 and figures["groups"] == 2  # step 1's own batch
    assert figures["model_kind"] == "character" and figures["model_parameters"] > 0
    records = _records(run)
    assert figures["mean_reward"] == pytest.approx(records[1]["reward_mean"])
    assert records[-1]["extra_tokens_generated"] == 0  # and nothing charged for it
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["credit_method"] == "uniform"
    said = [line for line in lines if line.startswith("credit auto: uniform, because")]
    assert len(said) == 1 and f"{figures['all_wrong']:.0%} of its groups are all wrong" in said[0]


@pytest.mark.slow
def test_after_the_choice_the_run_is_the_chosen_methods_run(init_dir, tmp_path, monkeypatch):
    # a table in which value_head (a method with parameters, built after step 1's rollout)
    # was measured ahead everywhere: auto chooses it, and its run is the named run
    row = _row(method="value_head", settings={}, needs_references=False)
    monkeypatch.setattr(credit_choice, "MEASUREMENTS", (row,))
    monkeypatch.setattr(credit_choice, "ALL_WRONG_BAND", 1.0)
    monkeypatch.setattr(credit_choice, "REWARD_BAND", 1.0)
    # a method that draws random numbers when it is built draws the same ones as a named run's
    draws: list[float] = []
    real_build = train_setup.build_method

    def drawing_build(*args, **kwargs):
        draws.append(float(torch.rand(1)))
        return real_build(*args, **kwargs)

    monkeypatch.setattr(train_setup, "build_method", drawing_build)
    monkeypatch.setattr(trainer_module, "build_method", drawing_build)
    auto_run, named_run = tmp_path / "auto", tmp_path / "named"
    cfg = micro_config(init_dir, auto_run, task="test_auto_parity", credit_method="auto")
    Trainer(cfg, log=lambda *_: None).train()
    choice = json.loads((auto_run / "credit_choice.json").read_text())
    assert choice["method"] == "value_head" and choice["decided_by"] == row.source
    named = micro_config(init_dir, named_run, task="test_auto_parity", credit_method="value_head")
    Trainer(named, log=lambda *_: None).train()
    auto, plain = _records(auto_run), _records(named_run)
    assert len(draws) == 2 and draws[0] == draws[1]
    assert len(auto) == len(plain) == 4
    for a, p in zip(auto, plain):
        assert {k: a.get(k) for k in STABLE} == {k: p.get(k) for k in STABLE}
        assert a.get("value/mean") == p.get("value/mean")  # the head itself is the same
    # resuming does not decide again: the run's config holds the chosen method
    monkeypatch.setattr(credit_choice, "MEASUREMENTS", ())
    before = (auto_run / "credit_choice.json").read_text()
    more = TrainConfig(resume=str(auto_run), steps=4, progress=False)
    lines = []
    train(more, log=lines.append, given={"steps", "progress"})
    assert not any(line.startswith("credit auto") for line in lines)
    assert (auto_run / "credit_choice.json").read_text() == before
    assert [r["step"] for r in _records(auto_run)] == [0, 1, 2, 3, 4]


def test_a_misspelt_credit_method_lists_auto_and_auto_prompts_is_retired(init_dir, tmp_path):
    with pytest.raises(ValueError, match="or auto"):
        Trainer(micro_config(init_dir, tmp_path / "run", credit_method="unifrom"))
    with pytest.warns(UserWarning, match="auto_prompts=64 is ignored"):
        cfg = CreditConfig(auto_prompts=64)
    assert cfg.auto_prompts is None


# ---------------------------------------------------------------------------------------------
# the measurements file: written by the bench, read by auto, rows of other models not alike


def test_auto_reads_its_rows_from_the_data_file_the_bench_writes(tmp_path):
    from rredcot.bench.configs import RecordAutoConfig
    from rredcot.bench.record import run_record_auto

    assert credit_choice.load_measurements() == MEASUREMENTS  # the table is the file's rows
    shipped = {(m.source, m.variant): m for m in MEASUREMENTS}
    row = shipped["credit_price/block_arith4_default/learn.json", "cl_cheap"]
    out = tmp_path / "rows.json"
    cfg = RecordAutoConfig(
        learn=str(RESULTS / row.source),
        variants="cl_cheap",
        testbed=row.testbed,
        all_wrong=row.all_wrong,
        mean_reward=row.mean_reward,
        model_kind="character",
        model=row.model,
        file=str(out),
    )
    (written,) = run_record_auto(cfg)
    assert written == row  # the shipped row is what the bench writes from its source
    assert credit_choice.load_measurements(out) == (row,)
    run_record_auto(cfg)  # recording again replaces the row, it does not add a second
    assert len(credit_choice.load_measurements(out)) == 1


def test_record_auto_refuses_what_auto_cannot_apply(tmp_path):
    from rredcot.bench.configs import RecordAutoConfig
    from rredcot.bench.record import run_record_auto
    from rredcot.errors import UserError

    learn = RESULTS / "references" / "arith4_default" / "learn.json"
    cfg = RecordAutoConfig(
        learn=str(learn), testbed="t", all_wrong=0.3, mean_reward=0.4, file=str(tmp_path / "f")
    )
    with pytest.raises(UserError, match="chooses credit settings only"):
        run_record_auto(cfg)  # a references variant is not a credit choice
    with pytest.raises(UserError, match="not in"):
        run_record_auto(dataclasses.replace(cfg, variants="nope"))
    with pytest.raises(ValueError, match="--all_wrong"):
        RecordAutoConfig(learn=str(learn), testbed="t", all_wrong=2.0, mean_reward=0.4)
    assert not (tmp_path / "f").exists()


def _learn_file(tmp_path: Path, content) -> Path:
    """A learn.json under ``benchmarks/results/`` (where record-auto cites it) holding
    ``content``: a report, text, or a function of the shipped ``cl_cheap`` summary row."""
    shipped = json.loads((RESULTS / "credit_price/block_arith4_default/learn.json").read_text())
    (row,) = [s for s in shipped["summary"] if s["variant"] == "cl_cheap"]
    path = tmp_path / "benchmarks" / "results" / "x" / "learn.json"
    path.parent.mkdir(parents=True)
    if callable(content):
        content = {"summary": [content(json.loads(json.dumps(row)))]}
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def _with(**changes):
    """A change to the ``cl_cheap`` summary row: fields, or ``credit.*`` overrides added."""

    def change(row):
        overrides = {k: v for k, v in changes.items() if k.startswith("credit.")}
        row["overrides"] = {**row["overrides"], **overrides}
        row.update({k: v for k, v in changes.items() if not k.startswith("credit.")})
        return row

    return change


def _paired(key: str, mean: float):
    def change(row):
        row[key] = {**row[key], "mean": mean}
        return row

    return change


_TIME = "time_averaged_accuracy_vs_reference"


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ({}, "no summary of variants"),
        ({"summary": []}, "no summary of variants"),
        ([{"variant": "cl_cheap"}], "no summary of variants"),  # a top-level list
        ({"summary": [{"method": "uniform"}]}, "summary entry 0 is not a variant"),
        ("{not json", "is not valid JSON"),
        pytest.param("[" * 100_000 + "]" * 100_000, "nests JSON deeper", id="deep"),
        (_paired(_TIME, math.nan), "finite mean"),
        (_paired(_TIME, math.inf), "finite mean"),
        (_paired("accuracy_at_reference_seconds_vs_reference", -math.inf), "finite mean"),
        (_with(**{"credit.continuation_likelihood.scope": "bogus"}), "scope='bogus'"),
        (_with(**{"credit.lam": "7"}), "credit.lam=7.0 must be in [0, 1]"),
        (_with(**{"credit.lam": "nan"}), "finite"),
        (_with(method="bogus"), "bogus"),
        (
            _with(
                method="value_head",
                **{
                    "credit.value_head.teacher": "continuation_likelihood",
                    "credit.continuation_likelihood.scope": "mixed",
                },
            ),
            "needs credit.continuation_likelihood.scope=all",
        ),
        (_with(**{"credit.__class__": "x"}), "not a credit setting"),
        (lambda row: {**row, "reference": None}, "nothing to record"),  # only GRPO itself
    ],
)
def test_record_auto_checks_what_it_records_in_one_line_naming_the_file(
    tmp_path, capsys, content, expected
):
    from helpers import one_line_error

    learn, out = _learn_file(tmp_path, content), tmp_path / "rows.json"
    argv = ["bench", "record-auto", "--learn", str(learn), "--testbed", "t"]
    argv += ["--all_wrong", "0.3", "--mean_reward", "0.4", "--file", str(out)]
    err = one_line_error(argv, capsys)
    assert expected in err and str(learn) in err, err
    assert not out.exists()  # nothing recorded


def _bad_rows(good: dict) -> list[tuple[object, str]]:
    """(a measurements file's content, the error it must give): malformed rows, rows that name
    code or set what the config refuses, non-finite or bad-typed figures (issue 57)."""
    flow = FLOW_METHOD
    return [
        ({"rows": [{**good, "colour": 1}]}, "unknown fields"),
        ({"rows": [{k: v for k, v in good.items() if k != "method"}]}, "missing fields"),
        ({"rows": [{**good, "per_token": [0.1]}]}, "per_token must be"),
        ({"rows": [{**good, "model_kind": "robot"}]}, "model_kind"),
        ({"rows": ["row"]}, "must be an object"),
        ({"rows": [{**good, "at_grpo_last_second": [math.inf, 0.01]}]}, "finite"),
        ({"rows": [{**good, "time_averaged": [0.1, math.nan]}]}, "finite"),
        ({"rows": [{**good, "seeds": "ten"}]}, "seeds must be a plain value"),
        ({"rows": [{**good, "settings": {"lam": "0.5"}}]}, "credit.lam must be a plain value"),
        ({"rows": [{**good, "settings": {"__class__": "x"}}]}, "not a credit setting"),
        ({"rows": [{**good, "settings": {"process_reward.function": "m:f"}}]}, "load code"),
        ({"rows": [{**good, "settings": {"process_reward.model": "gpt2"}}]}, "load code"),
        ({"rows": [{**good, "method": "process_reward", "settings": {}}]}, "runs code"),
        ({"rows": [{**good, "method": "bogus", "settings": {}}]}, "bogus"),
        ({"rows": [{**good, "method": flow, "settings": {"lam": 7.0}}]}, "credit.lam=7.0"),
        (
            {"rows": [{**good, "settings": {"continuation_likelihood.scope": "bogus"}}]},
            "scope='bogus'",
        ),
        (
            {
                "rows": [
                    {**good, "settings": {**_TEACHER, "continuation_likelihood.scope": "mixed"}}
                ]
            },
            "needs credit.continuation_likelihood.scope=all",
        ),
        ([good], "expected an object with a list 'rows'"),
        ("{not json", "is not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "nests JSON deeper"),
        (None, "cannot read measurements file"),  # deleted
    ]


_TEACHER = {"value_head.teacher": "continuation_likelihood"}


@pytest.mark.parametrize("case", range(21))
def test_a_bad_measurements_file_is_one_clear_error_naming_it(tmp_path, case):
    from rredcot.errors import UserError

    path = tmp_path / "rows.json"
    content, match = _bad_rows(MEASUREMENTS[0].to_json())[case]
    if content is not None:
        text = content if isinstance(content, str) else json.dumps(content)
        path.write_text(text)
    with pytest.raises(UserError, match=match) as err:
        credit_choice.load_measurements(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_the_shipped_rows_pass_the_check_and_a_valid_teacher_row_loads(tmp_path):
    for row in MEASUREMENTS:  # each shipped row, checked as a data file's
        assert credit_choice.measurement_from_json(row.to_json(), "row") == row
    path = tmp_path / "rows.json"
    good = {**MEASUREMENTS[0].to_json(), "method": "value_head", "settings": {**_TEACHER}}
    path.write_text(json.dumps({"rows": [good]}))
    (row,) = credit_choice.load_measurements(path)
    assert row.settings == _TEACHER


def test_the_measurements_file_is_read_when_auto_needs_it_not_at_import(tmp_path):
    """A garbled, deep, deleted or mis-kinded file fails no command that does not choose."""
    import shutil
    import subprocess
    import sys

    src = Path(rredcot.__file__).resolve().parents[1]
    copy = tmp_path / "src"
    shutil.copytree(src / "rredcot", copy / "rredcot", ignore=shutil.ignore_patterns("__pycache__"))
    rows = copy / "rredcot" / "measurements" / "credit_auto.json"
    good = MEASUREMENTS[0].to_json()
    env = {**os.environ, "PYTHONPATH": str(copy)}
    for text in ("{oops", "[" * 100_000, None, json.dumps({"rows": [{**good, "model_kind": "x"}]})):
        rows.unlink(missing_ok=True)
        if text is not None:
            rows.write_text(text)
        for argv in (["train", "--help"], ["--help"], ["bench", "credit", "--help"]):
            proc = subprocess.run(
                [sys.executable, "-m", "rredcot", *argv], capture_output=True, text=True, env=env
            )
            assert proc.returncode == 0, (argv, proc.stderr[-1500:])


def test_a_bad_measurements_file_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    from helpers import one_line_error

    bad = tmp_path / "rows.json"
    bad.write_text(json.dumps({"rows": [{**MEASUREMENTS[0].to_json(), "seeds": "ten"}]}))
    monkeypatch.setattr(credit_choice, "MEASUREMENTS_FILE", bad)
    monkeypatch.delattr(credit_choice, "MEASUREMENTS")  # not read yet: read when auto needs it
    loads: list[int] = []
    monkeypatch.setattr(train_setup, "load_train_policy", lambda *a, **k: loads.append(1))
    run = tmp_path / "run"
    err = one_line_error(["train", "--credit", "auto", "--out", str(run), "--steps", "1"], capsys)
    assert f"{bad} row 0: seeds must be" in err
    assert not loads and not run.exists()  # before the model loads, before the run directory


def test_a_language_model_is_not_decided_by_the_character_models_rows():
    figures = {"mean_reward": 0.40, "all_wrong": 0.28}  # the default task's own figures
    char = choose_credit({**figures, "model_kind": "character"}, True)
    assert char.decided_by == "credit_price/block_arith4_default/learn.json"
    lm = {**figures, "model_kind": "language_model", "model_parameters": 134_515_008}
    chosen = choose_credit(lm, True, tuple(m for m in MEASUREMENTS if m.model_kind == "character"))
    assert chosen.method == "uniform" and chosen.decided_by is None
    assert "no credit method was measured on a model like it" in chosen.reason
    assert "a language model of 135M parameters" in chosen.reason
    # a row measured on a language model of like size decides; one 100x larger does not
    small = _row(
        all_wrong=0.28, mean_reward=0.40, model_kind="language_model", model_parameters=134_515_008
    )
    assert choose_credit(lm, True, (small,)).method == FLOW_METHOD
    huge = dataclasses.replace(small, model_parameters=13_451_500_800)
    assert choose_credit(lm, True, (huge,)).method == "uniform"
    assert credit_choice.model_kind(100) == "character"
    assert credit_choice.model_kind(49_152) == "language_model"
