"""One line instead of a traceback, and a refusal before slow work instead of a hang (issue 47,
sections 3 and 4): every case here failed with a traceback, ran for minutes or was accepted
silently before."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from conftest import micro_config, one_line_error, tiny_trl_trainer, train_error_under_file_limit
from rredcot.cli.commands import main
from rredcot.training import runio
from rredcot.training.trainer import Trainer

QUIET = {"log": lambda *_: None}


# ---------------------------------------------------------------------------------------------
# config files: YAML within limits


def test_a_yaml_billion_laughs_is_refused_in_one_line(tmp_path, capsys):
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    config = tmp_path / "lol.yaml"
    config.write_text("\n".join(lines) + "\n")
    err = one_line_error(["train", "--config", str(config)], capsys)
    assert "lol.yaml" in err and "aliases" in err


def test_yaml_nested_deeper_than_the_stack_is_refused_in_one_line(tmp_path, capsys):
    config = tmp_path / "deep.yaml"
    config.write_text("steps: " + "[" * 10_000 + "]" * 10_000 + "\n")
    err = one_line_error(["train", "--config", str(config)], capsys)
    assert "deep.yaml" in err and "nests deeper" in err


def test_yaml_aliases_within_the_limit_still_load():
    from rredcot.safe_fs import load_yaml_text

    assert load_yaml_text("x: &x {k: 1}\ny: *x\n", "test") == {"x": {"k": 1}, "y": {"k": 1}}


# ---------------------------------------------------------------------------------------------
# sizes that cannot fit: refused with the estimate, before anything loads


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["diagnose", "--samples", "1000000000"], "--samples 1000000000"),
        (
            [
                *("train", "--credit", "uniform", "--references.mode", "bread"),
                *("--references.groups", "all", "--references.branch_rollouts", "1000000000"),
            ],
            "references.branch_rollouts=1000000000",
        ),
        (["train", "--prompts_per_step", "1000000000"], "prompts_per_step=1000000000"),
    ],
)
def test_sizes_beyond_memory_are_refused_with_the_estimate(tmp_path, capsys, argv, flag):
    err = one_line_error([*argv, "--out", str(tmp_path / "out")], capsys)
    assert flag in err and "GiB" in err, err
    assert not (tmp_path / "out").exists()


def test_an_eval_size_beyond_memory_in_a_config_file_is_refused(tmp_path, capsys):
    config = tmp_path / "big.yaml"
    config.write_text("eval_size: 1000000000000\n")
    err = one_line_error(["train", "--config", str(config), "--out", str(tmp_path / "o")], capsys)
    assert "eval_size=1000000000000" in err and "GiB" in err


def test_sft_refuses_a_zero_width_model(tmp_path, capsys):
    err = one_line_error(["sft", "--hidden_size", "0", "--out", str(tmp_path / "ws")], capsys)
    assert "hidden_size=0" in err


def test_a_task_longer_than_the_tiny_model_is_refused_before_the_warm_start(tmp_path, capsys):
    argv = ["sft", "--task.num_steps", "1000", "--out", str(tmp_path / "ws"), "--progress", "0"]
    err = one_line_error(argv, capsys)
    assert "256 positions" in err and "num_steps" in err
    assert not (tmp_path / "ws").exists()


# ---------------------------------------------------------------------------------------------
# data files


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"question": "1+1?", "answer": NaN}', "'answer' is nan"),
        (json.dumps({"question": "x" * 300_000, "answer": "2"}), "300,000 characters"),
        ("[" * 100_000 + "]" * 100_000, "nests JSON too deeply"),
    ],
    ids=["nan answer", "huge question", "deep nesting"],
)
def test_bad_data_rows_are_refused_in_one_line(tmp_path, capsys, line, expected):
    data = tmp_path / "train.jsonl"
    data.write_text(line + "\n")
    argv = ["train", "--task", "dataset", "--task.data", str(data), "--task.answer_format", "raw"]
    err = one_line_error([*argv, "--out", str(tmp_path / "run")], capsys)
    assert "train.jsonl line 1" in err and expected in err, err


# ---------------------------------------------------------------------------------------------
# resume


def test_resume_with_the_metrics_log_deleted_or_its_step_0_garbled(run_copy, capsys):
    (run_copy / "metrics.jsonl").unlink()
    assert main(["train", "--resume", str(run_copy), "--steps", "3"]) == 0
    records = [json.loads(x) for x in (run_copy / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[0]["metrics_lost"] is True
    lines = (run_copy / "metrics.jsonl").read_text().splitlines()
    lines[0] = "{garbled" + "[" * 100_000  # and nested past the stack
    (run_copy / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    assert main(["train", "--resume", str(run_copy), "--steps", "4"]) == 0
    assert (run_copy / "metrics.unreadable.jsonl").is_file()


@pytest.mark.parametrize(
    "state, expected",
    [({}, "lacks optimizer"), ("negative step", "step=-5")],
)
def test_a_trainer_state_that_cannot_be_resumed_is_one_line(run_copy, capsys, state, expected):
    ckpt = run_copy / "checkpoints" / "step_000002"
    if state == "negative step":
        state = runio.load_trainer_state(ckpt / "trainer_state.pt")
        state["step"] = -5
    torch.save(state, ckpt / "trainer_state.pt")
    runio.write_manifest(ckpt, 2)  # a consistent manifest: the checkpoint verifies
    err = one_line_error(["train", "--resume", str(run_copy), "--steps", "3"], capsys)
    assert "trainer_state.pt" in err and expected in err, err


def test_resume_given_an_empty_path_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    err = one_line_error(["train", "--resume", ""], capsys)
    assert "resume=''" in err
    assert list(tmp_path.iterdir()) == []


def test_a_bench_variant_named_dots_is_refused():
    from rredcot.bench.variants import dir_name, parse_variant

    for name in ("..", "."):
        with pytest.raises(ValueError, match="not only dots"):
            parse_variant(f"{name}=uniform")
        assert dir_name(name) not in (".", "..")


# ---------------------------------------------------------------------------------------------
# a full disk or a file-size limit while the policy is written


def test_a_failed_policy_write_is_one_line(init_dir, tmp_path):
    """A file-size limit of 50 kB: the policy's safetensors file (~150 kB) fails to write, which
    safetensors reports as its own ``SafetensorError``."""
    error = train_error_under_file_limit(init_dir, tmp_path / "run", 50_000)
    assert "policy" in error and "--resume" in error, error


# ---------------------------------------------------------------------------------------------
# explain a TRL run offline: the run records the problem it shows


@pytest.mark.trl
@pytest.mark.usefixtures("reset_accelerator_state")
def test_explain_of_a_trl_run_needs_none_of_its_tasks_data(init_dir, tmp_path, monkeypatch, capsys):
    """The README's TRL example trains ``task="gsm8k"`` on a local file; explain then showed the
    task's first evaluation problem, read from the dataset hub (offline: a failure after
    retries). The run's saved training row is shown instead."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    out = tmp_path / "trl_out"
    shutil.copytree(init_dir, out)
    settings = {
        "credit_method": "uniform",
        "credit": {},
        "task": "gsm8k",
        "task_args": {},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8},
        "example": {"prompt": "Question: 2 + 2?\n", "answer": "4"},
    }
    (out / "rredcot_credit.json").write_text(json.dumps(settings))
    argv = ["explain", "--run", str(out), "--samples", "2", "--no-color"]
    assert main(argv) == 0, capsys.readouterr().err
    assert "Question: 2 + 2?" in capsys.readouterr().out


