"""Files in a run or output folder run no code, and writers touch nothing outside it (issue 47,
section 2): a saved ``--credit auto`` choice names a method and plain settings only; the bench
and diagnose writers do not write through links; ``--overwrite`` and ``sft`` delete only what
they wrote."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import code_payload, one_line_error, tiny_trl_trainer
from rredcot.cli.commands import main
from rredcot.config import TrainConfig
from rredcot.errors import UserError

QUIET = {"log": lambda *_: None}


def _make_auto(run: Path, choice) -> None:
    """Make ``run`` an ``auto`` run (its config.yaml) whose saved choice is ``choice``."""
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["credit_method"] = "auto"
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    (run / "credit_choice.json").write_text(json.dumps(choice))


def _choices(spec: str, model_dir: str):
    return {
        "function in settings": (
            {"method": "uniform", "settings": {"process_reward.function": spec}},
            "process_reward.function",
        ),
        "model in settings": (
            {"method": "uniform", "settings": {"process_reward.model": model_dir}},
            "process_reward.model",
        ),
        "method process_reward": (
            {"method": "process_reward", "settings": {}, "reason": ""},
            "not one --credit auto chooses",
        ),
        "a list": ([{"method": "uniform"}], "holds a list"),
        "unknown setting": ({"method": "uniform", "settings": {"bogus": 1}}, "not a credit"),
        "unknown field": ({"method": "uniform", "code": spec}, "unknown field"),
        "a list as a setting": (
            {"method": "uniform", "settings": {"lam": [1, 2]}},
            "plain value",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "function in settings",
        "model in settings",
        "method process_reward",
        "a list",
        "unknown setting",
        "unknown field",
        "a list as a setting",
    ],
)
def test_resume_refuses_a_saved_choice_that_names_code_or_is_malformed(
    run_copy, init_dir, tmp_path, capsys, case
):
    spec, marker = code_payload(tmp_path)
    choice, expected = _choices(spec, str(init_dir))[case]
    _make_auto(run_copy, choice)
    err = one_line_error(["train", "--resume", str(run_copy), "--steps", "3"], capsys)
    assert not marker.exists(), "the saved choice's function was imported"
    assert "credit_choice.json" in err and expected in err, err


def test_a_valid_saved_choice_is_read(run_copy):
    from rredcot.methods.auto import FLOW_METHOD, FLOW_SETTINGS, CreditChoice

    choice = {"method": FLOW_METHOD, "settings": FLOW_SETTINGS, "reason": "r", "figures": {}}
    (run_copy / "credit_choice.json").write_text(json.dumps(choice))
    read = CreditChoice.read(run_copy / "credit_choice.json")
    assert read.method == FLOW_METHOD and read.settings == FLOW_SETTINGS


def test_bench_learn_does_not_import_what_a_reused_runs_choice_names(run_copy, tmp_path):
    from rredcot.bench.learn import _check_same_config

    spec, marker = code_payload(tmp_path)
    _make_auto(run_copy, {"method": "uniform", "settings": {"process_reward.function": spec}})
    with pytest.raises(UserError, match="process_reward.function"):
        _check_same_config(run_copy, TrainConfig(credit_method="auto"))
    assert not marker.exists()


@pytest.mark.trl
@pytest.mark.usefixtures("reset_accelerator_state")
def test_trl_resume_refuses_a_checkpoint_choice_that_names_code(init_dir, tmp_path):
    pytest.importorskip("trl")
    spec, marker = code_payload(tmp_path)
    trainer, _ = tiny_trl_trainer(
        init_dir,
        tmp_path / "out",
        max_steps=1,
        save_strategy="no",
        credit_method="auto",
    )
    ckpt = tmp_path / "checkpoint-1"
    ckpt.mkdir()
    settings = {
        "credit_method": "uniform",
        "credit": {},
        "task": "arithmetic",
        "task_args": {"num_steps": 2},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 8},
    }
    for choice, credit, expected in [
        (
            {"method": "uniform", "settings": {"process_reward.function": spec}, "reason": ""},
            {},
            "process_reward.function",
        ),
        (
            {"method": "uniform", "settings": {}, "reason": ""},
            {"process_reward": {"model": spec}},
            "process_reward.model",
        ),
        (["uniform"], {}, "holds a list"),
    ]:
        planted = {**settings, "credit": credit, "credit_choice": choice}
        (ckpt / "rredcot_credit.json").write_text(json.dumps(planted))
        with pytest.raises(UserError, match=expected):
            trainer.load_credit_state(ckpt)
        assert trainer.credit_method is None
    assert not marker.exists()


# ---------------------------------------------------------------------------------------------
# writers outside the run directory's: no link followed, nothing outside deleted


def _outside(tmp_path: Path, name: str) -> Path:
    folder = tmp_path / "outside"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f"{name}: not rredcot's")
    return path


def test_bench_memory_does_not_write_through_a_planted_link(tmp_path):
    from rredcot.bench.configs import MemoryBenchConfig
    from rredcot.bench.memory import _write

    out = tmp_path / "mem"
    out.mkdir()
    targets = {}
    for name in ("memory.json", ".memory.json.tmp", "memory.md", ".memory.md.tmp"):
        targets[name] = _outside(tmp_path, name)
        (out / name).symlink_to(targets[name])
    cfg = MemoryBenchConfig(out=str(out))
    _write(out, cfg, [{"model": "tiny", "method": "uniform", "scale": 1, "error": "x"}])
    for name, target in targets.items():
        assert target.read_text() == f"{name}: not rredcot's", f"{name} was followed"
    assert json.loads((out / "memory.json").read_text())["results"][0]["error"] == "x"
    assert not (out / "memory.json").is_symlink()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--timeout", "-1"], "--timeout"),
        (["--timeout", "0"], "--timeout"),
        (["--out", ""], "out"),
        (["--methods", "bogus"], "--methods bogus"),
        (["--models", "/nonexistent/model"], "--models /nonexistent/model"),
    ],
)
def test_bench_memory_refuses_what_cannot_run_before_measuring(tmp_path, capsys, argv, expected):
    base = ["bench", "memory", "--models", "tiny", "--methods", "uniform", "--scales", "1"]
    out = ["--out", str(tmp_path / "mem")] if "--out" not in argv else []
    err = one_line_error([*base, *out, *argv], capsys)
    assert expected in err, err
    assert not (tmp_path / "mem").exists()


def test_diagnose_does_not_write_through_planted_temporaries(init_dir, tmp_path):
    out = tmp_path / "diag"
    out.mkdir()
    targets = {}
    for name in (".diagnose.json.tmp", ".diagnose.md.tmp", ".diagnose.png.tmp"):
        targets[name] = _outside(tmp_path, name)
        (out / name).symlink_to(targets[name])
    argv = ["diagnose", "--policy", str(init_dir), "--task.num_steps", "2", "--prompts", "2"]
    argv += ["--samples", "2", "--group-sizes", "2", "--max-new-tokens", "8", "--mc-traces", "1"]
    argv += ["--mc-k", "2", "--bootstrap", "10", "--out", str(out), "--progress", "false"]
    assert main(argv) == 0
    for name, target in targets.items():
        assert target.read_text() == f"{name}: not rredcot's", f"{name} was followed"
    assert (out / "diagnose.png").read_bytes()[:4] == b"\x89PNG"


def test_overwrite_keeps_a_users_step_files_in_a_linked_checkpoints_folder(run_copy, tmp_path):
    """``checkpoints/`` linked to a user's folder: --overwrite removes the run's checkpoints
    there and nothing of the user's, though named ``step_*``."""
    from rredcot.training import runio

    mine = tmp_path / "my_folder"
    shutil.move(run_copy / "checkpoints", mine)
    (run_copy / "checkpoints").symlink_to(mine, target_is_directory=True)
    (mine / "step_notes.txt").write_text("mine")
    (mine / "step_000009").mkdir()  # a folder of the user's, no trainer state in it
    (mine / "step_000009" / "data.csv").write_text("1,2")
    (mine / "step_000010").symlink_to(tmp_path, target_is_directory=True)
    runio.claim_run_dir(run_copy, resume=False, overwrite=True).release()
    assert (run_copy / "checkpoints").is_symlink()
    assert sorted(p.name for p in mine.iterdir()) == [
        "step_000009",
        "step_000010",
        "step_notes.txt",
    ]
    assert (mine / "step_000009" / "data.csv").read_text() == "1,2"


