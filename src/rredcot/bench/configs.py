"""The benchmarks' configurations, free of torch so that ``rredcot bench --help`` (whose flags and
help come from them) starts fast. Every field carries its help text; ``rredcot.bench.cli``
turns each dataclass into its subcommand's flags with the same generator as ``rredcot train``
(``rredcot.config.io.add_dataclass_flags``). Each benchmark module re-exports its own:
``rredcot.bench.credit.CreditBenchConfig``, ``rredcot.bench.learn.LearnBenchConfig``,
``rredcot.bench.overhead.OverheadBenchConfig``, ``rredcot.bench.peer.PeerBenchConfig``.

Fields that are not plain flags: ``task`` (``--task NAME``), ``task_args`` (``--task.KEY VALUE``),
``overrides`` (``--set KEY=VALUE``, repeatable) and ``trl_overrides`` (``--trl-set KEY=VALUE``,
read by :func:`parse_trl_overrides`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from typing import Any

from rredcot.config import (
    help_field,
    refuse_bad_seed,
    refuse_bad_threads,
    refuse_blank_path,
    refuse_non_finite,
)
from rredcot.errors import require_extra

METHODS_HELP = (
    "Comma-separated credit methods or named variants name=method:key=value:..., e.g. "
    "'uniform,value_head,vh_collapse=value_head:lam=0:separate_answer=true:handover.mode=off:"
    "value_head.shared_prefixes=false'."
)
# the reported long-chain setting (benchmarks/results/long_chain): what `bench learn` runs
# with no further flags
LEARN_BUDGET_TOKENS = 500_000
LEARN_EVAL_EVERY = 5
LEARN_EVAL_SIZE = 256
LEARN_LR = 5e-5  # chosen on tuning seeds 0-1 (benchmarks/results/long_chain/README.md)
GROUND_TRUTHS = ("monte_carlo", "oracle")  # what `bench credit` compares the methods with


@dataclass
class CreditBenchConfig:
    checkpoint: str = help_field(
        "Policy: model, checkpoint or run directory (required).", default=""
    )
    methods: str = help_field(
        METHODS_HELP,
        default="uniform,value_head,answer_likelihood,monte_carlo,gradient,attention,first_last",
    )
    segmenters: str = help_field(
        "Comma-separated segmenters.", flags=("--segmenter",), default="newline"
    )
    task: str | None = help_field(
        "Task name (default: the checkpoint's task, else arithmetic).", default=None
    )
    task_args: dict = field(default_factory=dict)
    prompts: int = help_field("Held-out prompts N.", default=32)
    samples: int = help_field("Completions per prompt G.", default=8)
    ground_truth: str = help_field(
        "What the methods are compared with: monte_carlo (V_MC from --mc_k rollouts a boundary) "
        "or oracle (the verifier's first-wrong-line labels through the oracle method and its "
        "credit.oracle.* settings, no generation; tasks with step labels only, and only the "
        "traces the labels judge are scored).",
        default="monte_carlo",
    )
    mc_k: int = help_field("Ground-truth Monte Carlo rollouts per boundary.", default=32)
    lam: float = help_field("Lambda of every comparison (0: A_k = r_k).", default=0.0)
    out: str = help_field("Output directory.", default="bench/credit")
    seed: int = help_field("Seed of the prompts and samples.", default=0)
    value_fit_batches: int = help_field(
        "Fresh batches the value head is fitted on before scoring (0: untrained).", default=20
    )
    value_fit_prompts: int = help_field("Prompts per fit batch.", default=16)
    run: str | None = help_field(
        "Load learned method states (value head) from this training run instead.", default=None
    )
    max_new_tokens: int | None = help_field(
        "Completion length (default: the run's sampling.max_new_tokens, else 64).", default=None
    )
    temperature: float = help_field("Sampling temperature.", default=1.0)
    top_p: float = help_field("Sampling top-p.", default=1.0)
    blame_threshold: float = help_field(
        "correct_acc: a segment below this advantage counts as blamed.", default=0.0
    )
    chunk_prompts: int = help_field("Prompts per forward chunk.", default=16)
    examples: int = help_field("Traces per example page.", default=2)
    overrides: dict = field(default_factory=dict)  # dotted credit.* defaults (--set)
    device: str = help_field("Device: auto, cpu, cuda, mps.", default="auto")

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        refuse_blank_path(self.out)
        if not self.temperature > 0 or not 0 < self.top_p <= 1:
            raise ValueError(
                f"temperature={self.temperature} must be > 0 and top_p={self.top_p} in (0, 1]"
            )
        for name in ("prompts", "samples", "mc_k", "chunk_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1")
        for name in ("value_fit_batches", "value_fit_prompts", "examples"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name.replace('_', '-')} must be >= 0")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"lam={self.lam} must be in [0, 1]")
        if self.ground_truth not in GROUND_TRUTHS:
            raise ValueError(
                f"ground-truth={self.ground_truth!r}; valid: {', '.join(GROUND_TRUTHS)}"
            )


@dataclass
class LearnBenchConfig:
    methods: str = help_field(
        METHODS_HELP, default="uniform,value_head,answer_likelihood,monte_carlo"
    )
    seeds: int = help_field("Seeds per method.", default=3)
    first_seed: int = help_field(
        "First seed (tuning seeds are below 100; report on seeds from 100 up).", default=0
    )
    budget_tokens: int = help_field(
        "Sampled tokens per run (policy rollouts + credit-method generations); 0: none (with "
        "--budget-seconds or --budget-compute).",
        default=LEARN_BUDGET_TOKENS,
    )
    init: str | None = help_field(
        "Warm-start checkpoint (default: the train config's init, else the task setting's "
        "default warm-start, built and cached).",
        default=None,
    )
    out: str = help_field("Output directory (run directories inside).", default="bench/learn")
    steps_max: int = help_field("Step cap per run.", default=1000)
    eval_every: int | None = help_field(
        "Steps between held-out evaluations (None, or --set eval_every=N: the train config's).",
        default=LEARN_EVAL_EVERY,
    )
    eval_size: int | None = help_field(
        "Held-out prompts per evaluation (None, or --set eval_size=N: the train config's).",
        default=LEARN_EVAL_SIZE,
    )
    lr: float | None = help_field(
        "Policy learning rate of every run (None, or --set lr=X or a variant's lr: the train "
        "config's).",
        default=LEARN_LR,
    )
    target_acc: float | None = help_field(
        "Target accuracy of tokens-to-target (default: mean warm-start accuracy + target_delta).",
        default=None,
    )
    target_delta: float = help_field("Target = warm-start accuracy + this.", default=0.1)
    config: str | None = help_field("YAML TrainConfig every run starts from.", default=None)
    overrides: dict = field(default_factory=dict)  # dotted TrainConfig overrides (--set)
    task: str | None = help_field(
        "Task name (default: the config's task, else arithmetic).", default=None
    )
    task_args: dict = field(default_factory=dict)
    variance_probes: int = help_field(
        "Budget points where the policy-gradient variance is measured (0: off).", default=0
    )
    variance_prompts: int = help_field("Prompts per variance probe.", default=8)
    variance_minibatch: int = help_field("Prompts per gradient in a variance probe.", default=2)
    variance_bootstrap: int = help_field("Bootstrap resamples of the variance.", default=200)
    progress: bool = help_field("Progress bars.", default=False)
    budget_seconds: float = help_field(
        "Training seconds per run (equal wall-clock): a run stops after the step at which the "
        "sum of its step_seconds (rollout, scoring, credit, update; evaluation, checkpoints and "
        "start-up excluded) reaches it; 0: none. Every budget given applies, the first reached "
        "stops the run: with --budget-tokens 0 time is the only one.",
        default=0.0,
    )
    budget_compute: float = help_field(
        "Compute per run in forward-token equivalents (FLOPs / 2N, N the policy's parameters): a "
        "token sampled or scored (the loss's no-grad pass, the KL reference, the credit method's "
        "extra forwards and generations) counts 1 (forward 2N FLOPs), a token the update forwards "
        "and back-propagates 3 per epoch (forward 2N + backward 4N; rows and tails with no credit "
        "are not, sft references are: the train config's max_compute); 0: none. With "
        "--budget-tokens 0 it is the only budget.",
        default=0.0,
    )

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        refuse_blank_path(self.out)
        if self.seeds < 1:
            raise ValueError("--seeds must be >= 1")
        refuse_bad_seed(self.first_seed + self.seeds - 1, "--first-seed + --seeds - 1")
        for name in ("budget_tokens", "budget_seconds", "budget_compute"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: none)")
        if not (self.budget_tokens or self.budget_seconds or self.budget_compute):
            raise ValueError(
                "no budget: give --budget-tokens, --budget-seconds or --budget-compute (> 0)"
            )
        if self.steps_max < 1:
            raise ValueError("--steps-max must be >= 1")
        if self.variance_probes < 0 or self.variance_prompts < 1:
            raise ValueError("--variance-probes must be >= 0 and --variance-prompts >= 1")
        if self.variance_minibatch < 1 or self.variance_bootstrap < 1:
            raise ValueError("--variance-minibatch and --variance-bootstrap must be >= 1")


@dataclass
class OverheadBenchConfig:
    methods: str = help_field(
        METHODS_HELP, default="uniform,value_head,answer_likelihood,monte_carlo"
    )
    steps: int = help_field("Timed rounds.", default=20)
    warmup: int = help_field("Untimed rounds first.", default=2)
    init: str | None = help_field("Warm-start checkpoint (default: built/cached).", default=None)
    out: str = help_field("Output directory.", default="bench/overhead")
    seed: int = help_field("Seed.", default=0)
    reset_policy: bool = help_field(
        "Reset every policy to the warm-start before each step (false: let each train on, so "
        "that their lengths drift apart).",
        default=True,
    )
    config: str | None = help_field("YAML TrainConfig every method starts from.", default=None)
    overrides: dict = field(default_factory=dict)  # dotted TrainConfig overrides (--set)
    task: str | None = help_field("Task name (default: arithmetic).", default=None)
    task_args: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        refuse_blank_path(self.out)
        if self.steps < 1:
            raise ValueError("--steps must be >= 1 (timed rounds)")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")


@dataclass
class PeerBenchConfig:
    model: str | None = help_field(
        "Model (directory, .gguf, shipped alias such as smollm2-135m-instruct, 'tiny'); default: "
        "the task's default (the tiny warm-start on arithmetic).",
        default=None,
    )
    task: str = help_field("Task name.", default="arithmetic")
    task_args: dict = field(default_factory=dict)
    prompts: int = help_field("Prompts per step.", default=16)
    generations: int = help_field("Completions per prompt.", default=8)
    max_new_tokens: int | None = help_field(
        "Completion length (default: the task's suggestion, else 64).", default=None
    )
    steps: int = help_field("Timed steps per process.", default=20)
    warmup: int = help_field("Untimed steps first.", default=3)
    repeats: int = help_field("Processes per trainer.", default=4)
    threads: int = help_field(
        "torch threads of both trainers (0: each trainer's own default).", default=0
    )
    lr: float = help_field("Learning rate of both.", default=1e-5)
    seed: int = help_field("Seed.", default=0)
    trl_overrides: dict = field(default_factory=dict)  # GRPOConfig overrides (--trl-set)
    out: str = help_field("Output directory.", default="bench/peer")
    timeout: float = help_field("Seconds each process may run.", default=7200.0)

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        refuse_blank_path(self.out)
        for name in ("prompts", "generations", "steps", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1")
        if self.warmup < 0:
            raise ValueError("--warmup must be >= 0")
        refuse_bad_threads(self.threads, "--threads", zero="each trainer's own default")
        refuse_bad_seed(self.seed, "--seed")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError("--max-new-tokens must be >= 1")


MEMORY_METHODS = (
    "uniform,value_head,answer_likelihood,continuation_likelihood,monte_carlo,gradient,"
    "attention,first_last"
)


@dataclass
class MemoryBenchConfig:
    methods: str = help_field("Comma-separated credit methods.", default=MEMORY_METHODS)
    models: str = help_field(
        "Comma-separated models: 'tiny' (the arithmetic warm-start) or a --model.name_or_path "
        "(e.g. smollm2-135m-instruct).",
        default="tiny,smollm2-135m-instruct",
    )
    scales: str = help_field(
        "Comma-separated batch multipliers of --prompts-per-step (1 is the default batch).",
        default="1,2,4",
    )
    scaled_methods: str = help_field(
        "Methods measured at the scales above 1: 'all', or a comma-separated list (the others "
        "at scale 1 only).",
        default="all",
    )
    prompts_per_step: int = help_field("Prompts per step at scale 1.", default=16)
    steps: int = help_field("Steps per measurement (each in its own process).", default=1)
    tiny_task: str = help_field("Task of the tiny model.", default="arithmetic")
    real_task: str = help_field("Task of the other models.", default="gsm8k")
    real_task_data: str | None = help_field(
        "--task.data of the real task (e.g. a GSM8K jsonl); default: the task's own.",
        default=None,
    )
    threads: int = help_field("torch threads per process (0: rredcot train's auto).", default=0)
    micro_batch_tokens: int = help_field(
        "--micro_batch_tokens of every run (0: rredcot train's automatic rule).", default=0
    )
    seed: int = help_field("Seed.", default=0)
    timeout: float = help_field("Seconds each measurement may run.", default=3600.0)
    out: str = help_field("Output directory.", default="benchmarks/results/memory")

    def scale_list(self) -> list[int]:
        return [int(s) for s in self.scales.split(",") if s.strip()]

    def __post_init__(self) -> None:
        try:
            scales = self.scale_list()
        except ValueError as err:
            raise ValueError(f"--scales {self.scales!r}: give integers, e.g. 1,2,4") from err
        if not scales or min(scales) < 1:
            raise ValueError(f"--scales {self.scales!r}: give integers >= 1, e.g. 1,2,4")
        if (
            self.steps < 1
            or self.prompts_per_step < 1
            or min(self.threads, self.micro_batch_tokens) < 0
        ):
            raise ValueError(
                "--steps and --prompts-per-step must be >= 1, --threads and "
                "--micro-batch-tokens >= 0"
            )
        refuse_bad_threads(self.threads, "--threads", zero="rredcot train's auto")
        refuse_bad_seed(self.seed, "--seed")
        if not (math.isfinite(self.timeout) and self.timeout > 0):
            raise ValueError(
                f"--timeout {self.timeout}: give the seconds each measurement may run (> 0)"
            )
        if not [m for m in self.methods.split(",") if m.strip()]:
            raise ValueError("--methods names no credit method; give e.g. uniform,value_head")
        if not [m for m in self.models.split(",") if m.strip()]:
            raise ValueError("--models names no model; give e.g. tiny")
        refuse_blank_path(self.out)


def parse_trl_overrides(pairs: list[str]) -> dict[str, Any]:
    """``["bf16=true", "loss_type=grpo"]`` -> ``{"bf16": True, "loss_type": "grpo"}`` (values are
    JSON where they parse as JSON, strings otherwise); keys must be ``GRPOConfig`` fields."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--trl-set {pair!r}: expected KEY=VALUE")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    if out:
        grpo_config = require_extra("trl", "trl", "bench peer's --trl-set").GRPOConfig
        known = {f.name for f in dataclasses.fields(grpo_config)}
        bad = sorted(set(out) - known)
        if bad:
            raise ValueError(f"--trl-set: {', '.join(bad)} are not GRPOConfig fields")
    return out


