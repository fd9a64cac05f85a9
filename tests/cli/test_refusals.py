"""One line instead of a traceback, and a refusal up front instead of a hang (issue 47, sections 3
and 4; issue 57's input limits): every case here failed with a traceback, ran or hung for minutes,
or was accepted silently before; now it gets one clear line before any slow work, or the right
behaviour."""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest
import torch

from helpers import micro_config, one_line_error, tiny_trl_trainer, train_error_under_file_limit
from rredcot.cli.commands import main
from rredcot.errors import UserError
from rredcot.segment import split_text
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
# segment --strategy sentence: linear in a line's length


def test_a_long_line_of_many_sentences_segments_in_linear_time():
    line = "The cat sat. " * 200_000  # one line: each period used to scan back to its start
    start = time.perf_counter()
    spans = split_text(line, "sentence")
    seconds = time.perf_counter() - start
    assert len(spans) == 200_000
    assert seconds < 6, f"{seconds:.1f} s for 200k sentences (quadratic: about 20 s)"


def test_abbreviations_and_list_markers_on_a_long_line_still_do_not_cut():
    text = "Use e.g. this. " * 1000 + "\n  2. Then (e.g. that). Done."
    segments = [text[a:b] for a, b in split_text(text, "sentence")]
    assert segments == ["Use e.g. this. "] * 999 + [
        "Use e.g. this. \n  ",
        "2. Then (e.g. that). ",
        "Done.",
    ]


# ---------------------------------------------------------------------------------------------
# sizes that cannot fit: refused up front with the estimate or a bound, before anything loads


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


def test_sft_refuses_an_eval_size_beyond_memory_as_train_does(tmp_path, capsys):
    argv = ["sft", "--eval_size", "1000000000000", "--out", str(tmp_path / "ws")]
    err = one_line_error([*argv, "--progress", "0"], capsys)  # it hung before
    assert "eval_size=1000000000000" in err and "GiB" in err, err
    assert not (tmp_path / "ws").exists()


@pytest.mark.parametrize(
    "flags, named",
    [
        (
            ["--credit", "value_head", "--credit.value_head.hidden_size", "1000000000000"],
            "credit.value_head.hidden_size=1000000000000",
        ),
        (
            ["--credit", "monte_carlo", "--credit.monte_carlo.rollouts", "1000000000000"],
            "credit.monte_carlo.rollouts=1000000000000",
        ),
        (  # within memory at one token a row on a large machine, not at the task's length
            ["--credit", "monte_carlo", "--credit.monte_carlo.rollouts", "10000000000"],
            "credit.monte_carlo.rollouts=10000000000",
        ),
    ],
)
def test_credit_sizes_beyond_memory_are_refused_before_a_model_loads(
    tmp_path, capsys, flags, named
):
    err = one_line_error(["train", *flags, "--out", str(tmp_path / "run")], capsys)
    assert named in err and "GiB" in err, err
    assert "Loading weights" not in capsys.readouterr().err


def test_a_value_head_too_large_for_its_inputs_is_refused_before_it_is_allocated():
    from rredcot.config import ValueHeadConfig
    from rredcot.methods.value_fit import ValueFit

    fit = ValueFit(ValueHeadConfig(hidden_size=1_000_000), "cpu")  # 16 MB for one input
    with pytest.raises(ValueError, match=r"hidden_size=1000000: a head of [\d,]+ weights .*GiB"):
        fit.build(input_size=1_000_000, hidden_size=1_000_000, extra_size=0)  # 16 TB
    assert fit.head is None


def test_explain_refuses_samples_beyond_memory(init_dir, capsys):
    argv = ["explain", "--checkpoint", str(init_dir), "--method", "uniform"]
    err = one_line_error([*argv, "--samples", "1000000000000"], capsys)
    assert "--samples 1000000000000" in err and "GiB" in err, err


def test_explain_refuses_a_prompt_longer_than_the_models_context(init_dir, capsys):
    argv = ["explain", "--checkpoint", str(init_dir), "--method", "uniform"]
    start = time.perf_counter()
    err = one_line_error([*argv, "--prompt", "1+2=?" * 20_000], capsys)  # 10 GB before
    assert "--prompt is 100,00" in err and "the model's 256" in err, err
    assert time.perf_counter() - start < 30


def test_explain_refuses_a_trl_runs_example_longer_than_the_models_context(
    init_dir, tmp_path, capsys
):
    out = tmp_path / "trl_out"
    shutil.copytree(init_dir, out)
    settings = {
        "credit_method": "uniform",
        "credit": {},
        "task": "arithmetic",
        "task_args": {},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8},
        "example": {"prompt": "1+" * 500_000 + "1=?\n", "answer": "500001"},  # 1 MB
    }
    (out / "rredcot_credit.json").write_text(json.dumps(settings))
    err = one_line_error(["explain", "--run", str(out), "--samples", "2"], capsys)
    assert "rredcot_credit.json" in err and "the model's 256" in err, err


def test_diagnose_refuses_a_warm_starts_task_sized_past_the_model(init_dir, tmp_path, capsys):
    policy = tmp_path / "ws"
    shutil.copytree(init_dir, policy)
    record = {"task": "arithmetic", "task_args": {"num_steps": 100_000}}
    (policy / "warmstart.json").write_text(json.dumps(record))
    start = time.perf_counter()
    argv = ["diagnose", "--policy", str(policy), "--out", str(tmp_path / "d"), "--progress", "0"]
    err = one_line_error(argv, capsys)  # it made 32 prompts of 100,000 steps first (minutes)
    assert "num_steps=100000" in err and "256 positions" in err, err
    assert time.perf_counter() - start < 30
    assert not (tmp_path / "d").exists()


