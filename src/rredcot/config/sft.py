"""``rredcot sft``'s config (run by ``rredcot.training.sft.run_sft``): torch-free, so that the CLI
builds its flags without importing the trainer's libraries."""

from __future__ import annotations

from dataclasses import dataclass

from rredcot.config.fields import (
    help_field,
    refuse_bad_seed,
    refuse_bad_threads,
    refuse_blank_path,
    refuse_non_finite,
)
from rredcot.machine import refuse_beyond_memory

TINY_LR = 2e-3
"""The tiny character model's supervised rate (every shipped warm-start was built at it)."""
PRETRAINED_LR = 2e-5
"""An ``--init`` model's supervised rate: TRL's ``SFTConfig`` default."""


@dataclass
class SFTConfig:
    task: str = help_field("Task whose gold traces the model learns.", default="arithmetic")
    task_args: dict = help_field("Task parameters (CLI: --task.NAME VALUE).", default_factory=dict)
    init: str = help_field(
        "Start from this causal LM instead of the tiny character model: a directory written by "
        "save_pretrained, a .gguf file, a hub id or a shipped name such as "
        "smollm2-135m-instruct. Its own tokenizer is kept; it trains on a GPU where one is "
        "visible. Empty: the tiny model, built from hidden_size, num_layers and num_heads.",
        default="",
    )
    out: str = help_field("Output checkpoint directory.", default="runs/warmstart")
    seed: int = help_field("Random seed.", default=0)
    hidden_size: int = help_field("Tiny Llama hidden size (not with --init).", default=128)
    num_layers: int = help_field("Tiny Llama layers (not with --init).", default=4)
    num_heads: int = help_field("Tiny Llama attention heads (not with --init).", default=4)
    max_steps: int = help_field("Upper bound on optimiser steps.", default=1200)
    max_seconds: float = help_field(
        "Upper bound on wall-clock seconds (0: none). The default warm-start is bounded by steps "
        "only, so that its result does not depend on how busy the machine is.",
        default=0.0,
    )
    threads: int = help_field(
        "CPU threads for torch (0: torch's default, every core); the tiny model gains nothing "
        "from more, a pretrained --init model on a CPU does.",
        default=1,
    )
    batch_size: int = help_field("Gold traces per optimiser step.", default=64)
    lr: float | None = help_field(
        "Peak learning rate (AdamW). Empty (the default): 2e-3 for the tiny model (its shipped "
        "warm-starts were built at it), 2e-5 for an --init model (TRL's SFT default, a "
        "hundredth of the tiny model's).",
        default=None,
    )
    eval_every: int = help_field("Greedy evaluation every N steps.", default=50)
    eval_size: int = help_field("Held-out prompts per evaluation.", default=128)
    target_accuracy: float = help_field(
        "Stop at the first evaluation at or above this greedy accuracy (edge of competence).",
        default=0.5,
    )
    max_accuracy: float = help_field("Upper end of the edge-of-competence band.", default=0.75)
    stop_at_step: int = help_field(
        "Stop after exactly this many steps, whatever the accuracy (0: stop by the accuracy "
        "band). The learning-rate warm-up still follows max_steps, so a build stopped here has "
        "the weights of the same settings' longer build at this step.",
        default=0,
    )
    early_answer_prob: float = help_field(
        "Probability that a gold trace is cut after k < n steps and then answered (teaches the "
        "model to answer early; needed by answer_likelihood credit).",
        default=0.0,
    )
    max_new_tokens: int = help_field("Longest completion in evaluation.", default=64)
    progress: bool = help_field("Show a progress bar.", default=True)

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        if self.lr is not None and not self.lr > 0:
            raise ValueError(
                f"lr={self.lr} must be > 0 (empty: {TINY_LR:g} for the tiny model, "
                f"{PRETRAINED_LR:g} with --init)"
            )
        if not 0 <= self.early_answer_prob <= 1:
            raise ValueError("early_answer_prob must be in [0, 1]")
        if not 0 < self.target_accuracy <= self.max_accuracy <= 1:
            raise ValueError("need 0 < target_accuracy <= max_accuracy <= 1")
        if self.max_seconds < 0:
            raise ValueError("max_seconds must be >= 0")
        if self.batch_size < 1 or self.max_steps < 1 or self.eval_every < 1:
            raise ValueError("batch_size, max_steps and eval_every must be >= 1")
        if min(self.hidden_size, self.num_layers, self.num_heads) < 1:
            raise ValueError(
                f"hidden_size={self.hidden_size}, num_layers={self.num_layers} and "
                f"num_heads={self.num_heads} must be >= 1"
            )
        if self.hidden_size % self.num_heads or (self.hidden_size // self.num_heads) % 2:
            raise ValueError(
                f"hidden_size={self.hidden_size} must be a multiple of 2 x num_heads="
                f"{self.num_heads} (each head's width is even, for rotary positions)"
            )
        if self.eval_size < 1 or self.max_new_tokens < 1:
            raise ValueError("eval_size and max_new_tokens must be >= 1")
        refuse_bad_seed(self.seed)
        refuse_bad_threads(self.threads, zero="torch's default")
        tokens = self.max_new_tokens
        refuse_beyond_memory(f"eval_size={self.eval_size}", self.eval_size, tokens, "lower it")
        refuse_beyond_memory(f"batch_size={self.batch_size}", self.batch_size, tokens, "lower it")
        if not 0 <= self.stop_at_step <= self.max_steps:
            raise ValueError(
                f"stop_at_step={self.stop_at_step} must be in [0, max_steps={self.max_steps}] "
                "(0: stop by the accuracy band)"
            )
        refuse_blank_path(self.out)

    @property
    def resolved_lr(self) -> float:
        """``lr``, or its default for the model being trained."""
        if self.lr is not None:
            return self.lr
        return PRETRAINED_LR if self.init else TINY_LR
