"""A run or output folder from someone else runs no code and writes nowhere else (issues 39 and
47, section 2): a process-reward function that a run's ``config.yaml`` or a TRL run's
``rredcot_credit.json`` names is not imported by ``explain`` or ``train --resume`` unless named on
the command line; a saved ``--credit auto`` choice names a method and plain settings only; every
loader pins ``trust_remote_code=False``; files in a run directory, and the bench and diagnose
writers' files, are written without following links planted there; ``--overwrite`` and ``sft``
delete only what they wrote."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
import yaml

from helpers import (
    ROOT,
    Payload,
    code_payload,
    one_line_error,
    tiny_trl_trainer,
    train_error_under_file_limit,
)
from rredcot.cli.commands import main
from rredcot.config import TrainConfig
from rredcot.config.io import resume_config
from rredcot.errors import UserError

QUIET = {"log": lambda *_: None}


def _name_function(run: Path, spec: str) -> None:
    """Make ``run/config.yaml`` a process_reward run whose function is ``spec``."""
    data = yaml.safe_load((run / "config.yaml").read_text())
    data["credit_method"] = "process_reward"
    data["credit"]["process_reward"]["function"] = spec
    (run / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))


# ---------------------------------------------------------------------------------------------
# a function a run names is not imported by reading or resuming it


def test_explain_and_resume_do_not_import_a_function_the_run_names(run_copy, tmp_path, capsys):
    spec, marker = code_payload(tmp_path)
    _name_function(run_copy, spec)
    ckpt = run_copy / "checkpoints" / "step_000002"
    commands = {
        "explain --run": ["explain", "--run", str(run_copy), "--samples", "2", "--no-color"],
        "explain --checkpoint": ["explain", "--checkpoint", str(ckpt), "--samples", "2"],
        "train --resume": ["train", "--resume", str(run_copy), "--steps", "3"],
    }
    for name, argv in commands.items():
        err = one_line_error(argv, capsys)
        assert not marker.exists(), f"{name}: the run's function was imported"
        assert spec in err and "--credit.process_reward.function" in err, (name, err)


def test_a_restated_function_may_be_resumed(run_copy, tmp_path):
    spec, marker = code_payload(tmp_path)
    _name_function(run_copy, spec)
    cfg = TrainConfig(resume=str(run_copy))
    cfg.credit.process_reward.function = spec
    resumed = resume_config(cfg, {"resume", "credit.process_reward.function"})
    assert resumed.credit.process_reward.function == spec
    with pytest.raises(UserError, match="name it yourself"):
        resume_config(TrainConfig(resume=str(run_copy)), {"resume"})
    assert not marker.exists()


def test_explain_calls_a_function_named_on_its_command_line(run_copy, tmp_path, capsys):
    spec, marker = code_payload(tmp_path)
    _name_function(run_copy, spec)
    argv = ["explain", "--run", str(run_copy), "--samples", "2", "--no-color"]
    assert main([*argv, "--credit.process_reward.function", spec]) == 0
    assert marker.exists()
    assert "process_reward" in capsys.readouterr().out


def test_explain_does_not_import_a_function_a_trl_run_names(init_dir, tmp_path, capsys):
    spec, marker = code_payload(tmp_path)
    out = tmp_path / "trl_out"
    shutil.copytree(init_dir, out)
    settings = {
        "credit_method": "process_reward",
        "credit": {"process_reward": {"function": spec}},
        "task": "arithmetic",
        "task_args": {"num_steps": 2},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16},
    }
    (out / "rredcot_credit.json").write_text(json.dumps(settings))
    err = one_line_error(["explain", "--run", str(out), "--samples", "2", "--no-color"], capsys)
    assert not marker.exists(), "the TRL run's function was imported"
    assert "rredcot_credit.json" in err and spec in err


# ---------------------------------------------------------------------------------------------
# a saved --credit auto choice names a method and plain settings only (issue 47)


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
# trust_remote_code is pinned: a model folder's own code never runs, even when stdin says yes


def _remote_code_model(init_dir: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A model folder with an unknown ``model_type`` whose ``auto_map`` points at a real Python
    file that writes ``marker`` when imported (what ``trust_remote_code`` would run)."""
    marker = tmp_path / "remote_code_ran"
    folder = tmp_path / "remote_code_model"
    shutil.copytree(init_dir, folder)
    (folder / "evil_code.py").write_text(
        f"open({str(marker)!r}, 'w').write('pwned')\n"
        "from transformers import PretrainedConfig, PreTrainedTokenizerFast\n"
        "class EvilConfig(PretrainedConfig):\n"
        "    model_type = 'evilnet'\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n"
        "    pass\n"
    )
    config = json.loads((folder / "config.json").read_text())
    config["model_type"] = "evilnet"
    config["auto_map"] = {
        "AutoConfig": "evil_code.EvilConfig",
        "AutoModelForCausalLM": "evil_code.EvilConfig",
        "AutoModelForSequenceClassification": "evil_code.EvilConfig",
    }
    (folder / "config.json").write_text(json.dumps(config))
    tok_config = json.loads((folder / "tokenizer_config.json").read_text())
    tok_config["auto_map"] = {"AutoTokenizer": ["evil_code.EvilTokenizer", None]}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    return folder, marker


