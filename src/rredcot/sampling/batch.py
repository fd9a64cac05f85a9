"""The batch every stage of a step reads: prompts, samples, outcomes, segments, forward-pass
outputs. The data path (docs/architecture.md) is

    sample -> verify -> segment -> forward (log-probs, hidden states, entropies)
           -> credit method (values or weights) -> credit algebra (token advantages) -> loss

and each arrow makes a new frozen :class:`RolloutBatch` from the last one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from rredcot.algebra.layout import boundaries_to_segment_ids, shared_prefix_ids
from rredcot.tasks.base import Problem, Verdict

__all__ = ["GroupPeers", "RolloutBatch", "segment_layout"]


def segment_layout(
    boundaries: list[list[int]],
    response_mask: torch.Tensor,
    response_ids: torch.Tensor | None = None,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The one layout of rows' segments over their responses ``response_mask (B, T)``:
    ``(segment_ids (B, T), prefix_ids (B, S+1) | None)``, on ``response_mask``'s device.

    ``segment_ids``: token ``t`` of a row in segment ``k - 1`` when ``b_{k-1} <= t < b_k``, -1 on
    padding (:func:`rredcot.algebra.layout.boundaries_to_segment_ids`). ``prefix_ids``: with the
    rows' ``response_ids (B, T)`` and ``group_ids (B,)``, an id per prefix ``s_k``, shared by the
    rows of a group whose first ``b_k`` tokens agree
    (:func:`rredcot.algebra.layout.shared_prefix_ids`); None without them (rows not yet
    cut, or another trainer's rows)."""
    segment_ids = boundaries_to_segment_ids(boundaries, response_mask.shape[1]).to(
        response_mask.device
    )
    if response_ids is None or group_ids is None:
        return segment_ids, None
    return segment_ids, shared_prefix_ids(response_ids, response_mask, boundaries, group_ids)


@dataclass(frozen=True)
class GroupPeers:
    """The rows of a batch's groups that other processes hold (under TRL a group may span
    processes), as a method that reads the group's samples needs them (continuation
    likelihood's sources): one entry per peer row, in the order of the rows of every process.
    ``before[i]``: peer ``i`` is held by a process before this one (so it comes before this
    batch's rows in its group)."""

    group_ids: list[int]
    rewards: list[float]
    responses: list[tuple[int, ...]]  # response tokens, EOS included
    boundaries: list[list[int]]  # [0, b_1, ..., b_n]
    answers: list[str | None]  # the verifier's parsed answer of each (Verdict.answer)
    before: list[bool]

    def __len__(self) -> int:
        return len(self.group_ids)

    def around(self, own: list, theirs: list) -> list:
        """``own`` (one item per row of the batch, in row order) with ``theirs`` (one per peer)
        placed as the rows of every process are: earlier processes' peers first, then the
        batch's rows, then the later processes' peers."""
        first = [t for t, before in zip(theirs, self.before) if before]
        last = [t for t, before in zip(theirs, self.before) if not before]
        return first + own + last


