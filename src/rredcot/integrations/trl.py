"""rredcot credit inside TRL's ``GRPOTrainer`` (``pip install 'rredcot[trl]'``).

TRL keeps everything it does well: sampling (transformers or vLLM), reward functions, datasets,
the clipped loss, ``accelerate launch`` / DeepSpeed / FSDP, logging and checkpoints. This adapter
changes one thing: the advantages. TRL 1.16 computes one advantage per completion at the end of
``GRPOTrainer._generate_and_score_completions``; :class:`RREDCoTGRPOTrainer` lets that method run
unchanged, then replaces ``output["advantages"]`` with rredcot's ``(B, T)`` token advantages. TRL's
``_compute_loss`` takes ``(B, T)`` advantages as they are (it unsqueezes only 1-D ones), so the loss
is not overridden.

Per generation batch:

1. the outcome reward ``R`` of every process's completions is the weighted sum of TRL's reward
   functions (TRL gathers them; ``multi_objective_aggregation="sum_then_normalize"``, before
   normalisation);
2. each process decodes its completions with token offsets and segments them
   (``rredcot.integrations._batch``);
3. the credit runs the contract of :mod:`rredcot.methods.base` with the batch split across
   processes: each process measures its own rows (``method.rows``: the value head's boundary
   features, read at the real prompt and token positions exactly as in rredcot's own trainer;
   the answer likelihood's probes; a process reward's step scores, each process running its own
   copy of a frozen PRM), the rows are gathered, the estimate and the segment stage run over
   every process's rows (groups may span processes, as in TRL), and each process runs the token
   stage on its own rows and tokens. ``scale_rewards`` maps onto the normalisation
   (:func:`normalization_for_scale_rewards`);
4. the value head's hidden states and log-probs come from TRL's no-grad old-log-prob pass when
   TRL runs one, else from the training (loss) forward of each micro-batch: detached, read by a
   hook, and the advantages written into the micro-batch before the loss is formed. No extra
   forward either way (``rredcot/extra_forward`` = 0; 1 only with the Liger loss);
5. in training only, the method learns (``update`` over the gathered rows, after the credit of
   the step, so every process holds the same head and guard).

The credit method's state (the value head) is written as ``value_head.pt`` next to every
checkpoint and the final model, and read back on ``train(resume_from_checkpoint=...)``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from rredcot import credit
from rredcot.config import CreditConfig
from rredcot.config_io import from_dict
from rredcot.integrations._batch import prompt_text as _prompt_text
from rredcot.integrations._batch import rollout_batch_from_tensors
from rredcot.integrations.saved import CREDIT_STATE_FILE, settings_dict, write_settings
from rredcot.methods.base import (
    CreditContext,
    CreditOutput,
    CreditRows,
    RolloutBatch,
    build_credit,
    get_credit,
)
from rredcot.models import (
    is_activation_checkpointing,
    resolve_model_dir,
    set_activation_checkpointing,
)
from rredcot.normalization import Scale, apply_scale, masked_mean
from rredcot.rollout import eval_mode, policy_forward, segment_batch
from rredcot.segment import segmenter_from_config
from rredcot.tasks import get_task
from rredcot.tasks.answers import extract_reference
from rredcot.tasks.base import Problem, Task, Verdict, safe_verify

try:
    from trl import GRPOConfig, GRPOTrainer
except ImportError as err:  # pragma: no cover - the extra is not installed
    raise ImportError("rredcot.integrations.trl needs TRL: pip install 'rredcot[trl]'") from err

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
        default="value_head",
        metadata={
            "help": "rredcot credit method: value_head, answer_likelihood, "
            "continuation_likelihood (the group's correct completions on this process, and the "
            "task's reference), process_reward (your step scores or a frozen PRM, "
            "credit.process_reward) or uniform (GRPO)."
        },
    )
    credit: dict | str | None = field(
        default=None,
        metadata={
            "help": "Fields of rredcot.config.CreditConfig (segmenter, lam, normalization, "
            "value_head: {lr: ...}, ...) as a dict or a JSON object string."
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

    def __post_init__(self) -> None:
        if getattr(self, "activation_checkpointing", False) is None:
            # transformers >= 5.x renamed gradient_checkpointing (a deprecated alias that warns
            # when set); GRPOConfig's own default sets the old name, so carry it to the new one
            self.activation_checkpointing = self.gradient_checkpointing
        super().__post_init__()
        self.credit = _as_dict(self.credit, "credit")
        self.task_args = _as_dict(self.task_args, "task_args")
        get_credit(self.credit_method)  # unknown names list the valid ones
        if self.credit_method not in TRL_METHODS:
            raise ValueError(
                f"credit_method={self.credit_method!r} is not supported in TRL (it needs rredcot's "
                f"own sampling loop); use one of: {', '.join(TRL_METHODS)}"
            )
        if self.credit_config.value_head.alik_feature:
            raise ValueError(
                "credit.value_head.alik_feature is not supported in TRL (its probe forwards would run "
                "per micro-batch and unevenly across processes); leave it unset"
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

        self._warn_scale_rewards_conflict()

    @property
    def credit_config(self) -> CreditConfig:
        """The :class:`CreditConfig` built from ``credit`` (unknown keys list the valid ones).
        ``value_head.logprob_features`` is off unless ``credit`` turns it on (the head then also reads
        the log-probs of TRL's pass, as in rredcot's trainer). ``normalization="auto"`` (the
        default) follows TRL's ``scale_rewards`` (:func:`normalization_for_scale_rewards`)."""
        fields = _as_dict(self.credit, "credit")
        head = fields.get("value_head")
        if head is None or isinstance(head, Mapping):  # else from_dict names the bad section
            fields["value_head"] = {"logprob_features": False, **(head or {})}
        if fields.get("normalization", "auto") == "auto":
            # credit.form=reweight is GRPO's advantage reweighted: scaled as uniform's
            reweight = fields.get("form") == "reweight"
            fields["normalization"] = normalization_for_scale_rewards(
                self.scale_rewards, "uniform" if reweight else self.credit_method
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

    def gather_padded(self, t: Tensor, dim: int = 1) -> Tensor:
        """Like :meth:`gather` after zero-padding ``dim`` to the largest size of any process."""
        if self.world == 1:
            return t
        acc = self.accelerator
        return acc.gather(acc.pad_across_processes(t.contiguous(), dim=dim))

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

    def live(self, device) -> Tensor:
        """``(N,)`` bool: rows with a response (unscorable and empty rows have no segment)."""
        return (self.counts > 0).to(device)

    def gather(self, local: CreditRows, collective: _Collective, features: Tensor | None = None):
        """The credit rows of every process (:class:`~rredcot.methods.base.CreditRows`): this
        process's ``local`` rows' measurements gathered (padded to the widest row), the rewards
        and groups of every row; ``features`` (already gathered) stand in for the local ones.
        The group's shared prefixes are not gathered (their ids are local)."""
        width = self.width
        device = self.rewards.device if features is None else features.device

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
            features=features if features is not None else every(local.features, width),
            values=values,
            weights=every(local.weights, width - 1),
            cost=local.cost,
            metrics=local.metrics,
        )


