"""rredcot credit as a verl advantage estimator (``algorithm.adv_estimator=rredcot``).

verl keeps the model, the rollout engines (vLLM/SGLang), FSDP/Megatron sharding, the critic and
Ray. This module adds two things, both loaded in every verl process through
``VERL_USE_EXTERNAL_MODULES=rredcot.integrations.verl``:

1. an advantage estimator registered as ``rredcot`` in verl's registry
   (``verl.trainer.ppo.core_algos.register_adv_est``): :func:`compute_rredcot_advantage`, a
   function over verl's token tensors that runs rredcot's credit algebra (what it keeps between
   calls: see "State" below);
2. the trainer-side hook it needs. verl's ``compute_advantage`` hands a custom estimator only
   ``token_level_rewards``, ``response_mask``, ``index`` (the prompt ``uid``) and the algorithm
   ``config``: no response ids (so no segments) and no critic values. The hook segments the
   responses with :mod:`rredcot.segment` and makes the segment ids (and the critic's values)
   visible to the estimator for the duration of one ``compute_advantage`` call
   (:func:`rredcot_segments`). For verl's default v1 trainer it is the trainer mode
   ``rredcot_sync`` (``trainer.v1.trainer_mode=rredcot_sync``), a ``PPOTrainerSync`` whose
   ``_compute_advantage`` fetches ``responses`` from the TransferQueue and then runs verl's own
   ``_compute_advantage`` inside that context. Code that holds a full ``DataProto`` (the legacy
   ``RayPPOTrainer``, custom loops) calls :func:`compute_advantage_for_data` instead.

Values. Where rredcot's own loop and TRL use the small value head or answer likelihood, verl's
driver holds no model: the value estimate here is **verl's critic** (``critic.enable=True``), a
full value model that verl shards and trains itself. Its per-token values ``values[:, t] =
V(prompt + response[:t])`` give ``V(s_k) = values[:, b_k]`` at every segment start, and the
estimator returns TD(``value_head.td_lambda``) targets at segment starts as the critic's ``returns``
(``value_head.td_lambda = 1``, the default: every token regresses on ``R``). Credit methods:

- ``critic``: segment values from the critic, ``A_k`` by segment GAE with ``lam``, with the guards
  of every rredcot value source (:class:`CriticCredit`): anchored on the group's mean reward and
  handed over from uniform (GRPO) credit by the critic's reliability, measured on each step's
  outcomes after that step's credit (so the first step is GRPO's;
  ``+algorithm.rredcot.handover.mode=off`` uses the critic's credit at full weight);
- ``uniform``: GRPO through rredcot's algebra (no critic needed);
- ``answer_likelihood``: the actor's probability of a correct answer after each prefix, probed
  through its own ``compute_log_prob`` (:func:`build_probe_data`, :func:`probe_values`);
- ``process_reward``: your step scores or a frozen Hugging Face PRM
  (``algorithm.rredcot.process_reward.*``), run on the driver over the decoded prompts and
  responses (:func:`process_reward_values`; :func:`compute_advantage_for_data` calls it), with
  the method's measured hand-over updated after each step's credit.

Settings live under ``algorithm.rredcot`` (fields of :class:`rredcot.config.CreditConfig` plus
the keys of :data:`SETTINGS`: ``credit_method``, ``task``, ``task_args``,
``advantage_tail_floor``), e.g. ``+algorithm.rredcot.segmenter=sentence
+algorithm.rredcot.lam=0.5``.

State. The estimator is not a pure function. In the process that calls it (verl's driver) it
keeps, across calls, one credit method per ``(credit_method, settings)`` in the module's
``_METHODS``, built from the registry on first use: the guard of a value source (``critic``,
``answer_likelihood``, ``process_reward``) carries its reliability, the next step's hand-over
weight, from one step to the next (``uniform`` learns nothing; its instance is kept too).
:func:`reset_methods` forgets them (a second training run in the same process). The context
variable behind :func:`rredcot_segments` holds one batch's segment ids and values only inside
that ``with`` block, and is reset when it ends.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rredcot.algebra import credit
from rredcot.config import CreditConfig
from rredcot.config.io import from_dict
from rredcot.errors import require_extra
from rredcot.integrations._batch import (
    METRICS_PREFIX,
    fit_columns,
    group_ids_from_keys,
    prompt_text,
    rollout_batch_from_tensors,
    segment_completions,
    span_mask,
)
from rredcot.methods.answer_probes import build_probes
from rredcot.methods.base import (
    CreditContext,
    CreditMethod,
    CreditOutput,
    CreditRows,
    build_credit,
    register_credit,
    uniform_values,
)
from rredcot.methods.value_source import ValueSourceCredit
from rredcot.sampling.batch import RolloutBatch
from rredcot.segment import Segmenter, segmenter_from_config
from rredcot.tasks import get_task, get_task_class
from rredcot.tasks.base import Problem
from rredcot.training.row_policies import drop_small_tails

core_algos = require_extra(
    "verl.trainer.ppo.core_algos",
    "verl",
    "rredcot.integrations.verl",
    then="and then pip install --no-deps 'verl>=0.9,<0.10' (or install verl by its own instructions)",
)

__all__ = [
    "CriticCredit",
    "ESTIMATOR",
    "METHODS",
    "TRAINER_MODE",
    "compute_advantage_for_data",
    "compute_rredcot_advantage",
    "credit_settings",
    "rredcot_segments",
    "build_probe_data",
    "dense_prefix_rewards",
    "num_segments_of",
    "probe_values",
    "process_reward_values",
    "reset_methods",
    "segment_responses",
    "SETTINGS",
    "tail_floor_setting",
    "task_settings",
]

logger = logging.getLogger(__name__)

ESTIMATOR = "rredcot"
TRAINER_MODE = "rredcot_sync"
METHODS = ("critic", "uniform", "answer_likelihood", "process_reward")
# the keys of algorithm.rredcot that are not CreditConfig fields, with their help
SETTINGS = {
    "credit_method": f"the value source: one of {', '.join(METHODS)} (default critic)",
    "task": "rredcot task name (answer_likelihood's probes are written by its render_answer)",
    "task_args": "parameters of the task, a mapping",
    "advantage_tail_floor": "drop the tail of each row's credit where it is smaller than this "
    "(as rredcot train --advantage_tail_floor): token advantages after a row's last token with "
    "|advantage| >= the floor are set to 0 (a row with none gets 0 everywhere); the critic's "
    "returns are unchanged. 0 (default): off. verl's actor still forwards every token",
}


# ---------------------------------------------------------------------------------------------
# settings


def _settings_fields(config: Any) -> dict[str, Any]:
    raw = config.get("rredcot", None) if config is not None else None
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raw = dict(raw)  # an OmegaConf DictConfig
    return {str(k): v for k, v in raw.items()}


def credit_settings(config: Any = None) -> tuple[str, CreditConfig]:
    """``(credit_method, CreditConfig)`` from verl's algorithm config (``algorithm.rredcot``).

    ``config`` is verl's ``AlgoConfig``/``DictConfig`` (or a plain dict); its ``rredcot`` entry,
    if any, maps ``credit_method`` (``critic`` by default), ``task``/``task_args`` (for
    ``answer_likelihood``, :func:`task_settings`) and :class:`CreditConfig` fields.
    """
    fields = _settings_fields(config)
    method = str(fields.pop("credit_method", "critic"))
    for key in SETTINGS:
        fields.pop(key, None)
    if method not in METHODS:
        raise ValueError(
            f"algorithm.rredcot.credit_method={method!r}; valid in verl: {', '.join(METHODS)} "
            "(the value head needs the policy's hidden states, which verl's actor does not "
            "return: see docs/scaling.md)"
        )
    return method, from_dict(CreditConfig, fields, where="algorithm.rredcot.")


def tail_floor_setting(config: Any = None) -> float:
    """``algorithm.rredcot.advantage_tail_floor`` (:data:`SETTINGS`; default 0: off), checked to
    be a finite number >= 0."""
    raw = _settings_fields(config).get("advantage_tail_floor", 0.0)
    try:
        floor = float(raw)
    except (TypeError, ValueError):
        floor = float("nan")
    if not math.isfinite(floor) or floor < 0:
        raise ValueError(
            f"algorithm.rredcot.advantage_tail_floor={raw!r} must be a number >= 0 "
            "(0: keep every advantage)"
        )
    return floor


def task_settings(config: Any = None):
    """The rredcot task named by ``algorithm.rredcot.task`` (with ``task_args``), or None. The
    answer-likelihood probes are written by its ``render_answer``."""
    fields = _settings_fields(config)
    name = fields.get("task")
    if not name:
        return None
    args = fields.get("task_args") or {}
    return get_task(str(name), **{str(k): v for k, v in dict(args).items()})


def make_segmenter(cfg: CreditConfig, config: Any = None) -> Segmenter:
    """The estimator's segmenter (``segment.segmenter_from_config``), with the answer line of the
    task ``algorithm.rredcot.task`` names, if any (read from its class: no task is built)."""
    name = _settings_fields(config).get("task")
    pattern = get_task_class(str(name)).answer_line_pattern if name else None
    return segmenter_from_config(cfg, pattern)


# ---------------------------------------------------------------------------------------------
# segment ids: from response ids (trainer side) to boundaries (estimator side)


def segment_responses(
    responses: Tensor,
    response_mask: Tensor,
    tokenizer,
    segmenter: Segmenter,
    eos_token_ids: Any = None,
) -> Tensor:
    """``(B, T)`` long segment ids of verl's response tokens (``-1`` on padding).

    A multi-turn response whose mask has holes (tool outputs between the policy's turns) is
    segmented as the one text it is, up to its last real token: hole tokens keep the id of the
    segment they fall in (they stay inside the states ``s_k``; the estimator gives them no
    advantage, as verl's mask says). ``-1`` after the last real token.

    Args:
        responses: ``(B, T)`` response ids (``data.batch["responses"]``).
        response_mask: ``(B, T)`` 1 on the policy's tokens.
        tokenizer: the policy's tokenizer; segmenter: how to cut the decoded text.
    """
    span = span_mask(response_mask)
    boundaries, _, _ = segment_completions(responses, span, tokenizer, segmenter, eos_token_ids)
    return credit.boundaries_to_segment_ids(boundaries, responses.shape[1], device=responses.device)


def _filled_segment_ids(segment_ids: Tensor, response_mask: Tensor) -> Tensor:
    """Segment ids with the holes inside each row's span (``-1`` before its last real token)
    given the id of the segment they sit in (the one before; 0 at the start); -1 after."""
    ids = segment_ids.long().clone()
    valid = ids >= 0
    T = ids.shape[1]
    cols = torch.arange(T, device=ids.device).unsqueeze(0).expand_as(ids)
    last_valid = torch.where(valid, cols, torch.full_like(cols, -1)).cummax(dim=1).values
    prev = ids.gather(1, last_valid.clamp(min=0))
    prev = torch.where(last_valid >= 0, prev, torch.zeros_like(prev))
    span = span_mask(valid.long()).bool()
    return torch.where(span, torch.where(valid, ids, prev), torch.full_like(ids, -1))


def boundaries_from_segment_ids(segment_ids: Tensor, response_mask: Tensor) -> list[list[int]]:
    """Per row ``[0, b_1, ..., n_tokens]`` from segment ids (``0, 0, 1, 1, 2, ...`` over the
    row's span, up to its last real token). Holes (``-1`` inside the span, e.g. multi-turn tool
    outputs) belong to the segment they sit in."""
    span = span_mask(response_mask).bool()
    segment_ids = torch.where(span, segment_ids.long(), torch.full_like(segment_ids.long(), -1))
    filled = _filled_segment_ids(segment_ids, response_mask)
    out = []
    lengths = (filled >= 0).sum(-1).tolist()
    rows = filled.tolist()
    for row, n in enumerate(lengths):
        ids = rows[row][:n]
        if not ids:
            out.append([0])
            continue
        steps = [b - a for a, b in zip(ids[:-1], ids[1:])]
        if ids[0] != 0 or any(s not in (0, 1) for s in steps):
            raise ValueError(
                f"segment_ids row {row} must count segments 0, 1, 2, ... over its response "
                f"tokens (-1 only on padding and masked holes); got "
                f"{ids[:12]}{'...' if len(ids) > 12 else ''}"
            )
        out.append([0, *(t for t in range(1, n) if ids[t] != ids[t - 1]), n])
    return out


@dataclass
class _Segments:
    segment_ids: Tensor  # (B, T)
    values: Tensor | None  # (B, T) critic values, or None
    boundary_values: Tensor | None = None  # (B, S+1) V(s_k) from the driver (probes), or None


_ACTIVE: contextvars.ContextVar[_Segments | None] = contextvars.ContextVar(
    "rredcot_segments", default=None
)


@contextlib.contextmanager
def rredcot_segments(
    segment_ids: Tensor, values: Tensor | None = None, boundary_values: Tensor | None = None
) -> Iterator[None]:
    """Make one batch's segment ids (and the critic's token values, or boundary values
    ``V(s_k)`` computed on the driver, e.g. :func:`probe_values`) visible to the ``rredcot``
    estimator while verl's ``compute_advantage`` runs (verl passes it neither)."""
    token = _ACTIVE.set(_Segments(segment_ids, values, boundary_values))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


# ---------------------------------------------------------------------------------------------
# the estimator


def critic_boundary_values(
    token_values: Tensor, boundaries: list[list[int]]
) -> tuple[Tensor, Tensor]:
    """``(values (B, S+1), mask (B, S+1))``: verl's critic read at the segment starts
    (``V(s_k) = token_values[:, b_k]``; column ``n`` is replaced by ``R`` in the algebra).
    ``boundaries``: per row ``[0, b_1, ..., b_n]``."""
    n = torch.tensor([len(b) - 1 for b in boundaries], dtype=torch.long)
    S = int(n.max()) if len(n) else 0
    T = token_values.shape[1]
    starts = torch.zeros(len(boundaries), S + 1, dtype=torch.long)
    for row, bounds in enumerate(boundaries):
        starts[row, : len(bounds)] = torch.tensor(bounds).clamp(max=max(T - 1, 0))
    mask = torch.arange(S + 1).unsqueeze(0) <= n.unsqueeze(1)
    values = token_values.float().gather(1, starts.to(token_values.device))
    mask = mask.to(values.device)
    return torch.where(mask, values, torch.zeros_like(values)), mask


def dense_prefix_rewards(
    token_level_rewards: Tensor, filled_segment_ids: Tensor, num_segments: Tensor
) -> Tensor:
    """``(B, S+1)`` reward already received in ``s_k``: column ``k`` sums the token rewards of
    segments ``1..k`` other than the outcome on the row's last token (process rewards, a
    per-token KL penalty, tool rewards). Column 0 is 0.

    Adding it to ``V(s_k)`` keeps dense rewards in the credit: with ``V(s_n) := R`` (their sum
    with the outcome), segment ``k`` gets ``V(s_k) - V(s_{k-1})`` plus the dense rewards inside
    it, and the total still telescopes to ``R - V(s_0)``."""
    B, T = token_level_rewards.shape
    S = int(num_segments.max()) if B else 0
    dense = token_level_rewards.float().clone()
    valid = filled_segment_ids >= 0
    cols = torch.arange(T, device=dense.device).unsqueeze(0)
    last = torch.where(valid, cols, torch.full_like(cols, -1)).max(dim=1).values
    rows = torch.arange(B, device=dense.device)
    has = last >= 0
    dense[rows[has], last[has]] = 0.0  # the outcome: V(s_n) := R covers it
    dense = torch.where(valid, dense, torch.zeros_like(dense))
    per_segment = torch.zeros(B, max(S, 1), device=dense.device)
    per_segment.scatter_add_(1, filled_segment_ids.clamp(min=0), dense)
    prefix = torch.zeros(B, S + 1, device=dense.device)
    prefix[:, 1:] = per_segment[:, :S].cumsum(dim=1)
    return prefix


def _with_dense_rewards(values: Tensor, mask: Tensor, prefix: Tensor) -> Tensor:
    """``values (B, S+1)`` plus the dense rewards received so far (:func:`dense_prefix_rewards`)."""
    if not bool((prefix != 0).any()):
        return values
    shifted = values + prefix[:, : values.shape[1]].to(values.device)
    return torch.where(mask, shifted, values)


@register_credit("critic")
class CriticCredit(ValueSourceCredit):
    """``credit_method=critic``: values from verl's critic, with the guards of every rredcot value
    source (the group-mean anchor, the hand-over from uniform credit by measured reliability,
    safe normalisation; :class:`~rredcot.methods.value_source.ValueSourceCredit`).

    verl trains the critic; this method learns only how far to trust it: the slope of the
    outcomes on its last prefix value, measured on each step's outcomes after that step's credit,
    is the next steps' hand-over weight (0 at the start: GRPO until the critic has earned trust).
    ``credit.handover.mode=off`` uses the critic's credit at full weight from the first step."""

    def boundary_values(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, dict[str, float]]:
        raise ValueError(
            "credit_method=critic reads its values from verl's critic (data.batch['values'], "
            "critic.enable=True): the estimator puts them in the rows it credits; this method "
            "cannot compute values of a batch itself"
        )


_METHODS: dict[tuple, CreditMethod] = {}


def reset_methods() -> None:
    """Forget the credit methods kept between estimator calls (their earned hand-over weights):
    the next call starts from GRPO's credit, as a new training run does."""
    _METHODS.clear()


def _method_for(name: str, cfg: CreditConfig, config: Any) -> CreditMethod:
    """The credit method of these settings, from the registry, kept across steps on the driver:
    verl calls the estimator as a function once per step, and the method's state (a hand-over's
    reliability) must persist between the calls."""
    key = (name, repr(cfg))
    if key not in _METHODS:
        task = task_settings(config)
        if name == "answer_likelihood" and task is None:
            raise ValueError(
                "algorithm.rredcot.credit_method=answer_likelihood needs "
                "+algorithm.rredcot.task=NAME (e.g. gsm8k): its render_answer writes the probes"
            )
        # on the driver: a process reward function runs where verl's driver does, a PRM on its CPU
        context = CreditContext(policy=None, tokenizer=None, task=task)
        _METHODS[key] = build_credit(name, cfg, context)
    return _METHODS[key]


def compute_rredcot_advantage(
    token_level_rewards: Tensor,
    response_mask: Tensor,
    index: np.ndarray | None = None,
    config: Any = None,
    segment_ids: Tensor | None = None,
    values: Tensor | None = None,
    boundary_values: Tensor | None = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Segment-level credit for verl (registered as ``rredcot``).

    Args:
        token_level_rewards: ``(B, T)``; the outcome ``R`` is its row sum. Rewards before the
            row's last real token (process rewards, verl's KL-in-reward penalty) are kept in the
            segments they fall in (:func:`dense_prefix_rewards`).
        response_mask: ``(B, T)``; holes (multi-turn tool outputs) get no advantage.
        index: ``(B,)`` prompt ids (verl's ``uid``): the groups of ``uniform`` credit, of the
            group-mean anchor, of the GRPO credit the hand-over blends from and of
            ``group_std`` normalisation.
        config: verl's algorithm config; ``config.rredcot`` holds the settings
            (:func:`credit_settings`).
        segment_ids: ``(B, T)`` segment of each response token (:func:`segment_responses`);
            default: the ones made visible by :func:`rredcot_segments`.
        values: ``(B, T)`` critic values ``V(prompt + response[:t])`` (``critic``); default:
            likewise.
        boundary_values: ``(B, S+1)`` ``V(s_k)`` computed by the driver (``answer_likelihood``:
            :func:`probe_values`; ``process_reward``: :func:`process_reward_values`); default:
            likewise.

    Returns:
        advantages ``(B, T)`` (0 on padding and holes; with
        ``algorithm.rredcot.advantage_tail_floor`` > 0, 0 after each row's last token with
        ``|A| >=`` the floor, :func:`rredcot.training.row_policies.drop_small_tails`) and returns ``(B, T)``: the
        critic's TD targets for ``critic``, the advantages otherwise (as verl's GRPO).

    Not pure: the credit method of these settings is kept between calls (module doc, "State"),
    and a value source's guard is updated on this batch's outcomes after its credit.
    """
    active = _ACTIVE.get()
    if segment_ids is None and active is not None:
        segment_ids = active.segment_ids
        values = active.values if values is None else values
        boundary_values = active.boundary_values if boundary_values is None else boundary_values
    if segment_ids is None:
        raise ValueError(
            "the rredcot estimator needs each response's segments, which verl's "
            "compute_advantage does not pass: run verl with trainer.v1.trainer_mode="
            f"{TRAINER_MODE} and VERL_USE_EXTERNAL_MODULES=rredcot.integrations.verl, or wrap "
            "the call in rredcot.integrations.verl.rredcot_segments(segment_ids, values), or use "
            "compute_advantage_for_data(data, tokenizer, config)"
        )
    method_name, cfg = credit_settings(config)
    floor = tail_floor_setting(config)
    if method_name == "uniform" and index is None:
        raise ValueError("uniform credit needs index (verl's uid) to form prompt groups")
    rows = _verl_rows(token_level_rewards, response_mask, index, segment_ids)
    method = _method_for(method_name, cfg, config)
    if method_name == "critic":
        advantages, returns = _critic_credit(method, rows, values, cfg.value_head.td_lambda)
        return drop_small_tails(advantages, rows.mask.float(), floor), returns
    if method_name == "uniform":
        given, given_mask = uniform_values(rows.rewards, rows.group_ids, rows.num_segments)
    else:
        given, given_mask = _driver_values(
            method_name, boundary_values, rows.num_segments, rows.mask.device
        )
    out = _credit_from_values(method, given, given_mask, rows)
    advantages = drop_small_tails(out.advantages, rows.mask.float(), floor)
    return advantages, advantages


@dataclass
class _VerlRows:
    """verl's rows as tensors (its estimator sees no token ids)."""

    mask: Tensor  # (B, T) bool response tokens (holes: tool outputs)
    segment_ids: Tensor  # (B, T) long, -1 on padding and holes
    filled: Tensor  # (B, T) segment ids with holes filled (the span's segment)
    boundaries: list[list[int]]
    rewards: Tensor  # (B,) R, the row sum of the token-level rewards
    group_ids: Tensor  # (B,) long
    num_segments: Tensor  # (B,) long
    prefix: Tensor  # (B, S+1) rewards received before each boundary (dense_prefix_rewards)


def _verl_rows(
    token_level_rewards: Tensor, response_mask: Tensor, index, segment_ids: Tensor
) -> _VerlRows:
    """The rows of verl's batch: segment ids cut to the responses' spans (holes get no
    advantage), the prompt groups of ``index`` (verl's ``uid``), outcomes and dense rewards."""
    B, T = response_mask.shape
    mask = response_mask.bool()
    span = span_mask(mask.long()).bool()
    segment_ids = fit_columns(segment_ids.to(mask.device).long(), T, -1)
    segment_ids = torch.where(span, segment_ids, torch.full_like(segment_ids, -1))
    boundaries = boundaries_from_segment_ids(segment_ids, mask)
    filled = _filled_segment_ids(segment_ids, mask)
    if index is None:
        group_ids = torch.arange(B)
    else:
        group_ids = group_ids_from_keys(list(np.asarray(index, dtype=object)))
    num_segments = torch.tensor([len(b) - 1 for b in boundaries], dtype=torch.long)
    return _VerlRows(
        mask=mask,
        segment_ids=torch.where(mask, filled, torch.full_like(filled, -1)),
        filled=filled,
        boundaries=boundaries,
        rewards=token_level_rewards.float().sum(dim=-1),
        group_ids=group_ids.to(mask.device),
        num_segments=num_segments,
        prefix=dense_prefix_rewards(token_level_rewards, filled, num_segments),
    )


def _driver_values(
    method_name: str, boundary_values: Tensor | None, num_segments: Tensor, device
) -> tuple[Tensor, Tensor]:
    """``(values (B, S+1), mask)`` the driver computed (answer-likelihood probes, PRM scores)."""
    if boundary_values is None and method_name == "process_reward":
        raise ValueError(
            "algorithm.rredcot.credit_method=process_reward needs the step scores: call "
            "compute_advantage_for_data(data, tokenizer, config), which computes them "
            "with process_reward_values(data, tokenizer, config), or pass them as "
            "boundary_values (the rredcot_sync trainer mode does not compute them)"
        )
    if boundary_values is None:
        raise ValueError(
            "algorithm.rredcot.credit_method=answer_likelihood needs the probe values: "
            "build the probes with build_probe_data(data, tokenizer, task), run them "
            "through actor_rollout_wg.compute_log_prob, turn the log-probs into values "
            "with probe_values(...) and pass them as boundary_values (or through "
            "rredcot_segments(segment_ids, boundary_values=...))"
        )
    S1 = int(num_segments.max()) + 1 if len(num_segments) else 1
    given = fit_columns(boundary_values.to(device).float(), S1, 0.0)
    mask = torch.arange(S1, device=device).unsqueeze(0) <= num_segments.to(device).unsqueeze(1)
    return given, mask


def _critic_credit(
    method: CreditMethod, rows: _VerlRows, values: Tensor | None, lam_v: float
) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)`` from verl's critic: one more value source through the same
    path as the others (its values at the segment starts, dense rewards kept, anchored and
    handed over by the guard), and its TD(``lam_v``) targets, which exclude rewards already
    received (the critic predicts the return still to come)."""
    if values is None:
        raise ValueError(
            "algorithm.rredcot.credit_method=critic needs the critic's values: set "
            "critic.enable=True (or choose +algorithm.rredcot.credit_method=uniform)"
        )
    T = rows.mask.shape[1]
    values = fit_columns(values.to(rows.mask.device).float(), T, 0.0)
    raw, raw_mask = critic_boundary_values(values, rows.boundaries)
    out = _credit_from_values(method, raw, raw_mask, rows)
    response_mask = rows.mask.float()
    returns = _critic_returns(
        raw + rows.prefix, raw_mask, rows.rewards, rows.segment_ids, response_mask, lam_v
    )
    received = credit.segments_to_tokens(rows.prefix[:, :-1], rows.segment_ids, response_mask)
    return out.advantages, torch.where(rows.mask, returns - received, torch.zeros_like(returns))


def _credit_from_values(
    method: CreditMethod, values: Tensor, value_mask: Tensor, verl_rows: _VerlRows
) -> CreditOutput:
    """Boundary values of any verl value source through the contract every path runs: the rows
    (dense rewards kept in the values), the method's estimate (anchor, hand-over), the segment
    and token stages; then the method learns from this step's outcomes, after its credit (a
    no-op for uniform credit)."""
    response_mask = verl_rows.mask.float()
    rows = CreditRows(
        rewards=verl_rows.rewards,
        group_ids=verl_rows.group_ids,
        num_segments=value_mask.sum(dim=1) - 1,
        live=verl_rows.mask.any(dim=-1),
        value_mask=value_mask,
        segment_lengths=credit.segment_token_counts(
            verl_rows.segment_ids, response_mask, value_mask.shape[1] - 1
        ),
        values=_with_dense_rewards(values, value_mask, verl_rows.prefix),
    )
    estimate = method.estimate(rows)
    out = method.credit_output(rows, estimate, verl_rows.segment_ids, response_mask)
    method.update(rows, estimate)
    return out


def _critic_returns(
    values: Tensor,
    value_mask: Tensor,
    rewards: Tensor,
    segment_ids: Tensor,
    response_mask: Tensor,
    lam_v: float,
) -> Tensor:
    """``(B, T)`` critic targets: every token of segment ``k+1`` gets the TD(``lam_v``) target
    ``G_k`` of the state ``s_k`` where the segment starts (``lam_v = 1``: ``R``)."""
    seg_rewards, seg_mask = credit.redistribute(values, value_mask, rewards)
    # G_k = V(s_k) + sum_j lam_v^(j-k) r_{j+1}: the lam_v-return, by segment GAE.
    targets = values[:, :-1] + credit.segment_gae(seg_rewards, seg_mask, lam_v)
    targets = torch.where(seg_mask, targets, torch.zeros_like(targets))
    return credit.segments_to_tokens(targets, segment_ids, response_mask)


core_algos.register_adv_est(ESTIMATOR)(compute_rredcot_advantage)


# ---------------------------------------------------------------------------------------------
# trainer side


def compute_advantage_for_data(
    data, tokenizer, config: Any = None, boundary_values: Tensor | None = None
):
    """rredcot advantages for a full verl ``DataProto``, written to ``data.batch["advantages"]``
    and ``["returns"]``: segments ``responses``, reads the critic's ``values`` if present and calls
    the estimator through verl's registry. For the legacy ``RayPPOTrainer`` and custom loops (the
    v1 trainer uses the ``rredcot_sync`` trainer mode instead). ``boundary_values (B, S+1)``:
    the answer-likelihood values from :func:`probe_values`; for ``process_reward`` they are
    computed here when not given (:func:`process_reward_values`)."""
    method, cfg = credit_settings(config)
    if method == "process_reward" and boundary_values is None:
        boundary_values = process_reward_values(data, tokenizer, config)
    batch = data.batch
    if "response_mask" not in batch.keys():  # noqa: SIM118 - TensorDict has no `in`
        raise ValueError("data.batch needs 'response_mask' (verl's compute_response_mask)")
    segment_ids = segment_responses(
        batch["responses"],
        batch["response_mask"],
        tokenizer,
        make_segmenter(cfg, config),
    )
    values = batch["values"] if "values" in batch.keys() else None  # noqa: SIM118
    estimator = core_algos.get_adv_estimator_fn(ESTIMATOR)
    with rredcot_segments(segment_ids, values, boundary_values):
        advantages, returns = estimator(
            token_level_rewards=batch["token_level_rewards"],
            response_mask=batch["response_mask"],
            index=data.non_tensor_batch.get("uid"),
            config=config,
        )
    batch["advantages"] = advantages
    batch["returns"] = returns
    return data


# ---------------------------------------------------------------------------------------------
# answer likelihood through the actor's own log-prob computation


def _reference_answers(data, answer_key: str) -> list[str]:
    """Each row's reference answer from ``data.non_tensor_batch``: ``answer_key`` if present,
    else verl's ``reward_model["ground_truth"]``."""
    nt = data.non_tensor_batch
    if answer_key in nt:
        return [str(a) for a in nt[answer_key]]
    if "reward_model" in nt:
        return [str(dict(r).get("ground_truth", "")) for r in nt["reward_model"]]
    raise ValueError(
        f"the reference answers are in neither data.non_tensor_batch[{answer_key!r}] nor "
        "reward_model['ground_truth']; pass answer_key=... naming the column"
    )


