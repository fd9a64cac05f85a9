"""The references section (``references.*``): training on the task's reference solutions beside
the RL loss."""

from __future__ import annotations

from dataclasses import dataclass

from rredcot.config.fields import help_field

REFERENCE_MODES = ("off", "sft", "luffy", "bread")
"""The values of ``references.mode`` (:mod:`rredcot.training.references` says what each trains)."""

REFERENCE_GROUPS = ("failed", "all")
"""The values of ``references.groups``."""


@dataclass
class ReferencesConfig:
    """Training on the task's reference solutions (Task.gold_completion) beside the RL loss: the
    baselines a credit method that reads references must beat (rredcot.training.references)."""

    mode: str = help_field(
        "off (no reference is read), sft (a supervised term: references.sft_coef times the NLL "
        "of the chosen groups' references, aggregated as loss_agg aggregates, added to the loss "
        "of every optimiser step) or luffy (the reference joins its group as one more sample "
        "with its verified reward, the credit method's advantages computed with it, its tokens "
        "trained off-policy with LUFFY's shaped, unclipped ratio f(pi) = pi / (pi + gamma)) or "
        "bread (references.branch_rollouts more samples after the prompt and a prefix of the "
        "reference, a group of their own; uniform credit only). The reference tokens trained on "
        "and the branched rollouts count against max_tokens_generated (metric "
        "reference_tokens_trained).",
        default="off",
    )
    groups: str = help_field(
        "Which groups get their reference: failed (no sample with reward >= 1, where GRPO has no "
        "signal) or all (every group of the step: plain SFT mixing, or LUFFY as published).",
        default="failed",
    )
    sft_coef: float = help_field(
        "Weight of the supervised term (references.mode sft).", default=0.1
    )
    shaping_gamma: float = help_field(
        "gamma of LUFFY's policy shaping f(pi) = pi / (pi + gamma) of a reference token's "
        "probability (references.mode luffy; LUFFY uses 0.1).",
        default=0.1,
    )
    branch_rollouts: int = help_field(
        "Rollouts sampled from each chosen group's reference prefix (references.mode bread; "
        "0: sampling.num_generations).",
        default=0,
    )
    branch_fraction: float = help_field(
        "The share of the reference's lines given as the prefix the branched rollouts start "
        "from (references.mode bread; at least one line, never all).",
        default=0.5,
    )

    def __post_init__(self) -> None:
        if self.mode not in REFERENCE_MODES:
            raise ValueError(f"references.mode={self.mode!r}: use {', '.join(REFERENCE_MODES)}")
        if self.groups not in REFERENCE_GROUPS:
            raise ValueError(
                f"references.groups={self.groups!r}: use {', '.join(REFERENCE_GROUPS)}"
            )
        if not self.sft_coef > 0:
            raise ValueError(
                f"references.sft_coef={self.sft_coef} must be > 0 (references.mode off turns "
                "the references off)"
            )
        if not self.shaping_gamma > 0:
            raise ValueError(f"references.shaping_gamma={self.shaping_gamma} must be > 0")
        if self.branch_rollouts < 0:
            raise ValueError(
                f"references.branch_rollouts={self.branch_rollouts} must be >= 0 "
                "(0: sampling.num_generations)"
            )
        if not 0 < self.branch_fraction < 1:
            raise ValueError(f"references.branch_fraction={self.branch_fraction} must be in (0, 1)")