def test_loaders_pin_trust_remote_code_false(init_dir, tmp_path, monkeypatch, capsys):
    """As ``yes | rredcot ...``: transformers' question on stdin is never asked, nothing runs."""
    from rredcot.config import ProcessRewardConfig
    from rredcot.methods.process_reward import PRMScorer

    folder, marker = _remote_code_model(init_dir, tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 20))
    with pytest.raises(ValueError):
        PRMScorer(ProcessRewardConfig(model=str(folder)))
    assert not marker.exists(), "the PRM folder's code ran"


def test_segment_tokenizer_pins_trust_remote_code_false(init_dir, tmp_path, monkeypatch, capsys):
    folder, marker = _remote_code_model(init_dir, tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO("y\n" * 20))
    text = tmp_path / "trace.txt"
    text.write_text("step one\nstep two\n")
    main(["segment", str(text), "--strategy", "tokens:2", "--tokenizer", str(folder)])
    assert not marker.exists(), "segment --tokenizer ran the folder's code"


# ---------------------------------------------------------------------------------------------
# links planted in a run directory are never followed on write


def _outside_file(outside: Path, name: str) -> Path:
    """``outside/name`` (the folder made if missing), a file that is not rredcot's to write."""
    outside.mkdir(parents=True, exist_ok=True)
    path = outside / name
    path.write_text(f"{name}: not rredcot's")
    return path


def test_links_planted_in_a_run_dir_are_not_written_through(run_copy, tmp_path):
    """Links at the temporaries a resume writes and at the checkpoint it saves are replaced,
    never followed."""
    outside = tmp_path / "outside"
    outside.mkdir()
    ckpts = run_copy / "checkpoints"
    (run_copy / "plots").mkdir(exist_ok=True)
    planted = {
        run_copy / ".metrics.jsonl.tmp": _outside_file(outside, "a"),
        run_copy / ".config.yaml.tmp": _outside_file(outside, "b"),
        ckpts / ".latest.tmp": _outside_file(outside, "c"),
        run_copy / "plots" / ".reward_mean.png.tmp": _outside_file(outside, "d"),
    }
    for link, target in planted.items():
        link.symlink_to(target)
    for name in (".tmp_step_000003", "step_000003"):  # the checkpoint's temporary and final dirs
        folder = outside / name
        folder.mkdir()
        planted[ckpts / name] = _outside_file(folder, "kept")
        (ckpts / name).symlink_to(folder, target_is_directory=True)
    assert main(["train", "--resume", str(run_copy), "--steps", "3"]) == 0
    for link, target in planted.items():
        assert target.read_text() == f"{target.name}: not rredcot's", f"{link.name} was followed"
    assert sorted(p.name for p in outside.rglob("*")) == sorted(
        ["a", "b", "c", "d", ".tmp_step_000003", "step_000003", "kept", "kept"]
    )
    for name in ("metrics.jsonl", "config.yaml", "checkpoints/latest"):
        assert not (run_copy / name).is_symlink() and (run_copy / name).is_file(), name
    assert not (ckpts / "step_000003").is_symlink()
    assert (ckpts / "step_000003" / "trainer_state.pt").is_file()
    assert (run_copy / "checkpoints" / "latest").read_text() == "step_000003"


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.yaml", "credit_choice.json"])
def test_a_run_file_linked_outside_is_refused_on_resume(run_copy, tmp_path, capsys, name):
    """Issue 57, finding 4: the run's own file moved outside and a link left in its place is
    refused in one line (never adopted, read or rewritten), as docs/run_directory.md says."""
    outside = tmp_path / "outside"
    outside.mkdir()
    if (run_copy / name).exists():
        shutil.move(run_copy / name, outside / name)
    else:
        (outside / name).write_text("{}")
    (run_copy / name).symlink_to(outside / name)
    before = (outside / name).read_bytes()
    err = one_line_error(["train", "--resume", str(run_copy), "--steps", "3"], capsys)
    assert "symbolic link" in err and str(run_copy / name) in err, err
    assert (outside / name).read_bytes() == before
    assert (run_copy / name).is_symlink()


