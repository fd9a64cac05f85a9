"""``oracle``: segment values from the verifier's first-wrong-step label. BENCHMARK ONLY.

This method reads ground truth that training never has (``Verdict.first_error_step``, which
only tasks with step labels fill: the arithmetic chains, GSM8K calculator annotations). Its one
job is to say how much perfect segment credit is worth on a task, as a ceiling for the methods
that estimate values (``rredcot bench learn --methods uniform,oracle,...``); a run that trains
with it is not a result about any deployable method.

Values, with no recovery after the first wrong step:

- a prefix ``s_k`` that contains the trace's first wrong line has ``V(s_k) = 0``;
- a prefix that is still right has ``V(s_k) = p_g(m)``, the success rate of the samples of the
  same prompt group whose first ``m`` lines are right (``m`` = the lines ``s_k`` completes):
  ``p_g(m) = mean{R_j : j in g, L_j >= m}`` with ``L_j`` the number of right leading lines of
  sample ``j``. ``p_g(0)`` is the group's mean reward, uniform credit's ``V(s_0)``.

With ``lam = 0`` (the method's default) a wrong trace's blame lands on the segment that holds its
first wrong line, ``-p_g(m)``, and the segments before it get the small changes of ``p_g``; the
segments after it get 0. A row whose label is unknown (``first_error_step is None``) gets uniform
values (the group mean at every boundary).
"""

from __future__ import annotations

import bisect
import math

import torch

from rredcot import credit
from rredcot.batch import RolloutBatch
from rredcot.credit import Values
from rredcot.methods.base import CreditMethod, Estimate, register_credit

__all__ = ["OracleCredit", "completed_lines", "first_error_segment", "oracle_values"]

NO_ERROR = math.inf


def completed_lines(text: str, segment_char_starts: list[int]) -> list[int]:
    """How many lines of ``text`` each prefix completes: entry ``k`` for ``s_k``, ``k = 0..n``.

    A line counts once its text has ended inside the prefix (its newline, or the end of the
    text for the last line).
    """
    ends = [i + 1 for i, ch in enumerate(text) if ch == "\n"]
    if not text.endswith("\n"):
        ends.append(len(text))
    prefix_ends = list(segment_char_starts[1:]) + [len(text)]
    return [0] + [bisect.bisect_right(ends, end) for end in prefix_ends]


def first_error_segment(text: str, segment_char_starts: list[int], first_error_line: int) -> int:
    """1-based index of the segment holding line ``first_error_line`` (0-based); a line past
    the end of the text (a missing step) belongs to the last segment."""
    n = len(segment_char_starts)
    lines = text.split("\n")
    if first_error_line >= len(lines):
        return n
    offset = sum(len(line) + 1 for line in lines[:first_error_line])
    return max(1, bisect.bisect_right(segment_char_starts, offset))


def oracle_values(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    right_lines: list[float],
    lines_done: list[list[int]],
    error_segment: list[int | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values (B, S+1), value_mask (B, S+1))`` of the module docstring.

    Args:
        rewards: ``(B,)``; group_ids: ``(B,)`` integer.
        right_lines: per row ``L`` (``inf`` for a trace without a wrong line; ``nan``: unknown).
        lines_done: per row, the lines completed by ``s_0 .. s_n`` (:func:`completed_lines`).
        error_segment: per row, the 1-based segment of the first wrong line, or None.
    """
    B = rewards.shape[0]
    S = max((len(d) - 1 for d in lines_done), default=0)
    values = torch.zeros(B, S + 1, dtype=torch.float32)
    mask = torch.zeros(B, S + 1, dtype=torch.bool)
    group_mean, _ = credit.group_mean_std(rewards, group_ids)
    rows_of: dict[int, list[int]] = {}
    for row, g in enumerate(group_ids.tolist()):
        rows_of.setdefault(g, []).append(row)
    for row in range(B):
        done = lines_done[row]
        mask[row, : len(done)] = True
        peers = rows_of[int(group_ids[row])]
        known = [j for j in peers if not math.isnan(right_lines[j])]
        if math.isnan(right_lines[row]):
            values[row, : len(done)] = group_mean[row]
            continue
        for k, m in enumerate(done):
            if error_segment[row] is not None and k >= error_segment[row]:
                break  # the prefix holds the first wrong line: value 0
            alive = [j for j in known if right_lines[j] >= m]
            values[row, k] = float(rewards[alive].mean()) if alive else 0.0
        values[row, 0] = group_mean[row]
    return values, mask


@register_credit("oracle")
class OracleCredit(CreditMethod):
    """Ground-truth segment values from step labels (benchmark only; see the module doc)."""

    default_lam = 0.0

    def _values_and_coverage(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor, float]:
        """``(values, mask, fraction of rows with a step label)``."""
        right_lines: list[float] = []
        error_segment: list[int | None] = []
        lines_done: list[list[int]] = []
        for row, verdict in enumerate(batch.verdicts):
            text = batch.completions[row]
            starts = batch.segment_char_starts[row]
            lines_done.append(completed_lines(text, starts) if starts else [0])
            label = verdict.first_error_step
            if label is None or not starts:
                right_lines.append(math.nan)
                error_segment.append(None)
            elif label < 0:
                right_lines.append(NO_ERROR)
                error_segment.append(None)
            else:
                right_lines.append(float(label))
                error_segment.append(first_error_segment(text, starts, label))
        values, mask = oracle_values(
            batch.rewards.cpu(), batch.group_ids.cpu(), right_lines, lines_done, error_segment
        )
        device = batch.rewards.device
        labelled = sum(not math.isnan(x) for x in right_lines) / max(len(right_lines), 1)
        return values.to(device), mask.to(device), labelled

    def segment_values(self, batch: RolloutBatch) -> tuple[torch.Tensor, torch.Tensor]:
        values, mask, _ = self._values_and_coverage(batch)
        return values, mask

    def estimate(self, batch: RolloutBatch) -> Estimate:
        values, mask, labelled = self._values_and_coverage(batch)
        metrics = {"credit/oracle_labelled_fraction": labelled}
        return Estimate(Values(values, mask, lam=self.lam), metrics=metrics)
