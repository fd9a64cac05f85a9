"""The credit algebra: a method's estimate -> segment advantages -> token advantages.

Every credit method in rredcot ends here (docs/method.md, the credit algebra). For a response
split into segments ``k = 1..n`` with prefix states ``s_0 .. s_n`` and outcome reward ``R``:

    V(s_n) := R                          (the finished trace is worth its outcome)
    r_k     = V(s_k) - V(s_{k-1})        (redistributed reward; sum_k r_k = R - V(s_0))
    A_k     = sum_{j >= k} lam^(j-k) r_j (segment-level GAE, gamma = 1)

in two stages, two pure functions:

1. :func:`segment_credit`: a method's estimate (:class:`Values` or :class:`Weights`) -> segment
   advantages ``(B, S)`` (:class:`SegmentCredit`): redistribution, segment GAE, the hand-over
   from GRPO (or reweighting). It runs over every row of a batch, on all processes at once
   where a batch is split, since GRPO's groups may span them.
2. :func:`token_advantages`: segment advantages -> token advantages ``(B, T)``, every token of
   segment ``k`` getting ``A_k``, divided by the rows' :class:`~rredcot.algebra.normalization.Scale`.
   It runs on a process's own rows and tokens.

Pure tensor functions, torch only. Layout conventions (docs/architecture.md):

- values ``(B, S+1)`` with ``value_mask (B, S+1)``: ``values[b, k] = V(s_k)``, valid for
  ``k <= n_b``; the mask is a prefix mask with at least one True (``s_0``) per row.
- segment quantities ``(B, S)`` with ``segment_mask (B, S)``: column ``k-1`` holds segment ``k``.
- token quantities ``(B, T)`` with ``response_mask (B, T)``.
- ``segment_ids (B, T)`` long: the 0-based segment of each response token, ``-1`` on padding.

Masks may be bool or 0/1 numbers (nonzero = valid). Every reduction is masked, and padded
positions of every output are exactly 0: whatever sits in the padding (even NaN) never leaks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rredcot.algebra.layout import (  # re-exported: their paths before algebra.layout
    boundaries_to_segment_ids,
    segment_token_counts,
    segments_to_tokens,
)
from rredcot.algebra.normalization import Scale, apply_scale, divide_rows, group_mean_std
from rredcot.algebra.tensor_checks import (
    as_bool,
    as_float,
    check_lam,
    check_ndim,
    check_prefix_mask,
    check_shape,
)

__all__ = [
    "SIGMA_RULES",
    "Cost",
    "SegmentCredit",
    "Values",
    "Weights",
    "anchor_values",
    "boundaries_to_segment_ids",
    "redistribute",
    "reweight_coefficients",
    "reweight_grpo",
    "segment_advantages_from_values",
    "segment_credit",
    "segment_gae",
    "segment_token_counts",
    "segments_to_tokens",
    "token_advantages",
    "weights_to_segment_rewards",
]


# --------------------------------------------------------------------------------------
# The contract between credit methods and the algebra
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Values:
    """A value method's estimate: ``V(s_k)`` at every segment boundary of every row.

    Attributes:
        values: ``(B, S+1)``, ``values[b, k] = V(s_k)`` (what sits at ``s_n`` is replaced by R).
        mask: ``(B, S+1)`` prefix mask, at least ``s_0`` per row.
        lam: GAE lambda over segments: a float in [0, 1], or ``(B, S)`` per boundary
            (:func:`segment_gae`).
        handover_weight: in [0, 1]: the credit is ``A_gr + handover_weight (A - A_gr)`` with
            ``A_gr`` GRPO's segment advantages ``R - mean(R_group)``; 0 gives GRPO exactly.
        form: ``"redistribute"`` (the values' GAE advantages, above) or ``"reweight"``: GRPO's
            advantage times ``1 + handover_weight (sigma_k - 1)``, sigma from the values'
            changes (:func:`reweight_coefficients`; ``lam`` is not used).
        sigma_rule, sigma_temperature: :func:`reweight_coefficients`'s ``rule`` and
            ``temperature`` (reweight only).
    """

    values: Tensor
    mask: Tensor
    lam: float | Tensor = 1.0
    handover_weight: float = 1.0
    form: str = "redistribute"
    sigma_rule: str = "softmax"
    sigma_temperature: float = 0.1


@dataclass(frozen=True)
class Weights:
    """An attribution method's estimate: how to split ``R - mean(R_group)`` over segments.

    Attributes:
        weights: ``(B, S)`` non-negative; renormalised over each row's valid segments.
        mask: ``(B, S)`` prefix mask of valid segments.
    """

    weights: Tensor
    mask: Tensor


@dataclass(frozen=True)
class Cost:
    """What an estimate cost beyond the step's own sampling and forward pass."""

    extra_forward_tokens: float = 0.0  # tokens run through a forward pass for the estimate
    extra_backward_tokens: float = 0.0  # ... of which also through a backward pass
    extra_generated_tokens: float = 0.0  # tokens sampled for it (they count against budgets)

    @classmethod
    def split_from(cls, stats: dict[str, float]) -> tuple[Cost, dict[str, float]]:
        """``(the cost a pass reported in stats, the other stats)``: a pass's
        ``credit/extra_forward_tokens`` and ``credit/extra_generated_tokens`` (0 if absent)."""
        rest = dict(stats)
        cost = cls(
            extra_forward_tokens=rest.pop("credit/extra_forward_tokens", 0.0),
            extra_generated_tokens=rest.pop("credit/extra_generated_tokens", 0.0),
        )
        return cost, rest

    def metrics(self) -> dict[str, float]:
        return {
            "credit/extra_forward_tokens": float(self.extra_forward_tokens),
            "credit/extra_backward_tokens": float(self.extra_backward_tokens),
            "credit/extra_generated_tokens": float(self.extra_generated_tokens),
        }


@dataclass(frozen=True)
class SegmentCredit:
    """The segment stage's output for ``B`` rows (:func:`segment_credit`).

    Attributes:
        advantages: ``(B, S)`` segment advantages before normalisation, 0 on padding.
        mask: ``(B, S)`` bool, the valid segments.
        rewards: ``(B, S)`` redistributed rewards ``r_k`` (attribution: ``w_k (R - mean)``).
        values: ``(B, S+1)`` the values credit used (Values only), else None.
        grpo: ``(B,)`` GRPO's advantage ``R - mean(R_group)`` before scaling (Values with groups
            only): its share of every segment is divided as GRPO divides it where a normaliser's
            std floor acts (:func:`token_advantages`).
    """

    advantages: Tensor
    mask: Tensor
    rewards: Tensor
    values: Tensor | None = None
    grpo: Tensor | None = None

    def rows(self, index: slice | Tensor) -> SegmentCredit:
        """The credit of the rows ``index`` (a process's own rows of a global batch)."""
        pick = lambda t: None if t is None else t[index]  # noqa: E731
        return SegmentCredit(
            self.advantages[index],
            self.mask[index],
            self.rewards[index],
            pick(self.values),
            pick(self.grpo),
        )


# --------------------------------------------------------------------------------------
# Values -> segment rewards -> segment advantages
# --------------------------------------------------------------------------------------


def redistribute(values: Tensor, value_mask: Tensor, rewards: Tensor) -> tuple[Tensor, Tensor]:
    """Redistribute each outcome over its segments by differences of values.

    Row ``b`` has ``n_b = value_mask[b].sum() - 1`` segments. ``V(s_{n_b})`` is replaced by the
    outcome ``R_b`` (whatever ``values[b, n_b]`` holds is ignored) and segment ``k`` gets
    ``r_k = V(s_k) - V(s_{k-1})`` at column ``k-1``. The rewards of a row telescope to
    ``R_b - V(s_0)`` whatever the value estimates are. Rows with ``n_b = 0`` (empty response)
    have no segments.

    Args:
        values: ``(B, S+1)`` float, ``values[b, k] = V(s_k)``.
        value_mask: ``(B, S+1)`` prefix mask, at least one True per row.
        rewards: ``(B,)`` outcome rewards.

    Returns:
        segment_rewards ``(B, S)`` (0 on padding) and segment_mask ``(B, S)`` bool.
    """
    check_ndim(values, 2, "values", "(B, S+1)")
    if values.shape[1] < 1:
        raise ValueError("values must have at least one column (V(s_0)); got shape (B, 0)")
    check_shape(value_mask, tuple(values.shape), "value_mask", "(B, S+1)")
    check_shape(rewards, (values.shape[0],), "rewards", "(B,)")
    values = as_float(values)
    value_mask = as_bool(value_mask)
    check_prefix_mask(value_mask, "value_mask", at_least_one=True)

    last = value_mask.sum(dim=1) - 1  # (B,) index of s_n
    full = torch.where(value_mask, values, torch.zeros_like(values))
    full = full.scatter(1, last[:, None], as_float(rewards, like=values)[:, None])
    segment_mask = value_mask[:, 1:]
    diffs = full[:, 1:] - full[:, :-1]
    segment_rewards = torch.where(segment_mask, diffs, torch.zeros_like(diffs))
    return segment_rewards, segment_mask


def anchor_values(values: Tensor, value_mask: Tensor, baseline: Tensor) -> Tensor:
    """Shift every row's values so that ``V(s_0)`` is ``baseline``:
    ``V'(s_k) = V(s_k) - V(s_0) + baseline``.

    With the group's mean reward as the baseline, :func:`redistribute` then gives each trace
    GRPO's total ``R - mean(R_group)``, and the estimator only moves credit between the
    segments of the trace by its value increments. Whatever it gets wrong about how hard the
    prompt is (the same error at every boundary of a row) cancels.

    Args:
        values: ``(B, S+1)``; value_mask: ``(B, S+1)`` prefix mask; baseline: ``(B,)``.

    Returns:
        anchored values ``(B, S+1)``, 0 on padding.
    """
    check_ndim(values, 2, "values", "(B, S+1)")
    check_shape(value_mask, tuple(values.shape), "value_mask", "(B, S+1)")
    check_shape(baseline, (values.shape[0],), "baseline", "(B,)")
    values = as_float(values)
    value_mask = as_bool(value_mask)
    shifted = values - values[:, :1] + as_float(baseline, like=values)[:, None]
    return torch.where(value_mask, shifted, torch.zeros_like(shifted))


def segment_gae(segment_rewards: Tensor, segment_mask: Tensor, lam: float | Tensor) -> Tensor:
    """Segment-level GAE with gamma = 1: ``A_k = r_k + lam_k A_{k+1}`` over valid segments.

    ``lam = 0`` gives ``A_k = r_k`` (pure redistribution); ``lam = 1`` gives
    ``A_k = R - V(s_{k-1})`` (Monte Carlo return with a state-value baseline).

    ``lam`` may also be a ``(B, S)`` tensor: ``lam[b, k-1]`` is the weight of the boundary
    ``s_k`` that ends segment ``k``. ``lam_k = 1`` passes straight through ``s_k``, so whatever
    ``V(s_k)`` holds cancels (a boundary whose value is unknown); ``lam_k = 0`` trusts it fully.

    Args:
        segment_rewards: ``(B, S)`` from :func:`redistribute`.
        segment_mask: ``(B, S)`` prefix mask.
        lam: GAE lambda in ``[0, 1]``: a float or ``(B, S)``.

    Returns:
        segment_advantages ``(B, S)``, 0 on padding.
    """
    check_ndim(segment_rewards, 2, "segment_rewards", "(B, S)")
    check_shape(segment_mask, tuple(segment_rewards.shape), "segment_mask", "(B, S)")
    segment_rewards = as_float(segment_rewards)
    segment_mask = as_bool(segment_mask)
    check_prefix_mask(segment_mask, "segment_mask", at_least_one=False)
    if isinstance(lam, Tensor):
        check_shape(lam, tuple(segment_rewards.shape), "lam", "(B, S)")
        lam = as_float(lam, like=segment_rewards)
        valid = lam[segment_mask]
        if bool(((valid < 0) | (valid > 1) | ~torch.isfinite(valid)).any()):
            raise ValueError("every lam[b, k] must be in [0, 1] on valid segments")
        lam = torch.where(segment_mask, lam, torch.zeros_like(lam))
        lam_at = lambda k: lam[:, k]  # noqa: E731
    else:
        lam = check_lam(lam)
        lam_at = lambda k: lam  # noqa: E731

    r = torch.where(segment_mask, segment_rewards, torch.zeros_like(segment_rewards))
    advantages = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0]) if r.shape[1] > 0 else None
    for k in reversed(range(r.shape[1])):  # padding is on the right and is 0: it adds nothing
        running = r[:, k] + lam_at(k) * running
        advantages[:, k] = running
    return torch.where(segment_mask, advantages, torch.zeros_like(advantages))