@dataclass(frozen=True)
class RolloutBatch:
    """B sampled completions with everything a credit method may read. Frozen: each stage of
    the step (sampling, segmentation, the forward pass) makes a new batch with :meth:`replace`.

    The sequence layout is ``[left-padded prompt (P columns) | right-padded response (T columns)]``.
    """

    input_ids: torch.Tensor  # (B, L), L = P + T
    attention_mask: torch.Tensor  # (B, L)
    prompt_len: int  # P
    response_mask: torch.Tensor  # (B, T) float, 1 on real response tokens (EOS included)
    rewards: torch.Tensor  # (B,) float
    group_ids: torch.Tensor  # (B,) long; the G samples of one prompt share an id
    boundaries: list[list[int]]  # per row: [0, b_1, ..., b_n = T_b]
    segment_ids: torch.Tensor  # (B, T) long, -1 on padding
    segment_char_starts: list[list[int]] = field(default_factory=list)  # per row, per segment
    problems: list[Problem] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    verdicts: list[Verdict] = field(default_factory=list)
    old_logprobs: torch.Tensor | None = None  # (B, T)
    hidden_states: torch.Tensor | None = None  # (B, L, H * len(layers)) from the old-logprob pass
    position_ids: torch.Tensor | None = None  # (B, L)
    entropies: torch.Tensor | None = None  # (B, T) next-token entropy (entropy segmentation)
    prefix_ids: torch.Tensor | None = (
        None  # (B, S+1) rredcot.algebra.layout.shared_prefix_ids, -1 on padding
    )
    # (B, T) float, tree groups only (sampling.tree): how many leaves of the group share the
    # tokens up to and including each one (rredcot.sampling.tree.token_share_counts); None otherwise
    token_share_counts: torch.Tensor | None = None
    # (B,) bool, references.mode luffy only: True on a reference row (an off-policy sample whose
    # behaviour probability is taken as 1, rredcot.training.references); None: every row was sampled
    off_policy: torch.Tensor | None = None
    # rredcot.sampling.decode.SampledCache or None: the fast decoder's keys and values of the sampled
    # rows, kept for the credit's probes (train's probe_from_cache) until the credit is computed
    probe_cache: Any = None
    # GroupPeers or None: the rows of these groups that other processes hold (TRL; set by the
    # adapter for a method that reads the group's samples); None: every group's rows are here
    peers: GroupPeers | None = None

    def replace(self, **changes: Any) -> RolloutBatch:
        """A copy with the given fields changed (tensors are shared, not copied)."""
        return dataclasses.replace(self, **changes)

    def with_segments(
        self, boundaries: list[list[int]], char_starts: list[list[int]]
    ) -> RolloutBatch:
        """A copy whose rows are cut at ``boundaries`` (per row ``[0, b_1, ..., b_n]``, response
        tokens), each segment starting at ``char_starts`` in its row's text, with its
        ``segment_ids`` and ``prefix_ids`` laid out (:func:`segment_layout`)."""
        segment_ids, prefix_ids = segment_layout(
            boundaries, self.response_mask, self.input_ids[:, self.prompt_len :], self.group_ids
        )
        return self.replace(
            boundaries=boundaries,
            segment_char_starts=char_starts,
            segment_ids=segment_ids,
            prefix_ids=prefix_ids,
        )

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def response_len(self) -> int:
        return self.response_mask.shape[1]

    @property
    def num_segments(self) -> torch.Tensor:
        """(B,) number of segments of each row."""
        return torch.tensor([len(b) - 1 for b in self.boundaries], dtype=torch.long)

    def response_tokens(self, row: int, length: int | None = None) -> list[int]:
        """``row``'s first ``length`` response token ids (default: up to its last boundary)."""
        end = self.boundaries[row][-1] if length is None else length
        return self.input_ids[row, self.prompt_len : self.prompt_len + end].tolist()

    def boundary_positions(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Sequence positions of the last token of each prefix ``s_k`` and their mask.

        Returns ``(positions (B, S+1) long, mask (B, S+1) bool)``: column 0 is the last prompt
        token (``s_0``), column k the last token of segment k (``P + b_k - 1``).
        """
        max_segments = max((len(b) - 1 for b in self.boundaries), default=0)
        positions = torch.zeros(self.size, max_segments + 1, dtype=torch.long)
        mask = torch.zeros(self.size, max_segments + 1, dtype=torch.bool)
        for row, bounds in enumerate(self.boundaries):
            for k, b in enumerate(bounds):
                positions[row, k] = self.prompt_len + b - 1
                mask[row, k] = True
        return positions.to(self.input_ids.device), mask.to(self.input_ids.device)

    def select(self, rows: torch.Tensor | list[int]) -> RolloutBatch:
        """A sub-batch of the given rows (for minibatches and replay)."""
        idx = torch.as_tensor(rows, dtype=torch.long)
        pick = lambda t: None if t is None else t[idx.to(t.device)]  # noqa: E731
        keep = idx.tolist()
        # the prefix ids are as wide as the widest row kept (as segment_batch lays them out)
        width = max((len(self.boundaries[i]) for i in keep), default=1)
        prefix_ids = None if self.prefix_ids is None else pick(self.prefix_ids)[:, :width]
        return RolloutBatch(
            input_ids=pick(self.input_ids),
            attention_mask=pick(self.attention_mask),
            prompt_len=self.prompt_len,
            response_mask=pick(self.response_mask),
            rewards=pick(self.rewards),
            group_ids=pick(self.group_ids),
            boundaries=[self.boundaries[i] for i in keep],
            segment_ids=pick(self.segment_ids),
            segment_char_starts=[self.segment_char_starts[i] for i in keep]
            if self.segment_char_starts
            else [],
            problems=[self.problems[i] for i in keep] if self.problems else [],
            completions=[self.completions[i] for i in keep] if self.completions else [],
            verdicts=[self.verdicts[i] for i in keep] if self.verdicts else [],
            old_logprobs=pick(self.old_logprobs),
            hidden_states=pick(self.hidden_states),
            position_ids=pick(self.position_ids),
            entropies=pick(self.entropies),
            prefix_ids=prefix_ids,
            token_share_counts=pick(self.token_share_counts),
            off_policy=pick(self.off_policy),
            probe_cache=None if self.probe_cache is None else self.probe_cache.select(keep),
        )
