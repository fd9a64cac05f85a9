"""A run directory is data, never code (issue 31): ``trainer_state.pt`` is written as tensors and
plain data and read through ``torch.load(weights_only=True)``; a pickle payload planted in a
shared run directory (its manifest updated to match) does not run on ``rredcot explain`` or
``rredcot train --resume``: the command stops with a one-line error instead."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers import Payload, micro_config, one_line_error
from rredcot.training import runio
from rredcot.training.trainer import Trainer

QUIET = {"log": lambda *_: None}


@pytest.fixture(scope="module")
def value_run(init_dir, tmp_path_factory):
    """2 value-head steps, a checkpoint after each (``explain`` reads the head from them)."""
    run = tmp_path_factory.mktemp("safety") / "run"
    cfg = micro_config(init_dir, run, credit_method="value_head", steps=2, checkpoint_every=1)
    Trainer(cfg, **QUIET).train()
    return run


@pytest.fixture
def run_copy(value_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(value_run, copy)
    return copy


def _plant_payload(ckpt: Path, marker: Path, *, manifest: bool = True) -> None:
    """Add a code-running object to ``ckpt/trainer_state.pt``; update (or drop) the manifest so
    the checkpoint still verifies by its checksums."""
    state = runio.load_trainer_state(ckpt / "trainer_state.pt")
    state["credit_method"]["note"] = Payload(marker)
    runio.atomic_torch_save(state, ckpt / "trainer_state.pt")
    step = int(ckpt.name.removeprefix("step_"))
    if manifest:
        runio.write_manifest(ckpt, step)
        assert runio.verify_checkpoint(ckpt) is None  # the checksums match: only loading is left
    else:
        (ckpt / runio.MANIFEST).unlink()
    assert not marker.exists()


def test_trainer_state_is_plain_data(value_run):
    path = value_run / "checkpoints" / "step_000002" / "trainer_state.pt"
    assert torch.serialization.get_unsafe_globals_in_checkpoint(path) == []
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert isinstance(state["rng"]["numpy"]["keys"], torch.Tensor)
    assert isinstance(state["rng"]["python"]["internal"], torch.Tensor)
    assert state["credit_method"]["head"]["fc1.weight"].dtype == torch.float32


@pytest.mark.parametrize("manifest", [True, False], ids=["manifest", "no_manifest"])
def test_a_payload_does_not_run_on_explain_or_resume(
    init_dir, run_copy, tmp_path, capsys, manifest
):
    marker = tmp_path / "payload_ran"
    for step in ("step_000001", "step_000002"):
        _plant_payload(run_copy / "checkpoints" / step, marker, manifest=manifest)
    ckpt = run_copy / "checkpoints" / "step_000002"
    commands = {
        "explain --checkpoint": ["explain", "--checkpoint", str(ckpt), "--samples", "2"],
        "explain --run": [
            *("explain", "--checkpoint", str(init_dir), "--run", str(run_copy)),
            *("--samples", "2", "--task.num_steps", "2"),
        ],
        "train --resume": ["train", "--resume", str(run_copy)],
    }
    for name, argv in commands.items():
        err = one_line_error([*argv, "--no-color"] if argv[0] == "explain" else argv, capsys)
        assert not marker.exists(), f"{name}: the payload ran"
        assert "could run code" in err, (name, err)
        if manifest:  # with its checksums in order, the loader itself names the refused object
            assert "builtins.exec" in err, (name, err)
