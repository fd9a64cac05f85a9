"""Fixtures of the TRL adapter's tests: the tiny policy's saved folder and four arithmetic
prompts (the trainers themselves are built by trl_trainers.make_trainer)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def tiny_model_dir(init_dir):
    """The saved random-init tiny Llama and its character tokenizer (conftest's ``init_dir``,
    read-only), as the path TRL's trainer loads."""
    return str(init_dir)


@pytest.fixture(scope="module")
def arithmetic_dataset():
    from trl_trainers import arithmetic_prompts

    return arithmetic_prompts()
