"""The credit section (``credit.*``): segmentation, the credit algebra's settings that every method
shares, the sections they share (``handover``, ``reweight``), each method's own options
(``rredcot.config.method_options``) nested as ``credit.<method>.<field>``, and the table of the
built-in credit methods."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

from rredcot.config.fields import help_field, refuse_non_finite
from rredcot.config.method_options import (
    AnswerLikelihoodConfig,
    ContinuationLikelihoodConfig,
    MonteCarloConfig,
    OracleConfig,
    ProcessRewardConfig,
    ValueHeadConfig,
)

# every built-in credit method -> the module that registers it (rredcot.methods.base imports
# them on first use; --credit_method's help is written from it without importing torch)
BUILTIN_CREDIT_METHODS: dict[str, str] = {
    "uniform": "rredcot.methods.base",
    "node_values": "rredcot.methods.base",
    "value_head": "rredcot.methods.value_head",
    "answer_likelihood": "rredcot.methods.answer_likelihood",
    "continuation_likelihood": "rredcot.methods.continuation_likelihood",
    "process_reward": "rredcot.methods.process_reward",
    "monte_carlo": "rredcot.methods.monte_carlo",
    "gradient": "rredcot.methods.attribution",
    "attention": "rredcot.methods.attribution",
    "first_last": "rredcot.methods.attribution",
    "oracle": "rredcot.methods.oracle",  # benchmark only: reads the verifier's step labels
}
"""Built-in credit method -> the module that registers it (imported on first use)."""


@dataclass
class HandoverConfig:
    """The hand-over from uniform to value credit, shared by the value methods (value_head,
    answer_likelihood, process_reward, and verl's critic): how far the estimator's values are
    trusted, measured on fresh outcomes."""

    mode: str = help_field(
        "Blend uniform and value credit by the estimator's measured reliability: 'reliability' "
        "or 'off' (always use the method's credit).",
        default="reliability",
    )
    score: str = help_field(
        "What the hand-over weight tracks, measured on each fresh batch before the head trains on "
        "it: 'slope' (the least-squares weight w in R - b = w (V(s_n-1) - b), b the baseline of "
        "uniform credit: how much of the head's prediction to trust) or 'explained_variance' "
        "(1 - MSE(V(s_n-1), R) / MSE(b, R)). Clipped to [0, 1].",
        default="slope",
    )
    smoothing: float = help_field(
        "EMA decay of the estimator's measured reliability (the hand-over weight); starting "
        "from 0, it also sets how slowly trust is earned.",
        default=0.9,
    )

    def __post_init__(self) -> None:
        if self.mode not in ("reliability", "off"):
            raise ValueError("credit.handover.mode must be 'reliability' or 'off'")
        if self.score not in ("slope", "explained_variance"):
            raise ValueError("credit.handover.score must be 'slope' or 'explained_variance'")
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(
                f"credit.handover.smoothing={self.smoothing} must be in [0, 1) "
                "(0: use each step's fresh reliability as is)"
            )


@dataclass
class ReweightConfig:
    """How credit.form=reweight turns a trace's value changes into segment weights of GRPO's
    advantage (docs/method.md, reweighting)."""

    rule: str = help_field(
        "sigma rule: softmax (sigma ∝ exp(u/temperature)), linear (sigma ∝ max(0, 1 + (u - "
        "mean u)/temperature)) or rank (sigma ∝ the rank of u), where u is a segment's value "
        "change signed by the outcome's advantage; then scaled to mean 1 over the trace's tokens.",
        default="softmax",
    )
    temperature: float = help_field(
        "Temperature of the softmax and linear rules, in units of probability of success "
        "(smaller: more of the weight on the segments whose value moved with the outcome).",
        default=0.1,
    )

    def __post_init__(self) -> None:
        if self.rule not in ("softmax", "linear", "rank"):
            raise ValueError(f"credit.reweight.rule={self.rule!r} must be softmax, linear or rank")
        if not self.temperature > 0:
            raise ValueError(f"credit.reweight.temperature={self.temperature} must be > 0")


@dataclass
class CreditConfig:
    """How credit is assigned: segmentation, the credit algebra's settings shared by every
    method, and each method's own options (credit.<section>.<field>)."""

    segmenter: str = help_field(
        "Segmentation strategy: newline, paragraph, sentence, step, keywords, tokens:N, or the "
        "policy-entropy cuts entropy, keywords+entropy and newline+merge:target=N (`rredcot "
        "segment --help` lists each "
        "one's options).",
        default="newline",
    )
    min_chars: int = help_field(
        "Merge segments with fewer non-space characters into the next.", default=0
    )
    max_segments: int = help_field("Cap on segments per trace (0: no cap).", default=0)
    separate_answer: bool = help_field(
        "Keep the final answer line as its own segment (off by default: an answer segment takes "
        "all the blame of a wrong trace and can collapse the policy, docs/method.md, failure modes).",
        default=False,
    )
    lam: float = help_field(
        "Segment GAE lambda: 0 pure redistribution, 1 R - V(s_k-1) (chosen by `rredcot bench "
        "learn`: with the value head's group-mean anchor, 1 is GRPO's advantage minus the head's "
        "value gain before each segment, unbiased whatever the head predicts).",
        default=1.0,
    )
    normalization: str = help_field(
        "Advantage normalisation: auto (group_std for uniform, group_or_batch_std otherwise), "
        "group_or_batch_std (the group's reward std, the batch's where a group's rewards agree), "
        "batch_std, whiten, group_std (suits uniform credit only) or none.",
        default="auto",
    )
    agreeing_std: float = help_field(
        "group_or_batch_std's rule for a group whose rewards agree: a group whose reward std is "
        "below this has no outcome signal, so the value credit's departure from GRPO in it (which "
        "still moves credit between a trace's segments) is divided by max(the batch's reward std, "
        "agreeing_std) instead of by its own ~0 std (x 1e4, docs/method.md, failure modes). GRPO's "
        "share R - mean(R_group) is always divided by its group's std + 1e-4 as GRPO does, so "
        "hand-over weight 0 is GRPO bit for bit at any reward scale. Logged as "
        "credit/agreeing_groups (the share of groups below it). For 0/1 rewards any value in "
        "(0, 1/sqrt(G)) gives the same result.",
        default=0.1,
    )
    anchor: str = help_field(
        "'group': shift the values of every value source (value_head, answer_likelihood, "
        "process_reward, verl's critic) so V(s_0) is the group's mean reward, so every trace gets GRPO's total credit "
        "and the estimator only moves it between the trace's segments (its errors about a "
        "prompt's difficulty cancel); 'none': the estimator's own V(s_0).",
        default="group",
    )
    form: str = help_field(
        "How a value source's estimates become credit: 'redistribute' (segment GAE over the "
        "value changes, handed over from GRPO) or 'reweight' (GRPO's advantage on every segment, "
        "its size moved between a trace's segments by coefficients from the value changes; the "
        "sign is never flipped: docs/method.md). Uniform and the attribution methods ignore it.",
        default="redistribute",
    )
    auto_prompts: int | None = help_field(
        "Retired: --credit auto now decides from step 1's own batch and samples nothing extra. "
        "Accepted (older configs hold it) and ignored, with a warning.",
        default=None,
    )
    reweight: ReweightConfig = field(default_factory=ReweightConfig)
    value_head: ValueHeadConfig = field(default_factory=ValueHeadConfig)
    handover: HandoverConfig = field(default_factory=HandoverConfig)
    answer_likelihood: AnswerLikelihoodConfig = field(default_factory=AnswerLikelihoodConfig)
    continuation_likelihood: ContinuationLikelihoodConfig = field(
        default_factory=ContinuationLikelihoodConfig
    )
    monte_carlo: MonteCarloConfig = field(default_factory=MonteCarloConfig)
    process_reward: ProcessRewardConfig = field(default_factory=ProcessRewardConfig)
    oracle: OracleConfig = field(default_factory=OracleConfig)

    def __post_init__(self) -> None:
        refuse_non_finite(self, "credit.")
        if not 0.0 <= self.lam <= 1.0:
            raise ValueError(f"credit.lam={self.lam} must be in [0, 1]")
        if self.anchor not in ("group", "none"):
            raise ValueError("credit.anchor must be 'group' or 'none'")
        if not self.agreeing_std >= 0.0:
            raise ValueError(f"credit.agreeing_std={self.agreeing_std} must be >= 0")
        if self.auto_prompts is not None:
            warnings.warn(
                f"credit.auto_prompts={self.auto_prompts} is ignored: --credit auto decides from "
                "step 1's own batch and samples nothing extra; drop the setting",
                UserWarning,
                stacklevel=2,
            )
            self.auto_prompts = None
        from rredcot.segment import get_segmenter  # lazy: rredcot.segment imports nothing of ours

        try:  # a misspelt strategy fails here, not when a trainer is built
            get_segmenter(self.segmenter)
        except (ValueError, TypeError) as err:
            raise ValueError(f"credit.segmenter: {err}") from None
        if self.form not in ("redistribute", "reweight"):
            raise ValueError(f"credit.form={self.form!r} must be redistribute or reweight")
        if self.value_head.teacher != "none" and self.continuation_likelihood.scope != "all":
            raise ValueError(
                "credit.value_head.teacher=continuation_likelihood needs "
                "credit.continuation_likelihood.scope=all (the head learns every row's values)"
            )

    def section(self, cls: type) -> Any:
        """This config's instance of the options dataclass ``cls`` (``ValueHeadConfig`` ->
        ``self.value_head``): how a method finds the options it was registered with."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if type(value) is cls:
                return value
        raise ValueError(f"{cls.__name__} is not a section of CreditConfig")