# ---------------------------------------------------------------------------------------------
# ranges


@pytest.mark.parametrize("floor", ["1000000000000", "1", "1.5"])
def test_an_advantage_tail_floor_of_one_or_more_is_refused(tmp_path, capsys, floor):
    argv = ["train", "--advantage_tail_floor", floor, "--out", str(tmp_path / "run")]
    err = one_line_error(argv, capsys)  # it zeroed every advantage, exit 0 and no warning
    assert f"advantage_tail_floor={float(floor)}" in err and "[0, 1)" in err, err


def test_an_advantage_tail_floor_in_range_is_accepted():
    from rredcot.config import TrainConfig

    assert TrainConfig(advantage_tail_floor=0.01).advantage_tail_floor == 0.01


def test_the_help_of_keep_checkpoints_says_what_0_means(capsys):
    from rredcot.cli.commands import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "on disk (the newest ones); 0 keeps every checkpoint." in text


def test_a_value_head_learning_rate_out_of_range_is_refused(tmp_path, capsys):
    argv = ["train", "--credit", "value_head", "--credit.value_head.lr", "1000000000000"]
    err = one_line_error([*argv, "--out", str(tmp_path / "run")], capsys)  # an IndexError
    assert "credit.value_head.lr=1000000000000.0" in err and "(0, 1]" in err, err


def test_the_calibration_error_of_a_diverged_head_is_nan():
    from rredcot.methods.value_head import expected_calibration_error

    pred = torch.tensor([[float("nan"), 0.5]])
    ece = expected_calibration_error(pred, torch.ones(1, 2), torch.ones(1, 2))
    assert math.isnan(ece)


@pytest.mark.parametrize(
    "argv, named",
    [
        (["train", "--threads", "1000000000000"], "threads=1000000000000 must be in [0, 1024]"),
        (["train", "--seed", "100000000000000000000"], "seed=100000000000000000000"),
        (["sft", "--threads", "1000000000000"], "threads=1000000000000 must be in [0, 1024]"),
        (["sft", "--seed", "100000000000000000000"], "seed=100000000000000000000"),
        (["diagnose", "--threads", "1000000000000"], "--threads=1000000000000"),
        (["diagnose", "--seed", "100000000000000000000"], "--seed=100000000000000000000"),
    ],
)
def test_threads_and_seeds_out_of_range_are_refused_with_the_range(tmp_path, capsys, argv, named):
    err = one_line_error([*argv, "--out", str(tmp_path / "out")], capsys)
    assert named in err and "Overflow" not in err, err
    assert "[0, 1024]" in err or "[-2**63, 2**63 - 1]" in err, err
    assert not (tmp_path / "out").exists()


def test_explain_refuses_a_seed_out_of_range(init_dir, capsys):
    argv = ["explain", "--checkpoint", str(init_dir), "--method", "uniform", "--samples", "2"]
    err = one_line_error([*argv, "--seed", "100000000000000000000"], capsys)
    assert "--seed=100000000000000000000" in err and "[-2**63, 2**63 - 1]" in err, err


# ---------------------------------------------------------------------------------------------
# the device and the model


def test_float16_on_the_cpu_is_refused_before_training(init_dir, tmp_path, capsys):
    argv = ["train", "--init", str(init_dir), "--model.dtype", "float16", "--device", "cpu"]
    err = one_line_error([*argv, "--out", str(tmp_path / "run")], capsys)  # inf/nan at step 2
    assert "model.dtype=float16" in err and "float32 or bfloat16" in err, err
    assert not (tmp_path / "run").exists()


def test_a_hub_id_offline_fails_at_once_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    argv = ["train", "--model.name_or_path", "someone/no-such-model"]
    start = time.perf_counter()
    err = one_line_error([*argv, "--out", str(tmp_path / "run")], capsys)  # 30-55 s, retries
    assert "'someone/no-such-model'" in err and "HF_HUB_OFFLINE is set" in err, err
    assert "a .gguf file" in err and "smollm2-135m-instruct" in err
    assert time.perf_counter() - start < 10


def test_an_unreachable_hub_is_found_at_once(monkeypatch):
    from rredcot import models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused
    start = time.perf_counter()
    assert models.hub_unreachable().startswith("no connection to 127.0.0.1:9")
    assert time.perf_counter() - start < 6
    with pytest.raises(UserError, match="cannot be reached .* nor is it in the hub cache"):
        models.hub_options("someone/no-such-model")
    monkeypatch.setattr(models, "_hub_cached", lambda name: True)  # then the cache serves
    assert models.hub_options("someone/cached-model") == {"local_files_only": True}


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


def test_jsonl_and_json_data_with_a_byte_order_mark_are_read(tmp_path):
    from rredcot.tasks.dataset import load_rows

    row = {"question": "1+1?", "answer": "2"}
    lines = tmp_path / "train.jsonl"
    lines.write_bytes(b"\xef\xbb\xbf" + (json.dumps(row) + "\n").encode() * 2)
    assert [r for _, r in load_rows(str(lines))] == [row, row]
    array = tmp_path / "train.json"
    array.write_bytes(b"\xef\xbb\xbf" + json.dumps([row]).encode())
    assert [r for _, r in load_rows(str(array))] == [row]


def test_a_byte_order_mark_after_the_first_line_is_still_refused(tmp_path):
    from rredcot.tasks.dataset import DataError, load_rows

    data = tmp_path / "train.jsonl"
    data.write_bytes(b'{"question": "a", "answer": "1"}\n\xef\xbb\xbf{"question": "b"}\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_rows(str(data))


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
