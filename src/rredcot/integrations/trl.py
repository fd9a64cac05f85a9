"""rredcot credit inside TRL's ``GRPOTrainer`` (``pip install 'rredcot[trl]'``).

TRL keeps everything it does well: sampling (transformers or vLLM), reward functions, datasets,
the clipped loss, ``accelerate launch`` / DeepSpeed / FSDP, logging and checkpoints. This adapter
changes the advantages (and, with ``references`` on, adds their terms to the loss). TRL 1.16
computes one advantage per completion at the end of
``GRPOTrainer._generate_and_score_completions``; :class:`RREDCoTGRPOTrainer` lets that method run
unchanged, then replaces ``output["advantages"]`` with rredcot's ``(B, T)`` token advantages, which
TRL's ``_compute_loss`` takes as they are (it unsqueezes only 1-D ones).

Once per generation batch the credit runs the stages of ``rredcot train``'s step
(:mod:`rredcot.methods.base`), with the batch split across processes as TRL splits it:

1. rows: each process decodes and segments its completions (:mod:`rredcot.integrations._batch`),
   their outcome ``R`` being the weighted sum of TRL's reward functions (gathered by TRL, before
   its scaling; ``multi_objective_aggregation="sum_then_normalize"``), and the method measures its
   own rows (``method.rows``); the rows of every process are gathered (groups may span them);
2. ``method.estimate`` over every row;
3-4. ``method.credit_output``: the segment stage and the scale over every row, the token stage on
   this process's rows (``scale_rewards`` maps onto the normalisation:
   :func:`normalization_for_scale_rewards`);
5. in training, ``method.update`` over the gathered rows, after the credit.

The defaults are ``rredcot train``'s: ``credit_method="auto"`` chooses on the first generation
batch's own rollouts, by the same rule (:mod:`rredcot.methods.auto`), and every unset ``credit``
field keeps :class:`rredcot.config.CreditConfig`'s default. The choice is written beside every
checkpoint (``rredcot_credit.json``) and read back on resume, and the method's state (the value
head) as ``value_head.pt``.

The value head's hidden states and log-probs come from a forward that runs anyway where one does,
as in ``rredcot train``: TRL's no-grad old-log-prob pass when it runs one; else, where a
generation batch is one micro-batch (``steps_per_generation=1``; evaluation), its loss forward
(the trainer's single pass: the credit is formed between that forward and the loss); else (several
micro-batches, or the Liger loss) one no-grad forward of the adapter's own, as the trainer's
scoring pass under gradient accumulation (``rredcot/extra_forward`` = 1).

``references`` (issue 40's baselines, :mod:`rredcot.training.references`; needs ``task``; any processes)
trains on the task's reference solutions (``task.gold_completion`` of each row's problem) in the
groups ``references.groups`` chooses (default: no completion with outcome ``R >= 1``), on training
batches only. ``sft``: ``sft_coef`` times the references' NLL, aggregated as ``loss_type``
aggregates (:data:`LOSS_AGG_OF_LOSS_TYPE`), is added to the loss in shares over the generation
batch's micro-batches: once per optimiser step with TRL's defaults, as ``rredcot train`` adds it.
``luffy``: LUFFY's own recipe, which fits TRL's ``G`` rows per prompt: the reference takes the
place of the group's last rollout (``rredcot train`` appends it as a ``G + 1``-th row and drops
no sample), its reward is the reward functions' on it, the credit method's advantages are
computed with it, and its tokens are trained with the shaped, unclipped ``-A * f(pi)`` while TRL's
loss covers the other rows. ``bread`` is refused: its branched rollouts need a generation TRL's
step does not run.

TRL internals this adapter depends on, as of TRL 1.16.0, the one version its tests ran against
(the ``trl`` extra pins ``trl>=1.16,<1.17``). It overrides five private ``GRPOTrainer`` methods,
each calling TRL's own inside: ``_generate_and_score_completions`` (its advantages replaced, and
luffy's reference rows put in place of rollouts), ``_calculate_rewards`` (every process's rewards
per function, kept before TRL scales them), ``_get_per_token_logps_and_entropies`` (the hidden
states of TRL's pass or of the single loss forward, read by a hook on the decoder, with the
log-probs of the same forward), ``_compute_loss`` (which micro-batch the single loss forward's
credit goes to, and the references' terms added) and ``_load_optimizer_and_scheduler`` (the
credit's state read back on resume); and the public ``save_model`` (that state written beside
TRL's checkpoints). It also reads TRL's private attributes ``_metrics`` and ``_logs`` (its logs),
``_step`` and ``_tokenizer``, and the keys of the dict ``_generate_and_score_completions``
returns. All the
adapter holds between those calls is one :class:`_CreditState`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from rredcot.algebra.credit import drop_small_tails
from rredcot.algebra.loss import off_policy_pg, shaped_ratio
from rredcot.algebra.normalization import masked_mean
from rredcot.config import CreditConfig, ReferencesConfig
from rredcot.config.io import from_dict
from rredcot.errors import UserError, require_extra
from rredcot.integrations._batch import prompt_text as _prompt_text
from rredcot.integrations._batch import rollout_batch_from_tensors
from rredcot.integrations.saved import (
    CREDIT_STATE_FILE,
    SETTINGS_FILE,
    read_settings,
    settings_dict,
    write_settings,
)
from rredcot.methods.auto import (
    AUTO,
    CreditChoice,
    apply_choice,
    check_method_name,
    choose_from_rollouts,
    measured_rows,
    policy_figures,
)
from rredcot.methods.base import (
    CreditContext,
    CreditMethod,
    CreditOutput,
    CreditRows,
    RolloutBatch,
    build_credit,
)
from rredcot.models import (
    is_activation_checkpointing,
    resolve_model_dir,
    set_activation_checkpointing,
)
from rredcot.safe_fs import create_file
from rredcot.sampling.rollout import eval_mode, policy_forward, segment_batch
from rredcot.segment import segmenter_from_config
from rredcot.tasks import get_task
from rredcot.tasks.answers import extract_reference
from rredcot.tasks.base import Problem, Task, Verdict, safe_verify
from rredcot.training import references
from rredcot.training.runio import load_plain

_trl = require_extra("trl", "trl", "rredcot.integrations.trl")
GRPOConfig, GRPOTrainer = _trl.GRPOConfig, _trl.GRPOTrainer
is_conversational = _trl.data_utils.is_conversational

__all__ = [
    "CREDIT_STATE_FILE",
    "normalization_for_scale_rewards",
    "resolve_model",
    "TRL_METHODS",
    "RREDCoTGRPOConfig",
    "RREDCoTGRPOTrainer",
    "reference_answer",
    "task_reward",
]

METRICS_PREFIX = "rredcot/"  # every metric the adapter logs: rredcot/<the core's key>
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
# TRL's (B, T) completion columns of a generation batch (luffy widens them to a reference)
_COMPLETION_COLUMNS = (
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "sampling_per_token_logps",
    "importance_sampling_ratio",
    "tool_mask",
)
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


# ---------------------------------------------------------------------------------------------
# config


def _as_dict(value: dict | str | None, name: str) -> dict:
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
            "answer_likelihood, continuation_likelihood (the group's correct completions on this "
            "process, and the task's reference), process_reward (your step scores or a frozen "
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
        self.credit = _as_dict(self.credit, "credit")
        self.task_args = _as_dict(self.task_args, "task_args")
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
        self.references = _as_dict(self.references, "references")
        self._check_references()

        self._warn_scale_rewards_conflict()

    @property
    def references_config(self) -> ReferencesConfig:
        """The :class:`ReferencesConfig` built from ``references`` (unset fields: the defaults,
        ``mode="off"``)."""
        return from_dict(ReferencesConfig, _as_dict(self.references, "references"), "references.")

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
        fields = _as_dict(self.credit, "credit")
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
        mode = _as_dict(self.credit, "credit").get("normalization", "auto")
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


# ---------------------------------------------------------------------------------------------
# models by the names rredcot train takes


def resolve_model(model: str | os.PathLike) -> str:
    """What ``GRPOTrainer`` should load for ``model``, as ``rredcot train`` and ``load_policy``
    read it: a shipped alias (``smollm2-135m-instruct``) or a ``.gguf`` file (or a directory
    holding one) becomes its dequantised float32 copy under ``~/.cache/rredcot/gguf/`` (built on
    first use, once); a directory or hub id is returned unchanged. A shipped alias that
    is not installed fails here, with the install command, before anything is loaded."""
    return resolve_model_dir(model, log=lambda msg: print(f"rredcot: {msg}", flush=True))


# ---------------------------------------------------------------------------------------------
# reward functions from rredcot tasks


def _completion_text(completion: Any) -> str:
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def reference_answer(task: Task | None, answer: Any) -> str:
    """The reference answer in a dataset row's ``answer`` cell, as the task's verifier and the
    answer-likelihood probes need it: GSM8K's native column (the reasoning, then ``#### 72``)
    gives ``72``, a ``\\boxed{}`` solution its box (the task's ``answer_format``); a cell that holds
    the bare answer is returned as it is."""
    text = str(answer)
    fmt = getattr(getattr(task, "params", None), "answer_format", None)
    if not fmt:
        return text
    return extract_reference(text, fmt) or text


def task_reward(task: str | Task, answer_column: str = "answer", **task_args: Any):
    """A TRL reward function that scores completions with an rredcot task's verifier.

    The dataset needs a ``prompt`` column and an ``answer_column`` with each reference answer:
    the bare answer, or the task's native solution (GSM8K's ``answer`` column as it comes, ending
    in ``#### 72``: :func:`reference_answer`). Verifier errors score 0 (``safe_verify``).
    """
    the_task = get_task(task, **task_args) if isinstance(task, str) else task

    def reward(prompts, completions, **kwargs) -> list[float]:
        if answer_column not in kwargs:
            raise ValueError(
                f"the dataset has no {answer_column!r} column with the reference answers "
                f"(columns seen: {sorted(k for k in kwargs if not k.startswith('trainer'))})"
            )
        answers = kwargs[answer_column]
        return [
            float(
                safe_verify(
                    the_task,
                    Problem(_prompt_text(p), reference_answer(the_task, a)),
                    _completion_text(c),
                ).reward
            )
            for p, c, a in zip(prompts, completions, answers)
        ]

    reward.__name__ = f"rredcot_{the_task.name}"
    return reward


# ---------------------------------------------------------------------------------------------
# hidden states from a forward pass TRL runs anyway


def _decoder(model) -> torch.nn.Module:
    """The transformer backbone whose output TRL's fused LM head reads."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(inner, "module", inner)  # DDP / DeepSpeed engine
    if hasattr(inner, "get_decoder"):
        return inner.get_decoder()
    return inner.base_model


@contextlib.contextmanager
def _capture_hidden_states(model, layers: tuple[int, ...], store: list[Tensor]):
    """While active, every forward of ``model``'s decoder also returns its hidden states, and
    the chosen layers (concatenated on the last dim, detached) are appended to ``store``."""
    decoder = _decoder(model)

    def pre(module, args, kwargs):
        kwargs["output_hidden_states"] = True
        return args, kwargs

    def post(module, args, kwargs, output):
        states = output.hidden_states
        store.append(torch.cat([states[i] for i in layers], dim=-1).detach())

    handles = [
        decoder.register_forward_pre_hook(pre, with_kwargs=True),
        decoder.register_forward_hook(post, with_kwargs=True),
    ]
    try:
        yield store
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _no_checkpointing(model, kwargs):
    """Activation checkpointing off for a no-grad forward (as TRL's
    ``disable_gradient_checkpointing``, through transformers' current method names: TRL's
    calls the deprecated ``is_gradient_checkpointing`` on every step), then back on."""
    was_on = is_activation_checkpointing(model)
    if was_on:
        set_activation_checkpointing(model, False)
    try:
        yield
    finally:
        if was_on:
            set_activation_checkpointing(model, True, kwargs)


class _Collective:
    """The cross-process operations of the credit (accelerate's; the identity on one process)."""

    def __init__(self, accelerator) -> None:
        self.accelerator = accelerator

    @property
    def world(self) -> int:
        return int(self.accelerator.num_processes)

    @property
    def rank(self) -> int:
        return int(self.accelerator.process_index)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def gather(self, t: Tensor) -> Tensor:
        """Concatenate every process's ``t`` along dim 0 (same shapes)."""
        return t if self.world == 1 else self.accelerator.gather(t.contiguous())

    def gather_padded(self, t: Tensor, dim: int = 1, pad_index: int = 0) -> Tensor:
        """Like :meth:`gather` after padding ``dim`` (with ``pad_index``) to the largest size of
        any process."""
        if self.world == 1:
            return t
        acc = self.accelerator
        return acc.gather(acc.pad_across_processes(t.contiguous(), dim=dim, pad_index=pad_index))

    def max_int(self, x: int) -> int:
        if self.world == 1:
            return int(x)
        return int(self.gather(torch.tensor([int(x)], device=self.accelerator.device)).max())

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each metric averaged over the processes (NaNs skipped); keys must agree."""
        keys = sorted(k for k, v in metrics.items() if isinstance(v, (int, float)))
        if self.world == 1 or not keys:
            return {k: float(metrics[k]) for k in keys}
        local = torch.tensor(
            [float(metrics[k]) for k in keys], device=self.accelerator.device, dtype=torch.float64
        )
        every = self.gather(local.unsqueeze(0))
        return dict(zip(keys, torch.nanmean(every, dim=0).tolist()))


@dataclass
class _GlobalRows:
    """The rows of one generation batch on all processes (TRL's order: process 0's first).

    TRL gathers the rewards of every process before it normalises them, so groups may span
    processes; rredcot's group statistics use these global rows too."""

    rewards: Tensor  # (N,) outcome R (unscorable rows: their group's mean)
    group_ids: Tensor  # (N,) long
    counts: Tensor  # (N,) segments per row (0: unscorable or empty)
    start: int  # the local rows are [start, start + size)
    size: int

    @property
    def local(self) -> slice:
        return slice(self.start, self.start + self.size)

    @property
    def width(self) -> int:
        """``S + 1``: the most boundaries of any row."""
        return (int(self.counts.max()) if self.counts.numel() else 0) + 1

    def gather(self, local: CreditRows, collective: _Collective) -> CreditRows:
        """The credit rows of every process (:class:`~rredcot.methods.base.CreditRows`): this
        process's ``local`` rows' measurements gathered (padded to the widest row), the rewards
        and groups of every row. The group's shared prefixes are not gathered (their ids are
        local)."""
        width = self.width
        device = self.rewards.device

        def every(t: Tensor | None, columns: int) -> Tensor | None:
            if t is None:
                return None
            t = collective.gather_padded(t.to(collective.device).contiguous(), dim=1)
            return _fit_columns(t, columns).to(device)

        mask = (torch.arange(width).unsqueeze(0) <= self.counts.unsqueeze(1)).to(device)
        values = every(None if local.values is None else local.values.float(), width)
        if values is not None:  # the method's own mask of its values
            mask = every(local.value_mask.float(), width) > 0
        return CreditRows(
            rewards=self.rewards.to(device),
            group_ids=self.group_ids.to(device),
            num_segments=self.counts.to(device),
            live=(self.counts > 0).to(device),
            value_mask=mask,
            segment_lengths=every(local.segment_lengths, width - 1),
            features=every(local.features, width),
            values=values,
            weights=every(local.weights, width - 1),
            cost=local.cost,
            metrics=local.metrics,
        )


@dataclass
class _Waiting:
    """A generation batch whose credit waits for its one loss forward (the hidden states)."""

    batch: RolloutBatch  # this process's rows, no hidden states yet
    rows: _GlobalRows
    loss_mask: Tensor  # (B, T)
    mode: str
    inputs: dict | None = None  # the micro-batch TRL is forming the loss of (set in _compute_loss)


@dataclass
class _ReferenceTerm:
    """``references.mode`` sft: a training generation batch's reference rows, whose NLL its
    micro-batches add to their losses in shares (:meth:`RREDCoTGRPOTrainer._reference_sft_loss`)."""

    rows: references.ReferenceRows  # this process's
    parts: int  # steps_per_generation: the micro-batches of the batch, one share each
    total_rows: int = 0  # the reference rows of every process (the NLL's normalisers)
    total_tokens: float = 0.0
    nll: float = 0.0  # the shares' NLL summed so far (logged once the last share is in)
    done: int = 0  # shares added so far (num_iterations passes each add every share)


@dataclass
class _CreditState:
    """What the adapter holds between TRL's calls: the generation batch in hand (a new one each
    batch; an evaluation batch keeps the training batch's reference term)."""

    rewards_per_func: Tensor | None = None  # (N all processes, funcs), before TRL scales them
    read_pass: bool = False  # read the hidden states of TRL's coming old-log-prob pass
    hidden: Tensor | None = None  # (B, P+T, D) what that pass gave
    waiting: _Waiting | None = None  # the credit waiting for the batch's loss forward
    references: _ReferenceTerm | None = None  # the training batch's sft term (references.mode)
    loss_logps: list[Tensor] | None = None  # luffy: the loss forward's log-probs, kept here


def _outcome_rewards(
    rewards_per_func: Tensor, reward_weights: Tensor, num_generations: int
) -> tuple[Tensor, Tensor]:
    """``(R (N,), unscorable (N,) bool)`` of every process's rows: the weighted sum of the reward
    functions (TRL's ``sum_then_normalize`` before scaling). Unscorable rows (every function
    returned None) get their group's mean, so they move no group statistic."""
    weights = reward_weights.to(rewards_per_func.device).unsqueeze(0)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards[unscorable] = torch.nan
    groups = rewards.float().view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1, keepdim=True).nan_to_num(0.0)
    filled = torch.where(torch.isnan(groups), mean.expand_as(groups), groups)
    return filled.view(-1), unscorable