def _driver_batch(data, tokenizer, segmenter, eos_token_ids, problems) -> RolloutBatch:
    """A verl ``DataProto``'s prompts and responses as a :class:`RolloutBatch` on the driver,
    segmented as the estimator segments them (rewards and groups are not needed there)."""
    b = data.batch
    prompts, responses = b["prompts"], b["responses"]
    P = prompts.shape[1]
    attention = b["attention_mask"]
    response_mask = b["response_mask"] if "response_mask" in b.keys() else attention[:, P:]  # noqa: SIM118
    B = responses.shape[0]
    return rollout_batch_from_tensors(
        prompt_ids=prompts,
        prompt_mask=attention[:, :P],
        completion_ids=responses,
        completion_mask=span_mask(response_mask),
        rewards=torch.zeros(B),
        group_ids=torch.arange(B),
        tokenizer=tokenizer,
        segmenter=segmenter,
        eos_token_ids=eos_token_ids,
        problems=problems,
    )


def build_probe_data(
    data,
    tokenizer,
    task,
    segmenter: Segmenter,
    *,
    divisor: int = 1,
    answer_key: str = "answer",
    eos_token_ids: Any = None,
):
    """The answer-likelihood probes of a verl batch as a ``DataProto`` for the actor's
    ``compute_log_prob`` (the driver builds it; the workers score it like any rollout).

    For each trace, each boundary ``k < n`` and each reference answer, one row: prompt =
    ``prompt + response[:b_k]`` (left-padded), response = the probe ``render_answer(a) + EOS``
    (right-padded), with ``attention_mask``, ``position_ids`` and ``response_mask``; the probe
    text and layout are the core's (:func:`rredcot.methods.answer_probes.build_probes`).
    Rows are padded to a multiple of ``divisor`` (the actor's data-parallel size) with copies of
    row 0, so verl splits them evenly and every rank runs the same number of forwards.
    ``non_tensor_batch["rredcot_probe"]`` holds ``(row, k)`` (``(-1, -1)`` on padding rows).

    Args:
        data: verl ``DataProto`` with ``prompts`` (left-padded), ``responses``,
            ``attention_mask`` (over prompt + response) and, optionally, ``response_mask``.
        tokenizer, task: the policy's tokenizer; the rredcot task whose ``render_answer`` writes
            the answer line. segmenter: the segmenter of the estimator.
        answer_key: non-tensor column with the reference answers (default ``answer``, else
            ``reward_model["ground_truth"]``).
    """
    from verl import DataProto  # the optional extra `verl`

    answers = _reference_answers(data, answer_key)
    batch = _driver_batch(
        data, tokenizer, segmenter, eos_token_ids, [Problem("", a) for a in answers]
    )
    P, responses, B = batch.prompt_len, data.batch["responses"], batch.size
    probes, _ = build_probes(batch, tokenizer, task, [[a] if a else [] for a in answers])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prefixes, probe_ids, keys = [], [], []
    for p in probes:
        keep = batch.attention_mask[p.row, :P].bool()
        prefix = batch.input_ids[p.row, :P][keep].tolist() + responses[p.row, : p.b].tolist()
        prefixes.append(prefix)
        probe_ids.append(list(p.ids))
        keys.append((p.row, p.k))
    if not probes:  # nothing to probe: one dummy row keeps every rank's work equal
        prefixes, probe_ids, keys = [[pad_id]], [[pad_id]], [(-1, -1)]
    while len(prefixes) % max(divisor, 1):
        prefixes.append(prefixes[0])
        probe_ids.append(probe_ids[0])
        keys.append((-1, -1))
    N = len(prefixes)
    Lp = max(len(x) for x in prefixes)
    Lr = max(len(x) for x in probe_ids)
    prompt_t = torch.full((N, Lp), pad_id, dtype=torch.long)
    resp_t = torch.full((N, Lr), pad_id, dtype=torch.long)
    attn = torch.zeros(N, Lp + Lr, dtype=torch.long)
    for i, (pre, ids) in enumerate(zip(prefixes, probe_ids)):
        prompt_t[i, Lp - len(pre) :] = torch.tensor(pre)
        resp_t[i, : len(ids)] = torch.tensor(ids)
        attn[i, Lp - len(pre) : Lp + len(ids)] = 1
    position_ids = (attn.cumsum(dim=1) - 1).clamp(min=0)
    probe_keys = np.empty(N, dtype=object)
    probe_keys[:] = keys
    return DataProto.from_dict(
        tensors={
            "prompts": prompt_t,
            "responses": resp_t,
            "input_ids": torch.cat([prompt_t, resp_t], dim=1),
            "attention_mask": attn,
            "position_ids": position_ids,
            "response_mask": attn[:, Lp:],
        },
        non_tensors={"rredcot_probe": probe_keys},
        meta_info={"rredcot_rows": B},
    )


