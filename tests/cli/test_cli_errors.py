"""The command line (issue 13, findings 6-8): every help page renders, a user's mistake is one
line and exit status 2 (a traceback only for a bug), and settings that cannot work are refused or
warned about."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import rredcot
from rredcot.cli.commands import build_parser, main


def _subcommands(parser: argparse.ArgumentParser, prefix=()):
    """Every (sub)command path of the parser: (), ("train",), ("bench", "learn"), ..."""
    yield prefix
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subcommands(sub, (*prefix, name))


COMMANDS = list(_subcommands(build_parser()))


def test_the_commands_are_all_found():
    assert {(), ("train",), ("sft",), ("segment",), ("explain",)} <= set(COMMANDS)
    assert ("bench", "learn") in COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(c) or "rredcot")
def test_help_renders_for_every_subcommand(command, capsys):
    with pytest.raises(SystemExit) as done:
        main([*command, "--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: rredcot") and len(out.splitlines()) > 3


def test_train_help_shows_a_percent_sign(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "auto ~1%)" in capsys.readouterr().out


def _listed(help_text: str) -> set[str]:
    """The names a help text lists between its first colon and its first parenthesis."""
    return set(help_text.split(":", 1)[1].split("(", 1)[0].replace(",", " ").split())


def test_task_and_credit_help_list_the_registries(capsys):
    """``--task``'s and ``--credit_method``'s help name every registered task and every built-in
    credit method (written from the registries, so a new one cannot be left out), and
    ``rredcot train --help`` prints them. The registries are read in a fresh interpreter: tests
    register tasks and methods of their own."""
    code = (
        "import dataclasses, json\n"
        "from rredcot.config import TrainConfig\n"
        "from rredcot.methods.base import credit_names\n"
        "from rredcot.tasks import list_tasks\n"
        "helps = {f.name: f.metadata.get('help', '') for f in dataclasses.fields(TrainConfig)}\n"
        "print(json.dumps([helps['task'], helps['credit_method'], list_tasks(), credit_names()]))"
    )
    src = str(Path(rredcot.__file__).resolve().parent.parent)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": src},
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    task_help, credit_help, tasks, methods = json.loads(out.stdout.strip().splitlines()[-1])
    assert "word_problems" in tasks and {"uniform", "node_values", "oracle"} <= set(methods)
    assert _listed(task_help) == set(tasks)
    assert _listed(credit_help) == set(methods) | {"auto"}
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    printed = " ".join(capsys.readouterr().out.split())
    assert all(name in printed for name in [*tasks, *methods])


# ---------------------------------------------------------------------------------------------
# one line, exit status 2


def _one_line_error(argv, capsys, prefix="rredcot: error: "):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(prefix), err
    return err


def _user_mistakes(tmp):
    bad_yaml = tmp / "bad.yaml"
    bad_yaml.write_text("steps: 3\n  credit: [oops\n")
    a_list = tmp / "list.yaml"
    a_list.write_text("- steps\n- 3\n")
    a_file = tmp / "a_file"
    a_file.write_text("not a directory")
    empty = tmp / "nomodel"
    empty.mkdir()
    out = str(tmp / "run")
    return {
        "malformed YAML": (
            ["train", "--config", str(bad_yaml), "--out", out],
            "is not valid YAML at line 2, column",
        ),
        "a config that is not a mapping": (
            ["train", "--config", str(a_list), "--out", out],
            "not a mapping of config fields",
        ),
        "--config at a directory": (["train", "--config", str(tmp), "--out", out], "a directory"),
        "--config at a directory (sft)": (["sft", "--config", str(tmp)], "a directory"),
        "--config that does not exist": (
            ["train", "--config", str(tmp / "nope.yaml"), "--out", out],
            "does not exist",
        ),
        "--init at a directory with no model": (
            ["train", "--init", str(empty), "--out", out],
            f"--init {empty}: no model there (no config.json)",
        ),
        "--init at a file": (["train", "--init", str(a_file), "--out", out], "is a file"),
        "--out at a file": (["train", "--out", str(a_file)], "is a file, not a directory"),
        "--out at a file (sft)": (["sft", "--out", str(a_file)], "is a file, not a directory"),
        "--out of sft at a directory that is not a warm-start": (
            ["sft", "--out", str(tmp)],
            "not a warm-start checkpoint",
        ),
        "--init at a directory with no model (sft)": (
            ["sft", "--init", str(empty), "--out", out],
            f"--init {empty}: no model there (no config.json)",
        ),
        "--init with the tiny model's shape (sft)": (
            ["sft", "--init", str(empty), "--num_layers", "2", "--out", out],
            "--init " + str(empty) + " with --num_layers: those shape the tiny model",
        ),
        "--device that does not exist": (
            ["train", "--device", "gpu", "--out", out],
            "is not a device",
        ),
        "--resume of a directory that is not a run": (
            ["train", "--resume", str(tmp)],
            "no config.yaml there; is it a run directory?",
        ),
        "--out ''": (["train", "--out", ""], "out='' names no directory"),
        "--out '' (sft)": (["sft", "--out", " "], "out='' names no directory"),
        "--out where no directory can be made": (
            ["train", "--out", "/sys/rredcot_run"],
            "cannot create run directory /sys/rredcot_run: permission denied",
        ),
        "--html at a directory": (
            ["explain", "--demo", "--html", str(tmp)],
            f"--html {tmp}: a directory; give a file name",
        ),
        "--html under a file": (
            ["explain", "--demo", "--html", str(a_file / "x.html")],
            f"its folder {a_file} is a file",
        ),
        "--html where no file can be written": (
            ["explain", "--demo", "--html", "/sys/x.html"],
            "/sys/x.html: Permission denied; that location is not writable",
        ),
    }


MISTAKE_IDS = [
    "malformed YAML",
    "a config that is not a mapping",
    "--config at a directory",
    "--config at a directory (sft)",
    "--config that does not exist",
    "--init at a directory with no model",
    "--init at a file",
    "--out at a file",
    "--out at a file (sft)",
    "--out of sft at a directory that is not a warm-start",
    "--init at a directory with no model (sft)",
    "--init with the tiny model's shape (sft)",
    "--device that does not exist",
    "--resume of a directory that is not a run",
    "--out ''",
    "--out '' (sft)",
    "--out where no directory can be made",
    "--html at a directory",
    "--html under a file",
    "--html where no file can be written",
]


@pytest.mark.parametrize("mistake", MISTAKE_IDS)
def test_a_user_mistake_is_one_line_and_status_2(mistake, tmp_path, capsys):
    argv, expected = _user_mistakes(tmp_path)[mistake]
    err = _one_line_error(argv, capsys)
    assert expected in err, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_refused(tmp_path, capsys):
    err = _one_line_error(["train", "--device", "cuda", "--out", str(tmp_path / "r")], capsys)
    assert "--device cuda: no CUDA GPU is visible" in err and "--device cpu" in err
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_an_unknown_name_fails_before_any_model_is_loaded(tmp_path, monkeypatch, capsys):
    """`--credit no-such-method` (and every other name the config holds) is refused at once,
    listing the valid names: no run directory is made and no model is built or loaded."""
    import rredcot.models
    import rredcot.training.setup

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was built or loaded before the names were checked")

    for module, name in [
        (rredcot.training.setup, "load_train_policy"),
        (rredcot.training.setup, "load_named_policy"),
        (rredcot.models, "load_policy"),
        (rredcot.models, "build_tiny_llama"),
    ]:
        monkeypatch.setattr(module, name, no_loading)
    out = tmp_path / "run"
    mistakes = {
        ("--credit", "no-such-method"): "unknown credit method 'no-such-method'; valid: ",
        ("--task", "nope"): "unknown task 'nope'; valid: arithmetic,",
        ("--task.num_stepz", "3"): "got unknown parameter(s) num_stepz; valid: ",
        ("--credit.segmenter", "lines"): "unknown segmentation strategy 'lines'; valid: newline,",
        ("--credit.normalization", "zscore"): "unknown advantage normalization 'zscore'; valid:",
        ("--credit", "process_reward"): "credit_method=process_reward needs a value source",
    }
    for flags, expected in mistakes.items():
        err = _one_line_error(["train", "--out", str(out), *flags], capsys)
        assert expected in err, err
        assert not out.exists()
    err = _one_line_error(["train", "--out", str(out), "--credit", "no-such-method"], capsys)
    assert "uniform" in err and "value_head" in err and "answer_likelihood" in err


def test_a_full_disk_on_standard_output_is_one_line(tmp_path):
    """`rredcot segment > /dev/full`: one line, status 2, and no second error at exit."""
    import subprocess

    with open("/dev/full", "wb") as full:
        proc = subprocess.run(
            [sys.executable, "-m", "rredcot", "segment"],
            input=b"step one\nstep two\n",
            stdout=full,
            stderr=subprocess.PIPE,
            timeout=120,
        )
    err = proc.stderr.decode()
    assert proc.returncode == 2, err
    assert err.strip() == (
        "rredcot: error: writing the output: No space left on device; the disk is full; free "
        "space or write elsewhere"
    )


def test_binary_bytes_on_stdin_are_refused_like_a_file(tmp_path, monkeypatch, capsys):
    data = b"step one\n\xff\xfe\x00binary\n"
    (tmp_path / "trace.bin").write_bytes(data)
    from_file = _one_line_error(
        ["segment", str(tmp_path / "trace.bin")], capsys, "rredcot segment: error: "
    )
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    from_stdin = _one_line_error(["segment"], capsys, "rredcot segment: error: ")
    assert "is not UTF-8 text (byte 0xff at offset 9)" in from_file
    assert from_stdin.replace("stdin", str(tmp_path / "trace.bin")) == from_file


def test_stdin_keeps_its_line_ends_as_a_file_does(tmp_path, monkeypatch, capsys):
    """Offsets point into the trace as given: ``\\r\\n`` and a lone ``\\r`` are kept."""
    import json

    data = b"a\r\nb\rc\n"
    (tmp_path / "trace.txt").write_bytes(data)
    assert main(["segment", str(tmp_path / "trace.txt")]) == 0
    from_file = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert main(["segment"]) == 0
    from_stdin = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert from_stdin == from_file
    assert "".join(r["text"] for r in from_stdin) == data.decode()


def test_a_bug_keeps_its_traceback(monkeypatch, tmp_path):
    import rredcot.cli.train

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in rredcot")

    monkeypatch.setattr(rredcot.cli.train, "train", broken)
    with pytest.raises(RuntimeError, match="a bug in rredcot"):
        main(["train", "--out", str(tmp_path / "r")])


def test_every_config_field_has_help_text():
    """Configs describe themselves: every flag the generator makes has its help (issue 19)."""
    import dataclasses
    import typing

    from rredcot.bench.cli import SPECIAL_FIELDS
    from rredcot.bench.configs import (
        CreditBenchConfig,
        LearnBenchConfig,
        OverheadBenchConfig,
        PeerBenchConfig,
    )
    from rredcot.config import (
        AnswerLikelihoodConfig,
        ContinuationLikelihoodConfig,
        CreditConfig,
        HandoverConfig,
        ModelConfig,
        MonteCarloConfig,
        OracleConfig,
        ProcessRewardConfig,
        ReferencesConfig,
        ReweightConfig,
        SamplingConfig,
        SFTConfig,
        TrainConfig,
        TreeSamplingConfig,
        ValueHeadConfig,
    )

    configs = [TrainConfig, ModelConfig, SamplingConfig, CreditConfig, SFTConfig]
    configs += [ValueHeadConfig, HandoverConfig, AnswerLikelihoodConfig, MonteCarloConfig]
    configs += [ProcessRewardConfig, ContinuationLikelihoodConfig, ReweightConfig]
    configs += [TreeSamplingConfig, OracleConfig, ReferencesConfig]
    configs += [CreditBenchConfig, LearnBenchConfig, OverheadBenchConfig, PeerBenchConfig]
    missing = [
        f"{cls.__name__}.{f.name}"
        for cls in configs
        for f in dataclasses.fields(cls)
        if f.name not in SPECIAL_FIELDS
        and not dataclasses.is_dataclass(typing.get_type_hints(cls)[f.name])  # a section
        and not f.metadata.get("help")
    ]
    assert missing == []
    nested = {
        name: hint
        for cls in configs
        for name, hint in typing.get_type_hints(cls).items()
        if dataclasses.is_dataclass(hint)
    }
    assert set(nested.values()) <= set(configs)  # every section is checked too


def test_bench_flags_take_either_spelling():
    from rredcot.bench.cli import bench_config

    parser = build_parser()
    for flag in ("--first-seed", "--first_seed"):
        args = parser.parse_args(["bench", "learn", flag, "100", "--set", "lr=0.1"])
        cfg = bench_config("learn", args, {"num_steps": "12"})
        assert cfg.first_seed == 100 and cfg.overrides == {"lr": "0.1"}
        assert cfg.task_args == {"num_steps": "12"} and cfg.budget_tokens == 500_000


# ---------------------------------------------------------------------------------------------
# values that would run wrong silently are refused before any work (issue 39)

SILENT_MISTAKES = {
    "train --lr inf": (["train", "--lr", "inf"], "lr=inf: give a finite number"),
    "train --lr 1e400": (["train", "--lr", "1e400"], "lr=inf: give a finite number"),
    "train --kl_coef nan": (["train", "--kl_coef", "nan"], "kl_coef=nan: give a finite number"),
    "train --keep_checkpoints -1": (
        ["train", "--keep_checkpoints", "-1"],
        "keep_checkpoints=-1 must be >= 0",
    ),
    "train --warmup_steps -3": (["train", "--warmup_steps", "-3"], "warmup_steps=-3 must be >= 0"),
    "train --eval_every -1": (["train", "--eval_every", "-1"], "eval_every=-1 must be >= 0"),
    "train --lr -1": (["train", "--lr", "-1"], "lr=-1.0 must be >= 0"),
    "diagnose --temperature nan": (
        ["diagnose", "--temperature", "nan"],
        "--temperature=nan: give a finite number",
    ),
    "diagnose --group_sizes 100 --samples 2": (
        ["diagnose", "--group_sizes", "100", "--samples", "2"],
        "100 > --samples 2",
    ),
    "bench credit --methods x=uniform:nosuch.key=1": (
        ["bench", "credit", "--checkpoint", "/nonexistent", "--methods", "x=uniform:nosuch.key=1"],
        "unknown variant key 'nosuch.key'",
    ),
    "bench learn --methods x=uniform:sampling.nosuch=1": (
        ["bench", "learn", "--methods", "x=uniform:sampling.nosuch=1"],
        "unknown variant key 'sampling.nosuch'",
    ),
    "bench credit --temperature 0": (
        ["bench", "credit", "--checkpoint", "/nonexistent", "--temperature", "0"],
        "temperature=0.0 must be > 0",
    ),
}
BLANK_OUTPUTS = {
    "train --out ' '": ["train", "--out", " "],
    "sft --out ''": ["sft", "--out", ""],
    "diagnose --out ''": ["diagnose", "--out", ""],
    "diagnose --out ' '": ["diagnose", "--out", " "],
    "bench credit --out ''": ["bench", "credit", "--checkpoint", "/nonexistent", "--out", ""],
    "bench learn --out ' '": ["bench", "learn", "--out", " "],
    "bench overhead --out ''": ["bench", "overhead", "--out", ""],
    "bench peer --out '\\t'": ["bench", "peer", "--out", "\t"],
    "explain --html ''": ["explain", "--demo", "--html", ""],
    "explain --html ' '": ["explain", "--demo", "--html", " "],
}


@pytest.mark.parametrize("mistake", SILENT_MISTAKES)
def test_a_value_that_would_run_wrong_is_refused(mistake, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    argv, expected = SILENT_MISTAKES[mistake]
    assert expected in _one_line_error(argv, capsys)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", BLANK_OUTPUTS)
def test_every_command_that_writes_refuses_a_blank_path(command, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    err = _one_line_error(BLANK_OUTPUTS[command], capsys)
    assert "names no" in err and "blank" in err, err
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# names and data are checked before a model loads (issue 39)


def test_names_and_data_fail_before_explain_or_diagnose_loads_a_model(
    init_dir, tmp_path, monkeypatch, capsys
):
    import rredcot.diagnose.measure
    import rredcot.explain.model
    import rredcot.training.setup

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded before the names and the data were checked")

    for module in (rredcot.explain.model, rredcot.diagnose.measure):
        monkeypatch.setattr(module, "load_policy", no_loading)
    monkeypatch.setattr(rredcot.training.setup, "load_named_policy", no_loading)
    monkeypatch.setattr(rredcot.diagnose.measure, "default_policy_source", no_loading)
    monkeypatch.setattr(rredcot.training.setup, "default_policy_source", no_loading)
    bad_data = tmp_path / "data.jsonl"
    bad_data.write_text('{"question": "1+1?"}\n{not json\n')
    dataset = ["--task", "dataset", "--task.data", str(bad_data)]
    mistakes = {
        "explain --method": (
            ["explain", "--checkpoint", str(init_dir), "--method", "nosuchmethod"],
            "unknown credit method 'nosuchmethod'",
        ),
        "diagnose --segmenter": (
            ["diagnose", "--policy", str(init_dir), "--segmenter", "nosuchseg"],
            "unknown segmentation strategy 'nosuchseg'",
        ),
        "explain --task dataset": (
            ["explain", "--checkpoint", str(init_dir), *dataset],
            str(bad_data),
        ),
        "diagnose --task dataset": (
            ["diagnose", "--policy", str(init_dir), *dataset],
            str(bad_data),
        ),
        "diagnose --task dataset, default policy": (["diagnose", *dataset], str(bad_data)),
        "train --task dataset, default policy": (
            ["train", "--out", str(tmp_path / "run"), *dataset],
            str(bad_data),
        ),
    }
    for name, (argv, expected) in mistakes.items():
        assert expected in _one_line_error(argv, capsys), name


def test_a_model_that_cannot_load_is_not_called_an_output_write(tmp_path, capsys):
    folder = tmp_path / "broken_model"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    err = _one_line_error(["explain", "--checkpoint", str(folder), "--samples", "2"], capsys)
    assert "writing the output" not in err and "could not load" in err, err
