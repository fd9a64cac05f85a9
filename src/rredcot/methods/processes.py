"""A credit method across processes: accelerate's collectives (:class:`Collective`), the rows of
a step on every process (:class:`GlobalRows`), and the credit of this process's rows formed over
every process's (:func:`credit_over_processes`). ``rredcot train`` and the TRL adapter both use
them, so group and batch statistics, a value head's fit and a guard's reliability are the same
on every process, and equal to one process's on the union of the rows."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from rredcot.algebra.layout import fit_columns, shared_prefix_ids
from rredcot.methods.base import CreditMethod, CreditOutput, CreditRows, Estimate, RolloutBatch
from rredcot.sampling.batch import GroupPeers

__all__ = [
    "Collective",
    "GlobalRows",
    "credit_over_processes",
    "every_process_rows",
    "global_rows",
    "group_peers",
    "prefix_ids_over_processes",
]


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

    def sizes(self, rows: int) -> list[int]:
        """Every process's ``rows``, in process order."""
        if self.world == 1:
            return [int(rows)]
        return self.gather(torch.tensor([int(rows)], device=self.device)).tolist()

    def gather_rows(
        self, t: Tensor, pad_index: float = 0, sizes: list[int] | None = None
    ) -> Tensor:
        """Every process's rows of ``t`` ``(B_p, ...)`` concatenated in process order, dim 1
        (where there is one) padded with ``pad_index`` to the widest process's. Processes may
        hold different numbers of rows (``sizes``: every process's ``B_p``, gathered when not
        given)."""
        if self.world == 1:
            return t
        if t.dtype == torch.bool:  # not every backend gathers booleans
            return self.gather_rows(t.to(torch.uint8), pad_index, sizes).bool()
        acc = self.accelerator
        sizes = self.sizes(t.shape[0]) if sizes is None else sizes
        t = t.to(self.device).contiguous()
        if t.dim() > 1:
            t = acc.pad_across_processes(t, dim=1, pad_index=pad_index)
        most = max(sizes)
        if t.shape[0] < most:  # to the same shape on every process, cut again below
            pad = t.new_full((most - t.shape[0], *t.shape[1:]), pad_index)
            t = torch.cat([t, pad])
        every = acc.gather(t.contiguous())
        return torch.cat([every[p * most : p * most + n] for p, n in enumerate(sizes)])

    def sum(self, values: list[float]) -> list[float]:
        """``values`` summed element-wise over every process (float64; themselves on one)."""
        if self.world == 1:
            return [float(v) for v in values]
        mine = torch.tensor(values, dtype=torch.float64, device=self.device)
        return self.accelerator.reduce(mine, reduction="sum").cpu().tolist()

    def max_int(self, x: int) -> int:
        if self.world == 1:
            return int(x)
        return int(self.gather(torch.tensor([int(x)], device=self.accelerator.device)).max())

    def gather_objects(self, obj) -> list:
        """Every process's picklable ``obj``, in process order."""
        if self.world == 1:
            return [obj]
        every: list = [None] * self.world
        torch.distributed.all_gather_object(every, obj)
        return every

    def mean_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """Each numeric metric averaged over the processes that report it (NaNs skipped)."""
        mine = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.world == 1:
            return mine
        every: list[dict[str, float]] = self.gather_objects(mine)
        keys = sorted({k for part in every for k in part})
        return {
            k: float(torch.tensor([p[k] for p in every if k in p], dtype=torch.float64).nanmean())
            for k in keys
        }


