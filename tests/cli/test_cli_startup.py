"""The light commands of ``rredcot`` start without the heavy libraries.

``rredcot --help``, ``segment`` with a text strategy and ``explain --demo`` need neither torch nor
transformers; importing them costs seconds. Each command runs in a fresh interpreter under
``python -X importtime``, whose report lists every module imported: a heavy one in it fails the
test, whatever the machine's speed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import rredcot

SRC = Path(rredcot.__file__).resolve().parent.parent  # the rredcot under test, not an install
HEAVY = ("torch", "transformers", "accelerate", "numpy", "tokenizers", "peft", "datasets")
TRACE = "Janet sells 16 - 3 - 4 = 9 eggs.\nShe makes 9 * 2 = $18.\n#### 18"


def imported_modules(
    argv: list[str], stdin: str = ""
) -> tuple[set[str], subprocess.CompletedProcess]:
    """Top-level names of the modules ``python -X importtime -m rredcot ARGV`` imports."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "rredcot", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    names = {
        line.rsplit("|", 1)[1].strip().split(".")[0]
        for line in proc.stderr.splitlines()
        if line.startswith("import time:") and line.count("|") == 2
    }
    assert "rredcot" in names, proc.stderr[-2000:]  # the report was read
    return names, proc


@pytest.mark.parametrize(
    ("argv", "stdin", "expect"),
    [
        (["--help"], "", "Segment-level credit assignment"),
        (["--version"], "", "rredcot "),
        (["segment", "--strategy", "sentence"], TRACE, '"index": 1'),
        (["segment", "--strategy", "keywords", "--separate-answer"], TRACE, "#### 18"),
        (["explain", "--demo", "--no-color"], "", "sum of r_k"),
        (["train", "--help"], "", "--credit.lam"),
        (["sft", "--help"], "", "--max_steps"),
        (["bench", "credit", "--help"], "", "--mc-k"),
        (["bench", "peer", "--help"], "", "--trl-set"),
    ],
)
def test_light_commands_import_no_heavy_library(argv, stdin, expect):
    names, proc = imported_modules(argv, stdin)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert expect in proc.stdout
    assert sorted(names.intersection(HEAVY)) == []


@pytest.mark.slow
def test_the_check_sees_torch_when_a_command_needs_it(tmp_path):
    """The same check on a path that does import torch (loading a policy): it can fail."""
    argv = ["segment", "--strategy", "entropy", "--checkpoint", str(tmp_path / "missing")]
    names, proc = imported_modules(argv, TRACE)
    assert proc.returncode == 2 and "no model directory" in proc.stderr
    assert {"torch", "transformers"} <= names
