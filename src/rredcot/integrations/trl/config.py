"""The TRL adapter's settings: :class:`RREDCoTGRPOConfig` (``GRPOConfig`` plus the credit
settings), the credit methods TRL runs, each ``loss_type``'s aggregation, and the one line that
says what was resolved (:func:`describe_credit`)."""

from __future__ import annotations

import json
import math
import os
import warnings
from dataclasses import dataclass, field

from rredcot.config import CreditConfig, ReferencesConfig
from rredcot.config.io import from_dict
from rredcot.errors import require_extra
from rredcot.integrations._batch import METRICS_PREFIX
from rredcot.methods.auto import AUTO, check_method_name
from rredcot.methods.base import CreditMethod
from rredcot.models import resolve_model_dir

GRPOConfig = require_extra("trl", "trl", "rredcot.integrations.trl").GRPOConfig

__all__ = [
    "LOSS_AGG_OF_LOSS_TYPE",
    "METRICS_PREFIX",
    "REFERENCE_LOSS_TYPES",
    "TRL_METHODS",
    "RREDCoTGRPOConfig",
    "describe_credit",
    "json_dict",
    "normalization_for_scale_rewards",
    "resolve_model",
]

TRL_METHODS = (
    "value_head",
    "answer_likelihood",
    "continuation_likelihood",
    "process_reward",
    "uniform",
)


# rredcot's loss_agg of each TRL loss_type, by how TRL aggregates its per-token loss: grpo and
# sapo average each row's token mean over the rows (seq_mean); bnpo, dapo, cispo and vespo average
# over tokens (token_mean); dr_grpo divides by rows x max_completion_length. luspo sums each row's
# tokens, an aggregation rredcot has not.
LOSS_AGG_OF_LOSS_TYPE = {
    "grpo": "seq_mean",
    "sapo": "seq_mean",
    "bnpo": "token_mean",
    "dapo": "token_mean",
    "cispo": "token_mean",
    "vespo": "token_mean",
    "dr_grpo": "dr_grpo",
}
# luffy's reference row is taken out of TRL's loss and its own term added with TRL's normaliser:
# exact where that normaliser does not change when a row's tokens leave it (not bnpo's)
REFERENCE_LOSS_TYPES = {
    "sft": tuple(LOSS_AGG_OF_LOSS_TYPE),
    "luffy": ("grpo", "sapo", "dapo", "cispo", "vespo", "dr_grpo"),
}
REFERENCE_LOSS_TYPE_WHY = {
    "sft": "the NLL is aggregated as the loss aggregates, and luspo's per-row sum has no "
    "rredcot loss_agg",
    "luffy": "the reference row's term is added beside TRL's loss with TRL's normaliser, which "
    "bnpo and luspo form differently",
}


def json_dict(value: dict | str | None, name: str) -> dict:
    """``value`` (a dict, a JSON object string or None) as a new dict; ``name`` in errors."""
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{name} must be a dict or a JSON object string, got {value!r}"
            ) from err
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a dict or a JSON object string, got {value!r}")
    return dict(value)