@dataclass
class GlobalRows:
    """The rows of one step on all processes (process 0's first).

    Under TRL groups may span processes (TRL gathers the rewards of every process before it
    normalises them); under ``rredcot train`` each process holds whole groups. Either way the
    group statistics of the credit use these global rows."""

    rewards: Tensor  # (N,) outcome R (unscorable rows: their group's mean)
    group_ids: Tensor  # (N,) long
    counts: Tensor  # (N,) segments per row (0: unscorable or empty)
    start: int  # the local rows are [start, start + size)
    size: int
    sizes: list[int] | None = None  # every process's rows (None: ``size`` on each)

    @property
    def local(self) -> slice:
        return slice(self.start, self.start + self.size)

    @property
    def width(self) -> int:
        """``S + 1``: the most boundaries of any row."""
        return (int(self.counts.max()) if self.counts.numel() else 0) + 1

    def gather(
        self, local: CreditRows, collective: Collective, prefix_ids: Tensor | None = None
    ) -> CreditRows:
        """The credit rows of every process (:class:`~rredcot.methods.base.CreditRows`): this
        process's ``local`` rows' measurements gathered (padded to the widest row), the rewards
        and groups of every row, and the group's shared prefixes where given as ``prefix_ids``
        (every process's rows': :func:`prefix_ids_over_processes` under TRL, whose groups may
        span processes; each process's own ids made distinct under ``rredcot train``)."""
        width = self.width
        device = self.rewards.device
        sizes = self.sizes or [self.size] * collective.world

        def every(t: Tensor | None, columns: int, pad: float = 0) -> Tensor | None:
            if t is None:
                return None
            t = collective.gather_rows(t.contiguous(), pad_index=pad, sizes=sizes)
            return fit_columns(t, columns, pad).to(device)

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
            prefix_ids=None
            if prefix_ids is None
            else fit_columns(prefix_ids, width, -1).to(device),
            tree=local.tree,
            cost=local.cost,
            metrics=local.metrics,
        )


def global_rows(
    batch: RolloutBatch, rewards: Tensor, num_generations: int, collective: Collective
) -> GlobalRows:
    """TRL's: rewards and groups of every process's rows (TRL already gathered the rewards) and
    the segment counts (gathered here)."""
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


def group_peers(batch: RolloutBatch, collective: Collective) -> GroupPeers | None:
    """The rows other processes hold of ``batch``'s groups (TRL's groups may span processes):
    every process's rows (group id, reward, response tokens, boundaries, parsed answer)
    gathered, and those of this process's groups kept (:class:`~rredcot.sampling.batch.GroupPeers`).
    None on one process. Every process must call it (a collective)."""
    if collective.world == 1:
        return None
    answers = [v.answer for v in batch.verdicts] if batch.verdicts else [None] * batch.size
    mine = [
        (
            int(batch.group_ids[row]),
            float(batch.rewards[row]),
            tuple(batch.response_tokens(row)),
            list(bounds),
            None if answers[row] is None else str(answers[row]),
        )
        for row, bounds in enumerate(batch.boundaries)
    ]
    groups = {row[0] for row in mine}
    kept = [
        (p < collective.rank, row)
        for p, rows in enumerate(collective.gather_objects(mine))
        if p != collective.rank
        for row in rows
        if row[0] in groups
    ]
    return GroupPeers(
        group_ids=[row[0] for _, row in kept],
        rewards=[row[1] for _, row in kept],
        responses=[row[2] for _, row in kept],
        boundaries=[row[3] for _, row in kept],
        answers=[row[4] for _, row in kept],
        before=[before for before, _ in kept],
    )


def prefix_ids_over_processes(batch: RolloutBatch, collective: Collective) -> Tensor:
    """The shared-prefix ids of every process's rows, in process order, the same on every
    process (:func:`rredcot.algebra.layout.shared_prefix_ids`): prefixes of one group whose
    tokens agree share an id wherever their rows are (TRL's groups may span processes).
    Returns ``(N, S+1)`` long on the CPU, -1 on padding; on one process, the batch's own."""
    sizes = collective.sizes(batch.size)
    width = max((len(b) for b in batch.boundaries), default=1)
    bounds = torch.full((batch.size, width), -1, dtype=torch.long)
    for row, b in enumerate(batch.boundaries):
        bounds[row, : len(b)] = torch.tensor(b, dtype=torch.long)

    def every(t: Tensor, pad: float = 0) -> Tensor:
        return collective.gather_rows(t.to(collective.device), pad_index=pad, sizes=sizes).cpu()

    response = every(batch.input_ids[:, batch.prompt_len :].long())
    mask = every(batch.response_mask.float())
    groups = every(batch.group_ids.long())
    boundaries = [[b for b in row if b >= 0] for row in every(bounds, pad=-1).tolist()]
    return shared_prefix_ids(response, mask, boundaries, groups)


