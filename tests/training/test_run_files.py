"""A run directory's files from someone else, or left by a kill (issue 57, findings 2-7): a save
prunes only the run's own checkpoints, a FIFO or an oversized file is refused in one line (never
waited on, never read whole), a resume leaves one record per step, a run killed during its first
checkpoint resumes, and a trainer state that does not load or fit is one line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from helpers import micro_config, one_line_error
from rredcot.cli.commands import main
from rredcot.training import runio
from rredcot.training.trainer import Trainer

QUIET = {"log": lambda *_: None}
VOLATILE = ("step_seconds", "time/")


def _steps(run):
    return [r["step"] for r in runio.MetricsLog(run / "metrics.jsonl").read()]


def _resume(run, capsys, *extra):
    """``train --resume RUN --steps 3``, once: ``None`` if it succeeds, else its one error line
    (exit status 2, no traceback)."""
    capsys.readouterr()
    code = main(["train", "--resume", str(run), "--steps", "3", *extra])
    err = capsys.readouterr().err
    if code == 0:
        return None
    errors = [line for line in err.splitlines() if line.startswith("rredcot: error: ")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


# ---------------------------------------------------------------------------------------------
# finding 2: a save prunes only the checkpoints the run wrote


def _users_folders(disk):
    """The user's own ``step_*`` folders in a folder the run's checkpoints/ links to."""
    mine = {}
    for name in ("step_000099", "step_5", "step_000000", ".tmp_step_000007"):
        (disk / name).mkdir()
        mine[disk / name / "notes.txt"] = f"{name}: mine"
    (disk / "step_000008").mkdir()  # one that looks like a checkpoint, without a manifest
    torch.save({"step": 8}, disk / "step_000008" / "trainer_state.pt")
    mine[disk / "README"] = "my disk"
    for path, text in mine.items():
        path.write_text(text)
    return mine


@pytest.mark.parametrize("index", [True, False], ids=["index", "run_from_before_the_index"])
def test_a_save_in_a_linked_checkpoints_folder_keeps_the_users_folders(run_copy, tmp_path, index):
    """``RUN/checkpoints -> /disk2/ck`` (another disk), the user's ``step_000099/``, ``step_5/``,
    ``step_000000/`` there: saves at steps 3 and 4 prune the run's steps 1-2 and nothing else."""
    disk = tmp_path / "disk2" / "ck"
    disk.parent.mkdir()
    shutil.move(run_copy / "checkpoints", disk)
    (run_copy / "checkpoints").symlink_to(disk, target_is_directory=True)
    if not index:
        (run_copy / runio.CHECKPOINT_INDEX).unlink()
    mine = _users_folders(disk)
    assert main(["train", "--resume", str(run_copy), "--steps", "4"]) == 0
    for path, text in mine.items():
        assert path.read_text() == text, f"{path.parent.name} was deleted"
    ours = {f"step_{k:06d}" for k in range(1, 5)}
    assert sorted(p.name for p in disk.iterdir() if p.name in ours) == [
        "step_000003",
        "step_000004",
    ]
    own = json.loads((run_copy / runio.CHECKPOINT_INDEX).read_text())["own"]
    assert own == ["latest", "step_000003", "step_000004"]
    runio.claim_run_dir(
        run_copy, resume=False, overwrite=True
    ).release()  # the same for --overwrite
    assert all(path.read_text() == text for path, text in mine.items())
    assert not (disk / "step_000004").exists() and not (disk / "latest").exists()


def test_a_checkpoint_name_the_run_did_not_write_is_refused_before_training(
    run_copy, tmp_path, capsys
):
    """A folder of the user's where the run would save ``step_000003`` is neither replaced nor
    deleted: the resume is refused before it trains."""
    disk = tmp_path / "ck"
    shutil.move(run_copy / "checkpoints", disk)
    (run_copy / "checkpoints").symlink_to(disk, target_is_directory=True)
    (disk / "step_000003").mkdir()
    (disk / "step_000003" / "data.csv").write_text("1,2")
    before = (run_copy / "metrics.jsonl").read_bytes()
    err = _resume(run_copy, capsys)
    assert err and "step_000003 is there already and this run did not write it" in err, err
    assert (disk / "step_000003" / "data.csv").read_text() == "1,2"
    assert (run_copy / "metrics.jsonl").read_bytes() == before