def segment_advantages_from_values(
    values: Tensor, value_mask: Tensor, rewards: Tensor, lam: float | Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`redistribute` then :func:`segment_gae`.

    Args:
        values: ``(B, S+1)``; value_mask: ``(B, S+1)``; rewards: ``(B,)``; lam in ``[0, 1]``
        (a float, or ``(B, S)`` per boundary: see :func:`segment_gae`).

    Returns:
        segment_advantages ``(B, S)``, segment_mask ``(B, S)``, segment_rewards ``(B, S)``.
    """
    segment_rewards, segment_mask = redistribute(values, value_mask, rewards)
    return segment_gae(segment_rewards, segment_mask, lam), segment_mask, segment_rewards


def weights_to_segment_rewards(
    weights: Tensor, segment_mask: Tensor, rewards: Tensor, baseline: Tensor
) -> Tensor:
    """Split ``R - baseline`` over segments by attribution weights: ``r_k = w_k (R - baseline)``.

    Weights are renormalised over the valid segments of each row so they sum to 1; they must
    be finite and ``>= 0`` there (padding is ignored). A row whose valid weights are all zero
    gets uniform weights ``1 / n_b``. Rows without segments get nothing.

    Args:
        weights: ``(B, S)`` non-negative attribution weights.
        segment_mask: ``(B, S)`` prefix mask.
        rewards: ``(B,)`` outcome rewards.
        baseline: ``(B,)`` the value of the prompt, ``V(s_0)`` (e.g. the group mean reward).

    Returns:
        segment_rewards ``(B, S)``, 0 on padding; each row sums to ``R - baseline`` when it
        has at least one segment. Feed it to :func:`segment_gae` (usually with ``lam = 0``).
    """
    check_ndim(weights, 2, "weights", "(B, S)")
    check_shape(segment_mask, tuple(weights.shape), "segment_mask", "(B, S)")
    check_shape(rewards, (weights.shape[0],), "rewards", "(B,)")
    check_shape(baseline, (weights.shape[0],), "baseline", "(B,)")
    weights = as_float(weights)
    segment_mask = as_bool(segment_mask)
    check_prefix_mask(segment_mask, "segment_mask", at_least_one=False)

    w = torch.where(segment_mask, weights, torch.zeros_like(weights))
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise ValueError(
            "weights must be finite and >= 0 on valid segments (use e.g. abs() or a softmax "
            "on signed attributions)"
        )
    peak = w.amax(dim=1, keepdim=True) if w.shape[1] else w.sum(dim=1, keepdim=True)
    w = w / torch.where(peak > 0, peak, torch.ones_like(peak))  # in [0, 1]: sums neither over-
    w = torch.where(peak > 0, w, segment_mask.to(w.dtype))  # nor underflow; all-zero -> uniform
    total = w.sum(dim=1, keepdim=True)
    w = w / torch.where(total > 0, total, torch.ones_like(total))
    credit = as_float(rewards, like=w) - as_float(baseline, like=w)
    return torch.where(segment_mask, w * credit[:, None], torch.zeros_like(w))


# --------------------------------------------------------------------------------------
# Reweighting GRPO by segment (credit.form = reweight)
# --------------------------------------------------------------------------------------

SIGMA_RULES = ("softmax", "linear", "rank")
"""How :func:`reweight_coefficients` turns aligned value changes into weights (docs/method.md)."""


def reweight_coefficients(
    segment_rewards: Tensor,
    segment_mask: Tensor,
    segment_lengths: Tensor,
    direction: Tensor,
    rule: str = "softmax",
    temperature: float = 0.1,
) -> Tensor:
    """Normalised redistribution coefficients ``sigma_k >= 0`` of each row's segments.

    A segment's *aligned change* is ``u_k = sign(A_GRPO) * r_k``: its value change
    ``r_k = V(s_k) - V(s_{k-1})``, positive when it moved the value the way the outcome went
    (up in a trace better than its group, down in a worse one). Rules, each then scaled so that
    sigma averages 1 over the row's tokens (``sum_k len_k sigma_k = sum_k len_k``):

    - ``softmax``: ``sigma_k ∝ exp(u_k / temperature)``;
    - ``linear``: ``sigma_k ∝ max(0, 1 + (u_k - mean_tokens(u)) / temperature)`` (clipped linear);
    - ``rank``: ``sigma_k ∝ rank of u_k`` among the row's segments (1 = least aligned, ties share
      their mean rank); ``temperature`` is unused.

    Rows whose direction is 0 (an agreeing group: GRPO's advantage is 0) and rows with one
    segment get sigma = 1.

    Args:
        segment_rewards: ``(B, S)`` value changes ``r_k`` (:func:`redistribute`).
        segment_mask: ``(B, S)`` prefix mask.
        segment_lengths: ``(B, S)`` tokens per segment (:func:`segment_token_counts`); a valid
            segment without tokens weighs nothing in the average.
        direction: ``(B,)`` the sign (or any value; only its sign is read) of GRPO's advantage.
        rule: one of :data:`SIGMA_RULES`; temperature: > 0.

    Returns:
        sigma ``(B, S)``, >= 0, token-weighted mean 1 on each row with tokens; 0 on padding.
    """
    if rule not in SIGMA_RULES:
        raise ValueError(f"unknown sigma rule {rule!r}; valid: {', '.join(SIGMA_RULES)}")
    if not temperature > 0:
        raise ValueError(f"reweight temperature must be > 0, got {temperature}")
    check_ndim(segment_rewards, 2, "segment_rewards", "(B, S)")
    shape = tuple(segment_rewards.shape)
    check_shape(segment_mask, shape, "segment_mask", "(B, S)")
    check_shape(segment_lengths, shape, "segment_lengths", "(B, S)")
    check_shape(direction, (shape[0],), "direction", "(B,)")
    r = as_float(segment_rewards)
    mask = as_bool(segment_mask)
    lengths = torch.where(mask, as_float(segment_lengths, like=r), torch.zeros_like(r))
    sign = torch.sign(as_float(direction, like=r))
    aligned = torch.where(mask, sign[:, None] * r, torch.zeros_like(r))
    total = lengths.sum(dim=1, keepdim=True)

    if rule == "softmax":
        shifted = aligned / temperature
        peak = torch.where(mask, shifted, torch.full_like(shifted, -torch.inf)).amax(
            dim=1, keepdim=True
        )
        peak = torch.where(torch.isfinite(peak), peak, torch.zeros_like(peak))
        raw = torch.where(mask, torch.exp(shifted - peak), torch.zeros_like(r))
    elif rule == "linear":
        mean = (lengths * aligned).sum(dim=1, keepdim=True) / total.clamp_min(1e-12)
        raw = (1 + (aligned - mean) / temperature).clamp_min(0)
    else:  # rank: 1 + number below + half the ties (the mean rank of a tie)
        below = (aligned[:, None, :] < aligned[:, :, None]) & mask[:, None, :]
        ties = (aligned[:, None, :] == aligned[:, :, None]) & mask[:, None, :]
        raw = 1 + below.sum(dim=2).to(r.dtype) + (ties.sum(dim=2).to(r.dtype) - 1) / 2
    raw = torch.where(mask, raw, torch.zeros_like(raw))
    weighted = (lengths * raw).sum(dim=1, keepdim=True)
    sigma = torch.where(weighted > 0, raw * total / weighted.clamp_min(1e-30), torch.ones_like(r))
    keep_one = (sign == 0) | (mask.sum(dim=1) <= 1)
    sigma = torch.where(keep_one[:, None], torch.ones_like(sigma), sigma)
    return torch.where(mask, sigma, torch.zeros_like(sigma))


def reweight_grpo(
    grpo: Tensor,
    sigma: Tensor,
    segment_mask: Tensor,
    handover_weight: float = 1.0,
) -> Tensor:
    """GRPO's advantage reweighted by segment: ``A_k = (1 + w (sigma_k - 1)) * A_GRPO``.

    The sign of every segment's advantage is GRPO's; only its size moves between the segments of
    a trace. ``w = 0`` (or sigma = 1) returns ``A_GRPO`` on every segment exactly.

    Args:
        grpo: ``(B,)`` GRPO's advantage of each row (``R - mean(R_group)``, before scaling).
        sigma: ``(B, S)`` from :func:`reweight_coefficients`; segment_mask: ``(B, S)``.
        handover_weight: ``w`` in [0, 1].

    Returns:
        segment advantages ``(B, S)``, 0 on padding.
    """
    if not 0.0 <= handover_weight <= 1.0:
        raise ValueError(f"handover_weight={handover_weight} must be in [0, 1]")
    mask = as_bool(segment_mask)
    adv = as_float(grpo, like=sigma)[:, None].expand_as(sigma)
    if handover_weight > 0.0:
        adv = (1 + handover_weight * (sigma - 1)) * adv
    return torch.where(mask, adv, torch.zeros_like(adv))


# --------------------------------------------------------------------------------------
# Stage 1: a method's estimate -> segment advantages
# --------------------------------------------------------------------------------------


def segment_credit(
    estimate: Values | Weights,
    rewards: Tensor,
    group_ids: Tensor | None,
    segment_lengths: Tensor | None = None,
) -> SegmentCredit:
    """A method's estimate -> segment advantages ``(B, S)``, before normalisation.

    Values: redistribute -> segment GAE -> hand-over from GRPO by ``handover_weight``
    (``A_GRPO + w (A - A_GRPO)``); with ``form="reweight"``: redistribute -> GRPO's advantage
    times the blended coefficients of :func:`reweight_coefficients` (:func:`reweight_grpo`).
    Weights: ``r_k = w_k (R - mean(R_group))`` -> segment GAE with lambda 0.

    Args:
        estimate: :class:`Values` or :class:`Weights` over ``S`` segments.
        rewards: ``(B,)``; group_ids: ``(B,)`` integer (GRPO's groups: the hand-over,
            reweighting and weights need them).
        segment_lengths: ``(B, S)`` tokens per segment (:func:`segment_token_counts`); needed by
            ``form="reweight"`` only (sigma averages 1 over a row's tokens).

    Returns:
        :class:`SegmentCredit`.
    """
    rewards = as_float(rewards)

    def group_mean() -> Tensor:
        if group_ids is None:
            raise ValueError("the hand-over to GRPO, reweighting and weights need group_ids (B,)")
        return group_mean_std(rewards, group_ids.to(rewards.device))[0]

    if isinstance(estimate, Weights):
        mask = as_bool(estimate.mask)
        device = estimate.weights.device
        seg_rewards = weights_to_segment_rewards(
            estimate.weights, mask, rewards.to(device), group_mean().to(device)
        )
        return SegmentCredit(segment_gae(seg_rewards, mask, 0.0), mask, seg_rewards)
    if not isinstance(estimate, Values):
        raise TypeError(f"estimate must be Values or Weights, got {type(estimate).__name__}")
    trust = float(estimate.handover_weight)
    if not 0.0 <= trust <= 1.0:
        raise ValueError(f"Values.handover_weight={trust} must be in [0, 1]")
    if estimate.form not in ("redistribute", "reweight"):
        raise ValueError(f"Values.form={estimate.form!r}; valid: redistribute, reweight")
    values = estimate.values
    seg_adv, mask, seg_rewards = segment_advantages_from_values(
        values, estimate.mask, rewards.to(values.device), estimate.lam
    )
    grpo = None
    if group_ids is not None or trust < 1.0 or estimate.form == "reweight":
        grpo = (rewards - group_mean()).to(seg_adv.device)  # (B,) R - mean(R_group)
    if estimate.form == "reweight":
        if segment_lengths is None:
            raise ValueError("form='reweight' needs segment_lengths (B, S): segment_token_counts")
        sigma = reweight_coefficients(
            seg_rewards,
            mask,
            segment_lengths.to(seg_adv.device),
            grpo,
            estimate.sigma_rule,
            estimate.sigma_temperature,
        )
        seg_adv = reweight_grpo(grpo, sigma, mask, trust)
    elif trust < 1.0:
        share = torch.where(mask, grpo[:, None].expand_as(seg_adv), torch.zeros_like(seg_adv))
        seg_adv = share if trust == 0.0 else share + trust * (seg_adv - share)
    return SegmentCredit(seg_adv, mask, seg_rewards, values, grpo)


# --------------------------------------------------------------------------------------
# Stage 2: segment advantages -> token advantages, normalised
# --------------------------------------------------------------------------------------


def token_advantages(
    credit: SegmentCredit, segment_ids: Tensor, response_mask: Tensor, scale: Scale
) -> Tensor:
    """Every token of segment ``k`` gets ``A_k``, divided as ``scale`` says.

    Where the std floor of ``scale`` changed a row's divisor and the credit carries GRPO's share
    (value credit), the share is divided as GRPO divides it and only the departure from it keeps
    the floor (:func:`advantage_scale`): where the credit is GRPO's (hand-over weight 0, uniform)
    this is GRPO bit for bit at any reward scale.

    Args:
        credit: :class:`SegmentCredit` of the ``B`` rows (a process's own rows: :meth:`SegmentCredit.rows`).
        segment_ids: ``(B, T)`` long, ``-1`` on padding, row ``b`` using segments ``0..n_b-1``.
        response_mask: ``(B, T)``.
        scale: :func:`advantage_scale` of the same rows.

    Returns:
        token advantages ``(B, T)``, 0 on padding.
    """
    check_ndim(segment_ids, 2, "segment_ids", "(B, T)")
    check_shape(response_mask, tuple(segment_ids.shape), "response_mask", "(B, T)")
    ids = segment_ids.to(credit.advantages.device)
    tokens = segments_to_tokens(credit.advantages, ids, response_mask)
    out = apply_scale(tokens, response_mask, scale)
    if credit.grpo is not None and scale.floored is not None and bool(scale.floored.any()):
        share = torch.where(
            credit.mask, credit.grpo[:, None].expand_as(credit.advantages), torch.zeros(())
        ).to(credit.advantages.dtype)
        base = segments_to_tokens(share, ids, response_mask)
        mask = as_bool(response_mask)
        split = divide_rows(base, mask, scale.grpo_divisor) + divide_rows(
            tokens - base, mask, scale.divisor
        )
        out = torch.where(scale.floored.to(out.device)[:, None], split, out)
    return out