@dataclass
class RREDCoTGRPOConfig(GRPOConfig):
    """``GRPOConfig`` plus the rredcot credit settings.

    ``credit`` holds fields of :class:`rredcot.config.CreditConfig` (``segmenter``, ``lam``,
    ``normalization``, ``value_head``, ``handover``, ...), as a dict in Python or a JSON string on
    the command line, e.g. ``--credit '{"segmenter": "sentence", "value_head": {"lr": 0.003}}'``
    (an unknown key is an error that lists the valid ones). With ``credit["normalization"]`` unset
    (``auto``) TRL's ``scale_rewards`` decides (:func:`normalization_for_scale_rewards`); an
    explicit one wins, with a warning if it disagrees with a non-default ``scale_rewards``.
    """

    credit_method: str = field(
        default=AUTO,
        metadata={
            "help": "rredcot credit method: auto (as rredcot train: chosen on the first "
            "generation batch from its own rollouts, rredcot.methods.auto), value_head, "
            "answer_likelihood, continuation_likelihood (the group's correct completions, on "
            "every process, and the task's reference), process_reward (your step scores or a frozen "
            "PRM, credit.process_reward) or uniform (GRPO)."
        },
    )
    credit: dict | str | None = field(
        default=None,
        metadata={
            "help": "Fields of rredcot.config.CreditConfig (segmenter, lam, normalization, "
            "value_head: {lr: ...}, ...) as a dict or a JSON object string; unset fields keep "
            "rredcot train's defaults."
        },
    )
    task: str | None = field(
        default=None,
        metadata={
            "help": "rredcot task name (arithmetic, gsm8k, dataset, ...). answer_likelihood needs "
            "it to write its probes; with it, completions also get the task's verdicts."
        },
    )
    task_args: dict | str | None = field(
        default=None, metadata={"help": "Parameters of the task, a dict or JSON string."}
    )
    answer_column: str = field(
        default="answer",
        metadata={"help": "Dataset column with each prompt's reference answer (if any)."},
    )
    advantage_tail_floor: float = field(
        default=0.0,
        metadata={
            "help": "Drop the tail of each completion's credit where it is smaller than this (as "
            "rredcot train --advantage_tail_floor): token advantages after a completion's last "
            "token with |advantage| >= advantage_tail_floor are set to 0 (all of them where none "
            "is). TRL's loss still forwards every token, so this changes the update, not its "
            "cost. 0 (default): keep every advantage."
        },
    )
    references: dict | str | None = field(
        default=None,
        metadata={
            "help": "Fields of rredcot.config.ReferencesConfig (mode, groups, sft_coef, "
            "shaping_gamma) as a dict or a JSON object string: training on the task's reference "
            "solutions (task.gold_completion of each row's problem; needs task=...). mode sft adds "
            "sft_coef times the references' NLL, aggregated as loss_type aggregates, to the "
            "loss; luffy puts the reference in place of one rollout of each chosen group, "
            "trained with LUFFY's shaped ratio; bread is rredcot train's only. Unset: off."
        },
    )

    def __post_init__(self) -> None:
        if getattr(self, "activation_checkpointing", False) is None:
            # transformers >= 5.x renamed gradient_checkpointing (a deprecated alias that warns
            # when set); GRPOConfig's own default sets the old name, so carry it to the new one
            self.activation_checkpointing = self.gradient_checkpointing
        super().__post_init__()
        self.credit = json_dict(self.credit, "credit")
        self.task_args = json_dict(self.task_args, "task_args")
        check_method_name(self.credit_method)  # unknown names list the valid ones
        if self.credit_method not in (AUTO, *TRL_METHODS):
            raise ValueError(
                f"credit_method={self.credit_method!r} is not supported in TRL (it needs rredcot's "
                "own sampling loop, or passes the adapter does not run); use one of: "
                f"{', '.join((AUTO, *TRL_METHODS))}"
            )
        if self.credit_config.value_head.alik_feature:
            raise ValueError(
                "credit.value_head.alik_feature is not supported in TRL (the adapter does not run "
                "its probe forwards); leave it unset"
            )
        if self.credit_config.value_head.teacher != "none":
            raise ValueError(
                "credit.value_head.teacher is not supported in TRL yet (the adapter's rows are "
                "gathered before the teacher's values were tried there); leave it 'none'"
            )
        if self.credit_config.value_head.pretrain_steps:
            raise ValueError(
                "credit.value_head.pretrain_steps is not supported in TRL (the head trains on "
                "TRL's batches from the first step; the reliability hand-over starts it on uniform "
                "credit); leave it 0"
            )
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                "rredcot needs each completion's outcome reward R (the weighted sum of the reward "
                "functions); set multi_objective_aggregation='sum_then_normalize'"
            )
        if self.credit_method == "process_reward":
            self.credit_config.process_reward.require_source()
        if self.credit_method == "answer_likelihood" and not self.task:
            raise ValueError(
                "credit_method='answer_likelihood' needs task=... (e.g. 'gsm8k'): the task's "
                "render_answer writes the answer probes"
            )
        if not math.isfinite(self.advantage_tail_floor) or self.advantage_tail_floor < 0:
            raise ValueError(
                f"advantage_tail_floor={self.advantage_tail_floor} must be >= 0 (0: keep every "
                "advantage)"
            )
        self.references = json_dict(self.references, "references")
        self._check_references()

        self._warn_scale_rewards_conflict()

    @property
    def references_config(self) -> ReferencesConfig:
        """The :class:`ReferencesConfig` built from ``references`` (unset fields: the defaults,
        ``mode="off"``)."""
        return from_dict(ReferencesConfig, json_dict(self.references, "references"), "references.")

    def _check_references(self) -> None:
        """Refuse ``references`` settings the adapter cannot run, naming the field and the fix."""
        refs = self.references_config  # unknown keys and bad values: one line each
        mode = refs.mode
        if mode == "off":
            return
        if mode == "bread":
            raise ValueError(
                "references.mode='bread' is not supported in TRL (its branched rollouts are "
                "sampled after a prompt plus a reference prefix, a generation TRL's step does "
                "not run); use references.mode 'sft' or 'luffy', or rredcot train "
                "--references.mode bread"
            )
        if not self.task:
            raise ValueError(
                f"references.mode={mode!r} needs task=... (e.g. 'gsm8k'): the task's "
                "gold_completion gives each row's reference solution"
            )
        if self.loss_type not in REFERENCE_LOSS_TYPES[mode]:
            raise ValueError(
                f"references.mode={mode!r} does not support loss_type={self.loss_type!r} "
                f"({REFERENCE_LOSS_TYPE_WHY[mode]}); use loss_type one of "
                f"{', '.join(REFERENCE_LOSS_TYPES[mode])}"
            )
        if mode == "luffy" and self.beta != 0.0:
            raise ValueError(
                "references.mode='luffy' needs beta=0 (TRL's reference-model log-probs of a "
                "replaced row are the sampled completion's, not the reference's); set beta=0.0 "
                "or use references.mode 'sft'"
            )

    @property
    def credit_config(self) -> CreditConfig:
        """The :class:`CreditConfig` of ``credit_method`` (:meth:`credit_config_for`)."""
        return self.credit_config_for(self.credit_method)

    def credit_config_for(self, method: str) -> CreditConfig:
        """The :class:`CreditConfig` built from ``credit`` for ``method`` (unknown keys list the
        valid ones): every unset field is rredcot train's default, except that
        ``normalization="auto"`` follows TRL's ``scale_rewards``
        (:func:`normalization_for_scale_rewards`)."""
        fields = json_dict(self.credit, "credit")
        if fields.get("normalization", "auto") == "auto":
            # credit.form=reweight is GRPO's advantage reweighted: scaled as uniform's
            reweight = fields.get("form") == "reweight"
            fields["normalization"] = normalization_for_scale_rewards(
                self.scale_rewards, "uniform" if reweight else method
            )
        return from_dict(CreditConfig, fields, where="credit.")

    def _warn_scale_rewards_conflict(self) -> None:
        """Warn (once per config) when ``credit["normalization"]`` overrides a ``scale_rewards``
        the user chose (anything but TRL's default ``"group"``)."""
        mode = json_dict(self.credit, "credit").get("normalization", "auto")
        if mode == "auto" or self.scale_rewards == "group":
            return
        implied = normalization_for_scale_rewards(self.scale_rewards, self.credit_method)
        if mode != implied:
            warnings.warn(
                f"credit.normalization={mode!r} overrides scale_rewards={self.scale_rewards!r} "
                f"(which maps to {implied!r}); rredcot scales the advantages by "
                f"credit.normalization. Leave credit.normalization unset (auto) to follow "
                "scale_rewards.",
                stacklevel=3,
            )