def test_a_fresh_run_may_start_with_checkpoints_linked_to_another_disk(init_dir, tmp_path):
    disk = tmp_path / "disk2"
    disk.mkdir()
    mine = _users_folders(disk)
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(disk, target_is_directory=True)
    Trainer(
        micro_config(init_dir, run, steps=3, checkpoint_every=1, keep_checkpoints=1), **QUIET
    ).train()
    assert all(path.read_text() == text for path, text in mine.items())
    assert (disk / "step_000003" / "trainer_state.pt").is_file()
    assert not (disk / "step_000001").exists() and not (disk / "step_000002").exists()


# ---------------------------------------------------------------------------------------------
# finding 3: a FIFO is refused, never waited on


class Blocked(BaseException):
    """Raised in a test blocked for 20 s (no ``except Exception`` or ``OSError`` takes it)."""


@pytest.fixture
def no_hang():
    """Fail (instead of hanging the suite) a test that blocks for 20 s."""

    def stop(signum, frame):
        raise Blocked("blocked for 20 s (waiting on a FIFO?)")

    previous = signal.signal(signal.SIGALRM, stop)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("name", ["metrics.jsonl", "config.yaml", "checkpoints.json"])
def test_a_fifo_in_a_run_directory_is_refused_on_resume(run_copy, capsys, no_hang, name):
    (run_copy / name).unlink()
    os.mkfifo(run_copy / name)
    err = _resume(run_copy, capsys)
    assert err and "not a regular file" in err and name in err, err


def test_a_fifo_given_as_config_is_refused(init_dir, tmp_path, capsys, no_hang):
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)
    argv = ["train", "--config", str(fifo), "--init", str(init_dir), "--out", str(tmp_path / "r")]
    err = one_line_error(argv, capsys)
    assert "not a regular file" in err and str(fifo) in err, err


# ---------------------------------------------------------------------------------------------
# finding 4: a resume leaves one record per step, 0 to the checkpoint's


def test_resume_sets_aside_duplicate_and_negative_steps(run_copy, capsys):
    path = run_copy / "metrics.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    first_step_1 = json.loads(lines[1])
    with open(path, "a") as fh:
        fh.write(json.dumps({**first_step_1, "reward_mean": 9.0}) + "\n")
        fh.write(json.dumps({"step": -5, "reward_mean": 1.0}) + "\n")
    capsys.readouterr()
    assert main(["train", "--resume", str(run_copy), "--steps", "3"]) == 0
    said = capsys.readouterr().out
    records = runio.MetricsLog(path).read()
    assert [r["step"] for r in records] == [0, 1, 2, 3]
    assert records[1]["reward_mean"] == first_step_1["reward_mean"]
    aside = [json.loads(x) for x in (run_copy / runio.UNREADABLE_METRICS).open()]
    assert [a["problem"] for a in aside] == ["a second record of step 1", "a negative step"]
    assert "set aside line(s) 4 (a second record of step 1), 5 (a negative step)" in said


# ---------------------------------------------------------------------------------------------
# finding 5: a run killed during its first checkpoint resumes

_KILL_IN_FIRST_SAVE = """
import os, signal, sys
from rredcot.training import runio
def killed(obj, path):  # the policy is written, trainer_state.pt is being written: kill -9
    open(path, "wb").write(b"PK half")
    os.kill(os.getpid(), signal.SIGKILL)
runio.atomic_torch_save = killed
from rredcot.cli.commands import main
main(sys.argv[1:])
"""


def _train_argv(init_dir, out):
    return [
        *("train", "--init", str(init_dir), "--out", str(out), "--credit", "uniform"),
        *("--steps", "3", "--checkpoint_every", "2", "--prompts_per_step", "2"),
        *("--sampling.num_generations", "2", "--sampling.max_new_tokens", "8"),
        *("--eval_size", "2", "--progress", "false", "--task.num_steps", "2"),
    ]


def _records(run):
    records = runio.MetricsLog(run / "metrics.jsonl").read()
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE)} for r in records]


@pytest.mark.slow
def test_a_run_killed_during_its_first_checkpoint_resumes(init_dir, tmp_path, capsys):
    run = tmp_path / "run"
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_IN_FIRST_SAVE, *_train_argv(init_dir, run)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert (run / "checkpoints" / ".tmp_step_000002").is_dir()
    assert not (run / "checkpoints" / "step_000002").exists() and _steps(run) == [0, 1, 2]
    capsys.readouterr()
    assert main(["train", "--resume", str(run)]) == 0
    assert "the run completed no checkpoint" in capsys.readouterr().out
    assert main(_train_argv(init_dir, tmp_path / "uninterrupted")) == 0
    assert _records(run) == _records(tmp_path / "uninterrupted")
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == [
        "latest",
        "step_000002",
        "step_000003",
    ]