def probe_values(probe_data, log_probs: Tensor, num_segments: Tensor) -> Tensor:
    """``(B, S+1)`` values ``V(s_k) = min(1, sum_a exp(sum log pi(probe_a | s_k)))`` from the
    actor's log-probs of the probe rows (``compute_log_prob(probe_data)``'s ``old_log_probs``,
    ``(N, R)``). Column ``n_b`` (the outcome, set by the algebra) and padding are 0.

    Args:
        probe_data: what :func:`build_probe_data` returned.
        log_probs: ``(N, R)`` per-token log-probs of its ``responses``.
        num_segments: ``(B,)`` segments per trace (``segment_ids.max(1) + 1``).
    """
    mask = probe_data.batch["response_mask"].bool()
    if log_probs.shape != mask.shape:
        raise ValueError(
            f"log_probs must be (N, R) = {tuple(mask.shape)} like the probes' responses; got "
            f"{tuple(log_probs.shape)}"
        )
    B = int(probe_data.meta_info["rredcot_rows"])
    S = int(num_segments.max()) if len(num_segments) else 0
    values = torch.zeros(B, S + 1)
    totals = torch.where(mask, log_probs.float().cpu(), torch.zeros_like(log_probs.float().cpu()))
    for (row, k), lp in zip(probe_data.non_tensor_batch["rredcot_probe"], totals.sum(dim=1)):
        if row >= 0 and k < S + 1:
            values[row, k] += float(lp.exp())
    return values.clamp(max=1.0)