@dataclass
class _Pending:
    """A generation batch whose value-head credit waits for the loss forwards (no TRL pass)."""

    batch: RolloutBatch  # local rows, no hidden states
    rows: _GlobalRows
    loss_mask: Tensor  # (B, T)
    mode: str
    features: Tensor | None = None  # (N, S+1, D) boundary hidden states, filled as seen
    seen: Tensor | None = None  # (N,) bool
    advantages: Tensor | None = None  # (B, T) local token advantages, filled as computed


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
    ``trainer.credit_method.head``).
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
        c = args.credit_config
        self.task: Task | None = get_task(args.task, **args.task_args) if args.task else None
        self.segmenter = segmenter_from_config(c, getattr(self.task, "answer_line_pattern", None))
        self.credit_method = build_credit(
            args.credit_method,
            c,
            CreditContext(
                policy=self.model,
                tokenizer=self._tokenizer,
                task=self.task,
                segmenter=self.segmenter,
                device=self.accelerator.device,
            ),
        )
        self._hidden_layers = (
            tuple(self.credit_method.hidden_layers)
            if self.credit_method.needs_hidden_states
            else None
        )
        if (
            self._hidden_layers is not None
            and self._defers_to_loss_forward()
            and self.credit_method.normalization == "whiten"
            and args.steps_per_generation > 1
        ):
            raise ValueError(
                "credit.normalization='whiten' needs every completion's values before the first "
                "loss of a generation batch, but here they come from the loss forwards of "
                f"{args.steps_per_generation} micro-batches (steps_per_generation). Use "
                "normalization 'batch_std' or 'group_or_batch_std', or steps_per_generation=1"
            )
        self.collective = _Collective(self.accelerator)
        if self.accelerator.is_main_process:
            print(f"rredcot: {self.describe_credit()}", flush=True)
        self.last_batch: RolloutBatch | None = None  # the last generation batch, for inspection
        self.last_credit = None  # its CreditOutput (over the segments of every process's rows)
        self._rewards_per_func: Tensor | None = None
        self._capture_armed = False
        self._captured: list[Tensor] = []
        self._pending: _Pending | None = None
        self._loss_inputs: dict | None = None

    def describe_credit(self) -> str:
        """One line saying what was resolved: the method, the segmenter, the normalisation, the
        hand-over and where the values' inputs come from (printed once at start)."""
        method, c, args = self.credit_method, self.credit_method.config, self.args
        cuts = c.segmenter + ("" if c.separate_answer else " (answer line merged)")
        if c.min_chars or c.max_segments:
            cuts += f", min_chars {c.min_chars}, max_segments {c.max_segments or 'none'}"
        norm = method.normalization
        if norm == "group_or_batch_std":
            norm += f" (agreeing_std {c.agreeing_std})"
        if _as_dict(args.credit, "credit").get("normalization", "auto") == "auto":
            norm += f", from scale_rewards={args.scale_rewards!r}"
        if args.credit_method == "uniform":
            source, handover = "none (GRPO: the group's mean reward)", "none"
        else:
            handover = c.handover.mode + (
                f" ({c.handover.score}, starts at w = 0: GRPO)"
                if c.handover.mode == "reliability"
                else " (full weight from step 1)"
            )
            if self._hidden_layers is not None:
                extra = " + log-prob features" if c.value_head.logprob_features else ""
                where = (
                    "TRL's old-log-prob pass"
                    if self._trl_runs_old_logprob_pass()
                    else "each micro-batch's loss forward"
                    if self._defers_to_loss_forward()
                    else "one extra no-grad forward per generation batch (the Liger loss)"
                )
                source = f"hidden states of layers {list(self._hidden_layers)}{extra} from {where}"
            elif args.credit_method == "answer_likelihood":
                source = "the policy's probability of the reference answer after each prefix"
            else:
                prm = c.process_reward
                source = f"step scores of {prm.function or prm.model}"
        return (
            f"credit_method={args.credit_method}, segmenter={cuts}, normalization={norm}, "
            f"lam={method.lam}, hand-over={handover}, features={source}; metrics under "
            f"{METRICS_PREFIX} (docs/metrics.md)"
        )

    # -- what TRL computes, kept for the credit -----------------------------------------------
    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        rewards_per_func = super()._calculate_rewards(
            inputs, prompts, completions, completion_ids_list
        )
        self._rewards_per_func = rewards_per_func  # (N_all_processes, num_funcs), before scaling
        return rewards_per_func

    def _trl_runs_old_logprob_pass(self) -> bool:
        """Whether TRL 1.16's ``_generate_and_score_completions`` runs its no-grad old-log-prob
        forward on ``self.model`` (the same condition it uses)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return self.args.gradient_accumulation_steps % generate_every != 0 or bool(
            self.use_vllm and self.vllm_importance_sampling_correction
        )

    def _defers_to_loss_forward(self) -> bool:
        """Whether hidden states come from the loss forward itself (TRL runs no old-log-prob
        pass, and the loss goes through ``_get_per_token_logps_and_entropies``)."""
        return not self._trl_runs_old_logprob_pass() and not self.args.use_liger_kernel

    def _get_per_token_logps_and_entropies(self, model, *args, **kwargs):
        # 1. TRL's old-log-prob pass: its first call on self.model in a generation step (a PEFT
        #    reference pass, also on self.model, comes after it).
        if self._capture_armed and model is self.model:
            self._capture_armed = False
            with _capture_hidden_states(model, self._hidden_layers, self._captured):
                return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
        # 2. the loss forward of a micro-batch whose credit waits for it.
        if self._loss_inputs is not None:
            inputs, self._loss_inputs = self._loss_inputs, None
            store: list[Tensor] = []
            with _capture_hidden_states(model, self._hidden_layers, store):
                result = super()._get_per_token_logps_and_entropies(model, *args, **kwargs)
            self._deferred_credit(inputs, torch.cat(store, dim=0), result[0].detach())
            return result
        return super()._get_per_token_logps_and_entropies(model, *args, **kwargs)

    def _compute_loss(self, model, inputs):
        pending = self._pending
        if pending is not None and "rredcot_row" in inputs:
            global_rows = inputs["rredcot_row"].to("cpu") + pending.rows.start
            if not bool(pending.seen[global_rows].all()):
                self._loss_inputs = inputs  # the next forward's hidden states give the credit
        try:
            return super()._compute_loss(model, inputs)
        finally:
            self._loss_inputs = None

    # -- the override -------------------------------------------------------------------------
    def _generate_and_score_completions(self, inputs):
        if self._pending is not None:
            raise RuntimeError(
                "rredcot: a new generation batch started before every micro-batch of the last "
                "one went through the loss (TRL internals changed?)"
            )
        self._captured = []
        self._capture_armed = self._hidden_layers is not None and self._trl_runs_old_logprob_pass()
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._capture_armed = False
        return self._apply_credit(inputs, output)

    def _extra_forward(self, output: dict, mode: str) -> tuple[Tensor, Tensor]:
        """``(hidden states (B, P+T, D), log-probs (B, T))`` of the local rows by one no-grad
        forward of our own (only where neither TRL's pass nor the loss forward can give them:
        the Liger loss)."""
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
            _capture_hidden_states(self.model, self._hidden_layers, store),
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

    def _global_rows(self, batch: RolloutBatch, num_generations: int) -> _GlobalRows:
        """Rewards and groups of every process's rows (TRL already gathered the rewards) and the
        segment counts (gathered here)."""
        if self._rewards_per_func is None:
            raise RuntimeError(
                "rewards were not computed before the credit (TRL internals changed?)"
            )
        rewards, _ = _outcome_rewards(self._rewards_per_func, self.reward_weights, num_generations)
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

    def _apply_credit(self, inputs: list[dict], output: dict) -> dict:
        """Replace TRL's per-completion advantages with rredcot's ``(B, T)`` token advantages
        (now, or in the loss forward of each micro-batch when the hidden states come from it)."""
        mode = "train" if self.model.training else "eval"
        G = self.num_generations if mode == "train" else self.num_generations_eval
        completion_ids, completion_mask = output["completion_ids"], output["completion_mask"]
        B = completion_ids.shape[0]
        start = self.collective.rank * B
        all_rewards, all_unscorable = _outcome_rewards(
            self._rewards_per_func, self.reward_weights, G
        )
        rewards = all_rewards[start : start + B].to(completion_ids.device)
        unscorable = all_unscorable[start : start + B].to(completion_ids.device)
        # Segments cover every completion token (a prefix mask); unscorable rows get none. The
        # advantages are then masked like TRL's loss (tool-output tokens excluded).
        live_mask = completion_mask * (~unscorable).to(completion_mask.dtype).unsqueeze(1)
        loss_mask = live_mask * output["tool_mask"] if "tool_mask" in output else live_mask
        group_ids = torch.arange(start, start + B, device=completion_ids.device) // G

        problems = [
            Problem(
                _prompt_text(x.get("prompt", "")),
                reference_answer(self.task, x.get(self.args.answer_column, "")),
            )
            for x in inputs
        ]
        batch = rollout_batch_from_tensors(
            prompt_ids=output["prompt_ids"],
            prompt_mask=output["prompt_mask"],
            completion_ids=completion_ids,
            completion_mask=live_mask,
            rewards=rewards,
            group_ids=group_ids,
            tokenizer=self._tokenizer,
            segmenter=self.segmenter if not self.segmenter.uses_entropy else self._line_segmenter,
            eos_token_ids=self.eos_token_ids,
            problems=problems,
        )
        batch.attention_mask[:, batch.prompt_len :] = completion_mask.long()  # what the model saw
        if self.segmenter.uses_entropy:
            batch = self._entropy_segmented(batch)
        batch = batch.replace(verdicts=self._verdicts(batch))
        rows = self._global_rows(batch, G)
        self.credit_method.context.policy = self.model  # the prepared (possibly wrapped) model
        self.last_batch = batch

        if self._hidden_layers is not None:
            captured = torch.cat(self._captured, dim=0) if self._captured else None
            logps = output.get("old_per_token_logps")  # from the same pass of TRL's
            self._captured = []
            full = tuple(batch.input_ids.shape)
            if captured is None or tuple(captured.shape[:2]) != full or logps is None:
                if self._defers_to_loss_forward():
                    return self._defer(output, batch, rows, loss_mask, mode)
                captured, logps = self._extra_forward(output, mode)
                extra = 1.0
            else:
                extra = 0.0
            self._metrics[mode]["rredcot/extra_forward"].append(extra)
            batch = batch.replace(hidden_states=captured, old_logprobs=logps.detach())
            self.last_batch = batch
        every = rows.gather(self._local_rows(batch), self.collective)
        estimate, out, advantages = self._credit(batch, rows, every)
        output["advantages"] = advantages * loss_mask.to(advantages.dtype)
        self._finish(out, output["advantages"], loss_mask, every, estimate, mode)
        return output

    # -- credit over the global rows ----------------------------------------------------------
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

    def _credit(self, batch: RolloutBatch, rows: _GlobalRows, every: CreditRows):
        """``(estimate, CreditOutput, (B, T) local token advantages)``.

        The method's estimate and the segment stage run on every process's rows, so group
        statistics, the anchor, the hand-over and the normalisation's scale see whole groups
        even where they span processes; the token stage then runs on the local rows and tokens
        (``whiten`` over every process's tokens)."""
        method = self.credit_method
        estimate = method.estimate(every)
        seg, metrics = method.segment_stage(every, estimate)
        scale = method.scale(every, estimate, like=seg.advantages)
        local = seg.rows(rows.local)
        local = dataclasses.replace(local, advantages=local.advantages.to(batch.segment_ids.device))
        if scale.whiten:
            tokens = credit.token_advantages(local, batch.segment_ids, batch.response_mask, Scale())
            tokens = self._whiten_everywhere(tokens, batch, scale)
        else:
            tokens = credit.token_advantages(
                local, batch.segment_ids, batch.response_mask, scale.rows(rows.local)
            )
        value_mask = estimate.credit.mask if isinstance(estimate.credit, credit.Values) else None
        out = CreditOutput(
            tokens, seg.advantages, seg.mask, seg.values, value_mask, metrics, estimate.cost
        )
        return estimate, out, tokens.to(torch.float32)

    def _whiten_everywhere(self, tokens: Tensor, batch: RolloutBatch, scale: Scale) -> Tensor:
        """The local rows of ``tokens`` whitened over every process's tokens."""
        every = self.collective.gather_padded(tokens, dim=1)
        mask = self.collective.gather_padded(batch.response_mask.contiguous(), dim=1)
        start = self.collective.rank * batch.size
        whitened = apply_scale(every, mask, scale)
        return whitened[start : start + batch.size, : tokens.shape[1]]

    def _finish(
        self,
        out: CreditOutput,
        advantages: Tensor,
        loss_mask: Tensor,
        every: CreditRows,
        estimate,
        mode: str,
    ) -> None:
        """Log the credit (averaged over processes), then, in training, let the method learn
        from every process's rows (after its credit: the credit never sees the step's
        outcomes; every process holds the same head and guard)."""
        self.last_credit = out
        self._log_credit(self.collective.mean_metrics(out.metrics), mode)
        self._log_row_advantages(advantages, loss_mask)
        if mode == "train":
            self._log_credit(self.credit_method.update(every, estimate), mode)

    # -- the credit from the loss forward (no pass of TRL to read hidden states from) ---------
    def _defer(self, output: dict, batch, rows: _GlobalRows, loss_mask: Tensor, mode: str):
        """Leave a placeholder; each micro-batch's loss forward fills its rows' advantages
        (:meth:`_deferred_credit`) before the loss is formed."""
        B, T = output["completion_ids"].shape
        device = output["completion_ids"].device
        output["advantages"] = torch.zeros(B, T, device=device)
        output["rredcot_row"] = torch.arange(B, device=device)
        self._pending = _Pending(
            batch=batch,
            rows=rows,
            loss_mask=loss_mask,
            mode=mode,
            seen=torch.zeros(rows.rewards.shape[0], dtype=torch.bool),
            advantages=torch.zeros(B, T, device=device),
        )
        self._metrics[mode]["rredcot/extra_forward"].append(0.0)
        return output

    def _deferred_credit(self, inputs: dict, hidden: Tensor, logps: Tensor) -> None:
        """Credit of one micro-batch from the detached hidden states and log-probs of its loss
        forward, written into ``inputs["advantages"]`` before TRL forms the loss.

        A row's value-head credit depends only on its own boundary features and on the rewards
        (group mean, normalisation), all known, so rows not yet forwarded (other micro-batches)
        do not change it. After the last micro-batch the credit is logged and the head learns."""
        pending = self._pending
        local_rows = inputs["rredcot_row"].to("cpu")
        sub = pending.batch.select(local_rows)
        if hidden.shape[:2] != sub.input_ids.shape:
            raise RuntimeError(
                f"rredcot: the loss forward's hidden states are {tuple(hidden.shape[:2])}, the "
                f"micro-batch is {tuple(sub.input_ids.shape)} (TRL internals changed?)"
            )
        sub = sub.replace(hidden_states=hidden.detach(), old_logprobs=logps)
        local_feats = _fit_columns(self.credit_method.rows(sub).features, pending.rows.width)
        device = self.accelerator.device
        every_rows = self.collective.gather((local_rows + pending.rows.start).to(device)).cpu()
        every_feats = self.collective.gather(local_feats.contiguous())
        if pending.features is None:
            N, S1 = pending.rows.rewards.shape[0], pending.rows.width
            pending.features = every_feats.new_zeros(N, S1, every_feats.shape[-1])
        pending.features[every_rows.to(pending.features.device)] = every_feats
        pending.seen[every_rows] = True
        every = pending.rows.gather(
            CreditRows.of(pending.batch), self.collective, features=pending.features
        )
        estimate, out, tokens = self._credit(pending.batch, pending.rows, every)
        picked = local_rows.to(tokens.device)
        mask = pending.loss_mask[picked].to(tokens.dtype)
        inputs["advantages"] = tokens[picked] * mask
        pending.advantages[picked] = inputs["advantages"].to(pending.advantages.device)
        if bool(pending.seen.all()):
            self._pending = None
            self.last_batch = pending.batch
            self._finish(out, pending.advantages, pending.loss_mask, every, estimate, pending.mode)

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
        the run's rredcot settings (method, credit config, task, sampling) to
        ``output_dir/rredcot_credit.json``, which ``rredcot explain --run output_dir`` reads."""
        if not self.args.should_save:
            return None
        args = self.args
        write_settings(
            output_dir,
            settings_dict(
                args.credit_method,
                self.credit_method.config,
                args.task,
                args.task_args,
                args.answer_column,
                self.temperature,
                args.top_p,
                args.max_completion_length,
            ),
        )
        state = self.credit_method.state_dict()
        if not state:
            return None
        path = Path(output_dir) / CREDIT_STATE_FILE
        tmp = path.with_name(f"{path.name}.tmp")
        torch.save({"credit_method": self.args.credit_method, "state": state}, tmp)
        tmp.replace(path)
        return path

    def load_credit_state(self, checkpoint_dir: str | Path) -> bool:
        """Read ``value_head.pt`` from a checkpoint or model directory; False if it has none."""
        path = Path(checkpoint_dir) / CREDIT_STATE_FILE
        if not path.exists():
            return False
        saved = torch.load(path, map_location=self.accelerator.device, weights_only=True)
        if saved.get("credit_method") != self.args.credit_method:
            raise ValueError(
                f"{path} holds the state of credit method {saved.get('credit_method')!r}, but "
                f"this trainer uses {self.args.credit_method!r}"
            )
        self.credit_method.load_state_dict(saved["state"])
        return True

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        super().save_model(output_dir, _internal_call)
        self.save_credit_state(output_dir or self.args.output_dir)

    def _load_optimizer_and_scheduler(self, checkpoint):
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is not None:
            self.load_credit_state(checkpoint)
