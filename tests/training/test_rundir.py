"""A run directory owns itself (issue 13, findings 1-3): one writer at a time, no silent reuse of
a run, resume only from a checkpoint that verifies, and never over recorded history."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import yaml

from helpers import micro_config as shared_micro_config
from rredcot.cli.commands import main
from rredcot.config import TrainConfig
from rredcot.errors import UserError
from rredcot.training import runio
from rredcot.training.trainer import Trainer, train

QUIET = {"log": lambda *_: None}


def micro_config(init_dir, out, **overrides) -> TrainConfig:
    return shared_micro_config(init_dir, out, **{"steps": 4, "checkpoint_every": 2, **overrides})


@pytest.fixture(scope="module")
def finished_run(init_dir, tmp_path_factory):
    """4 steps, checkpoints at steps 2 and 4; tests work on copies."""
    run = tmp_path_factory.mktemp("finished") / "run"
    Trainer(micro_config(init_dir, run), **QUIET).train()
    return run


@pytest.fixture
def run_copy(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


VOLATILE = ("step_seconds", "time/")


def _records(run):
    records = runio.MetricsLog(run / "metrics.jsonl").read()
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


def _resume(run, log=None, **overrides):
    """``rredcot train --resume RUN`` with ``overrides`` given, as the CLI passes them."""
    cfg = TrainConfig(resume=str(run), **overrides)
    return train(cfg, log=log or QUIET["log"], given={"resume", *overrides})


# ---------------------------------------------------------------------------------------------
# 1. one writer


def _train_cmd(init_dir, out, steps):
    return [
        sys.executable,
        "-m",
        "rredcot",
        "train",
        "--init",
        str(init_dir),
        "--out",
        str(out),
        "--credit",
        "uniform",
        "--steps",
        str(steps),
        "--prompts_per_step",
        "2",
        "--sampling.num_generations",
        "2",
        "--sampling.max_new_tokens",
        "8",
        "--eval_size",
        "2",
        "--checkpoint_every",
        "2",
        "--progress",
        "false",
        "--task.num_steps",
        "2",
    ]


@pytest.mark.slow
def test_two_concurrent_trains_give_one_run_and_one_refusal(init_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    out = tmp_path / "R"
    first = subprocess.Popen(
        _train_cmd(init_dir, out, 10_000),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        lock = out / runio.LOCK
        deadline = time.time() + 120
        while time.time() < deadline and first.poll() is None:
            if lock.exists() and str(first.pid) in lock.read_text():
                break  # the first run owns the directory
            time.sleep(0.05)
        second = subprocess.run(
            _train_cmd(init_dir, out, 10_000), env=env, capture_output=True, text=True, timeout=300
        )
        assert first.poll() is None, "the first run ended before the second one started"
    finally:
        first.kill()  # SIGKILL: the kernel drops its lock, whatever state it was in
        first.wait()
    assert second.returncode == 2, second.stderr
    message = second.stderr.strip()
    assert len(message.splitlines()) == 1 and "Traceback" not in message, message
    assert message.startswith(f"rredcot: error: run directory {out} is in use by pid {first.pid}")
    assert "on host " in message and "pick another --out" in message
    # the refused process wrote nothing: every step the first one got to is recorded once
    steps = [r["step"] for r in runio.MetricsLog(out / "metrics.jsonl").read()]
    assert steps == list(range(len(steps)))
    # the killed owner's lock went with it
    runio.RunLock(out).release()


def test_a_lock_is_released_by_its_process_and_refuses_a_second_holder(tmp_path):
    held = runio.RunLock(tmp_path)
    with pytest.raises(UserError, match=rf"in use by pid {os.getpid()} on host"):
        runio.RunLock(tmp_path)
    held.release()
    runio.RunLock(tmp_path).release()  # free again


# ---------------------------------------------------------------------------------------------
# 2. --out on an existing run


def test_out_on_an_existing_run_is_refused(init_dir, run_copy):
    before = (run_copy / "metrics.jsonl").read_text(), (run_copy / "config.yaml").read_text()
    with pytest.raises(UserError, match="holds a run already") as err:
        Trainer(micro_config(init_dir, run_copy, steps=14, seed=5), **QUIET)
    assert "--resume" in str(err.value) and "--overwrite" in str(err.value)
    assert "metrics up to step 4" in str(err.value)
    after = (run_copy / "metrics.jsonl").read_text(), (run_copy / "config.yaml").read_text()
    assert after == before
    runio.RunLock(run_copy).release()  # the refusal let go of the directory


def test_overwrite_replaces_the_run(init_dir, run_copy):
    (run_copy / "notes.txt").write_text("mine")
    cfg = micro_config(init_dir, run_copy, steps=1, seed=5, overwrite=True)
    Trainer(cfg, **QUIET).train()
    assert [r["step"] for r in _records(run_copy)] == [0, 1]
    saved = (run_copy / "config.yaml").read_text()
    assert "seed: 5" in saved and "overwrite: false" in saved
    assert [p.name for p in (run_copy / "checkpoints").glob("step_*")] == ["step_000001"]
    assert (run_copy / "notes.txt").read_text() == "mine"  # only run files are removed


def test_resume_refuses_a_changed_config_naming_each_difference(run_copy):
    before = (run_copy / "config.yaml").read_text()
    with pytest.raises(UserError) as err:
        _resume(run_copy, credit_method="value_head", seed=5, steps=6)
    message = str(err.value)
    assert "credit_method='uniform', seed=0" in message
    assert "credit_method='value_head', seed=5" in message
    assert "steps" in message.split("Only")[1]  # named as a field that may change
    assert (run_copy / "config.yaml").read_text() == before


def test_resume_may_extend_steps_and_rewrites_the_config_by_a_rename(run_copy):
    config = run_copy / "config.yaml"
    stat = config.stat()
    result = _resume(run_copy, steps=5, eval_every=1)
    assert result["steps"] == 5
    assert [r["step"] for r in _records(run_copy)] == [0, 1, 2, 3, 4, 5]
    assert config.stat().st_ino != stat.st_ino  # replaced by a rename, never written in place
    assert "steps: 5" in config.read_text()


def test_resume_refuses_a_config_yaml_with_an_unknown_key(run_copy, capsys):
    """A run's config.yaml holding a key no config field has (here a flat name the credit options
    had before they moved into sections) gets the error every unknown key gets, naming the key
    and the valid ones, before the run is touched."""
    config = run_copy / "config.yaml"
    saved = yaml.safe_load(config.read_text())
    saved["credit"]["value_lr"] = 0.001
    config.write_text(yaml.safe_dump(saved, sort_keys=False))
    before = (run_copy / "metrics.jsonl").read_bytes()
    assert main(["train", "--resume", str(run_copy), "--steps", "5"]) == 2
    message = capsys.readouterr().err.strip()
    assert len(message.splitlines()) == 1, message
    assert message.startswith(
        "rredcot: error: unknown config key credit.value_lr; valid keys in credit: "
    )
    assert "value_head.{alik_feature, ema, epochs, hidden_size" in message
    assert (run_copy / "metrics.jsonl").read_bytes() == before
    assert "value_lr" in config.read_text()  # the file is left as it was


# ---------------------------------------------------------------------------------------------
# 3. resume only from a valid checkpoint, never over history


def test_resume_without_checkpoints_refuses(run_copy):
    shutil.rmtree(run_copy / "checkpoints")
    before = (run_copy / "metrics.jsonl").read_text()
    with pytest.raises(UserError, match="no valid checkpoint left.*steps up to 4.*--overwrite"):
        _resume(run_copy)
    assert (run_copy / "metrics.jsonl").read_text() == before


def _truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


CORRUPTIONS = {
    "truncated model.safetensors": lambda c: _truncate(c / "policy" / "model.safetensors"),
    "truncated trainer_state.pt": lambda c: _truncate(c / "trainer_state.pt"),
    "empty trainer_state.pt": lambda c: _truncate(c / "trainer_state.pt", keep=0),
    "a flipped byte": lambda c: _flip(c / "policy" / "model.safetensors"),
    "a missing manifest and a truncated model": lambda c: (
        (c / runio.MANIFEST).unlink(),
        _truncate(c / "policy" / "model.safetensors"),
    ),
}


def _flip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", CORRUPTIONS.values(), ids=CORRUPTIONS)
def test_a_corrupt_checkpoint_does_not_verify(finished_run, tmp_path, corrupt):
    ckpt = tmp_path / "step_000004"
    shutil.copytree(finished_run / "checkpoints" / "step_000004", ckpt)
    assert runio.verify_checkpoint(ckpt) is None
    corrupt(ckpt)
    reason = runio.verify_checkpoint(ckpt)
    assert reason and ("policy/model.safetensors" in reason or "trainer_state.pt" in reason)


def test_a_truncated_newest_checkpoint_resumes_from_the_one_before(finished_run, run_copy):
    _truncate(run_copy / "checkpoints" / "step_000004" / "policy" / "model.safetensors")
    config = run_copy / "config.yaml"
    stat = config.stat()
    lines = []
    result = _resume(run_copy, log=lines.append)
    # the same config: config.yaml is not rewritten at a (re)start
    assert (config.stat().st_ino, config.stat().st_mtime_ns) == (stat.st_ino, stat.st_mtime_ns)
    assert any(
        line.startswith("skipping checkpoint step_000004: policy/model.safetensors has ")
        and line.endswith("(truncated or replaced)")
        for line in lines
    ), lines
    assert "resuming from the older checkpoint step_000002 instead" in lines
    assert result["steps"] == 4
    # the steps after the older checkpoint ran again, exactly as the first time
    assert _records(run_copy) == _records(finished_run)
    assert runio.verify_checkpoint(run_copy / "checkpoints" / "step_000004") is None


def test_every_checkpoint_corrupt_refuses_naming_each(run_copy):
    for step in ("step_000002", "step_000004"):
        _truncate(run_copy / "checkpoints" / step / "trainer_state.pt")
    with pytest.raises(UserError) as err:
        _resume(run_copy)
    message = str(err.value)
    assert "step_000004: trainer_state.pt has" in message and "step_000002: " in message


def test_checkpoints_carry_a_manifest_written_last(finished_run):
    ckpt = finished_run / "checkpoints" / "step_000004"
    manifest = json.loads((ckpt / runio.MANIFEST).read_text())
    files = {p.relative_to(ckpt).as_posix() for p in ckpt.rglob("*") if p.is_file()}
    assert set(manifest["files"]) == files - {runio.MANIFEST}
    assert {"trainer_state.pt", "policy/model.safetensors"} <= set(manifest["files"])
    assert manifest["step"] == 4
    assert runio.find_checkpoint(finished_run) == (ckpt, [])


def test_a_checkpoint_in_the_layout_of_earlier_runs_resumes(finished_run, run_copy):
    """``trainer_state.pt`` keeps the keys runs have always written; a checkpoint from before
    ``extra_tokens_generated`` and ``reference_tokens_trained`` were counted (no such keys), with the RNG states pickled as the
    tuples (and NumPy array) of the format before plain data, resumes and reruns the same
    steps."""
    import numpy as np
    import torch

    ckpt = run_copy / "checkpoints" / "step_000002"
    state = runio.load_trainer_state(ckpt / "trainer_state.pt")
    assert list(state) == [
        "step",
        "samples_seen",
        "tokens_generated",
        "extra_tokens_generated",
        "skipped_total",
        "train_seconds",
        "compute_used",
        "reference_tokens_trained",
        "optimizer",
        "scheduler",
        "credit_method",
        "rng",
    ]
    assert sorted(p.name for p in (ckpt / "policy").iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    del state["extra_tokens_generated"], state["train_seconds"], state["compute_used"]
    del state["reference_tokens_trained"]  # all four added later
    python, numpy_state = state["rng"]["python"], state["rng"]["numpy"]
    state["rng"]["python"] = (
        python["version"],
        tuple(python["internal"].tolist()),
        python["gauss_next"],
    )
    state["rng"]["numpy"] = (
        numpy_state["kind"],
        numpy_state["keys"].numpy().astype(np.uint32),
        numpy_state["pos"],
        numpy_state["has_gauss"],
        numpy_state["cached_gaussian"],
    )
    runio.atomic_torch_save(state, ckpt / "trainer_state.pt")
    assert "numpy.ndarray" in torch.serialization.get_unsafe_globals_in_checkpoint(
        ckpt / "trainer_state.pt"
    )
    runio.write_manifest(ckpt, 2)
    shutil.rmtree(run_copy / "checkpoints" / "step_000004")
    lines = []
    result = _resume(run_copy, log=lines.append)
    assert f"resumed from {ckpt} at step 2" in lines
    assert result["steps"] == 4 and result["extra_tokens_generated"] == 0
    # an old checkpoint holds no compute: the resumed run counts its own steps' from 0
    resumed = _records(run_copy)
    assert resumed[-1]["compute/used"] == sum(r["compute/step"] for r in resumed[3:])
    unsaved = ("compute/used",)
    assert [{k: v for k, v in r.items() if k not in unsaved} for r in resumed] == [
        {k: v for k, v in r.items() if k not in unsaved} for r in _records(finished_run)
    ]


def test_out_that_is_a_file_is_refused(init_dir, tmp_path):
    path = tmp_path / "a_file"
    path.write_text("x")
    with pytest.raises(UserError, match="is a file, not a directory"):
        Trainer(micro_config(init_dir, path), **QUIET)
    assert path.read_text() == "x"


# ---------------------------------------------------------------------------------------------
# the same refusals on the command line: one line, exit status 2


def _cli_error(argv, capsys):
    from rredcot.cli.commands import main

    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def test_cli_refusals_are_one_line(run_copy, capsys):
    run = str(run_copy)
    err = _cli_error(["train", "--out", run, "--credit", "value_head", "--seed", "5"], capsys)
    assert "holds a run already" in err
    err = _cli_error(["train", "--resume", run, "--credit", "value_head", "--seed", "5"], capsys)
    assert "credit_method='uniform', seed=0" in err and "seed=5" in err
    err = _cli_error(["train", "--resume", run, "--overwrite"], capsys)
    assert "give one of them" in err
    for step in ("step_000002", "step_000004"):
        _truncate(run_copy / "checkpoints" / step / "policy" / "model.safetensors")
    err = _cli_error(["train", "--resume", run], capsys)
    assert "no valid checkpoint left (step_000004: policy/model.safetensors has" in err
    ckpt = run_copy / "checkpoints" / "step_000004"
    err = _cli_error(["explain", "--checkpoint", str(ckpt), "--no-color"], capsys)
    assert f"checkpoint {ckpt} cannot be used: policy/model.safetensors has" in err
    out = str(run_copy.parent / "other")
    err = _cli_error(["train", "--init", str(ckpt / "policy"), "--out", out], capsys)
    assert "the model does not load" in err


def test_one_generation_per_prompt_warns_that_nothing_is_learned(init_dir, tmp_path):
    cfg = micro_config(init_dir, tmp_path / "run")
    cfg.sampling.num_generations = 1
    lines = []
    Trainer(cfg, log=lines.append).release()
    assert any("num_generations=1" in x and "advantage is 0" in x for x in lines), lines


# ---------------------------------------------------------------------------------------------
# metrics.jsonl on resume (issue 31): every readable record kept, unreadable lines set aside,
# no completed step dropped


def _steps(run):
    return [r["step"] for r in runio.MetricsLog(run / "metrics.jsonl").read()]


def test_resume_after_a_cut_last_metrics_line_keeps_the_step(finished_run, run_copy):
    """The last record (step 4, the checkpoint's) cut by a full disk: the resumed run keeps
    steps 0-3, keeps step 4 in the log marked ``metrics_lost`` (with the checkpoint's totals)
    and the cut text aside, and says so."""
    path = run_copy / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    cut = lines[-1][: len(lines[-1]) // 2]
    path.write_text("".join(lines[:-1]) + cut)
    said = []
    _resume(run_copy, log=said.append, steps=5)
    assert _steps(run_copy) == [0, 1, 2, 3, 4, 5]
    records = runio.MetricsLog(path).read()
    assert _records(run_copy)[:4] == _records(finished_run)[:4]
    original = runio.MetricsLog(finished_run / "metrics.jsonl").read()[4]
    assert records[4]["metrics_lost"] is True
    assert records[4]["tokens_generated"] == original["tokens_generated"]
    assert "metrics.jsonl: could not read line(s) 5 (cut short); kept in " in "\n".join(said)
    assert any("no readable record of completed step(s) 4;" in line for line in said), said
    aside = [json.loads(line) for line in (run_copy / runio.UNREADABLE_METRICS).open()]
    assert aside == [{"line": 5, "problem": "cut short", "text": cut}]


def test_resume_after_a_garbled_metrics_line_keeps_every_readable_record(finished_run, run_copy):
    """Step 2's line garbled in the middle: steps 3 and 4 stay as they were, the run goes on at
    5, step 2 stays marked ``metrics_lost`` and its line is kept aside."""
    path = run_copy / "metrics.jsonl"
    lines = path.read_bytes().splitlines(keepends=True)
    lines[2] = b'{"step": 2, "rew\xff\x00 garbage\n'
    path.write_bytes(b"".join(lines))
    said = []
    _resume(run_copy, log=said.append, steps=5)
    assert _steps(run_copy) == [0, 1, 2, 3, 4, 5]
    before, after = _records(finished_run), _records(run_copy)
    assert after[:2] == before[:2] and after[3:5] == before[3:5]
    assert after[2] == {"step": 2, "metrics_lost": True}
    assert any("could not read line(s) 3 (not JSON)" in line for line in said), said
    (aside,) = [json.loads(line) for line in (run_copy / runio.UNREADABLE_METRICS).open()]
    assert aside["line"] == 3 and aside["text"].startswith('{"step": 2, "rew\\xff')


# ---------------------------------------------------------------------------------------------
# --overwrite deletes only what rredcot wrote (issue 31)


def test_overwrite_refuses_a_folder_that_is_not_a_rredcot_run(init_dir, tmp_path):
    folder = tmp_path / "my_project"
    (folder / "plots").mkdir(parents=True)
    (folder / "plots" / "figure1.png").write_bytes(b"mine")
    (folder / "config.yaml").write_text("lr: 0.1\n")
    with pytest.raises(UserError, match="no run that rredcot wrote") as err:
        Trainer(micro_config(init_dir, folder, overwrite=True), **QUIET)
    assert "config.yaml, plots" in str(err.value)
    assert (folder / "plots" / "figure1.png").read_bytes() == b"mine"
    assert (folder / "config.yaml").read_text() == "lr: 0.1\n"


def test_overwrite_with_linked_checkpoints_clears_only_the_runs_files(run_copy, tmp_path):
    """``checkpoints/`` a link to another disk: --overwrite removes the run's checkpoints there,
    keeps the link and what else lives there; a file of the user's in plots/ stays."""
    elsewhere = tmp_path / "big_disk" / "ckpts"
    shutil.move(run_copy / "checkpoints", elsewhere)
    (run_copy / "checkpoints").symlink_to(elsewhere, target_is_directory=True)
    (elsewhere / "README.txt").write_text("not rredcot's")
    (run_copy / "plots").mkdir(exist_ok=True)
    (run_copy / "plots" / "reward_mean.png").write_bytes(b"png")
    (run_copy / "plots" / "my_notes.txt").write_text("mine")
    (run_copy / "notes.md").write_text("mine too")
    runio.claim_run_dir(run_copy, resume=False, overwrite=True).release()
    assert (run_copy / "checkpoints").is_symlink()
    assert sorted(p.name for p in elsewhere.iterdir()) == ["README.txt"]
    assert sorted(p.name for p in (run_copy / "plots").iterdir()) == ["my_notes.txt"]
    assert not (run_copy / "config.yaml").exists() and not (run_copy / "metrics.jsonl").exists()
    assert (run_copy / "notes.md").read_text() == "mine too"
