"""The settings of ``rredcot diagnose`` (:class:`DiagnoseConfig`), free of torch so that the
command's flags and ``--help`` come from them without loading a model library. The figures
themselves are :mod:`rredcot.diagnose`'s; docs/diagnose.md defines every one of them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rredcot.config import (
    help_field,
    refuse_bad_seed,
    refuse_bad_threads,
    refuse_blank_path,
    refuse_non_finite,
)
from rredcot.machine import refuse_beyond_memory

DEFAULT_UNCERTAIN_P = 0.5
"""A sampled token with ``p(y_t) < 0.5`` is an uncertain decision: the policy gave the token it
emitted less than an even chance, so another token was at least as likely overall."""


_DEFAULT_GROUP_SIZES = "2,4,8,16"


@dataclass
class DiagnoseConfig:
    """What ``rredcot diagnose`` samples and measures (docs/diagnose.md)."""

    policy: str = help_field(
        "The policy: a model directory, a checkpoint (checkpoints/step_N), a run directory (its "
        "newest checkpoint; its sampling settings are used), a .gguf file, a hub id or a shipped "
        "alias (smollm2-135m-instruct). Empty: what `rredcot train` would load for the task "
        "(the tiny model's cached warm-start on arithmetic).",
        default="",
    )
    task: str | None = help_field(
        "Task name (default: the checkpoint's task, else arithmetic). Data files go through "
        "--task dataset --task.data FILE.",
        default=None,
    )
    task_args: dict = field(default_factory=dict)
    prompts: int = help_field("Held-out prompts P (task.eval_problems(P, seed)).", default=32)
    samples: int = help_field("Completions per prompt G (the group size).", default=16)
    group_sizes: str = help_field(
        "Comma-separated group sizes G' <= G at which the share of agreeing groups is also "
        "given, computed exactly over every G'-subset of each prompt's G samples (a size above "
        "--samples is refused; the default's are dropped).",
        default=_DEFAULT_GROUP_SIZES,
    )
    temperature: float | None = help_field(
        "Sampling temperature (default: the run directory's sampling.temperature, else 1.0). "
        "Token probabilities and entropies are read at this temperature, as the loss reads them.",
        default=None,
    )
    top_p: float | None = help_field(
        "Nucleus threshold (default: the run's sampling.top_p, else 1.0).", default=None
    )
    max_new_tokens: int | None = help_field(
        "Completion length (default: the run's sampling.max_new_tokens, else the task's "
        "suggestion, else 64).",
        default=None,
    )
    segmenter: str | None = help_field(
        "Segmentation strategy (default: the run's credit.segmenter, else newline). The final "
        "answer line is always kept as its own segment here, so that it is a kind of its own.",
        default=None,
    )
    uncertain_p: float = help_field(
        "A sampled token with probability below this (at the sampling temperature) counts as an "
        "uncertain decision.",
        default=DEFAULT_UNCERTAIN_P,
    )
    position_bins: int = help_field(
        "Bins of relative position along a trace (token index / trace length).", default=10
    )
    max_positions: int = help_field(
        "Segment positions reported one by one; later segments are pooled into the last.",
        default=12,
    )
    mc_traces: int = help_field(
        "Traces of the Monte Carlo subset (a seeded random sample of the traces; 0: no Monte "
        "Carlo values, no estimator scores).",
        default=16,
    )
    mc_k: int = help_field("Monte Carlo continuations per boundary (K).", default=16)
    mc_max_tokens: int = help_field(
        "Cap on the Monte Carlo cost in estimated generated tokens: the subset is shrunk (its "
        "traces dropped from the end) until the estimate fits.",
        default=100_000,
    )
    value_head_run: str | None = help_field(
        "Score the value head of this `rredcot train` run directory (trained with credit "
        "value_head) against the Monte Carlo values.",
        default=None,
    )
    answer_likelihood: bool = help_field(
        "Score the answer-likelihood estimator against the Monte Carlo values.", default=False
    )
    process_reward_function: str | None = help_field(
        "Score a process-reward function (module:fn or file.py:fn, as "
        "--credit.process_reward.function) against the Monte Carlo values.",
        default=None,
    )
    process_reward_model: str | None = help_field(
        "Score a frozen Hugging Face process reward model (a directory, as "
        "--credit.process_reward.model) against the Monte Carlo values.",
        default=None,
    )
    bootstrap: int = help_field(
        "Bootstrap resamples (over prompts) of the intervals on the shares.", default=2000
    )
    seed: int = help_field("Seed of the prompts, the samples and the subset.", default=0)
    chunk_prompts: int = help_field("Prompts per sampling call.", default=16)
    out: str = help_field(
        "Output directory: diagnose.json, diagnose.md and diagnose.png.", default="diagnose"
    )
    device: str = help_field("Device: auto, cpu, cuda, mps.", default="auto")
    threads: int = help_field("Torch CPU threads (0: torch's default).", default=0)
    progress: bool = help_field("Progress bars.", default=True)

    def __post_init__(self) -> None:
        refuse_non_finite(self, "--")
        refuse_blank_path(self.out)
        for name in ("prompts", "samples", "mc_k", "chunk_prompts", "position_bins"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("mc_traces", "mc_max_tokens", "bootstrap", "threads"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0")
        if self.max_positions < 1:
            raise ValueError("--max-positions must be >= 1")
        if not 0.0 < self.uncertain_p <= 1.0:
            raise ValueError(f"--uncertain-p {self.uncertain_p} must be in (0, 1]")
        if self.temperature is not None and self.temperature <= 0:
            raise ValueError(f"--temperature {self.temperature} must be > 0")
        if self.top_p is not None and not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"--top-p {self.top_p} must be in (0, 1]")
        if self.max_new_tokens is not None and self.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens {self.max_new_tokens} must be >= 1")
        self.group_size_list()  # a bad list is refused before any model loads
        refuse_bad_seed(self.seed, "--seed")
        refuse_bad_threads(self.threads, "--threads", zero="torch's default")
        refuse_beyond_memory(
            f"--prompts {self.prompts} x --samples {self.samples}",
            self.prompts * self.samples,
            self.max_new_tokens or 1,
            "lower them",
        )
        refuse_beyond_memory(
            f"--mc-traces {self.mc_traces} x --mc-k {self.mc_k}",
            self.mc_traces * self.mc_k,
            self.max_new_tokens or 1,
            "lower them",
        )
        if self.segmenter:  # and a misspelt strategy
            from rredcot.segment import get_segmenter  # lazy: as CreditConfig's check

            get_segmenter(self.segmenter)

    def group_size_list(self) -> list[int]:
        """The sizes ``G'`` of ``group_sizes`` and ``samples``; a size above ``samples`` is
        refused (one of the default list is dropped)."""
        try:
            sizes = [int(x) for x in str(self.group_sizes).split(",") if x.strip()]
        except ValueError as err:
            raise ValueError(
                f"--group-sizes {self.group_sizes!r}: give comma-separated integers, e.g. 2,4,8"
            ) from err
        if any(s < 2 for s in sizes):
            raise ValueError(
                f"--group-sizes {self.group_sizes!r}: every size must be >= 2 (a group of one "
                "always agrees with itself)"
            )
        if self.samples < 2:
            raise ValueError(
                "--samples must be >= 2: with one sample per prompt every group agrees and GRPO "
                "learns nothing"
            )
        too_big = [s for s in sizes if s > self.samples]
        if self.group_sizes == _DEFAULT_GROUP_SIZES:  # the default's sizes past --samples: dropped
            sizes = [s for s in sizes if s <= self.samples]
        elif too_big:
            raise ValueError(
                f"--group-sizes {self.group_sizes!r}: {', '.join(map(str, too_big))} > --samples "
                f"{self.samples}; a group cannot be larger than the samples drawn per prompt: "
                "raise --samples or drop those sizes"
            )
        return sorted(set(sizes) | {self.samples})