def _fit_columns(t: Tensor, width: int) -> Tensor:
    """``t`` with dim 1 zero-padded (or cut) to ``width``."""
    if t.shape[1] >= width:
        return t[:, :width]
    pad = t.new_zeros((t.shape[0], width - t.shape[1], *t.shape[2:]))
    return torch.cat([t, pad], dim=1)


def _counting_forwards(model) -> tuple[list[int], Any]:
    """A forward-pre-hook on ``model`` that counts its calls: ``(counter, handle)``."""
    counter = [0]

    def pre(module, args):
        counter[0] += 1

    return counter, model.register_forward_pre_hook(pre)


# ---------------------------------------------------------------------------------------------
# the trainer


class RREDCoTGRPOTrainer(GRPOTrainer):
    """``GRPOTrainer`` whose advantages come from an rredcot credit method (module docstring).

    Same constructor as ``GRPOTrainer``; ``args`` must be a :class:`RREDCoTGRPOConfig`. The
    credit method is ``trainer.credit_method`` (its value head, if any, at
    ``trainer.credit_method.head``); with ``credit_method="auto"`` it is None until the first
    generation batch chose it (``trainer.credit_choice`` says what and why).
    """

    def __init__(self, model, reward_funcs=None, args: RREDCoTGRPOConfig | None = None, **kwargs):
        if args is None:
            name = model if isinstance(model, (str, os.PathLike)) else model.config._name_or_path
            args = RREDCoTGRPOConfig(f"{str(name).split('/')[-1] or 'model'}-RREDCoT-GRPO")
        if not isinstance(args, RREDCoTGRPOConfig):
            raise TypeError(
                f"args must be an RREDCoTGRPOConfig (a GRPOConfig with the credit settings), got "
                f"{type(args).__name__}; build it with RREDCoTGRPOConfig(**your_grpo_kwargs, "
                "credit_method=..., credit={...})"
            )
        if isinstance(model, (str, os.PathLike)):
            model = resolve_model(model)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        self.task: Task | None = get_task(args.task, **args.task_args) if args.task else None
        self.segmenter = segmenter_from_config(
            args.credit_config, getattr(self.task, "answer_line_pattern", None)
        )
        self.collective = _Collective(self.accelerator)
        self.credit_method: CreditMethod | None = None
        self.credit_choice: CreditChoice | None = None  # what auto chose, and why
        self.last_batch: RolloutBatch | None = None  # the last generation batch, for inspection
        self.last_credit: CreditOutput | None = None  # its credit (this process's rows)
        self._state = _CreditState()
        self.reference_tokens_trained = 0  # references.mode: reference tokens trained on (run)
        self._check_reference_data()
        if args.credit_method == AUTO:
            measured_rows()  # the rows auto reads: a bad file is refused before training
            self._announce(self.describe_credit())
        else:
            self._use_method(args.credit_method, args.credit_config)

    def _check_reference_data(self) -> None:
        """With ``references`` on: a training set whose first rows give the task a reference
        solution each; refused before training starts."""
        mode = self.args.references_config.mode
        if mode == "off":
            return
        data, column = self.train_dataset, self.args.answer_column
        if data is None:
            return
        columns = getattr(data, "column_names", None)
        if columns is not None and column not in columns:
            raise ValueError(
                f"references.mode={mode!r} reads each row's reference solution from the task and "
                f"the {column!r} column, which the training set lacks (columns: {columns}); set "
                "answer_column to the column with the answers or solutions"
            )
        rows = list(itertools.islice(iter(data), 4))
        references.check_task_references(
            self.task, [self._problem(r) for r in rows], self.args.task
        )

    # -- the credit method --------------------------------------------------------------------
    def _use_method(self, name: str, config: CreditConfig) -> None:
        """Build the credit method ``name`` (at start, or once ``auto`` chose it)."""
        method = build_credit(
            name,
            config,
            CreditContext(
                policy=self.model,
                tokenizer=self._tokenizer,
                task=self.task,
                segmenter=self.segmenter,
                device=self.accelerator.device,
            ),
        )
        self.credit_method = method
        self._announce(self.describe_credit())

    def _choose_credit(self, rows: _GlobalRows, batch: RolloutBatch) -> CreditChoice:
        """``auto``'s choice from the first generation batch's own rollouts, by rredcot train's
        rule (:mod:`rredcot.methods.auto`): every process's rewards by group, and whether the
        task has a reference solution for every prompt of every process."""
        task = self.task
        mine = task is not None and all(task.gold_completion(p) is not None for p in batch.problems)
        has_references = self.collective.max_int(int(not mine)) == 0
        model = policy_figures(self.model, self.processing_class)
        return choose_from_rollouts(
            rows.rewards.cpu(), rows.group_ids.cpu(), has_references, model=model
        )

    def _use_choice(self, choice: CreditChoice, config: CreditConfig | None = None) -> None:
        """Use what ``auto`` chose: its method, with its settings over the run's credit config
        (``config``: a resumed run's saved one, the settings in it already)."""
        if choice.method not in TRL_METHODS:
            raise ValueError(
                f"credit_method='auto' chose {choice.method!r}, which TRL does not support; name "
                f"one of {', '.join(TRL_METHODS)}"
            )
        if config is None:
            chosen = SimpleNamespace(
                credit_method=AUTO, credit=self.args.credit_config_for(choice.method)
            )
            apply_choice(chosen, choice)
            config = chosen.credit
        self.credit_choice = choice
        self._announce(f"credit auto: {choice.method}, because {choice.reason}")
        self._use_method(choice.method, config)

    def _announce(self, line: str) -> None:
        if self.accelerator.is_main_process:
            print(f"rredcot: {line}", flush=True)

    def describe_credit(self) -> str:
        """One line saying what was resolved: the method, the segmenter, the normalisation, the
        hand-over and where the values' inputs come from (printed when the method is built)."""
        method, args = self.credit_method, self.args
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
        if _as_dict(args.credit, "credit").get("normalization", "auto") == "auto":
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
                }[self._hidden_source("train")]
                source = f"hidden states of layers {list(method.hidden_layers)}{extra} from {where}"
            elif method.name == "answer_likelihood":
                source = "the policy's probability of the reference answer after each prefix"
            elif method.name == "continuation_likelihood":
                source = "the policy's likelihood of the group's correct continuations"
            else:
                prm = c.process_reward
                source = f"step scores of {prm.function or prm.model}"
        return (
            f"credit_method={method.name}, segmenter={cuts}, normalization={norm}, "
            f"lam={method.lam}, hand-over={handover}, features={source}; metrics under "
            f"{METRICS_PREFIX} (docs/metrics.md)"
        )

    # -- where the hidden states come from -----------------------------------------------------
    def _trl_runs_old_logprob_pass(self) -> bool:
        """Whether TRL 1.16's ``_generate_and_score_completions`` runs its no-grad old-log-prob
        forward on ``self.model`` (the same condition it uses)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _hidden_source(self, mode: str) -> str:
        """Where the hidden states come from, as rredcot train's step reads them: ``trl_pass``
        (TRL's own scoring pass), ``loss_forward`` (a generation batch that is one micro-batch:
        its loss forward, the trainer's single pass) or ``own_forward`` (a no-grad forward of
        the adapter's own: the trainer's scoring pass under gradient accumulation)."""
        if self._trl_runs_old_logprob_pass():
            return "trl_pass"
        one_micro_batch = mode == "eval" or self.args.steps_per_generation == 1
        return (
            "loss_forward" if one_micro_batch and not self.args.use_liger_kernel else "own_forward"
        )

    # -- TRL's internals, overridden ------------------------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        self._state.rewards_per_func = rewards_per_func  # (N all processes, funcs), unscaled
        return rewards_per_func

    def _generate_and_score_completions(self, inputs):
        if self._state.waiting is not None:
            raise RuntimeError(
                "rredcot: a new generation batch started before the last one went through its "
                "loss forward (TRL internals changed?)"
            )
        mode = "train" if self.model.training else "eval"
        method = self.credit_method
        reads = method is not None and method.needs_hidden_states
        self._state = _CreditState(
            read_pass=reads and self._hidden_source(mode) == "trl_pass",
            references=self._state.references if mode == "eval" else None,
        )
        output = super()._generate_and_score_completions(inputs)
        return self._apply_credit(inputs, output)

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        result = self._logps_reading_hidden_states(model, *args, **kwargs)
        if self._state.loss_logps is not None:  # luffy's loss reads the forward's log-probs
            self._state.loss_logps.append(result[0])
        return result

    def _logps_reading_hidden_states(self, model, *args, **kwargs):
        state = self._state
        trl_pass = state.read_pass and model is self.model  # its first pass; a PEFT ref's follows
        loss_forward = state.waiting is not None and state.waiting.inputs is not None
        if not (trl_pass or loss_forward):
            return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        state.read_pass = False
        store: list[Tensor] = []
        with _capture_hidden_states(model, self.credit_method.hidden_layers, store):
            result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        if trl_pass:
            state.hidden = torch.cat(store, dim=0)
        else:
            self._credit_in_loss_forward(torch.cat(store, dim=0), result[0].detach())
        return result

    def _compute_loss(self, model, inputs):
        waiting = self._state.waiting
        if waiting is not None and "rredcot_row" in inputs:
            waiting.inputs = inputs  # its forward gives the credit (_credit_in_loss_forward)
        if "rredcot_reference" in inputs:
            return self._luffy_loss(model, inputs)
        loss = super()._compute_loss(model, inputs)
        term = self._state.references
        if term is not None and self.model.training:
            loss = loss + self._reference_sft_loss(model, term)
        return loss

    # -- the reference solutions (references.mode) ----------------------------------------------
    def _with_references(self, inputs: list[dict], output: dict) -> None:
        """``references.mode`` on a training generation batch: the references of the groups
        ``references.groups`` chooses (default: those with no sample of outcome ``R >= 1``), after
        the group's prompt (:func:`rredcot.training.references.reference_rows`, as rredcot train builds
        them); sft keeps them for the loss (:meth:`_reference_sft_loss`), luffy puts each in place
        of its group's last rollout (:meth:`_replace_rollouts`). Groups may span processes: the
        choice is made on every process's rewards, and a group's reference is built by the
        process holding its first row (sft) or its last (luffy). Their tokens are counted once per
        generation batch over every process (``rredcot/references/tokens``; the run's
        ``rredcot/reference_tokens_trained``), as rredcot train counts them (docs/metrics.md)."""
        cfg = self.args.references_config
        if cfg.mode == "off":
            return
        G = self.num_generations
        rewards, _ = _outcome_rewards(self._state.rewards_per_func, self.reward_weights, G)
        group_ids = torch.arange(rewards.shape[0]) // G
        B = output["prompt_ids"].shape[0]
        start = self.collective.rank * B
        anchor = G - 1 if cfg.mode == "luffy" else 0  # the row of its group that holds it
        mine = [
            g
            for g in references.chosen_groups(rewards.cpu(), group_ids, cfg.groups)
            if start <= g * G + anchor < start + B
        ]
        refs = references.reference_rows(
            output["prompt_ids"],
            output["prompt_mask"],
            group_ids[start : start + B],
            [self._problem(x) for x in inputs],
            mine,
            self.task,
            self._tokenizer,
        )
        counts = torch.tensor([[refs.size, refs.tokens]], device=self.collective.device)
        total_rows, total_tokens = (int(x) for x in self.collective.gather(counts).sum(dim=0))
        if cfg.mode == "sft":
            term = _ReferenceTerm(refs, self.args.steps_per_generation, total_rows, total_tokens)
            self._state.references = term
        else:
            self._replace_rollouts(inputs, output, refs, start, total_rows)
        self.reference_tokens_trained += total_tokens
        failed = len(references.chosen_groups(rewards.cpu(), group_ids, "failed"))
        stats = dataclasses.replace(refs, failed_groups=failed).stats(
            float(self.reference_tokens_trained)
        )
        stats.update({"references/groups": total_rows, "references/tokens": total_tokens})
        self._log_credit(stats, "train")

    def _replace_rollouts(
        self, inputs: list[dict], output: dict, refs, start: int, total_rows: int
    ) -> None:
        """references.mode luffy: each reference ``refs`` (of the groups whose last row this
        process holds, rows ``start ..`` of the generation batch being its own) in place of its
        group's last rollout, in ``output`` before the credit reads it (LUFFY's recipe: G rows,
        one off-policy). The row's rewards are the reward functions' on the reference (into the
        outcome ``R`` the credit reads, on every process: :meth:`_reference_rewards`); its old
        (and sampling) log-probs are 0 (``pi_phi = 1``); the completion columns are widened
        where the reference is longer; ``num_items_in_batch`` is recounted over every process;
        ``rredcot_reference`` marks the rows for the loss (:meth:`_luffy_loss`). TRL's own logs
        of the batch (rewards, completions) were written before, from the sampled rollouts.
        ``total_rows``: the references of every process (none: nothing changes)."""
        B = output["completion_ids"].shape[0]
        reference = torch.zeros(B, dtype=torch.bool, device=output["completion_ids"].device)
        output["rredcot_reference"] = reference
        if total_rows == 0:
            return
        rows = ((refs.group_ids + 1) * self.num_generations - 1 - start).tolist()
        if refs.size:
            self._put_references(output, refs, rows)
            reference[rows] = True
        mask = output["completion_mask"]
        loss_mask = mask if "tool_mask" not in output else mask * output["tool_mask"]
        count = self.collective.gather(loss_mask.sum().reshape(1)).sum()
        output["num_items_in_batch"] = count.to(output["num_items_in_batch"].dtype)
        self._state.hidden = None  # TRL's pass saw the sampled rows: the credit forwards anew
        self._reference_rewards(inputs, output, refs, rows, start)

    def _put_references(self, output: dict, refs, rows: list[int]) -> None:
        """The reference rows ``refs`` written into ``output``'s local rows ``rows``: completion
        ids and mask, old and sampling log-probs 0, importance ratio and tool mask 1; the
        completion columns widened to the longest reference."""
        B, T = output["completion_ids"].shape
        width = max(T, refs.response_mask.shape[1])
        pad = self._tokenizer.pad_token_id if self._tokenizer.pad_token_id is not None else 0
        fills = {"completion_ids": pad, "importance_sampling_ratio": 1.0, "tool_mask": 1}
        for key in _COMPLETION_COLUMNS:  # widened to the longest reference
            value = output.get(key)
            if isinstance(value, Tensor) and value.dim() == 2 and value.shape[1] == T:
                output[key] = _fit_columns(value, width)
                output[key][:, T:] = fills.get(key, 0)
        P = refs.prompt_len
        Tr = refs.response_mask.shape[1]
        ids, mask = output["completion_ids"], output["completion_mask"]
        ids[rows] = pad
        ids[rows, :Tr] = refs.input_ids[:, P:].to(ids.dtype)
        mask[rows] = 0
        mask[rows, :Tr] = refs.response_mask.to(mask.dtype)
        for key, value in (
            ("old_per_token_logps", 0.0),
            ("sampling_per_token_logps", 0.0),
            ("importance_sampling_ratio", 1.0),
            ("tool_mask", 1),
        ):
            if isinstance(output.get(key), Tensor) and output[key].shape[0] == B:
                output[key][rows] = value

    def _reference_rewards(self, inputs: list[dict], output: dict, refs, rows, start) -> None:
        """The reward functions on the references, written into every process's
        ``rewards_per_func`` at their rows: TRL's ``_calculate_rewards`` gathers its result, so
        every process scores as many rows as the busiest one (repeats of one of its own, whose
        scores are dropped) and the gathered rows' places are gathered with them."""
        most = self.collective.max_int(refs.size)
        P = refs.prompt_len
        chat = is_conversational(inputs[0])
        texts = list(refs.completions)
        ids = [
            refs.input_ids[i, P:][refs.response_mask[i].bool()].tolist() for i in range(len(rows))
        ]
        picked = [inputs[r] for r in rows]
        if not picked:  # a stand-in: this process's first rollout (its score is dropped)
            first = output["completion_ids"][0][output["completion_mask"][0].bool()].tolist()
            picked, ids = [inputs[0]], [first]
            texts = [self._tokenizer.decode(first, skip_special_tokens=True)]
        extra = most - len(picked)
        picked, texts, ids = (
            picked + picked[:1] * extra,
            texts + texts[:1] * extra,
            ids + ids[:1] * extra,
        )
        completions = [[{"role": "assistant", "content": t}] if chat else t for t in texts]
        rewards = GRPOTrainer._calculate_rewards(
            self, picked, [x["prompt"] for x in picked], completions, ids
        )
        index = torch.full((most,), -1, dtype=torch.long, device=self.collective.device)
        index[: refs.size] = torch.tensor(rows, dtype=torch.long, device=index.device) + start
        every = self.collective.gather(index).to(rewards.device)
        state = self._state.rewards_per_func
        state[every[every >= 0].to(state.device)] = rewards[every >= 0].to(state.dtype)

    def _luffy_loss(self, model, inputs: dict) -> Tensor:
        """references.mode luffy: TRL's loss of the micro-batch with its reference rows left out
        (their tokens masked as TRL masks tool output), plus LUFFY's term on them: per token
        ``-A * f(pi_theta)``, ``f(x) = x / (x + gamma)`` (:func:`rredcot.algebra.loss.off_policy_pg`,
        unclipped, ``pi`` from the same loss forward), normalised as ``loss_type`` normalises the
        micro-batch (per-row means over the micro-batch's rows for grpo/sapo, rows x
        ``max_completion_length`` for dr_grpo, the generation batch's tokens for dapo/cispo/vespo)
        and scaled for gradient accumulation as TRL scales its own."""
        ref = inputs["rredcot_reference"]
        mask = inputs["completion_mask"].float()
        if "tool_mask" in inputs:
            mask = mask * inputs["tool_mask"]
        trl_inputs = dict(inputs)
        trl_inputs["tool_mask"] = mask * (~ref).unsqueeze(1).to(mask.dtype)
        waiting = self._state.waiting
        if waiting is not None and waiting.inputs is inputs:
            waiting.inputs = trl_inputs  # the loss forward writes the credit where TRL reads it
        self._state.loss_logps = []
        try:
            loss = super()._compute_loss(model, trl_inputs)
            logps = self._state.loss_logps[0]
        finally:
            self._state.loss_logps = None
        advantages = inputs["advantages"] = trl_inputs["advantages"]  # the loss forward's credit
        if advantages.dim() == 1:
            advantages = advantages.unsqueeze(1)
        gamma = self.args.references_config.shaping_gamma
        per_token = off_policy_pg(logps, advantages, gamma) * mask
        per_token = per_token[ref]
        train = self.model.training
        accumulation = self.current_gradient_accumulation_steps if train else 1.0
        B = mask.shape[0]
        if self.loss_type in ("grpo", "sapo"):
            term = (per_token.sum(-1) / mask[ref].sum(-1).clamp(min=1.0)).sum() / B
        elif self.loss_type == "dr_grpo":
            term = per_token.sum() / (B * self.max_completion_length)
        else:  # dapo, cispo, vespo: the generation batch's tokens, as TRL's normaliser
            normalizer = (
                inputs["num_items_in_batch"].clamp(min=1.0) / self.accelerator.num_processes
            )
            if train:
                normalizer = normalizer * accumulation / self.args.steps_per_generation
            term, accumulation = per_token.sum() / normalizer, 1.0
        with torch.no_grad():  # the reference tokens' mean shaped ratio, over every process
            weights = mask * ref.unsqueeze(1).to(mask.dtype)
            sums = torch.stack([(shaped_ratio(logps, gamma) * weights).sum(), weights.sum()])
            sums = self.collective.gather(sums.double().unsqueeze(0)).sum(dim=0)
        if float(sums[1]) > 0:
            self._log_credit(
                {"references/shaped_ratio": float(sums[0] / sums[1])}, "train" if train else "eval"
            )
        return loss + term / accumulation

    def _reference_sft_loss(self, model, term: _ReferenceTerm) -> Tensor:
        """This micro-batch's share of ``sft_coef`` times the references' NLL
        (:func:`rredcot.training.references.reference_nll`, aggregated over every reference row of the
        generation batch, on every process, as ``loss_type`` aggregates:
        :data:`LOSS_AGG_OF_LOSS_TYPE`). The rows are split over the batch's
        ``steps_per_generation`` micro-batches, so the shares sum to the whole term; scaled by
        ``steps_per_generation / gradient_accumulation_steps`` as TRL scales its own loss, an
        optimiser step gets ``sft_coef * NLL`` once (TRL's defaults: one generation batch per
        optimiser step, as rredcot train adds it once per optimiser step). Under several
        processes each loss is scaled by their number (their gradients are averaged), and a
        process whose share is empty while another process has references runs a stand-in
        forward of zero weight, so that all run the same forwards."""
        rows, S = term.rows, term.parts
        share = torch.tensor_split(torch.arange(rows.size), S)[self._step % S]
        nll = torch.zeros((), device=rows.input_ids.device)
        world = self.collective.world
        if len(share):
            logps, _, _ = super()._get_per_token_logps_and_entropies(
                model,
                rows.input_ids[share],
                rows.attention_mask[share],
                rows.response_mask.shape[1],
            )
            nll = references.reference_nll(
                logps,
                rows.response_mask[share],
                LOSS_AGG_OF_LOSS_TYPE[self.loss_type],
                self.max_completion_length,
                num_rows=term.total_rows,
                num_tokens=term.total_tokens,
            )
        elif world > 1 and term.total_rows:  # another process has references here
            ids = torch.zeros(1, 2, dtype=torch.long, device=self.collective.device)
            logps, _, _ = super()._get_per_token_logps_and_entropies(
                model, ids, torch.ones_like(ids), 1
            )
            nll = 0.0 * logps.sum()
        term.nll, term.done = term.nll + float(nll.detach()), term.done + 1
        if term.done % S == 0:  # the last share of a pass over the batch
            nll_sum = self.collective.gather(
                torch.tensor([term.nll], device=self.collective.device)
            )
            self._log_credit({"references/sft_nll": float(nll_sum.sum())}, "train")
            term.nll = 0.0
        scale = S / self.current_gradient_accumulation_steps * world
        return self.args.references_config.sft_coef * scale * nll

    # -- the credit of a generation batch -------------------------------------------------------
    def _apply_credit(self, inputs: list[dict], output: dict) -> dict:
        """TRL's per-completion advantages replaced by rredcot's ``(B, T)`` token advantages:
        now, or in the batch's loss forward where the hidden states come from it."""
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            self._with_references(inputs, output)
        batch, rows, loss_mask = self._rollout_batch(inputs, output, mode)
        if self.credit_method is None:
            self._use_choice(self._choose_credit(rows, batch))
        self.last_batch = batch
        if self.credit_method.needs_hidden_states:
            hidden, logps = self._state.hidden, output.get("old_per_token_logps")
            own = hidden is None or logps is None or hidden.shape[:2] != batch.input_ids.shape
            if own and self._hidden_source(mode) == "loss_forward":
                return self._wait_for_loss_forward(output, batch, rows, loss_mask, mode)
            if own:
                hidden, logps = self._extra_forward(output, mode)
            self._metrics[mode]["rredcot/extra_forward"].append(float(own))
            batch = batch.replace(hidden_states=hidden, old_logprobs=logps.detach())
        output["advantages"] = self._credit(batch, rows, loss_mask, mode)
        return output

    def _credit(self, batch: RolloutBatch, rows: _GlobalRows, loss_mask: Tensor, mode: str):
        """``(B, T)`` advantages of this process's rows, once per generation batch, by the stages
        of rredcot train's step: the method's rows (gathered from every process, so group
        statistics see whole groups), the estimate over them, the segment and token stages
        (:meth:`~rredcot.methods.base.CreditMethod.credit_output` on this process's rows), then,
        in training, the method's update (after the credit: it never sees the step's outcomes;
        every process holds the same head and guard)."""
        method = self.credit_method
        method.context.policy = self.model  # the prepared (possibly wrapped) model
        every = rows.gather(self._local_rows(batch), self.collective)
        estimate = method.estimate(every)
        if method.normalization == "whiten" and self.collective.world > 1:
            out = self._whitened_credit(every, estimate, batch, rows)
        else:
            out = method.credit_output(
                every, estimate, batch.segment_ids, batch.response_mask, local=rows.local
            )
        advantages = out.advantages.to(torch.float32) * loss_mask.to(torch.float32)
        advantages = drop_small_tails(advantages, loss_mask, self.args.advantage_tail_floor)
        self.last_batch, self.last_credit = batch, out
        self._log_credit(self.collective.mean_metrics(out.metrics), mode)
        self._log_row_advantages(advantages, loss_mask)
        if mode == "train":
            self._log_credit(method.update(every, estimate), mode)
        return advantages

    def _whitened_credit(self, every: CreditRows, estimate, batch: RolloutBatch, rows):
        """``credit.normalization='whiten'`` under several processes: whitening is over every
        token of the generation batch, so the token stage runs on every process's rows (their
        segment ids and masks gathered, a few integers a token) and each process keeps its
        own rows' credit."""
        device = self.collective.device
        segment_ids = self.collective.gather_padded(batch.segment_ids.to(device), pad_index=-1)
        mask = self.collective.gather_padded(batch.response_mask.to(device))
        out = self.credit_method.credit_output(
            every, estimate, segment_ids.to(every.rewards.device), mask.to(every.rewards.device)
        )
        T, local = batch.response_mask.shape[1], rows.local
        return dataclasses.replace(
            out,
            advantages=out.advantages[local, :T],
            segment_advantages=out.segment_advantages[local],
            segment_mask=out.segment_mask[local],
            values=None if out.values is None else out.values[local],
            value_mask=None if out.value_mask is None else out.value_mask[local],
        )

    def _wait_for_loss_forward(self, output: dict, batch, rows, loss_mask: Tensor, mode: str):
        """Leave zero advantages and number the rows (TRL shuffles them); the batch's one loss
        forward gives the credit (:meth:`_credit_in_loss_forward`)."""
        B, T = output["completion_ids"].shape
        device = output["completion_ids"].device
        output["advantages"] = torch.zeros(B, T, device=device)
        output["rredcot_row"] = torch.arange(B, device=device)
        self._state.waiting = _Waiting(batch, rows, loss_mask, mode)
        self._metrics[mode]["rredcot/extra_forward"].append(0.0)
        return output

    def _credit_in_loss_forward(self, hidden: Tensor, logps: Tensor) -> None:
        """The waiting batch's credit from the detached hidden states and log-probs of its loss
        forward (TRL's shuffled row order), written into the micro-batch before the loss."""
        waiting, self._state.waiting = self._state.waiting, None
        inputs, batch = waiting.inputs, waiting.batch
        order = inputs["rredcot_row"]
        if hidden.shape[:2] != batch.input_ids.shape or len(order) != batch.size:
            raise RuntimeError(
                f"rredcot: the loss forward's hidden states are {tuple(hidden.shape[:2])}, the "
                f"generation batch is {tuple(batch.input_ids.shape)} (TRL internals changed?)"
            )
        in_order = torch.empty_like(hidden), torch.empty_like(logps)
        in_order[0][order], in_order[1][order] = hidden, logps
        batch = batch.replace(hidden_states=in_order[0], old_logprobs=in_order[1])
        advantages = self._credit(batch, waiting.rows, waiting.loss_mask, waiting.mode)
        inputs["advantages"] = advantages[order.to(advantages.device)]

    def _rollout_batch(self, inputs: list[dict], output: dict, mode: str):
        """``(batch, rows, loss_mask)``: this process's completions as a segmented
        :class:`RolloutBatch`, the rows of every process (:class:`_GlobalRows`) and the
        ``(B, T)`` mask of TRL's loss."""
        G = self.num_generations if mode == "train" else self.num_generations_eval
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        B = completion_ids.shape[0]
        start = self.collective.rank * B
        if self._state.rewards_per_func is None:
            raise RuntimeError(
                "rewards were not computed before the credit (TRL internals changed?)"
            )
        all_rewards, all_unscorable = _outcome_rewards(
            self._state.rewards_per_func, self.reward_weights, G
        )
        rewards = all_rewards[start : start + B].to(completion_ids.device)
        unscorable = all_unscorable[start : start + B].to(completion_ids.device)
        # Segments cover every completion token (a prefix mask); unscorable rows get none. The
        # advantages are then masked like TRL's loss (tool-output tokens excluded).
        live_mask = completion_mask * (~unscorable).to(completion_mask.dtype).unsqueeze(1)
        loss_mask = live_mask * output["tool_mask"] if "tool_mask" in output else live_mask
        batch = rollout_batch_from_tensors(
            prompt_ids=output["prompt_ids"],
            prompt_mask=output["prompt_mask"],
            completion_ids=completion_ids,
            completion_mask=live_mask,
            rewards=rewards,
            group_ids=torch.arange(start, start + B, device=completion_ids.device) // G,
            tokenizer=self._tokenizer,
            segmenter=self.segmenter if not self.segmenter.uses_entropy else self._line_segmenter,
            eos_token_ids=self.eos_token_ids,
            problems=[self._problem(x) for x in inputs],
        )
        batch.attention_mask[:, batch.prompt_len :] = completion_mask.long()  # what the model saw
        if self.segmenter.uses_entropy:
            batch = self._entropy_segmented(batch)
        batch = batch.replace(verdicts=self._verdicts(batch))
        return batch, self._global_rows(batch, all_rewards, G), loss_mask

    def _problem(self, row: dict) -> Problem:
        """A dataset row as the task's :class:`Problem`: the prompt's text, the reference answer,
        and the answer cell as the reference solution where it holds more than the answer
        (GSM8K's worked solution: continuation likelihood's reference)."""
        cell = str(row.get(self.args.answer_column, ""))
        answer = reference_answer(self.task, cell)
        meta = {"solution": cell} if cell != answer else {}
        return Problem(_prompt_text(row.get("prompt", "")), answer, meta)

    def _global_rows(self, batch: RolloutBatch, rewards: Tensor, num_generations: int):
        """Rewards and groups of every process's rows (TRL already gathered the rewards) and the
        segment counts (gathered here)."""
        N = rewards.shape[0]
        start = self.collective.rank * batch.size
        counts = self.collective.gather(batch.num_segments.to(self.accelerator.device))
        if counts.shape[0] != N:
            raise RuntimeError(
                f"rredcot: {counts.shape[0]} completions across processes but {N} rewards "
                "(TRL internals changed?)"
            )
        group_ids = torch.arange(N, device=rewards.device) // num_generations
        return _GlobalRows(rewards, group_ids, counts.cpu(), start, batch.size)

    def _local_rows(self, batch: RolloutBatch) -> CreditRows:
        """The method's rows of this process's batch (:meth:`CreditMethod.rows`: boundary
        features, or values such as answer-likelihood probes). The forwards it runs are evened
        out across processes with dummy forwards, so sharded models (ZeRO-3, FSDP) see the same
        number of forwards on every rank."""
        counter, handle = _counting_forwards(self.model)
        try:
            local = self.credit_method.rows(batch)
        finally:
            handle.remove()
        self._even_out_forwards(counter[0])
        return local

    @torch.no_grad()
    def _even_out_forwards(self, done: int) -> int:
        """Run one-token no-grad forwards until this process has run as many as the busiest
        one; returns how many it ran."""
        most = self.collective.max_int(done)
        model = self.model
        ids = torch.zeros(1, 1, dtype=torch.long, device=self.accelerator.device)
        for _ in range(most - done):
            model(input_ids=ids, attention_mask=torch.ones_like(ids))
        return most - done

    def _extra_forward(self, output: dict, mode: str) -> tuple[Tensor, Tensor]:
        """``(hidden states (B, P+T, D), log-probs (B, T))`` of the local rows by one no-grad
        forward of the adapter's own (where neither TRL's pass nor a single loss forward gives
        them)."""
        ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        store: list[Tensor] = []
        batch_size = (
            self.args.per_device_train_batch_size
            if mode == "train"
            else self.args.per_device_eval_batch_size
        )
        with (
            torch.no_grad(),
            _no_checkpointing(self.model, self.args.gradient_checkpointing_kwargs),
            _capture_hidden_states(self.model, self.credit_method.hidden_layers, store),
        ):
            logps, _, _ = super()._get_per_token_logps_and_entropies(
                self.model, ids, mask, output["completion_ids"].size(1), batch_size=batch_size
            )
        return torch.cat(store, dim=0), logps

    @property
    def _line_segmenter(self):
        """Newline cuts with the segmenter's options: the first cut of a batch that an entropy
        strategy then re-cuts (:meth:`_entropy_segmented`)."""
        return dataclasses.replace(self.segmenter, strategy="newline")

    @torch.no_grad()
    def _entropy_segmented(self, batch: RolloutBatch) -> RolloutBatch:
        """``batch`` cut by the entropy strategy (``entropy``, ``keywords+entropy``,
        ``newline+merge``), with the policy's next-token entropies from one extra no-grad forward
        (TRL's own pass comes after the advantages are needed)."""
        with eval_mode(self.model):
            fwd = policy_forward(
                self.model,
                batch.input_ids,
                batch.attention_mask,
                batch.prompt_len,
                with_entropy=True,
                temperature=self.args.temperature,
                shared_prompt=False,
            )
        return segment_batch(batch, self._tokenizer, self.segmenter, fwd.entropy)

    def _verdicts(self, batch: RolloutBatch) -> list[Verdict]:
        if self.task is None:
            return [
                Verdict(float(r), None, None, "scored by the TRL reward functions")
                for r in batch.rewards.tolist()
            ]
        return [safe_verify(self.task, p, c) for p, c in zip(batch.problems, batch.completions)]

    def _log_credit(self, metrics: dict[str, float], mode: str) -> None:
        """Log the credit method's metrics in rredcot's one namespace beside TRL's own:
        ``credit/handover_weight`` as ``rredcot/credit/handover_weight`` (docs/metrics.md)."""
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._metrics[mode][f"{METRICS_PREFIX}{key}"].append(float(value))

    def _log_row_advantages(self, advantages: Tensor, mask: Tensor) -> None:
        """Show each completion's mean token advantage in TRL's completions table (TRL logged its
        own per-completion advantages just before)."""
        row_mean = masked_mean(advantages, mask.bool(), dim=1)
        gathered = self.accelerator.gather(row_mean.contiguous()).tolist()
        logs = self._logs["advantages"]
        for _ in range(min(len(gathered), len(logs))):
            logs.pop()
        logs.extend(gathered)

    # -- saving and resuming the credit method's state ---------------------------------------
    def save_credit_state(self, output_dir: str | Path) -> Path | None:
        """Write the credit method's state (the value head) to ``output_dir/value_head.pt`` and
        the run's rredcot settings (method, credit config, task, sampling, and what ``auto``
        chose) to ``output_dir/rredcot_credit.json``, which ``rredcot explain --run output_dir``
        reads. Nothing before ``auto`` chose."""
        method = self.credit_method
        if not self.args.should_save or method is None:
            return None
        args = self.args
        write_settings(
            output_dir,
            settings_dict(
                method.name,
                method.config,
                args.task,
                args.task_args,
                args.answer_column,
                self.temperature,
                args.top_p,
                args.max_completion_length,
                credit_choice=None if self.credit_choice is None else self.credit_choice.to_json(),
                example=self._example(),
            ),
        )
        state = method.state_dict()
        if not state:
            return None
        path = Path(output_dir) / CREDIT_STATE_FILE
        tmp = path.with_name(f"{path.name}.tmp")
        with os.fdopen(create_file(tmp), "wb") as f:  # a link planted at tmp is never followed
            torch.save({"credit_method": method.name, "state": state}, f)
        tmp.replace(path)
        return path

    def _example(self) -> dict | None:
        """The first training row's prompt and answer as text (``rredcot explain --run`` shows
        it, and so needs none of the task's data); None where the prompt is not plain text."""
        if self.task is None:
            return None
        try:
            row = self.train_dataset[0]
            problem = self._problem(dict(row))
        except Exception:  # noqa: BLE001 - an iterable or empty dataset: nothing recorded
            return None
        if not isinstance(problem.prompt, str) or not problem.prompt or not problem.answer:
            return None
        return {"prompt": problem.prompt, "answer": str(problem.answer)}

    def load_credit_state(self, checkpoint_dir: str | Path) -> bool:
        """Read ``value_head.pt`` from a checkpoint or model directory; False if it has none.
        With ``auto`` not yet chosen, the checkpoint's choice (``rredcot_credit.json``) is used,
        with the credit config it saved, so a resumed run keeps its method."""
        if self.credit_method is None:
            saved = read_settings(checkpoint_dir)
            if saved is None or not saved.credit_choice:
                return False  # nothing chosen there: the first generation batch chooses
            where = f"{Path(checkpoint_dir) / SETTINGS_FILE} (credit_choice)"
            choice = CreditChoice.read_dict(saved.credit_choice, where)  # names no code
            self._check_saved_code(saved.credit, Path(checkpoint_dir) / SETTINGS_FILE)
            self._use_choice(choice, saved.credit)
        path = Path(checkpoint_dir) / CREDIT_STATE_FILE
        if not path.exists():
            return False
        saved = load_plain(path)  # a payload or a cut file: one line naming it
        if not isinstance(saved, dict) or "state" not in saved:
            raise UserError(f"{path} is not a credit state RREDCoTGRPOTrainer writes")
        if saved.get("credit_method") != self.credit_method.name:
            raise ValueError(
                f"{path} holds the state of credit method {saved.get('credit_method')!r}, but "
                f"this trainer uses {self.credit_method.name!r}"
            )
        self.credit_method.load_state_dict(saved["state"])
        return True

    def _check_saved_code(self, saved: CreditConfig, path: Path) -> None:
        """A checkpoint's saved credit config may name a process-reward function or model only
        where this trainer's own ``credit`` names the same: reading a checkpoint never imports
        code or loads a model that the checkpoint alone names."""
        mine = self.args.credit_config.process_reward
        for name in ("function", "model"):
            theirs = getattr(saved.process_reward, name)
            if theirs and theirs != getattr(mine, name):
                raise UserError(
                    f"{path} names credit.process_reward.{name}={theirs[:120]!r}, which resuming "
                    "would load; rredcot never loads code or a model a checkpoint names: read "
                    f"that file, then give it yourself (credit.process_reward.{name}) to allow it"
                )

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        self.save_credit_state(output_dir or self.args.output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.load_credit_state(checkpoint)
