"""Each credit method's options in a dataclass of its own (issue 19, item 4): registered with the
method, nested in ``CreditConfig`` as ``credit.<section>.<field>`` for flags and YAML alike, and
the old flat names (``credit.value_lr``) still read by every route through one table, with a
one-line note naming the new spelling."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from rredcot import config as config_module
from rredcot.bench.cli import bench_config
from rredcot.bench.variants import parse_set, parse_variant
from rredcot.cli import build_parser
from rredcot.config import (
    AnswerLikelihoodConfig,
    CreditConfig,
    HandoverConfig,
    MonteCarloConfig,
    TrainConfig,
    ValueHeadConfig,
    current_key,
    flatten,
    from_dict,
    load_yaml,
    resolve_config,
    to_dict,
    upgrade_renamed,
)
from rredcot.methods.base import CreditContext, build_credit, credit_names, credit_options

FLAT = Path(__file__).parent / "fixtures" / "credit_section_flat.yaml"


@pytest.fixture(autouse=True)
def fresh_notes(monkeypatch):
    """Each test sees the deprecation notes its own calls print (they print once a process)."""
    monkeypatch.setattr(config_module, "NOTED_RENAMES", set())


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


def test_shared_options_stay_at_credit_level_and_old_names_all_have_a_home():
    shared = {"segmenter", "min_chars", "max_segments", "separate_answer", "lam", "normalization"}
    names = {f.name for f in dataclasses.fields(CreditConfig)}
    assert shared <= names
    assert {"value_head", "handover", "answer_likelihood", "monte_carlo"} <= names
    leaves = set(flatten(to_dict(CreditConfig())))
    assert set(CreditConfig.RENAMED.values()) <= leaves  # every old name points at a field
    assert len(CreditConfig.RENAMED) == 26  # every flat option the config had before


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


def test_new_flags_nest_per_method(capsys):
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
    assert "deprecated" not in capsys.readouterr().err


def test_new_yaml_nests_the_same_way_and_flags_override_it(tmp_path, capsys):
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
    assert "deprecated" not in capsys.readouterr().err


def test_train_help_groups_each_methods_options_and_hides_the_old_names(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--help"])
    out = capsys.readouterr().out
    for group in ("credit.value_head:", "credit.handover:", "credit.answer_likelihood:"):
        assert f"\n{group}\n" in out
    assert "Options of the value_head method" in out
    assert "--credit.value_head.lr FLOAT" in out
    assert "--credit.value_lr" not in out and "--credit.mc_rollouts" not in out


# ---------------------------------------------------------------------------------------------
# the old flat names, by every route


OLD_FLAGS = [
    "--credit.value_lr",
    "3e-3",
    "--credit.value-shared-min-count",
    "1",
    "--credit.handover",
    "off",
    "--credit.handover_score",
    "explained_variance",
    "--credit.mc_rollouts",
    "8",
    "--credit.value_anchor",
    "none",
    "--credit.answer_cue",
    "think",
]
NEW_FLAGS = [
    "--credit.value_head.lr",
    "3e-3",
    "--credit.value_head.shared_min_count",
    "1",
    "--credit.handover.mode",
    "off",
    "--credit.handover.score",
    "explained_variance",
    "--credit.monte_carlo.rollouts",
    "8",
    "--credit.anchor",
    "none",
    "--credit.answer_likelihood.cue",
    "think",
]


def test_old_flags_set_the_new_fields_with_one_note_each(capsys):
    old, new = _train_config(OLD_FLAGS), _train_config(NEW_FLAGS)
    assert to_dict(old) == to_dict(new)
    err = capsys.readouterr().err.splitlines()
    assert "rredcot: --credit.value_lr is deprecated; use --credit.value_head.lr" in err
    assert "rredcot: --credit.handover is deprecated; use --credit.handover.mode" in err
    assert (
        "rredcot: --credit.value-shared-min-count is deprecated; use "
        "--credit.value_head.shared_min_count" in err
    )
    assert len(err) == 7  # one line per old name, none for the new ones
    _train_config(OLD_FLAGS)
    assert capsys.readouterr().err == ""  # once a process


def test_old_yaml_keys_read_as_the_new(tmp_path, capsys):
    path = tmp_path / "old.yaml"
    path.write_text(
        "credit:\n"
        "  value_lr: 0.003\n"
        "  value_shared_min_count: 1\n"
        "  handover: 'off'\n"
        "  handover_score: explained_variance\n"
        "  mc_rollouts: 8\n"
        "  value_anchor: none\n"
        "  answer_cue: think\n"
    )
    assert to_dict(_train_config([], str(path))) == to_dict(_train_config(NEW_FLAGS))
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1  # one line for the whole file
    assert err[0].startswith("rredcot: deprecated names, read as the new ones: credit.handover ")
    assert "credit.value_lr -> credit.value_head.lr" in err[0]
    assert "credit.mc_rollouts -> credit.monte_carlo.rollouts" in err[0]
    # an old key in the YAML and a new flag for the same section merge
    cfg = _train_config(["--credit.handover.smoothing", "0.5"], str(path))
    assert (cfg.credit.handover.mode, cfg.credit.handover.smoothing) == ("off", 0.5)


def test_old_and_new_name_of_one_field_together_are_refused():
    with pytest.raises(ValueError, match="both credit.value_lr and credit.value_head.lr"):
        from_dict(CreditConfig, {"value_lr": 0.1, "value_head": {"lr": 0.2}}, "credit.")


def test_old_dotted_keys_of_set_and_bench_variants(capsys):
    assert parse_set(["credit.value_shared_min_count=1", "value_lr=3e-3", "handover=off"]) == {
        "credit.value_head.shared_min_count": "1",
        "credit.value_head.lr": "3e-3",
        "credit.handover.mode": "off",
    }
    old = parse_variant("value_head:value_shared_min_count=1:handover=off")
    new = parse_variant("value_head:value_head.shared_min_count=1:handover.mode=off")
    assert (
        old.name == "value_head:value_shared_min_count=1:handover=off"
    )  # its runs keep their dirs
    assert (
        old.overrides
        == new.overrides
        == {
            "credit.value_head.shared_min_count": "1",
            "credit.handover.mode": "off",
        }
    )
    assert old.credit_config() == new.credit_config()
    assert old.credit_config().value_head.shared_min_count == 1
    err = capsys.readouterr().err
    assert "rredcot: credit.value_shared_min_count is deprecated; use " in err
    assert current_key("credit.handover.score") == "credit.handover.score"  # current: as it is
    assert current_key("sampling.temperature") == "sampling.temperature"


def test_bench_commands_take_credit_flags_and_old_set_keys():
    argv = [
        "bench",
        "learn",
        "--credit.value_head.lr",
        "3e-3",
        "--set",
        "credit.value_shared_min_count=1",
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
        "value_lr=1",
        "--credit.anchor",
        "none",
    ]
    cfg = bench_config("credit", build_parser().parse_args(argv), {})
    assert cfg.overrides == {"credit.value_head.lr": "1", "credit.anchor": "none"}


def test_an_old_format_config_yaml_loads_into_the_sections(tmp_path):
    """A run's config.yaml written before the change (main's layout, tests/fixtures)."""
    old = yaml.safe_load(FLAT.read_text())
    assert "value_lr" in old["credit"] and "value_head" not in old["credit"]
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({"steps": 3, **old}))
    cfg = load_yaml(path)
    assert cfg.credit == CreditConfig()  # main wrote every default: the same config
    assert upgrade_renamed(TrainConfig, old)["credit"]["value_head"]["lr"] == 0.001


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
