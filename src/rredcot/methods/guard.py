"""The guard every value source shares (docs/method.md, value sources): the group-mean anchor,
the reliability measured on fresh outcomes, and the hand-over from uniform (GRPO) credit.

One :class:`Guard` wraps the values of any source (the value head, answer and continuation
likelihood, process rewards, verl's critic), so that every estimator is made safe the same way:

- :meth:`Guard.anchor` shifts the values so that ``V(s_0)`` is the group's mean reward
  (``credit.anchor="group"``): every trace gets GRPO's total credit ``R - mean R_group`` and the
  estimator only moves it between the trace's segments.
- :meth:`Guard.fold` measures, on a batch's outcomes after its credit was formed, how far the
  last prefix value ``V(s_{n-1})`` can be trusted beyond the baseline uniform credit already has
  (the least-squares slope, :func:`prediction_slope`, or the explained variance,
  :func:`explained_variance`) and folds the score, clipped to [0, 1], into an EMA: the
  reliability, which is the next batches' hand-over weight ``w``.
- the weight goes into :class:`rredcot.algebra.credit.Values`: the algebra gives
  ``A = A_uniform + w (A_value - A_uniform)``, GRPO's advantages at ``w = 0`` and the method's
  at ``w = 1`` (:func:`rredcot.algebra.credit.segment_credit`).
"""

from __future__ import annotations

from torch import Tensor

from rredcot.algebra.credit import anchor_values
from rredcot.algebra.normalization import group_mean_std
from rredcot.config import CreditConfig

__all__ = [
    "Guard",
    "bounded_skill",
    "explained_variance",
    "handover_scores",
    "prediction_slope",
    "smoothed_reliability",
]


def _last_prefix_value(
    values: Tensor, value_mask: Tensor, rewards: Tensor, baseline: Tensor | None
) -> tuple[Tensor, Tensor, Tensor] | None:
    """``(V(s_{n-1}), R, baseline)`` in float64 over the rows with at least one segment (the
    baseline defaults to the batch mean of those R); None when no row has a segment."""
    n = value_mask.bool().sum(dim=1) - 1
    rows = n >= 1
    if not bool(rows.any()):
        return None
    last = values[rows].gather(1, (n[rows] - 1).unsqueeze(1)).squeeze(1).double()
    r = rewards[rows].double().to(last.device)
    base = r.mean() if baseline is None else baseline[rows].double().to(last.device)
    return last, r, base


def explained_variance(
    values: Tensor, value_mask: Tensor, rewards: Tensor, baseline: Tensor | None = None
) -> float:
    """``1 - mean((R - V(s_{n-1}))^2) / mean((R - baseline)^2)`` over the rows with at least one
    segment: the share of the outcome variance around ``baseline`` (default: the batch mean, so
    the denominator is ``var(R)``) that the last prefix value explains (1 perfect, 0 no better
    than the baseline, negative worse). NaN when the baseline is exact or no row has a segment.

    Args:
        values: ``(B, S+1)``; value_mask: ``(B, S+1)`` prefix mask; rewards: ``(B,)``;
        baseline: ``(B,)`` or None.
    """
    picked = _last_prefix_value(values, value_mask, rewards, baseline)
    if picked is None:
        return float("nan")
    last, r, base = picked
    var = ((r - base) ** 2).mean()
    if float(var) < 1e-8:
        return float("nan")
    return float(1.0 - ((r - last) ** 2).mean() / var)


def prediction_slope(
    values: Tensor,
    value_mask: Tensor,
    rewards: Tensor,
    baseline: Tensor | None = None,
    min_rms: float = 0.0,
) -> float:
    """How much of the last prefix value's departure from the baseline to trust: the least-squares
    ``w`` in ``R - b ≈ w (V(s_{n-1}) - b)``, ``sum(e d) / sum(d^2)`` over the rows with at least
    one segment (``b`` = ``baseline``, default the batch mean of R).

    ``w = 1``: the departures are calibrated; ``0 < w < 1``: right in direction but too large;
    ``w <= 0``: noise. Unlike the explained variance, an over-confident estimator that still
    points the right way scores above 0. NaN when no row has a segment, every departure is 0, or
    the departures' root mean square is below ``min_rms`` (an estimator that hardly departs from
    the baseline has nothing to be trusted with, however well its tiny departures correlate).

    Args:
        values: ``(B, S+1)``; value_mask: ``(B, S+1)`` prefix mask; rewards: ``(B,)``;
        baseline: ``(B,)`` or None.
    """
    picked = _last_prefix_value(values, value_mask, rewards, baseline)
    if picked is None:
        return float("nan")
    last, r, base = picked
    d, e = last - base, r - base
    dd = float((d * d).sum())
    if dd < 1e-12 or (min_rms > 0 and (dd / d.numel()) ** 0.5 < min_rms):
        return float("nan")
    return float((e * d).sum()) / dd


