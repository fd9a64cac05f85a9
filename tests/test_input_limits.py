"""Issue 57's findings on input limits: each size, range or input here hung, failed late with a
traceback, or was accepted silently before; now it gets one clear line up front, or the right
behaviour."""

from __future__ import annotations

import json
import math
import shutil
import time

import pytest
import torch

from conftest import one_line_error
from rredcot.errors import UserError
from rredcot.segment import split_text

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
# sizes that cannot fit: refused up front with a bound or an estimate


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