@pytest.mark.trl
@pytest.mark.usefixtures("reset_accelerator_state")
def test_the_trl_trainer_records_its_first_training_row(init_dir, tmp_path):
    pytest.importorskip("trl")
    from rredcot.integrations.saved import read_settings

    trainer, problems = tiny_trl_trainer(init_dir, tmp_path / "out", credit_method="uniform")
    trainer.save_credit_state(tmp_path / "out")
    saved = read_settings(tmp_path / "out")
    assert saved.example == {"prompt": problems[0].prompt, "answer": str(problems[0].answer)}


@pytest.mark.trl
@pytest.mark.usefixtures("reset_accelerator_state")
def test_trl_settings_nested_past_the_stack_are_one_line(init_dir, tmp_path, capsys):
    out = tmp_path / "trl_out"
    shutil.copytree(init_dir, out)
    (out / "rredcot_credit.json").write_text(
        '{"credit_method": ' + "[" * 100_000 + "]" * 100_000 + "}"
    )
    err = one_line_error(["explain", "--run", str(out), "--samples", "2"], capsys)
    assert "rredcot_credit.json" in err and "nests JSON deeper" in err


def test_resume_with_the_metrics_log_linked_to_an_outside_file(run_copy, tmp_path, capsys):
    """Refused in one line (issue 57, finding 4): never adopted as the run's log."""
    outside = tmp_path / "other.jsonl"
    outside.write_text('{"step": 0}\n{"step": 1, "note": "not this run"}\n')
    (run_copy / "metrics.jsonl").unlink()
    (run_copy / "metrics.jsonl").symlink_to(outside)
    err = one_line_error(["train", "--resume", str(run_copy), "--steps", "3"], capsys)
    assert "metrics.jsonl is a symbolic link" in err, err
    assert outside.read_text() == '{"step": 0}\n{"step": 1, "note": "not this run"}\n'
    assert (run_copy / "metrics.jsonl").is_symlink()


def test_a_tiny_model_with_odd_head_width_is_refused_in_one_line(tmp_path, capsys):
    argv = ["sft", "--hidden_size", "6", "--num_heads", "2", "--out", str(tmp_path / "ws")]
    assert "even" in one_line_error(argv, capsys)
    from rredcot.models import build_char_tokenizer, build_tiny_llama

    with pytest.raises(ValueError, match="even width"):
        build_tiny_llama(build_char_tokenizer(), hidden_size=6, num_heads=2)


def test_a_task_sized_past_the_models_context_is_refused_before_its_pool(init_dir, tmp_path):
    """--init given (no warm-start): 100,000-step chains took minutes to build the training
    pool before the context check; the answer length alone is over the context."""
    import time

    cfg = micro_config(init_dir, tmp_path / "run", task_args={"num_steps": 100_000})
    cfg.sampling.max_new_tokens = 0  # the task's: 10 x 100,000 + 16 characters
    start = time.perf_counter()
    with pytest.raises(ValueError, match="leaves no room for a prompt in the policy's 256"):
        Trainer(cfg, **QUIET)
    assert time.perf_counter() - start < 30


def test_json_of_an_output_folder_is_read_within_limits(tmp_path):
    """One reader for JSON that a run or output folder holds (bench learn's results, a
    diagnose report): nesting past the stack is one UserError naming the file; brackets inside
    strings are text, not nesting."""
    from rredcot.diagnose.report import DiagnoseReport
    from rredcot.errors import UserError
    from rredcot.safe_fs import loads_json, read_json_file

    deep = tmp_path / "result.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UserError, match="result.json nests JSON deeper"):
        read_json_file(deep, "a finished run's result")
    with pytest.raises(UserError, match="result.json nests JSON deeper"):
        DiagnoseReport.from_json(deep)
    assert loads_json(json.dumps({"text": "[" * 1000}), "line 1") == {"text": "[" * 1000}
    with pytest.raises(UserError, match="line 2 is not valid JSON"):
        loads_json("{cut", "line 2")