def test_sft_never_deletes_a_sibling_tmp_folder(tmp_path):
    from rredcot.config import SFTConfig
    from rredcot.training.sft import run_sft

    sibling = tmp_path / "ws.tmp"
    sibling.mkdir()
    (sibling / "notes.txt").write_text("mine")
    cfg = SFTConfig(
        out=str(tmp_path / "ws"),
        task_args={"num_steps": 2},
        hidden_size=16,
        num_layers=1,
        num_heads=2,
        max_steps=1,
        batch_size=2,
        eval_every=1,
        eval_size=2,
        max_new_tokens=4,
        progress=False,
    )
    run_sft(cfg, **QUIET)
    assert (sibling / "notes.txt").read_text() == "mine"
    assert (tmp_path / "ws" / "warmstart.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ws", "ws.tmp"]


def test_bench_plots_are_not_written_through_planted_links(tmp_path):
    """bench's curves (plot_mean_std) go through the same safe writer as a run's plots."""
    import numpy as np

    from rredcot.bench.report import plot_mean_std

    out = tmp_path / "bench"
    out.mkdir()
    targets = {}
    for name in ("curve.png", ".curve.png.tmp"):
        targets[name] = _outside(tmp_path, name)
        (out / name).symlink_to(targets[name])
    x = np.arange(3.0)
    plot_mean_std({"a": (x, x, 0 * x)}, out / "curve.png", xlabel="x", ylabel="y")
    for name, target in targets.items():
        assert target.read_text() == f"{name}: not rredcot's", f"{name} was followed"
    assert (out / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "curve.png").is_symlink()
