"""No warning a user sees on every run comes from rredcot's own calls (issue 31): transformers'
v6 deprecations of the ``gradient_checkpointing*`` names and PyTorch's "optimizer.step() has been
overridden after learning rate scheduler initialization"."""

from __future__ import annotations

import math
import warnings

import pytest

from helpers import micro_config, train_step_with_grads
from rredcot.models import is_activation_checkpointing, set_activation_checkpointing

DEPRECATED = r".*deprecated and will be removed in v6.*"
OVERRIDDEN = r".*optimizer.step\(\)` has been overridden.*"


@pytest.fixture
def strict_warnings():
    """The two warnings as errors (others, from libraries, stay warnings)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=DEPRECATED)
        warnings.filterwarnings("error", message=OVERRIDDEN)
        yield


def test_activation_checkpointing_is_switched_by_its_current_name(tiny_policy, strict_warnings):
    assert not is_activation_checkpointing(tiny_policy)
    set_activation_checkpointing(tiny_policy, True, {"use_reentrant": False})
    assert is_activation_checkpointing(tiny_policy) and tiny_policy.model.gradient_checkpointing
    set_activation_checkpointing(tiny_policy, False)
    assert not is_activation_checkpointing(tiny_policy)


def test_a_checkpointed_run_and_a_step_whose_gradients_are_read_warn_nothing(
    init_dir, tmp_path, strict_warnings
):
    from rredcot.training.trainer import Trainer

    cfg = micro_config(init_dir, tmp_path / "run")
    cfg.model.gradient_checkpointing = True
    trainer = Trainer(cfg, log=lambda *_: None)
    try:
        assert is_activation_checkpointing(trainer.policy)
        record, grads = train_step_with_grads(trainer)  # runs the schedule's first step
        assert math.isfinite(record["policy_loss"]) and grads
        assert trainer.scheduler.last_epoch == 1
    finally:
        trainer.release()


@pytest.mark.trl
def test_the_trl_config_sets_checkpointing_by_its_current_name(tmp_path, strict_warnings):
    from rredcot.integrations.trl import RREDCoTGRPOConfig

    args = RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    assert args.gradient_checkpointing is True  # TRL's default, kept
    off = RREDCoTGRPOConfig(output_dir=str(tmp_path), use_cpu=True, activation_checkpointing=False)
    assert off.gradient_checkpointing is False
