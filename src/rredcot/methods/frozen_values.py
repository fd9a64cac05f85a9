"""Credit from a value estimator that does not learn (the policy's own answer probes, a frozen
process reward model), made safe the way the value head is (docs/method.md, value sources).

Such an estimator cannot get better, so all that is learnt is how far to trust it: its values
are anchored on the group's mean reward, and its credit is handed over from uniform (GRPO)
credit by a reliability measured on each fresh batch's outcomes *after* that batch's credit was
computed (:mod:`rredcot.methods.handover`). :class:`FrozenValuesCredit` holds that loop once for
every such method; a subclass supplies :meth:`~FrozenValuesCredit.segment_values` (and, where the
estimator's values need it, :meth:`~FrozenValuesCredit.prepare_values`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rredcot import credit
from rredcot.batch import RolloutBatch
from rredcot.credit import Cost, Values
from rredcot.methods.base import CreditContext, CreditMethod, Estimate
from rredcot.methods.handover import (
    anchor,
    handover_scores,
    live_rows,
    smoothed_reliability,
)

__all__ = ["MIN_DEPARTURE_RMS", "FrozenValuesCredit"]

MIN_DEPARTURE_RMS = 0.01
"""Below this RMS of the values' departures from the baseline the fresh-batch slope is not
measured (NaN, which leaves the reliability as it is): near-zero departures make the slope's
ratio explode (on the default warm-start it averaged 3,417)."""


class FrozenValuesCredit(CreditMethod):
    """Values from a frozen estimator with the value methods' guards: the group-mean anchor,
    the hand-over by measured reliability, safe normalisation.

    ``estimate`` hands credit over from uniform by ``reliability`` (earned on earlier batches);
    ``update`` then scores those same values against the batch's outcomes. The integrations,
    which compute values on their own rows, call :meth:`estimate_from_values` and
    :meth:`update_from_values`."""

    def __init__(self, config, context: CreditContext) -> None:
        super().__init__(config, context)
        self.reliability = 0.0  # EMA of the clipped fresh-batch score: the hand-over weight
        self.num_updates = 0
        self._scored: tuple[Tensor, Tensor, Tensor, Tensor, Tensor] | None = None

    # -- what a subclass supplies ---------------------------------------------------------------
    def segment_values(self, batch: RolloutBatch) -> tuple[Tensor, Tensor]:
        """``(values (B, S+1), mask (B, S+1))`` of the estimator on ``batch``."""
        raise NotImplementedError

    def prepare_values(self, values: Tensor, mask: Tensor, group_mean: Tensor) -> Tensor:
        """The estimator's values as credit reads them, before the anchor (default: as given)."""
        return values

    def pass_stats(self) -> dict[str, float]:
        """Statistics of the estimator's last pass (``credit/extra_forward_tokens`` and
        ``credit/extra_generated_tokens`` become the :class:`~rredcot.credit.Cost`)."""
        return {}

    def forget_pass(self) -> None:
        """Drop what the last pass cached, once its values have been scored."""

    # -- credit ---------------------------------------------------------------------------------
    @property
    def handover_weight(self) -> float:
        """Weight of the method's credit against uniform credit (1 with the hand-over off)."""
        return 1.0 if self.config.handover.mode == "off" else float(self.reliability)

    def estimate(self, batch: RolloutBatch) -> Estimate:
        """:meth:`estimate_from_values` of the batch's :meth:`segment_values`."""
        values, mask = self.segment_values(batch)
        return self.estimate_from_values(
            values, mask, batch.rewards, batch.group_ids, live_rows(batch)
        )

    def _ready(self, values: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """Prepared (:meth:`prepare_values`) and anchored on the group means of ``rewards``
        (groups may span processes); anchoring anchored values leaves them as they are."""
        mean, _ = credit.group_mean_std(rewards, group_ids)
        values = self.prepare_values(values.float(), mask, mean)
        return anchor(values, mask, mean, self.config.anchor)

    def estimate_from_values(
        self, values: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor, live: Tensor
    ) -> Estimate:
        """Values (this method's, or computed elsewhere: each process's rows in TRL, the
        driver's in verl) prepared, anchored and handed over from uniform credit by
        :attr:`handover_weight`; the arguments as :meth:`CreditMethod.estimate_from_values`."""
        values = self._ready(values, mask, rewards, group_ids)
        w = self.handover_weight
        self._scored = (
            values.detach(),
            mask,
            rewards.detach().clone(),
            group_ids.detach().clone(),
            live,
        )
        stats = dict(self.pass_stats())
        cost = Cost(
            extra_forward_tokens=stats.pop("credit/extra_forward_tokens", 0.0),
            extra_generated_tokens=stats.pop("credit/extra_generated_tokens", 0.0),
        )
        stats.update(
            {"credit/handover_reliability": float(self.reliability), "credit/handover_weight": w}
        )
        return Estimate(
            Values(values, mask, lam=self.lam, handover_weight=min(max(w, 0.0), 1.0)), cost, stats
        )

    def _last_scored(
        self, rewards: Tensor, group_ids: Tensor
    ) -> tuple[Tensor, Tensor, Tensor] | None:
        """``(values, mask, live)`` of the last estimate if it ran on these rows (the same
        rewards and groups: the trainer's and the integrations' update batch)."""
        if self._scored is None:
            return None
        values, mask, scored_rewards, groups, live = self._scored
        same = (
            scored_rewards.shape == rewards.shape
            and torch.equal(scored_rewards, rewards.detach().to(scored_rewards.device))
            and torch.equal(groups, group_ids.detach().to(groups.device))
        )
        return (values, mask, live) if same else None

    def update(self, batch: RolloutBatch) -> dict[str, float]:
        """Score the values the last estimate used (or, for a batch it did not see, the batch's
        own) on the batch's outcomes and fold the score into the reliability, the next batches'
        hand-over weight. The estimator itself learns nothing."""
        found = self._last_scored(batch.rewards, batch.group_ids)
        if found is None:
            values, mask = self.segment_values(batch)
            return self.update_from_values(
                values, mask, batch.rewards, batch.group_ids, live_rows(batch)
            )
        return self._score(*found, batch.rewards, batch.group_ids)

    def update_from_values(
        self, values: Tensor, mask: Tensor, rewards: Tensor, group_ids: Tensor, live: Tensor
    ) -> dict[str, float]:
        """:meth:`update` for rows whose values were computed elsewhere: scores the values the
        last :meth:`estimate_from_values` used on these rows (else ``values``, made ready)."""
        found = self._last_scored(rewards, group_ids)
        if found is None:
            found = self._ready(values, mask, rewards, group_ids), mask, live
        return self._score(*found, rewards, group_ids)

    def _score(
        self, scored: Tensor, mask: Tensor, live: Tensor, rewards: Tensor, group_ids: Tensor
    ) -> dict[str, float]:
        """Fold the score of ``scored`` values on the outcomes into the reliability."""
        device = scored.device
        live = live.to(device)
        mean = credit.group_mean_std(rewards, group_ids)[0].to(device)
        baseline = None if self.config.anchor == "none" else mean[live]
        score, slope, skill = handover_scores(
            scored[live],
            mask.to(device)[live],
            rewards.to(device)[live],
            baseline,
            self.config.handover.score,
            min_rms=MIN_DEPARTURE_RMS,
        )
        self.reliability = smoothed_reliability(
            self.reliability, score, self.config.handover.smoothing
        )
        self.num_updates += 1
        self._scored = None
        self.forget_pass()
        return {
            "credit/handover_slope": slope,
            "credit/handover_skill": skill,
            "credit/handover_reliability_after": float(self.reliability),
        }

    def pretrain(self, sample_batch, steps: int) -> dict[str, float]:
        """Measure reliability on ``steps`` batches from ``sample_batch()`` (the warm-start
        policy's samples) before RL, as ``update`` does during RL."""
        if steps < 0:
            raise ValueError(f"pretrain steps must be >= 0, got {steps}")
        slopes = [self.update(sample_batch())["credit/handover_slope"] for _ in range(steps)]
        measured = [s for s in slopes if not math.isnan(s)]
        return {
            "value_pretrain/steps": float(steps),
            "value_pretrain/slope_mean": sum(measured) / len(measured)
            if measured
            else float("nan"),
            "value_pretrain/reliability": float(self.reliability),
        }

    # -- state: the hand-over only (the estimator is frozen and rebuilt from its source) --------
    def state_dict(self) -> dict[str, Any]:
        return {
            "version": 1,
            "reliability": float(self.reliability),
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # saved before the hand-over existed: nothing earned yet
            return
        if state.get("version") != 1:
            raise ValueError(
                f"{self.name} state has version {state.get('version')!r}; this code reads 1"
            )
        self.reliability = float(state["reliability"])
        self.num_updates = int(state["num_updates"])