def _prompt_texts(data, tokenizer) -> list[str]:
    """Each row's prompt text: the user turn of ``non_tensor_batch["raw_prompt"]`` (verl's
    ``data.return_raw_chat``) when present, else the prompt ids decoded without special tokens."""
    nt = data.non_tensor_batch
    if "raw_prompt" in nt:
        return [prompt_text(p) for p in nt["raw_prompt"]]
    b = data.batch
    prompts = b["prompts"]
    keep = b["attention_mask"][:, : prompts.shape[1]].bool()
    return [
        tokenizer.decode(prompts[row][keep[row]].tolist(), skip_special_tokens=True)
        for row in range(prompts.shape[0])
    ]


def process_reward_values(data, tokenizer, config: Any = None, eos_token_ids: Any = None) -> Tensor:
    """``(B, S+1)`` process-reward values of a verl batch, computed on the driver: the responses
    are decoded and segmented exactly as the estimator segments them (:func:`make_segmenter`),
    and the method's source (``algorithm.rredcot.process_reward.function`` or ``.model``) scores
    every boundary (:meth:`rredcot.methods.process_reward.ProcessRewardCredit.boundary_values`;
    column 0 and column ``n`` are set by the estimator).

    Args:
        data: verl ``DataProto`` with ``prompts`` (left-padded), ``responses``,
            ``attention_mask`` (over prompt + response) and, optionally, ``response_mask`` and
            ``non_tensor_batch["raw_prompt"]``.
        tokenizer: the policy's tokenizer; config: verl's algorithm config.
    """
    method_name, cfg = credit_settings(config)
    if method_name != "process_reward":
        raise ValueError(
            f"process_reward_values needs algorithm.rredcot.credit_method=process_reward, not "
            f"{method_name!r}"
        )
    problems = [Problem(text, "") for text in _prompt_texts(data, tokenizer)]
    batch = _driver_batch(data, tokenizer, make_segmenter(cfg, config), eos_token_ids, problems)
    values, _, _ = _method_for(method_name, cfg, config).boundary_values(batch)
    return values.cpu()


