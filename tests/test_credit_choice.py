"""``--credit auto``: the rule (pure), and the probe inside ``rredcot train``: what it chooses, what
it writes, what it charges, and that the run after it is the run of the method it chose."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from conftest import micro_config
from rredcot.config import CreditConfig, TrainConfig
from rredcot.credit_choice import (
    ALL_WRONG_HIGH,
    FLOW_METHOD,
    FLOW_SETTINGS,
    REWARD_LOW,
    apply_choice,
    choose_credit,
    flow_flags,
    group_outcomes,
)
from rredcot.diagnose import verdict
from rredcot.tasks import Verdict, register_task
from rredcot.tasks.arithmetic import ArithmeticTask
from rredcot.trainer import Trainer, train

# ---------------------------------------------------------------------------------------------
# the rule


def test_group_outcomes_counts_all_wrong_and_all_right_groups():
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    figures = group_outcomes(rewards, groups)
    assert figures == {"mean_reward": 0.375, "all_wrong": 0.5, "all_right": 0.25, "groups": 4.0}
    with pytest.raises(ValueError, match="rejected every one"):
        group_outcomes(torch.zeros(0), torch.zeros(0, dtype=torch.long))


@pytest.mark.parametrize(
    ("mean", "wrong", "refs", "method"),
    [
        (0.30, ALL_WRONG_HIGH, True, FLOW_METHOD),  # at the threshold: flow
        (0.30, 0.6, True, FLOW_METHOD),
        (0.30, ALL_WRONG_HIGH - 0.01, True, "value_head"),  # GRPO has a signal in most groups
        (0.30, 0.6, False, "value_head"),  # nothing for continuation likelihood to score
        (REWARD_LOW - 0.01, 0.9, True, "value_head"),  # no outcome signal at all
    ],
)
def test_the_rule_chooses_flow_only_where_groups_are_all_wrong_and_references_exist(
    mean, wrong, refs, method
):
    choice = choose_credit({"mean_reward": mean, "all_wrong": wrong}, has_references=refs)
    assert choice.method == method
    assert choice.settings == (FLOW_SETTINGS if method == FLOW_METHOD else {})
    assert f"{wrong:.0%}" in choice.reason and choice.figures["all_wrong"] == wrong


def test_apply_choice_sets_the_nested_settings_and_the_result_is_the_bench_variant():
    cfg = TrainConfig()
    assert cfg.credit_method == "auto"  # the default
    apply_choice(cfg, choose_credit({"mean_reward": 0.2, "all_wrong": 0.4}, True))
    assert cfg.credit_method == "continuation_likelihood"
    assert (cfg.credit.lam, cfg.credit.anchor, cfg.credit.handover.smoothing) == (0.0, "none", 0.5)
    # the flags the verdict prints are the same settings (the learn bench's cl_flow variant)
    assert flow_flags() == (
        "--credit continuation_likelihood --credit.lam 0 --credit.anchor none "
        "--credit.handover.smoothing 0.5"
    )


def test_diagnose_verdict_recommends_what_auto_chooses():
    _, reasons = verdict({"mean_reward": 0.2, "all_wrong": 0.4})
    assert any(flow_flags() in r and r.startswith("+") for r in reasons)


# ---------------------------------------------------------------------------------------------
# the probe in `rredcot train`


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


def test_auto_chooses_flow_where_groups_are_all_wrong_and_records_why(init_dir, tmp_path):
    run = tmp_path / "run"
    cfg = micro_config(init_dir, run, task="test_half_hopeless", credit_method="auto", steps=1)
    cfg.credit.auto_prompts = 16
    lines = []
    Trainer(cfg, log=lines.append).train()
    choice = json.loads((run / "credit_choice.json").read_text())
    assert choice["method"] == "continuation_likelihood"
    assert choice["figures"]["all_wrong"] >= ALL_WRONG_HIGH
    assert choice["figures"]["prompts"] == 16 and choice["figures"]["group_size"] == 4
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["credit_method"] == "continuation_likelihood"
    assert saved["credit"]["lam"] == 0.0 and saved["credit"]["anchor"] == "none"
    assert saved["credit"]["handover"]["smoothing"] == 0.5
    assert any(line.startswith("credit auto: continuation_likelihood") for line in lines)
    # the probe's tokens are charged to the credit method, from step 0 on
    records = _records(run)
    assert records[0]["extra_tokens_generated"] == choice["figures"]["tokens"] > 0
    assert records[-1]["extra_tokens_generated"] >= choice["figures"]["tokens"]


def test_after_the_probe_the_run_is_the_chosen_methods_run(init_dir, tmp_path):
    auto_run, named_run = tmp_path / "auto", tmp_path / "named"
    cfg = micro_config(init_dir, auto_run, task="test_auto_parity", credit_method="auto")
    cfg.credit.auto_prompts = 8
    Trainer(cfg, log=lambda *_: None).train()
    chosen = json.loads((auto_run / "credit_choice.json").read_text())["method"]
    assert chosen == "value_head"
    named = micro_config(init_dir, named_run, task="test_auto_parity", credit_method=chosen)
    Trainer(named, log=lambda *_: None).train()
    auto, plain = _records(auto_run), _records(named_run)
    assert len(auto) == len(plain) == 4
    for a, p in zip(auto, plain):
        assert {k: a.get(k) for k in STABLE} == {k: p.get(k) for k in STABLE}
    # resuming does not probe again: the run's config holds the chosen method
    before = (auto_run / "credit_choice.json").read_text()
    more = TrainConfig(resume=str(auto_run), steps=4, progress=False)
    lines = []
    train(more, log=lines.append, given={"steps", "progress"})
    assert not any(line.startswith("credit auto") for line in lines)
    assert (auto_run / "credit_choice.json").read_text() == before
    assert [r["step"] for r in _records(auto_run)] == [0, 1, 2, 3, 4]


def test_a_misspelt_credit_method_lists_auto(init_dir, tmp_path):
    with pytest.raises(ValueError, match="or auto"):
        Trainer(micro_config(init_dir, tmp_path / "run", credit_method="unifrom"))
    with pytest.raises(ValueError, match="auto_prompts=0 must be >= 1"):
        CreditConfig(auto_prompts=0)
