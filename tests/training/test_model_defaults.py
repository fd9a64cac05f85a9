"""Defaults that depend on the policy's kind: the learning rate left empty is 1e-4 for the
built-in character model and 3e-5 for a language model (1e-4 halves SmolLM2-135M's accuracy in
three steps); a given rate is kept; the run logs and saves the value it used."""

from __future__ import annotations

import pytest
import yaml

from helpers import micro_config
from rredcot.config import MODEL_DEFAULTS, TrainConfig
from rredcot.training.setup import resolve_model_defaults
from rredcot.training.trainer import Trainer


class _Vocab:
    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size


@pytest.mark.parametrize(
    ("vocab", "given", "expected"),
    [
        (100, None, 1e-4),  # the character tokenizer
        (49_152, None, 3e-5),  # SmolLM2's byte-level BPE
        (49_152, 1e-5, 1e-5),  # a rate the user gave is kept
        (100, 0.0, 0.0),
    ],
)
def test_an_empty_rate_defaults_by_the_policys_kind(vocab, given, expected):
    cfg = TrainConfig(lr=given)
    said: list[str] = []
    resolve_model_defaults(cfg, _Vocab(vocab), said.append)
    assert cfg.lr == expected
    assert bool(said) == (given is None)  # the default used is said, a given rate is not
    if said:
        assert f"lr {expected:g}" in said[0]


def test_the_table_and_the_help_agree():
    assert MODEL_DEFAULTS["character"]["lr"] == 1e-4
    assert MODEL_DEFAULTS["language_model"]["lr"] == 3e-5
    with pytest.raises(ValueError, match="lr=-1"):
        TrainConfig(lr=-1.0)


def test_a_run_saves_the_rate_it_used(init_dir, tmp_path):
    run = tmp_path / "run"
    lines: list[str] = []
    Trainer(micro_config(init_dir, run, steps=1), log=lines.append).train()
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["lr"] == 1e-4  # the character model's default, resolved before the optimiser
    assert any(
        line.startswith("defaults for the built-in character model: lr 0.0001") for line in lines
    )