def _distinct(ids: Tensor, collective: Collective, sizes: list[int]) -> Tensor:
    """Every process's ids ``(B_p, ...)`` long (``-1``: none) gathered, each process's shifted
    past the ids of the processes before it."""
    shift = torch.tensor([int(ids.max()) + 1 if ids.numel() else 0], device=collective.device)
    shifts = collective.gather(shift).cpu()
    offset = int(shifts[: collective.rank].sum())
    mine = torch.where(ids >= 0, ids + offset, ids)
    return collective.gather_rows(mine, pad_index=-1, sizes=sizes).cpu()


def every_process_rows(local: CreditRows, collective: Collective) -> tuple[CreditRows, slice]:
    """``rredcot train``'s: the credit rows of every process, in process order, and the slice
    of them this process holds. Each process holds whole groups (its own prompts), so a
    process's group ids (and shared prefixes) are shifted past the processes' before it. On one
    process, ``local`` itself."""
    if collective.world == 1:
        return local, slice(0, len(local.rewards))
    device = local.rewards.device
    sizes = collective.sizes(len(local.rewards))
    start = sum(sizes[: collective.rank])
    rows = GlobalRows(
        rewards=collective.gather_rows(local.rewards.float(), sizes=sizes).to(device),
        group_ids=_distinct(local.group_ids.long(), collective, sizes).to(device),
        counts=collective.gather_rows(local.num_segments.long(), sizes=sizes).cpu(),
        start=start,
        size=sizes[collective.rank],
        sizes=sizes,
    )
    prefix_ids = None
    if local.prefix_ids is not None:
        prefix_ids = _distinct(local.prefix_ids.long(), collective, sizes)
    every = rows.gather(local, collective, prefix_ids=prefix_ids)
    live = collective.gather_rows(local.live, sizes=sizes).to(device)
    metrics = collective.mean_metrics(local.metrics)  # what measuring the rows saw
    return dataclasses.replace(every, live=live, metrics=metrics), rows.local


def credit_over_processes(
    method: CreditMethod,
    every: CreditRows,
    estimate: Estimate,
    segment_ids: Tensor,
    response_mask: Tensor,
    local: slice,
    collective: Collective,
) -> CreditOutput:
    """:meth:`~rredcot.methods.base.CreditMethod.credit_output` of this process's rows ``local``
    of ``every`` (the segment stage and the scale over every row). ``credit.normalization=
    'whiten'`` is over every token of the step, so there the token stage runs on every
    process's rows (their segment ids and masks gathered, a few integers a token) and each
    process keeps its own rows' credit."""
    if collective.world == 1:
        return method.credit_output(every, estimate, segment_ids, response_mask)
    if method.normalization != "whiten":
        return method.credit_output(every, estimate, segment_ids, response_mask, local=local)
    sizes = collective.sizes(segment_ids.shape[0])
    device = every.rewards.device
    all_ids = collective.gather_rows(segment_ids.long(), pad_index=-1, sizes=sizes).to(device)
    all_mask = collective.gather_rows(response_mask, sizes=sizes).to(device)
    out = method.credit_output(every, estimate, all_ids, all_mask)
    T = response_mask.shape[1]
    return dataclasses.replace(
        out,
        advantages=out.advantages[local, :T],
        segment_advantages=out.segment_advantages[local],
        segment_mask=out.segment_mask[local],
        values=None if out.values is None else out.values[local],
        value_mask=None if out.value_mask is None else out.value_mask[local],
    )
