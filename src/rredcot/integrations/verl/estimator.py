"""The advantage estimator registered with verl as ``rredcot``
(:func:`compute_rredcot_advantage`): verl's token tensors through rredcot's credit algebra, with
the segment ids (and values) that :func:`rredcot_segments` makes visible for one call, and
:class:`CriticCredit`, the credit method of verl's critic (registered as ``critic``). Importing it
registers both, after the check that verl is installed."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rredcot.algebra import credit, layout
from rredcot.algebra.layout import fit_columns
from rredcot.errors import require_extra
from rredcot.integrations._batch import group_ids_from_keys, span_mask
from rredcot.integrations.verl.config import (
    ESTIMATOR,
    INSTALL_VERL,
    TRAINER_MODE,
    credit_settings,
    tail_floor_setting,
)
from rredcot.integrations.verl.segments import boundaries_from_segment_ids, fill_segment_holes
from rredcot.integrations.verl.state import method_for
from rredcot.methods.base import (
    CreditMethod,
    CreditOutput,
    CreditRows,
    register_credit,
    uniform_values,
)
from rredcot.methods.value_source import ValueSourceCredit
from rredcot.sampling.batch import RolloutBatch
from rredcot.training.row_policies import drop_small_tails

core_algos = require_extra(
    "verl.trainer.ppo.core_algos",
    "verl",
    "rredcot.integrations.verl",
    then=INSTALL_VERL,
)

__all__ = [
    "CriticCredit",
    "compute_rredcot_advantage",
    "critic_boundary_values",
    "dense_prefix_rewards",
    "rredcot_segments",
]


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
    method = method_for(method_name, cfg, config)
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
    filled = fill_segment_holes(segment_ids, mask)
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
    received = layout.segments_to_tokens(rows.prefix[:, :-1], rows.segment_ids, response_mask)
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
        segment_lengths=layout.segment_token_counts(
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
    return layout.segments_to_tokens(targets, segment_ids, response_mask)


core_algos.register_adv_est(ESTIMATOR)(compute_rredcot_advantage)