def handover_scores(
    values: Tensor,
    value_mask: Tensor,
    rewards: Tensor,
    baseline: Tensor | None,
    kind: str,
    min_rms: float = 0.0,
) -> tuple[float, float, float]:
    """``(score, slope, explained variance)`` of values scored against fresh outcomes; ``score``
    is the one ``kind`` (``credit.handover.score``: ``"slope"`` or ``"explained_variance"``) names.

    The explained variance returned (the ``credit/handover_skill`` metric) is floored at -1
    (:func:`bounded_skill`); ``score`` is not (it is clipped to [0, 1] where it is used).

    Args:
        values: ``(B, S+1)`` the values credit uses (anchored when the method anchors);
        value_mask: ``(B, S+1)``; rewards: ``(B,)``; baseline: ``(B,)`` the baseline of uniform
        credit (the group mean when anchored) or None for the batch mean; min_rms: see
        :func:`prediction_slope`.
    """
    if kind not in ("slope", "explained_variance"):
        raise ValueError(f"credit.handover.score={kind!r}: use 'slope' or 'explained_variance'")
    slope = prediction_slope(values, value_mask, rewards, baseline, min_rms)
    skill = explained_variance(values, value_mask, rewards, baseline)
    return (slope if kind == "slope" else skill), slope, bounded_skill(skill)


def bounded_skill(skill: float) -> float:
    """A skill score (``1 - MSE / MSE of the baseline``) floored at -1, for the logs.

    Below 0 the values predict the outcomes worse than the baseline; how much worse is unbounded,
    because the denominator is the outcomes' variance around the baseline, which is tiny where a
    batch's groups nearly agree: with the group mean as baseline and rewards whose groups spread
    by ~0.02, an error of 0.5 reads about -600. -1 ("at least twice the baseline's error") keeps
    the curve readable; NaN (nothing to score) stays NaN."""
    return skill if skill != skill else max(float(skill), -1.0)


def smoothed_reliability(reliability: float, score: float, decay: float) -> float:
    """``decay * reliability + (1 - decay) * clip(score, 0, 1)``; a NaN score (nothing to
    measure) leaves ``reliability`` as it is."""
    if score != score:  # NaN
        return float(reliability)
    return decay * float(reliability) + (1.0 - decay) * min(max(float(score), 0.0), 1.0)


class Guard:
    """The anchor, the reliability and the hand-over weight of one value source.

    Args:
        config: the credit settings (``credit.anchor``, ``credit.handover.*``).
        min_departure_rms: the slope is not measured below this RMS of the values' departures
            from the baseline (:func:`prediction_slope`'s ``min_rms``).
    """

    def __init__(self, config: CreditConfig, min_departure_rms: float = 0.0) -> None:
        self.config = config
        self.min_departure_rms = min_departure_rms
        self.reliability = 0.0  # EMA of the clipped fresh-batch score
        self.num_updates = 0

    @property
    def weight(self) -> float:
        """Weight of the source's credit against uniform credit (1 with the hand-over off)."""
        return 1.0 if self.config.handover.mode == "off" else float(self.reliability)

    def anchor(self, values: Tensor, value_mask: Tensor, group_mean: Tensor) -> Tensor:
        """``credit.anchor``: ``"group"`` gives ``V(s_k) - V(s_0) + group_mean``, ``"none"``
        the values as they are.

        Args:
            values: ``(B, S+1)``; value_mask: ``(B, S+1)``; group_mean: ``(B,)``.
        """
        mode = self.config.anchor
        if mode == "none":
            return values
        if mode != "group":
            raise ValueError(f"credit.anchor={mode!r}: use 'group' or 'none'")
        return anchor_values(values, value_mask, group_mean.to(values.device, values.dtype))

    def metrics(self) -> dict[str, float]:
        """What the credit of this step is trusted with (logged with the estimate)."""
        return {
            "credit/handover_reliability": float(self.reliability),
            "credit/handover_weight": min(max(self.weight, 0.0), 1.0),
        }

    def fold_estimate(self, rows, est) -> dict[str, float]:
        """:meth:`fold` of the values an estimate gave credit (``est.credit.values``, anchored and
        before any node values) on the live rows' fresh outcomes: the one scoring of every
        guarded value (the value head and every ValueSourceCredit).

        Args:
            rows: the :class:`~rredcot.methods.base.CreditRows` the estimate was formed on;
            est: its :class:`~rredcot.methods.base.Estimate`, whose credit is ``Values``.
        """
        scored = est.credit.values.detach()
        device = scored.device
        live = rows.live.to(device)
        mean = group_mean_std(rows.rewards, rows.group_ids)[0].to(device)
        return self.fold(
            scored[live],
            est.credit.mask.to(device)[live],
            rows.rewards.to(device)[live],
            mean[live],
        )

    def fold(
        self, scored: Tensor, value_mask: Tensor, rewards: Tensor, group_mean: Tensor
    ) -> dict[str, float]:
        """Score ``scored`` values (as credit used them: anchored) on fresh outcomes and fold the
        ``credit.handover.score`` into the reliability.

        Args:
            scored: ``(B, S+1)``; value_mask: ``(B, S+1)``; rewards: ``(B,)``, all of the live
                rows only; group_mean: ``(B,)`` their groups' mean rewards: uniform credit's
                baseline (the batch mean stands in with ``credit.anchor=none``).
        """
        baseline = None if self.config.anchor == "none" else group_mean
        score, slope, skill = handover_scores(
            scored,
            value_mask,
            rewards,
            baseline,
            self.config.handover.score,
            min_rms=self.min_departure_rms,
        )
        self.reliability = smoothed_reliability(
            self.reliability, score, self.config.handover.smoothing
        )
        self.num_updates += 1
        return {"credit/handover_slope": slope, "credit/handover_skill": skill}

    def state_dict(self) -> dict[str, float | int]:
        return {"reliability": float(self.reliability), "num_updates": self.num_updates}

    def load_state_dict(self, state: dict) -> None:
        self.reliability = float(state["reliability"])
        self.num_updates = int(state["num_updates"])