# ---------------------------------------------------------------------------------------------
# finding 6: reads are bounded


def test_a_device_or_huge_file_as_manifest_is_skipped_with_a_reason(run_copy):
    manifest = run_copy / "checkpoints" / "step_000002" / runio.MANIFEST
    manifest.unlink()
    manifest.symlink_to("/dev/zero")
    assert "not a regular file" in runio.verify_checkpoint(manifest.parent)
    manifest.unlink()
    with open(manifest, "wb") as fh:
        fh.truncate(4 << 30)  # sparse: 4 GiB of zeros
    assert "more than any manifest rredcot writes" in runio.verify_checkpoint(manifest.parent)
    ckpt, skipped = runio.find_checkpoint(run_copy)
    assert ckpt.name == "step_000001" and [p.name for p, _ in skipped] == ["step_000002"]


def test_a_huge_metrics_log_is_refused_in_one_line(run_copy, capsys):
    with open(run_copy / "metrics.jsonl", "ab") as fh:
        fh.truncate(300 << 20)  # sparse: 300 MiB
    err = _resume(run_copy, capsys)
    assert err and "metrics.jsonl is over 256 MiB" in err, err


# ---------------------------------------------------------------------------------------------
# finding 7: a trainer state that matches its manifest but does not load or fit


def _cut(path):
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _other_shape(path):
    state = torch.load(path, weights_only=True)
    moments = next(iter(state["optimizer"]["state"].values()))
    moments["exp_avg"] = moments["exp_avg_sq"] = torch.zeros(3, 5)
    torch.save(state, path)


TRAINER_STATES = {
    "cut": _cut,
    "empty": lambda path: path.write_bytes(b""),
    "other optimizer shape": _other_shape,
    "no scheduler state": lambda p: torch.save({**torch.load(p), "scheduler": {"x": 1}}, p),
}


@pytest.mark.parametrize("damage", TRAINER_STATES.values(), ids=TRAINER_STATES)
def test_a_trainer_state_that_matches_its_manifest_but_not_the_run_is_one_line(
    run_copy, capsys, damage
):
    ckpt = run_copy / "checkpoints" / "step_000002"
    damage(ckpt / "trainer_state.pt")
    runio.write_manifest(ckpt, 2)  # the manifest matches what is there now
    err = _resume(run_copy, capsys)
    assert err and str(ckpt / "trainer_state.pt") in err and "--overwrite" in err, err
    assert "resume from an earlier checkpoint" in err, err


def test_bench_overhead_refuses_a_linked_runs_folder(init_dir, tmp_path):
    """Finding 1 for ``bench overhead --out O``: its trainers' ``O/runs/<variant>`` is made
    below ``O`` without following a link planted at ``O/runs``."""
    from rredcot.bench.configs import OverheadBenchConfig
    from rredcot.bench.overhead import run_overhead_bench
    from rredcot.errors import UserError

    out, outside = tmp_path / "overhead", tmp_path / "outside"
    out.mkdir()
    outside.mkdir()
    (out / "runs").symlink_to(outside, target_is_directory=True)
    cfg = OverheadBenchConfig(
        methods="uniform", steps=1, warmup=0, init=str(init_dir), out=str(out), task="arithmetic"
    )
    with pytest.raises(UserError, match="runs is a symbolic link"):
        run_overhead_bench(cfg, **QUIET)
    assert list(outside.iterdir()) == []


def test_a_planted_checkpoint_index_names_nothing_outside_checkpoints(run_copy, tmp_path, capsys):
    """``checkpoints.json`` decides what is deleted: one that names a path outside
    ``checkpoints/`` is refused on resume and deletes nothing on --overwrite."""
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.csv").write_text("1,2")
    index = {"own": ["../../victim", "step_000002"], "completed": ["step_000002"]}
    (run_copy / runio.CHECKPOINT_INDEX).write_text(json.dumps(index))
    err = _resume(run_copy, capsys)
    assert err and "is not a checkpoint index rredcot wrote" in err, err
    runio.claim_run_dir(run_copy, resume=False, overwrite=True).release()
    assert (victim / "data.csv").read_text() == "1,2"
    assert not (run_copy / "checkpoints").exists()