@pytest.mark.parametrize("name", [".lock", "metrics.unreadable.jsonl"])
def test_a_link_a_run_would_write_through_is_refused(run_copy, tmp_path, capsys, name):
    """``.lock`` (opened and truncated before any check on main) and the file unreadable
    metrics lines are set aside in: a link there is refused in one line, its target untouched."""
    target = _outside_file(tmp_path, "precious")
    (run_copy / name).unlink(missing_ok=True)  # .lock is left by the run (empty)
    (run_copy / name).symlink_to(target)
    with open(run_copy / "metrics.jsonl", "a") as fh:
        fh.write("{garbled\n")
    err = one_line_error(["train", "--resume", str(run_copy), "--steps", "3"], capsys)
    assert "symbolic link" in err and name in err, err
    assert target.read_text() == "precious: not rredcot's"


def test_overwrite_keeps_sink_folders_the_run_did_not_write(run_copy):
    """``report_to none``: ``wandb/`` and ``tensorboard/`` in the run directory are the user's."""
    for sink in ("wandb", "tensorboard"):
        (run_copy / sink).mkdir()
        (run_copy / sink / "mine.txt").write_text("mine")
    from rredcot.training import runio

    runio.claim_run_dir(run_copy, resume=False, overwrite=True).release()
    for sink in ("wandb", "tensorboard"):
        assert (run_copy / sink / "mine.txt").read_text() == "mine"
    assert not (run_copy / "config.yaml").exists() and not (run_copy / "checkpoints").exists()


# ---------------------------------------------------------------------------------------------
# the writers outside a run directory (bench, diagnose, sft): no link followed, nothing outside
# deleted