def normalization_for_scale_rewards(scale_rewards: str | bool, credit_method: str) -> str:
    """rredcot's normalisation for TRL's ``scale_rewards``.

    ``"group"`` (TRL's default): GRPO's per-group std for ``uniform`` (TRL's advantages exactly),
    ``group_or_batch_std`` for value-based credit (the group's std, or the batch's where a
    group's rewards all agree: value credit is never divided by ~0, docs/method.md, failure modes);
    ``"batch"``: ``batch_std`` (the batch's reward std; only the value credit's departure from
    GRPO is floored at 0.1, so ``uniform`` is TRL's advantages exactly); ``"none"``: ``none``
    (TRL's Dr. GRPO setting; exactly TRL's advantages for ``uniform``).
    """
    mode = {True: "group", False: "none"}.get(scale_rewards, scale_rewards)
    if mode == "group":
        return "group_std" if credit_method == "uniform" else "group_or_batch_std"
    if mode == "batch":
        return "batch_std"
    if mode == "none":
        return "none"
    raise ValueError(f"scale_rewards={scale_rewards!r}: TRL knows 'group', 'batch' and 'none'")


def resolve_model(model: str | os.PathLike) -> str:
    """What ``GRPOTrainer`` should load for ``model``, as ``rredcot train`` and ``load_policy``
    read it: a shipped alias (``smollm2-135m-instruct``) or a ``.gguf`` file (or a directory
    holding one) becomes its dequantised float32 copy under ``~/.cache/rredcot/gguf/`` (built on
    first use, once); a directory or hub id is returned unchanged. A shipped alias that
    is not installed fails here, with the install command, before anything is loaded."""
    return resolve_model_dir(model, log=lambda msg: print(f"rredcot: {msg}", flush=True))