def num_segments_of(segment_ids: Tensor, response_mask: Tensor) -> Tensor:
    """``(B,)`` segments per row from verl-layout segment ids (holes allowed)."""
    return torch.tensor(
        [len(b) - 1 for b in boundaries_from_segment_ids(segment_ids, response_mask)]
    )


def _register_trainer() -> type | None:
    """Register ``trainer.v1.trainer_mode=rredcot_sync`` when verl's v1 trainer imports (a full
    verl install: TransferQueue, Ray, the rollout servers); a core-only install skips it."""
    try:
        import transfer_queue as tq
        from verl.trainer.ppo.v1.trainer_base import TRAINER_REGISTRY, register_trainer
        from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
    except ModuleNotFoundError as err:  # a core-only install (pip install 'rredcot[verl]')
        logger.debug("rredcot: verl's v1 trainer is not installed (%s); no %s", err, TRAINER_MODE)
        return None
    except ImportError as err:  # installed but broken: say so, the estimator still works
        logger.warning("rredcot: cannot import verl's v1 trainer (%s); no %s", err, TRAINER_MODE)
        return None
    if TRAINER_MODE in TRAINER_REGISTRY:
        return TRAINER_REGISTRY[TRAINER_MODE]

    @register_trainer(TRAINER_MODE)
    class RREDCoTPPOTrainerSync(PPOTrainerSync):
        """verl's synchronous v1 trainer; with ``algorithm.adv_estimator=rredcot`` it segments
        the responses before verl's own ``_compute_advantage`` runs."""

        def _compute_advantage(self, batch, metrics):
            if str(self.config.algorithm.adv_estimator) != ESTIMATOR:
                return super()._compute_advantage(batch, metrics)
            method, cfg = credit_settings(self.config.algorithm)
            fields = ["responses", "response_mask"] + (["values"] if method == "critic" else [])
            data = tq.kv_batch_get(
                keys=batch.keys, partition_id=batch.partition_id, select_fields=fields
            ).to_padded_tensor()
            segment_ids = segment_responses(
                data["responses"],
                data["response_mask"],
                self.tokenizer,
                make_segmenter(cfg, self.config.algorithm),
            )
            values = data["values"] if "values" in data.keys() else None  # noqa: SIM118
            metrics[f"{METRICS_PREFIX}mean_segments"] = float(
                (segment_ids.max(dim=1).values + 1).float().mean()
            )
            with rredcot_segments(segment_ids, values):
                return super()._compute_advantage(batch, metrics)

    return RREDCoTPPOTrainerSync


RREDCoTPPOTrainerSync = _register_trainer()
