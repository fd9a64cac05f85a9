"""Each credit method's options in a dataclass of its own (issue 19, item 4): registered with the
method, nested in ``CreditConfig`` as ``credit.<section>.<field>`` for flags, YAML, ``--set`` and
bench variants alike; an unknown key is an error that lists the valid ones."""

from __future__ import annotations

import dataclasses

import pytest
import yaml

from rredcot.bench.cli import bench_config
from rredcot.bench.variants import parse_variant
from rredcot.cli.commands import build_parser
from rredcot.config import (
    AnswerLikelihoodConfig,
    CreditConfig,
    HandoverConfig,
    MonteCarloConfig,
    TrainConfig,
    ValueHeadConfig,
)
from rredcot.config.io import from_dict, resolve_config, to_dict
from rredcot.methods.base import CreditContext, build_credit, credit_names, credit_options


def _train_overrides(argv: list[str]) -> dict:
    """The overrides ``rredcot train ARGV`` hands to ``resolve_config``."""
    args = build_parser().parse_args(["train", *argv])
    return {k: v for k, v in vars(args).items() if k not in ("command", "config", "func")}


def _train_config(argv: list[str], yaml_path: str | None = None) -> TrainConfig:
    return resolve_config(TrainConfig, yaml_path, _train_overrides(argv))


# ---------------------------------------------------------------------------------------------
# the sections and their registration


def test_each_method_is_registered_with_its_own_options():
    assert credit_options("value_head") is ValueHeadConfig
    assert credit_options("answer_likelihood") is AnswerLikelihoodConfig
    assert credit_options("monte_carlo") is MonteCarloConfig
    assert credit_options("uniform") is None
    section_types = {f.type for f in dataclasses.fields(CreditConfig)}
    for name in credit_names():
        options = credit_options(name)
        assert options is None or options.__name__ in section_types, name
    cfg = CreditConfig()
    method = build_credit("value_head", cfg, CreditContext(policy=None, tokenizer=None))
    assert method.options is cfg.value_head and method.fit.config is cfg.value_head
    with pytest.raises(ValueError, match="not a section"):
        cfg.section(TrainConfig)


def test_shared_options_stay_at_credit_level():
    shared = {"segmenter", "min_chars", "max_segments", "separate_answer", "lam", "normalization"}
    names = {f.name for f in dataclasses.fields(CreditConfig)}
    assert shared <= names
    assert {"value_head", "handover", "answer_likelihood", "monte_carlo"} <= names


def test_validation_lives_in_each_section():
    with pytest.raises(ValueError, match="value_head.loss=bce needs credit.value_head.output"):
        ValueHeadConfig(output="linear")
    with pytest.raises(ValueError, match="value_head.td_lambda=2"):
        ValueHeadConfig(td_lambda=2)
    with pytest.raises(ValueError, match="handover.smoothing=1"):
        HandoverConfig(smoothing=1.0)
    with pytest.raises(ValueError, match="monte_carlo.rollouts"):
        MonteCarloConfig(rollouts=0)
    with pytest.raises(ValueError, match="credit.lam"):
        CreditConfig(lam=2.0)
    assert AnswerLikelihoodConfig(eos=True).eos == "true"  # a YAML boolean


# ---------------------------------------------------------------------------------------------
# the new spelling: flags and YAML


def test_new_flags_nest_per_method():
    cfg = _train_config(
        [
            "--credit.value_head.lr",
            "3e-3",
            "--credit.value_head.shared-min-count",
            "1",
            "--credit.value_head.logprob_features",  # a bare boolean flag
            "--credit.handover.mode",
            "off",
            "--credit.answer_likelihood.cue",
            "think",
            "--credit.monte_carlo.rollouts",
            "8",
            "--credit.anchor",
            "none",
            "--credit.lam",
            "0.5",
        ]
    )
    c = cfg.credit
    assert (c.value_head.lr, c.value_head.shared_min_count, c.value_head.logprob_features) == (
        3e-3,
        1,
        True,
    )
    assert (c.handover.mode, c.answer_likelihood.cue, c.monte_carlo.rollouts) == ("off", "think", 8)
    assert (c.anchor, c.lam) == ("none", 0.5)


def test_new_yaml_nests_the_same_way_and_flags_override_it(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "credit:\n"
        "  lam: 0.5\n"
        "  value_head: {lr: 0.003, epochs: 2}\n"
        "  handover: {mode: 'off', smoothing: 0.5}\n"
        "  monte_carlo: {rollouts: 8}\n"
    )
    cfg = _train_config(["--credit.value_head.epochs", "3"], str(path))
    c = cfg.credit
    assert (c.lam, c.value_head.lr, c.value_head.epochs) == (0.5, 0.003, 3)
    assert (c.handover.mode, c.handover.smoothing, c.monte_carlo.rollouts) == ("off", 0.5, 8)
    assert c.value_head.replay == ValueHeadConfig().replay  # the rest keeps its defaults
    saved = yaml.safe_load(yaml.safe_dump(to_dict(cfg)))["credit"]
    assert saved["value_head"]["lr"] == 0.003 and "value_lr" not in saved


def test_train_help_groups_each_methods_options(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    for group in ("credit.value_head:", "credit.handover:", "credit.answer_likelihood:"):
        assert f"\n{group}\n" in out
    assert "Options of the value_head method" in out
    assert "--credit.value_head.lr FLOAT" in out


# ---------------------------------------------------------------------------------------------
# --set and bench variants


def test_bench_commands_take_credit_flags_and_set_keys():
    argv = [
        "bench",
        "learn",
        "--credit.value_head.lr",
        "3e-3",
        "--set",
        "credit.value_head.shared_min_count=1",
        "--set",
        "credit.lam=0.5",
    ]
    args = build_parser().parse_args(argv)
    cfg = bench_config("learn", args, {})
    assert cfg.overrides == {
        "credit.value_head.lr": "3e-3",
        "credit.value_head.shared_min_count": "1",
        "credit.lam": "0.5",
    }
    argv = [
        "bench",
        "credit",
        "--checkpoint",
        "x",
        "--set",
        "value_head.lr=1",
        "--credit.anchor",
        "none",
    ]
    cfg = bench_config("credit", build_parser().parse_args(argv), {})
    assert cfg.overrides == {"credit.value_head.lr": "1", "credit.anchor": "none"}


# ---------------------------------------------------------------------------------------------
# unknown keys


def test_an_unknown_key_lists_the_valid_names():
    with pytest.raises(ValueError) as err:
        from_dict(TrainConfig, {"credit": {"value_head": {"lrr": 0.1}}})
    message = str(err.value)
    assert "unknown config key credit.value_head.lrr;" in message
    assert "valid keys in credit.value_head: " in message
    assert "lr, output, pretrain_steps, replay" in message
    with pytest.raises(ValueError) as err:
        from_dict(TrainConfig, {"credit": {"value_lrr": 0.1}})
    message = str(err.value)
    assert "value_head.{alik_feature, ema, epochs, hidden_size" in message
    assert "handover.{mode, score, smoothing}" in message and "lam" in message
    with pytest.raises(ValueError, match=r"unknown variant key 'value_lrr'.*value_head\.\{"):
        parse_variant("value_head:value_lrr=1")
