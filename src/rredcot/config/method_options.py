"""Each credit method's own options (``credit.<method>.<field>``): one dataclass per method,
registered with it (``register_credit(name, options=...)`` in ``rredcot.methods``) and nested in
``CreditConfig``. They live here, free of torch, so that ``rredcot --help`` builds every flag
without importing a method."""

from __future__ import annotations

from dataclasses import dataclass

from rredcot.config.fields import help_field, refuse_unknown
from rredcot.machine import refuse_beyond_memory, refuse_bytes_beyond_memory

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


ANSWER_ESTIMATORS = ("probability", "per_token")


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
    estimator: str = help_field(
        "probability: V(s_k) = the summed probability of the correct answers' probes after "
        "s_k, capped at 1 (the method's form); per_token: V(s_k) = the largest per-token "
        "probability exp(log pi(probe | s_k) / |probe|) over the boundary's probes "
        "(length-normalised, in log space: a score, not a probability, that does not vanish "
        "where a pretrained model gives a stated answer ~1e-9 before its last line). The value "
        "head's alik_feature reads the probability form either way (its features carry its log).",
        default="probability",
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
        if self.estimator not in ANSWER_ESTIMATORS:
            raise ValueError(
                f"credit.answer_likelihood.estimator={self.estimator!r} must be "
                f"{' or '.join(ANSWER_ESTIMATORS)}"
            )
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


def refuse_per_token_stop_below(estimator: str, stop_below: float) -> None:
    """``stop_below`` stops probing where a path's probability is small, which only falls along
    the path; ``per_token`` values need not, so the two are refused together."""
    if estimator == "per_token" and stop_below > 0.0:
        raise ValueError(
            "credit.continuation_likelihood.stop_below reads a path's probability, which "
            "only falls along it; per_token values need not: set stop_below=0 or another "
            "estimator"
        )


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
        "batch; per_token: V = mean over the distinct continuations of exp(log pi(u | prefix) "
        "/ |u|), the per-token probability (length-normalised, in log space; a score, not a "
        "bound, that does not vanish on long continuations).",
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
        if self.estimator not in ("importance", "sum", "per_token"):
            raise ValueError(
                f"credit.continuation_likelihood.estimator={self.estimator!r} must be "
                "importance, sum or per_token"
            )
        refuse_per_token_stop_below(self.estimator, self.stop_below)
        for name in ("max_continuations", "chunk_tokens", "logits_mb"):
            if getattr(self, name) < 1:
                raise ValueError(
                    f"credit.continuation_likelihood.{name}={getattr(self, name)} must be >= 1"
                )


ORACLE_VALUES = ("group", "pooled", "monte_carlo")
ORACLE_ENDED_UNLABELLED = ("last_segment", "grpo")
"""The values of ``credit.oracle.ended_unlabelled`` and ``capped_unlabelled``."""
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
    ended_unlabelled: str = help_field(
        "A failed trace the verifier could not label (no stated answer, no wrong equation) that "
        "ended on its own (EOS before the token cap). last_segment: it stopped without a right "
        "answer, so its last segment holds the first error (no unjudged refuge: text the labels "
        "cannot check is blamed like text they can); grpo: GRPO's credit on every segment, as a "
        "trace cut by the cap always gets (the labels of the first SmolLM2 ceiling runs, under "
        "which the policy learned to write such traces).",
        default="last_segment",
    )
    capped_unlabelled: str = help_field(
        "The same for a trace cut by the token cap (no EOS). grpo: GRPO's credit, since a cut "
        "trace may have been right so far; last_segment: it ran out of tokens without a right "
        "answer, so its last segment holds the first error (every failed trace is then blamed "
        "somewhere: on SmolLM2 the policy learned to run to the cap when only ended traces "
        "were).",
        default="grpo",
    )

    def __post_init__(self) -> None:
        refuse_unknown(self.values, ORACLE_VALUES, "credit.oracle.values")
        for name in ("ended_unlabelled", "capped_unlabelled"):
            refuse_unknown(getattr(self, name), ORACLE_ENDED_UNLABELLED, f"credit.oracle.{name}")
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
