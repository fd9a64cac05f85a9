"""The credit's cross-process plumbing: accelerate's collectives (:class:`Collective`) and the
rows of a generation batch on every process (:class:`GlobalRows`). No TRL import."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rredcot.integrations._batch import fit_columns
from rredcot.methods.base import CreditRows, RolloutBatch

__all__ = ["Collective", "GlobalRows", "global_rows"]


class Collective:
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
class GlobalRows:
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

    def gather(self, local: CreditRows, collective: Collective) -> CreditRows:
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
            return fit_columns(t, columns).to(device)

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


def global_rows(
    batch: RolloutBatch, rewards: Tensor, num_generations: int, collective: Collective
) -> GlobalRows:
    """Rewards and groups of every process's rows (TRL already gathered the rewards) and the
    segment counts (gathered here)."""
    N = rewards.shape[0]
    start = collective.rank * batch.size
    counts = collective.gather(batch.num_segments.to(collective.device))
    if counts.shape[0] != N:
        raise RuntimeError(
            f"rredcot: {counts.shape[0]} completions across processes but {N} rewards "
            "(TRL internals changed?)"
        )
    group_ids = torch.arange(N, device=rewards.device) // num_generations
    return GlobalRows(rewards, group_ids, counts.cpu(), start, batch.size)