def test_bench_memory_does_not_write_through_a_planted_link(tmp_path):
    from rredcot.bench.configs import MemoryBenchConfig
    from rredcot.bench.memory import _write

    out = tmp_path / "mem"
    out.mkdir()
    targets = {}
    for name in ("memory.json", ".memory.json.tmp", "memory.md", ".memory.md.tmp"):
        targets[name] = _outside_file(tmp_path / "outside", name)
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
        targets[name] = _outside_file(tmp_path / "outside", name)
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
        targets[name] = _outside_file(tmp_path / "outside", name)
        (out / name).symlink_to(targets[name])
    x = np.arange(3.0)
    plot_mean_std({"a": (x, x, 0 * x)}, out / "curve.png", xlabel="x", ylabel="y")
    for name, target in targets.items():
        assert target.read_text() == f"{name}: not rredcot's", f"{name} was followed"
    assert (out / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert not (out / "curve.png").is_symlink()


# ---------------------------------------------------------------------------------------------
# a write that fails (a full disk) during a checkpoint: one line, no half checkpoint left


@pytest.mark.slow
def test_a_failed_checkpoint_write_is_one_line_and_leaves_no_temporary(init_dir, tmp_path):
    """The file-size limit makes every write past 200 kB fail at the OS (as a full disk does):
    the policy (~150 kB) is written, ``trainer_state.pt`` (~320 kB with the optimiser) is not."""
    error = train_error_under_file_limit(init_dir, tmp_path / "run", 200_000)
    assert "trainer_state.pt" in error, error


# ---------------------------------------------------------------------------------------------
# files that would run code when loaded, cut files, empty settings: one line naming the file


def _trl_output(init_dir: Path, folder: Path, credit_method: str = "value_head") -> Path:
    shutil.copytree(init_dir, folder)
    settings = {
        "credit_method": credit_method,
        "credit": {},
        "task": "arithmetic",
        "task_args": {"num_steps": 2},
        "sampling": {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 16},
    }
    (folder / "rredcot_credit.json").write_text(json.dumps(settings))
    return folder


def test_a_policy_whose_weights_would_run_code_is_refused_in_one_line(init_dir, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file

    marker = tmp_path / "payload_ran"
    policy = tmp_path / "policy"
    shutil.copytree(init_dir, policy)
    weights = load_file(str(policy / "model.safetensors"))
    (policy / "model.safetensors").unlink()
    torch.save({**weights, "evil": Payload(marker)}, policy / "pytorch_model.bin")
    argv = ["explain", "--checkpoint", str(policy), "--samples", "2", "--no-color"]
    err = one_line_error(argv, capsys)
    assert not marker.exists()
    assert "could run code" in err and "builtins.exec" in err and str(policy) in err, err


def test_a_trl_value_head_that_would_run_code_is_refused_in_one_line(init_dir, tmp_path, capsys):
    import torch

    marker = tmp_path / "payload_ran"
    out = _trl_output(init_dir, tmp_path / "trl_out")
    record = {"credit_method": "value_head", "state": {"note": Payload(marker)}}
    torch.save(record, out / "value_head.pt")
    argv = ["explain", "--run", str(out), "--samples", "2", "--no-color"]
    err = one_line_error(argv, capsys)
    assert not marker.exists()
    assert "value_head.pt" in err and "could run code" in err, err


def test_a_cut_trl_value_head_is_refused_in_one_line(init_dir, tmp_path, capsys):
    import torch

    out = _trl_output(init_dir, tmp_path / "trl_out")
    torch.save({"credit_method": "value_head", "state": {"w": torch.zeros(64, 64)}}, out / "v.pt")
    data = (out / "v.pt").read_bytes()
    (out / "value_head.pt").write_bytes(data[: len(data) // 2])
    argv = ["explain", "--run", str(out), "--samples", "2", "--no-color"]
    err = one_line_error(argv, capsys)
    assert "value_head.pt" in err and "cannot be read" in err, err
    bench = ["bench", "credit", "--checkpoint", str(out), "--run", str(out)]
    bench += ["--methods", "value_head", "--out", str(tmp_path / "bench")]
    err = one_line_error(bench, capsys)  # before sampling and the ground truth
    assert "value_head.pt" in err and "cannot be read" in err, err
    assert not (tmp_path / "bench" / "credit.json").exists()


@pytest.mark.parametrize(
    "text", ["{}", "[1, 2]", "{not json", '{"credit_method": "value_head", "credit": 3}']
)
def test_malformed_trl_settings_are_refused_naming_the_file(init_dir, tmp_path, capsys, text):
    out = _trl_output(init_dir, tmp_path / "trl_out")
    (out / "rredcot_credit.json").write_text(text)
    argv = ["explain", "--run", str(out), "--samples", "2", "--no-color"]
    err = one_line_error(argv, capsys)
    assert str(out / "rredcot_credit.json") in err, err


def test_an_error_quoting_a_linked_config_yaml_does_not_dump_its_target(tmp_path, capsys):
    """``config.yaml`` linked to another file: the error names the file, quotes a few words."""
    secret = tmp_path / "secret.txt"
    secret.write_text("secret line " * 100)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").symlink_to(secret)
    err = one_line_error(["train", "--resume", str(run)], capsys)
    assert len(err) < 300 and err.count("secret line") < 10, err
    assert str(run / "config.yaml") in err, err


# ---------------------------------------------------------------------------------------------
# data files never name code (issue 57): auto's rows, record-auto's input, a resumed --config


def _row_naming(spec: str) -> dict:
    """A measurements row ahead of GRPO everywhere whose method runs ``spec``."""
    from rredcot.methods.auto import MEASUREMENTS

    row = {**MEASUREMENTS[0].to_json(), "method": "process_reward", "seeds": 10}
    pairs = {k: [0.5, 0.01] for k in ("per_token", "at_grpo_last_second", "time_averaged")}
    return {**row, **pairs, "settings": {"process_reward.function": spec}}


def test_plain_auto_train_refuses_a_measurement_row_that_names_code(
    init_dir, tmp_path, monkeypatch, capsys
):
    import rredcot.methods.auto as credit_choice

    spec, marker = code_payload(tmp_path)
    rows = tmp_path / "credit_auto.json"
    rows.write_text(json.dumps({"rows": [_row_naming(spec)]}))
    monkeypatch.setattr(credit_choice, "MEASUREMENTS_FILE", rows)
    monkeypatch.delattr(credit_choice, "MEASUREMENTS")  # read when auto needs it
    monkeypatch.setattr(credit_choice, "ALL_WRONG_BAND", 1.0)  # the row is like any run
    monkeypatch.setattr(credit_choice, "REWARD_BAND", 1.0)
    run = tmp_path / "run"
    argv = ["train", "--init", str(init_dir), "--out", str(run), "--steps", "1"]
    argv += ["--prompts_per_step", "2", "--eval_size", "2", "--task.num_steps", "2"]
    err = one_line_error([*argv, "--sampling.max_new_tokens", "8", "--progress", "false"], capsys)
    assert str(rows) in err and "process_reward" in err, err
    assert not marker.exists() and not run.exists()


def test_apply_choice_checks_what_it_sets():
    from rredcot.methods.auto import FLOW_METHOD, CreditChoice, apply_choice

    cfg = TrainConfig()
    for settings, expected in (
        ({"__class__": "x"}, "not a credit setting"),
        ({"process_reward.function": "m:f"}, "load code"),
        ({"continuation_likelihood.scope": "bogus"}, "scope='bogus'"),
        ({"lam": 7.0}, "credit.lam=7.0"),
    ):
        with pytest.raises(UserError, match=expected):
            apply_choice(cfg, CreditChoice(FLOW_METHOD, settings, "r"))
    bread = TrainConfig()
    bread.references.mode = "bread"
    with pytest.raises(UserError, match="bread runs with credit_method uniform"):
        apply_choice(bread, CreditChoice(FLOW_METHOD, {}, "r"))
    assert (cfg, bread.credit_method) == (TrainConfig(), "auto")  # nothing was set
    apply_choice(cfg, CreditChoice(FLOW_METHOD, {"lam": 0.0, "handover.smoothing": 0.5}, "r"))
    assert (cfg.credit_method, cfg.credit.lam, cfg.credit.handover.smoothing) == (
        FLOW_METHOD,
        0,
        0.5,
    )


@pytest.mark.parametrize("field", ["function", "model"])
def test_record_auto_refuses_a_variant_that_names_code(tmp_path, capsys, field):
    from rredcot.methods.auto import MEASUREMENTS

    spec, marker = code_payload(tmp_path)
    results = ROOT / "benchmarks" / "results"
    report = json.loads((results / MEASUREMENTS[0].source).read_text())
    (row,) = [s for s in report["summary"] if s["variant"] == MEASUREMENTS[0].variant]
    row["overrides"][f"credit.process_reward.{field}"] = spec
    learn = tmp_path / "benchmarks" / "results" / "x" / "learn.json"
    learn.parent.mkdir(parents=True)
    learn.write_text(json.dumps({"summary": [row]}))
    out = tmp_path / "rows.json"
    argv = ["bench", "record-auto", "--learn", str(learn), "--testbed", "t", "--file", str(out)]
    err = one_line_error([*argv, "--all_wrong", "0.3", "--mean_reward", "0.4"], capsys)
    assert f"credit.process_reward.{field}" in err and str(learn) in err, err
    assert not out.exists() and not marker.exists()


def test_resume_does_not_count_the_runs_own_config_as_naming_its_code(run_copy, tmp_path, capsys):
    spec, marker = code_payload(tmp_path)
    _name_function(run_copy, spec)
    config = str(run_copy / "config.yaml")
    argv = ["train", "--resume", str(run_copy), "--config", config, "--steps", "3"]
    err = one_line_error(argv, capsys)
    assert "--config" in err and f"--credit.process_reward.function {spec}" in err, err
    assert not marker.exists()
    # a saved PRM model is restated on the command line too, as a function is
    data = yaml.safe_load((run_copy / "config.yaml").read_text())
    data["credit"]["process_reward"] = {"function": "", "model": str(tmp_path / "prm")}
    (run_copy / "config.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(UserError, match="credit.process_reward.model"):
        resume_config(TrainConfig(resume=str(run_copy)), {"resume"})


def test_a_fresh_runs_config_file_that_names_code_is_said_in_one_line(tmp_path):
    from rredcot.config.io import resolve_config

    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({"credit": {"process_reward": {"function": "m:f"}}}))
    lines: list[str] = []
    cfg = resolve_config(TrainConfig, str(config), {}, log=lines.append)
    assert cfg.credit.process_reward.function == "m:f"
    assert len(lines) == 1 and str(config) in lines[0] and "'m:f'" in lines[0]
    lines.clear()  # named on the command line too: nothing to say
    flag = {"credit.process_reward.function": "m:f"}
    resolve_config(TrainConfig, str(config), flag, log=lines.append)
    assert lines == []
    with pytest.raises(UserError, match="--config .* names credit.process_reward.function"):
        resolve_config(TrainConfig, str(config), {"resume": "RUN"}, log=lines.append)