@dataclass
class RecordAutoConfig:
    learn: str = help_field(
        "A learn bench's learn.json (under benchmarks/results/) whose variants were measured "
        "against uniform (GRPO), each at its tuned rate.",
        default="",
    )
    variants: str = help_field(
        "Comma-separated variants of its summary to record (empty: every credit variant but "
        "the reference; variants that change more than credit settings are refused).",
        default="",
    )
    testbed: str = help_field("The testbed in words (task, starting policy).", default="")
    all_wrong: float = help_field(
        "The starting policy's share of all-wrong groups at the runs' group size (its "
        "first-batch figure, e.g. from benchmarks/investigations/probe_auto.py).",
        default=-1.0,
    )
    mean_reward: float = help_field("The starting policy's mean reward.", default=-1.0)
    model_kind: str = help_field(
        "character (the built-in tiny Llama) or language_model (a subword-vocabulary LM).",
        default="language_model",
    )
    model: str = help_field("The policy in words.", default="")
    model_parameters: int = help_field("The policy's parameters (0: unknown).", default=0)
    file: str = help_field(
        "The measurements file to update (empty: the one --credit auto reads, "
        "src/rredcot/measurements/credit_auto.json).",
        default="",
    )

    def __post_init__(self) -> None:
        if not self.learn:
            raise ValueError("bench record-auto needs --learn (a learn.json)")
        if not self.testbed:
            raise ValueError("bench record-auto needs --testbed (the task and starting policy)")
        for name in ("all_wrong", "mean_reward"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(
                    f"--{name} {getattr(self, name)}: give the starting policy's figure in [0, 1]"
                )
        if self.model_kind not in ("character", "language_model"):
            raise ValueError(f"--model_kind {self.model_kind!r}: character or language_model")
        if self.model_parameters < 0:
            raise ValueError("--model_parameters must be >= 0 (0: unknown)")
