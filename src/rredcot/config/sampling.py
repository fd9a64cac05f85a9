"""The sampling section (``sampling.*``): how completions are sampled and scored, and the
tree-structured groups (``sampling.tree.*``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rredcot.config.fields import help_field

DECODERS = ("auto", "fast", "hf")
"""The values of ``sampling.decoder`` (``rollout.resolve_decoder`` says what auto picks)."""

FORK_RULES = ("entropy", "even", "random")
"""The values of ``sampling.tree.fork_rule`` (:mod:`rredcot.sampling.tree` says what each picks)."""

SHARED_TOKEN_WEIGHTS = ("per_leaf", "per_node")
"""The values of ``sampling.tree.shared_token_weight``."""


@dataclass
class TreeSamplingConfig:
    """Tree-structured groups (sampling.tree): each prompt's group grows as a tree whose leaves are
    its num_generations completions; a shared prefix is generated once (docs/tree.md)."""

    enabled: bool = help_field(
        "Grow each prompt's group as a tree instead of sampling its completions independently: "
        "`roots` independent completions, then rounds that fork `forks_per_round` new branches "
        "at segment boundaries of the completions so far (the fast decoder copies the branch "
        "point's KV cache, so the shared prefix is neither generated nor prefilled again) until "
        "the group has num_generations leaves. The token budget counts each generated token "
        "once. Needs the fast decoder (llama / qwen2 models).",
        default=False,
    )
    roots: int = help_field(
        "Independent completions each tree starts from (1 <= roots <= num_generations).",
        default=2,
    )
    fork_rule: str = help_field(
        "Where to fork among the segment boundaries generated so far: 'entropy' (the highest "
        "next-token entropy of the policy at the boundary, as TreeRL and TreeAdv), 'even' "
        "(boundaries spread evenly over the depth of the completions) or 'random'.",
        default="entropy",
    )
    forks_per_round: int = help_field(
        "New branches per prompt per round (each at a different branch point where the "
        "completions offer enough; fewer rounds mean fewer sequential decoding passes: with "
        "the defaults a group of 8 is 2 roots, then 3 + 3 branches, 3 passes).",
        default=3,
    )
    shared_token_weight: str = help_field(
        "How the loss counts a token that several leaves share: 'per_leaf' (once in every leaf "
        "through it, each time with that leaf's advantage: the per-trajectory estimator, as if "
        "the leaves were separate samples) or 'per_node' (its leaves' terms divided by their "
        "number: every distinct token of the tree counted once).",
        default="per_leaf",
    )

    def __post_init__(self) -> None:
        if self.roots < 1:
            raise ValueError("sampling.tree.roots must be >= 1")
        if self.forks_per_round < 1:
            raise ValueError("sampling.tree.forks_per_round must be >= 1")
        if self.fork_rule not in FORK_RULES:
            raise ValueError(
                f"sampling.tree.fork_rule={self.fork_rule!r}: use {', '.join(FORK_RULES)}"
            )
        if self.shared_token_weight not in SHARED_TOKEN_WEIGHTS:
            raise ValueError(
                f"sampling.tree.shared_token_weight={self.shared_token_weight!r}: use "
                f"{', '.join(SHARED_TOKEN_WEIGHTS)}"
            )


@dataclass
class SamplingConfig:
    """How completions are sampled (and scored: the loss uses the same temperature)."""

    num_generations: int = help_field(
        "Completions sampled per prompt (the group size G).", default=8
    )
    temperature: float = help_field(
        "Sampling temperature. The old log-probs, the loss and the KL reference score the "
        "completions at this temperature too (logits / T), so the update stays on-policy.",
        default=1.0,
    )
    top_p: float = help_field("Nucleus sampling threshold.", default=1.0)
    max_new_tokens: int = help_field(
        "Longest completion; longer ones are truncated. 0: the task's suggestion (room for a "
        "gold trace: 64 for 4-step arithmetic, 136 for 12 steps), else 64.",
        default=0,
    )
    use_model_generation_config: bool = help_field(
        "Also apply the model's own generation_config (repetition penalty, top-k, min-p, ...). "
        "Off by default: those settings change the sampling distribution away from the one the "
        "loss scores (plain temperature / top-p), making the update silently off-policy.",
        default=False,
    )
    decoder: str = help_field(
        "The decoding loop: 'fast' (rredcot's loop for Llama-family models, llama and qwen2: a "
        "static KV cache written in place, one prefill per prompt for its G samples, a stop as "
        "soon as every sample has ended; the same tokens as Hugging Face generate for the same "
        "seed), 'hf' (transformers' generate: any model) or 'auto' (fast where the model is "
        "supported and use_model_generation_config is off, else hf; the run's log says which "
        "and why).",
        default="auto",
    )
    tree: TreeSamplingConfig = field(default_factory=TreeSamplingConfig)

    def __post_init__(self) -> None:
        if self.num_generations < 1:
            raise ValueError("sampling.num_generations must be >= 1")
        if self.temperature <= 0:
            raise ValueError("sampling.temperature must be > 0 (sampling is required for RL)")
        if not 0 < self.top_p <= 1:
            raise ValueError("sampling.top_p must be in (0, 1]")
        if self.max_new_tokens < 0:
            raise ValueError("sampling.max_new_tokens must be >= 1 (0: the task's suggestion)")
        if self.decoder not in DECODERS:
            raise ValueError(f"sampling.decoder={self.decoder!r}: use {', '.join(DECODERS)}")
        if self.tree.enabled and self.tree.roots > self.num_generations:
            raise ValueError(
                f"sampling.tree.roots={self.tree.roots} is more than sampling.num_generations="
                f"{self.num_generations} (the leaves of each tree): lower roots"
            )
        if self.tree.enabled and self.decoder == "hf":
            raise ValueError(
                "sampling.tree needs the fast decoder (it forks its KV cache): set "
                "sampling.decoder to auto or fast, or turn sampling.tree.enabled off"
            )
