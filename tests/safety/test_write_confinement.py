"""Issue 57, finding 1: a command writes nothing outside the directory its user named, whatever
link is planted below it. Each command runs once; then, for every file and folder it created
in turn, that entry is replaced by a link to a copy of it outside, the command runs again, and
nothing outside may change: the link is refused in one line or replaced, never followed."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from rredcot.bench.configs import LearnBenchConfig
from rredcot.bench.learn import run_learn_bench
from rredcot.cli.commands import main
from rredcot.config import SFTConfig
from rredcot.errors import UserError
from rredcot.training.sft import run_sft

QUIET = {"log": lambda *_: None}
pytestmark = pytest.mark.slow


def _train_argv(init_dir: Path, out: Path, *extra: str) -> list[str]:
    return [
        "train",
        *("--init", str(init_dir), "--out", str(out), "--credit", "uniform"),
        *("--steps", "2", "--checkpoint_every", "1", "--prompts_per_step", "2"),
        *("--sampling.num_generations", "2", "--sampling.max_new_tokens", "8"),
        *("--eval_size", "2", "--progress", "false", "--task.num_steps", "2"),
        *extra,
    ]


def _created(root: Path) -> list[str]:
    """Every file and folder below ``root``, parents first; the files of one ``policy/`` or
    ``plots/`` folder count as one entry (they are written alike)."""
    entries, grouped = [], set()
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_file() and path.parent.name in ("policy", "plots"):
            group = path.parent.relative_to(root).as_posix() + "/*"
            if group in grouped:
                continue
            grouped.add(group)
            rel = group
        entries.append(rel)
    return entries


def _snapshot(folder: Path) -> dict[str, object]:
    """What ``folder`` holds: each path's kind and content (a link's target)."""
    state: dict[str, object] = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_symlink():
            state[rel] = ("link", str(path.readlink()))
        elif path.is_dir():
            state[rel] = ("dir",)
        else:
            state[rel] = ("file", path.read_bytes())
    return state


def _plant(root: Path, entry: str, outside: Path) -> list[Path]:
    """Move ``root/entry`` (a glob ``folder/*``: each file there) to a folder of its own under
    ``outside`` and leave a link to it in its place; returns the links."""
    paths = sorted((root / entry[:-2]).iterdir()) if entry.endswith("/*") else [root / entry]
    links = []
    for path in paths:
        target = outside / f"{len(list(outside.iterdir()))}" / path.name
        target.parent.mkdir()
        shutil.move(path, target)
        path.symlink_to(target, target_is_directory=target.is_dir())
        links.append(path)
    return links


def _each_planted(pristine: Path, at: Path, tmp_path: Path, entries: list[str], prepare=None):
    """For each entry: ``at``, a fresh copy of ``pristine`` (then ``prepare(at, entry)``) with
    that entry planted, and the folder outside it that must not change (``(entry, outside,
    before)``)."""
    for i, entry in enumerate(entries):
        shutil.rmtree(at, ignore_errors=True)
        shutil.copytree(pristine, at, symlinks=True)
        if prepare is not None:
            prepare(at, entry)
        outside = tmp_path / f"outside{i}"
        outside.mkdir()
        _plant(at, entry, outside)
        yield entry, outside, _snapshot(outside)


def _check_outside(entry: str, outside: Path, before: dict) -> None:
    after = _snapshot(outside)
    assert after == before, (
        f"a link at {entry} was written through: {sorted(set(after) ^ set(before))}"
    )


@pytest.fixture(scope="module")
def train_baseline(init_dir, tmp_path_factory):
    run = tmp_path_factory.mktemp("confine") / "run"
    assert main(_train_argv(init_dir, run)) == 0
    return run


def test_train_writes_through_no_planted_link(init_dir, train_baseline, tmp_path, capsys):
    """``train`` fresh (into a folder holding only the link), ``--resume`` and ``--overwrite``;
    ``checkpoints/`` itself may be a link (another disk): there, only the run's own entries may
    change (the user's ``step_*`` folders beside them stay, finding 2)."""
    entries = _created(train_baseline)
    assert {"plots", "checkpoints/step_000002/policy", "metrics.jsonl", ".lock"} <= set(entries)
    commands = {
        "resume": lambda run: ["train", "--resume", str(run), "--steps", "3"],
        "overwrite": lambda run: _train_argv(init_dir, run, "--overwrite"),
    }
    run = tmp_path / "run"
    for entry, outside, before in _each_planted(train_baseline, run, tmp_path, entries):
        mine = {}
        if entry == "checkpoints":  # the documented layout: the user's folders there stay
            for name in ("step_000099", "step_5", "step_000000", ".tmp_step_7"):
                (outside / "0" / "checkpoints" / name).mkdir()
                mine[name] = outside / "0" / "checkpoints" / name / "mine.txt"
                mine[name].write_text("mine")
        for name, argv in commands.items():
            code = main(argv(run))
            assert code in (0, 2), (entry, name)
            if entry != "checkpoints":
                _check_outside(f"{entry} ({name})", outside, before)
            assert all(p.read_text() == "mine" for p in mine.values()), (entry, name)
    for rel in sorted({e.removesuffix("/*") for e in entries}):  # fresh: the link alone
        entry = rel
        out, outside = tmp_path / "fresh" / rel.replace("/", "_"), tmp_path / "fresh_outside"
        shutil.rmtree(outside, ignore_errors=True)
        outside.mkdir(parents=True)
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (outside / "target").write_text("not rredcot's")
        (out / rel).symlink_to(outside / "target")
        assert main(_train_argv(init_dir, out)) in (0, 2), entry
        assert _snapshot(outside) == {"target": ("file", b"not rredcot's")}, entry
    capsys.readouterr()


def _bench_config(init_dir, out: Path) -> LearnBenchConfig:
    return LearnBenchConfig(
        methods="uniform",
        seeds=1,
        budget_tokens=20,
        init=str(init_dir),
        out=str(out),
        steps_max=2,
        eval_every=1,
        task="arithmetic",
        task_args={"num_steps": 2},
        overrides={
            "prompts_per_step": "1",
            "sampling.num_generations": "3",
            "sampling.max_new_tokens": "8",
            "eval_size": "3",
            "checkpoint_every": "1",
        },
        variance_probes=2,
        variance_prompts=2,
        variance_minibatch=1,
        variance_bootstrap=10,
    )


def test_bench_learn_writes_through_no_planted_link(init_dir, tmp_path):
    """``bench learn --out L``: a link at ``L/runs/uniform/seed0`` (or any folder between) or at
    any file a run writes (``variance.jsonl`` appended to) is refused or replaced. Each copy is
    a run stopped before its last variance probe and its ``result.json`` (so that it resumes and
    appends); the checkpoints' own files are the train test's."""
    base, pristine = tmp_path / "learn", tmp_path / "pristine"
    cfg = _bench_config(init_dir, base)
    run_learn_bench(cfg, **QUIET)
    shutil.move(base, pristine)  # each case runs where the bench ran (its runs record --out)
    entries = [e for e in _created(pristine) if "checkpoints/step_" not in e]
    assert {"runs/uniform/seed0", "runs/uniform/seed0/variance.jsonl", "learn.json"} <= set(entries)
    seed0 = pristine / "runs" / "uniform" / "seed0"
    result = (seed0 / "result.json").read_bytes()
    (seed0 / "result.json").unlink()
    probes = (seed0 / "variance.jsonl").read_text().splitlines(keepends=True)
    (seed0 / "variance.jsonl").write_text(probes[0])  # the final probe is still to come

    def prepare(at: Path, entry: str) -> None:
        if entry == "runs/uniform/seed0/result.json":
            (at / entry).write_bytes(result)

    for entry, outside, before in _each_planted(pristine, base, tmp_path, entries, prepare):
        try:
            run_learn_bench(cfg, **QUIET)
        except UserError as err:
            assert "\n" not in str(err), err
        _check_outside(entry, outside, before)


def test_sft_writes_through_no_planted_link(tmp_path):
    """``sft --out W`` replaces ``W`` as a whole: a link at any file in it is removed, never
    followed."""
    cfg = SFTConfig(
        out=str(tmp_path / "ws"),
        task_args={"num_steps": 2},
        **dict(hidden_size=16, num_layers=1, num_heads=2, max_steps=1, batch_size=2),
        **dict(eval_every=1, eval_size=2, max_new_tokens=4, progress=False),
    )
    run_sft(cfg, **QUIET)
    entries = _created(tmp_path / "ws")
    out = tmp_path / "case"
    for entry, outside, before in _each_planted(tmp_path / "ws", out, tmp_path, entries):
        run_sft(dataclasses.replace(cfg, out=str(out)), **QUIET)
        _check_outside(entry, outside, before)
