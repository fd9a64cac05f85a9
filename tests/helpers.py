"""Helpers the tests share (plain functions; the fixtures are in conftest.py): micro runs and
their steps, sampled rollout batches, the CLI's one-line errors, payloads that must never run,
the paths of the repository and of tests/fixtures, and the credit method
``test_negated_uniform``.

Importable from any folder under tests/ (pyproject.toml's ``pythonpath = ["tests"]``), as are
the other helper modules here: text_batches, tiny_lms, credit_reference, metrics_doc and
prm_scores."""

from __future__ import annotations

from pathlib import Path

import torch

from rredcot.methods.base import UniformCredit, register_credit

ROOT = Path(__file__).resolve().parents[1]  # the repository
FIXTURES = ROOT / "tests" / "fixtures"


@register_credit("test_negated_uniform")
class NegatedUniform(UniformCredit):
    """GRPO's advantages with the sign flipped: what a sign bug in the loss path would do.

    Registered when conftest imports this module, so before any test module is collected: a
    test parametrized over ``credit_names()`` sees it whichever folders are collected first."""

    def credit_output(self, rows, est, segment_ids, response_mask):
        out = super().credit_output(rows, est, segment_ids, response_mask)
        out.advantages = -out.advantages
        out.segment_advantages = -out.segment_advantages
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
    from rredcot.sampling.forward import fill_forward
    from rredcot.sampling.rollout import build_rollout_batch
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


class Payload:
    """Unpickling this runs ``exec``: it creates ``marker`` (what an attacker's code would do)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",))
