"""Credit from a value source the method does not train (the policy's own answer or
continuation probes, a process reward model, verl's critic), made safe by the guard every value
source shares (:mod:`rredcot.methods.guard`; docs/method.md, value sources).

The method cannot make the source better, so all it learns is how far to trust it: the values
are anchored on the group's mean reward, and their credit is handed over from uniform (GRPO)
credit by a reliability measured on each fresh batch's outcomes *after* that batch's credit was
formed. A subclass supplies :meth:`ValueSourceCredit.boundary_values` (and, where the source's
values need it, :meth:`ValueSourceCredit.prepare_values`).
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from rredcot.algebra.credit import Cost, Values
from rredcot.algebra.normalization import group_mean_std
from rredcot.methods.base import CreditContext, CreditMethod, CreditRows, Estimate
from rredcot.methods.guard import Guard
from rredcot.sampling.batch import RolloutBatch

__all__ = ["MIN_DEPARTURE_RMS", "ValueSourceCredit"]

MIN_DEPARTURE_RMS = 0.01
"""Below this RMS of the values' departures from the baseline the fresh-batch slope is not
measured (NaN, which leaves the reliability as it is): near-zero departures make the slope's
ratio explode."""


class ValueSourceCredit(CreditMethod):
    """Values from a source outside the method, through the guard: the group-mean anchor, the
    hand-over by measured reliability, safe normalisation.

    :meth:`rows` measures the source's values of a batch (each process its own rows in the
    adapters, which then gather them); :meth:`estimate` hands their credit over from uniform by
    the reliability earned on earlier batches; :meth:`update` then scores those same values
    against the batch's outcomes."""

    learns = True

    def __init__(self, config, context: CreditContext) -> None:
        super().__init__(config, context)
        self.guard = Guard(config, MIN_DEPARTURE_RMS)

    # -- what a subclass supplies ---------------------------------------------------------------
    def boundary_values(self, batch: RolloutBatch) -> tuple[Tensor, Tensor, dict[str, float]]:
        """``(values (B, S+1), mask (B, S+1), stats)`` of the source on ``batch``; the stats'
        ``credit/extra_forward_tokens`` and ``credit/extra_generated_tokens`` become the
        :class:`~rredcot.algebra.credit.Cost`, the rest are logged."""
        raise NotImplementedError

    def prepare_values(self, values: Tensor, mask: Tensor, group_mean: Tensor) -> Tensor:
        """The source's values as credit reads them, before the anchor (default: as given)."""
        return values

    # -- the contract ---------------------------------------------------------------------------
    def rows(self, batch: RolloutBatch) -> CreditRows:
        values, mask, stats = self.boundary_values(batch)
        cost, stats = Cost.split_from(stats)
        return CreditRows.of(batch).replace(
            values=values, value_mask=mask, cost=cost, metrics=stats
        )

    def estimate(self, rows: CreditRows) -> Estimate:
        """The rows' values prepared, anchored on their groups' mean rewards (groups may span
        processes) and handed over from uniform credit by the guard's weight."""
        mean, _ = group_mean_std(rows.rewards, rows.group_ids)
        values = self.prepare_values(rows.values.float(), rows.value_mask, mean)
        values = self.guard.anchor(values, rows.value_mask, mean)
        metrics = {**rows.metrics, **self.guard.metrics()}
        w = metrics["credit/handover_weight"]
        return Estimate(
            Values(values, rows.value_mask, lam=self.lam, handover_weight=w), rows.cost, metrics
        )

    def update(self, rows: CreditRows, est: Estimate) -> dict[str, float]:
        """Score the values the estimate used on the rows' outcomes and fold the score into the
        reliability, the next batches' hand-over weight (:meth:`Guard.fold_estimate`). The source
        itself learns nothing."""
        metrics = self.guard.fold_estimate(rows, est)
        return {**metrics, "credit/handover_reliability_after": float(self.guard.reliability)}

    def pretrain_summary(self, history: list[dict[str, float]]) -> dict[str, float]:
        slopes = [m["credit/handover_slope"] for m in history]
        measured = [s for s in slopes if not math.isnan(s)]
        return {
            "value_pretrain/slope_mean": sum(measured) / len(measured) if measured else math.nan,
            "value_pretrain/reliability": float(self.guard.reliability),
        }

    # -- state: the guard only (the source is rebuilt from its own settings) --------------------
    def state_dict(self) -> dict[str, Any]:
        return {"version": 1, **self.guard.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # saved before the hand-over existed: nothing earned yet
            return
        if state.get("version") != 1:
            raise ValueError(
                f"{self.name} state has version {state.get('version')!r}; this code reads 1"
            )
        self.guard.load_state_dict(state)