def describe_credit(
    method: CreditMethod | None, args: RREDCoTGRPOConfig, hidden_source: str
) -> str:
    """One line saying what was resolved: the method (None: ``auto``, not chosen yet), the
    segmenter, the normalisation, the hand-over and where the values' inputs come from
    (``hidden_source``: :func:`rredcot.integrations.trl.forward.hidden_source`)."""
    c = args.credit_config if method is None else method.config
    cuts = c.segmenter + ("" if c.separate_answer else " (answer line merged)")
    if c.min_chars or c.max_segments:
        cuts += f", min_chars {c.min_chars}, max_segments {c.max_segments or 'none'}"
    if method is None:
        return (
            f"credit_method=auto (chosen on the first generation batch from its own "
            f"rollouts, rredcot.methods.auto), segmenter={cuts}; metrics under "
            f"{METRICS_PREFIX} (docs/metrics.md)"
        )
    norm = method.normalization
    if norm == "group_or_batch_std":
        norm += f" (agreeing_std {c.agreeing_std})"
    if json_dict(args.credit, "credit").get("normalization", "auto") == "auto":
        norm += f", from scale_rewards={args.scale_rewards!r}"
    if method.name == "uniform":
        source, handover = "none (GRPO: the group's mean reward)", "none"
    else:
        handover = c.handover.mode + (
            f" ({c.handover.score}, starts at w = 0: GRPO)"
            if c.handover.mode == "reliability"
            else " (full weight from step 1)"
        )
        if method.needs_hidden_states:
            extra = " + log-prob features" if c.value_head.logprob_features else ""
            where = {
                "trl_pass": "TRL's old-log-prob pass",
                "loss_forward": "the loss forward (one micro-batch per generation batch)",
                "own_forward": "one extra no-grad forward per generation batch",
            }[hidden_source]
            source = f"hidden states of layers {list(method.hidden_layers)}{extra} from {where}"
        elif method.name in ("answer_likelihood", "continuation_likelihood"):
            answers = method.name == "answer_likelihood"
            group = "the group's right " + ("answers" if answers else "completions")
            ref = "the reference answer" if answers else "the reference"
            read = {"group": group, "reference": ref, "both": f"{ref} and {group}"}
            what = read[getattr(c, method.name).source]
            if answers:
                source = f"the policy's probability of {what} after each prefix"
            else:
                source = f"the policy's likelihood of the continuations of {what}"
        else:
            prm = c.process_reward
            source = f"step scores of {prm.function or prm.model}"
    return (
        f"credit_method={method.name}, segmenter={cuts}, normalization={norm}, "
        f"lam={method.lam}, hand-over={handover}, features={source}; metrics under "
        f"{METRICS_PREFIX} (docs/metrics.md)"
    )
