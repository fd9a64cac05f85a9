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
segments after it get 0. A row whose label is unknown (``first_error_step is None``: no step
labels, or a trace cut by the token cap before it stated an answer) gets GRPO's credit: its
inner boundaries carry no value (NaN in the rows) and lambda 1 passes through them, so every
segment gets ``R - mean(R_group)``, not the whole change on its last segment. A failed trace
without a label that *ended on its own* (EOS before the cap: it stopped without a right answer)
is wrong at its last line (``credit.oracle.ended_unlabelled=last_segment``, the default): with
GRPO's credit there instead, text the labels cannot check (no equations, no stated answer) was a
refuge from the blame that checkable lines get, and on SmolLM2 the policy learned to write it
(``benchmarks/results/smollm2/ceiling/README.md``). A trace cut by the cap keeps GRPO's credit
unless ``credit.oracle.capped_unlabelled=last_segment``: with ended traces blamed, the SmolLM2
policy learned to run to the cap instead.

That is ``credit.oracle.values=group``, the default. It gives no credit in a group whose rewards
all agree (``p_g`` is 0 or 1 at every boundary), exactly where GRPO learns nothing, so it is not a
ceiling of what credit can do there. The other values:

- ``pooled``: ``p(m)`` pooled over the whole batch (every row one group), ``V(s_0)`` the batch's
  mean reward: every group gets credit, from rates shared across prompts.
- ``monte_carlo``: the true ceiling. A still-right prefix is worth the current policy's
  probability of success from it, estimated by ``credit.oracle.rollouts`` continuations
  (:func:`rredcot.methods.monte_carlo.mc_values`), ``s_0`` included; a prefix holding the first
  wrong line is worth 0. The continuations are free: their tokens are reported
  (``credit/oracle_generated_tokens``) but not charged to the run's token budget. A row without
  a label gets Monte Carlo values at every boundary.
"""

from __future__ import annotations

import bisect
import math

import torch

from rredcot.algebra.credit import Values
from rredcot.algebra.normalization import group_mean_std
from rredcot.config import OracleConfig
from rredcot.methods.base import CreditMethod, CreditRows, Estimate, register_credit
from rredcot.methods.monte_carlo import context_mc_values
from rredcot.sampling.batch import RolloutBatch

__all__ = [
    "OracleCredit",
    "completed_lines",
    "ended_with_eos",
    "first_error_segment",
    "oracle_mc_values",
    "oracle_values",
]

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


def ended_with_eos(batch: RolloutBatch, eos_token_id: int | None) -> list[bool]:
    """Per row: True when its response's last real token is ``eos_token_id`` (the trace ended
    on its own, not at the token cap); all False without an EOS id."""
    if eos_token_id is None:
        return [False] * len(batch.verdicts)
    mask = batch.response_mask
    lengths = mask.sum(-1).long().tolist()
    response = batch.input_ids[:, batch.prompt_len :]
    return [n > 0 and int(response[row, n - 1]) == eos_token_id for row, n in enumerate(lengths)]


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
    group_mean, _ = group_mean_std(rewards, group_ids)
    rows_of: dict[int, list[int]] = {}
    for row, g in enumerate(group_ids.tolist()):
        rows_of.setdefault(g, []).append(row)
    for row in range(B):
        done = lines_done[row]
        mask[row, : len(done)] = True
        peers = rows_of[int(group_ids[row])]
        known = [j for j in peers if not math.isnan(right_lines[j])]
        if math.isnan(right_lines[row]):
            values[row, 1 : len(done)] = math.nan  # unknown: GRPO's credit (OracleCredit.estimate)
            values[row, 0] = group_mean[row]
            continue
        for k, m in enumerate(done):
            if error_segment[row] is not None and k >= error_segment[row]:
                break  # the prefix holds the first wrong line: value 0
            alive = [j for j in known if right_lines[j] >= m]
            values[row, k] = float(rewards[alive].mean()) if alive else 0.0
        values[row, 0] = group_mean[row]
    return values, mask


def oracle_mc_values(
    mc: torch.Tensor, num_segments: torch.Tensor, error_segment: list[int | None]
) -> torch.Tensor:
    """Monte Carlo values ``mc (B, S+1)`` with every prefix that holds the first wrong line set
    to 0: ``V(s_k) = 0`` for ``error_segment <= k < n`` (``V(s_n)`` stays, the algebra sets it
    to ``R``). ``error_segment[b]`` is 1-based, None for a row without a wrong line."""
    values = mc.clone()
    for row, first in enumerate(error_segment):
        if first is not None:
            values[row, first : int(num_segments[row])] = 0.0
    return values


@register_credit("oracle", options=OracleConfig)
class OracleCredit(CreditMethod):
    """Ground-truth segment values from step labels (benchmark only; see the module doc)."""

    default_lam = 0.0
    batch_size: int = 256  # continuation rows per generate call (values=monte_carlo)

    def __init__(self, config, context) -> None:
        super().__init__(config, context)
        if self.options.values == "monte_carlo" and context.task is None:
            raise ValueError(
                "oracle with credit.oracle.values=monte_carlo needs the task to verify its "
                "continuations; pass CreditContext(task=...)"
            )

    def _labels(self, batch: RolloutBatch):
        """Per row: right leading lines ``L`` (inf: no wrong line, nan: unknown), lines done by
        each prefix, and the 1-based segment of the first wrong line (None: none or unknown)."""
        right_lines: list[float] = []
        error_segment: list[int | None] = []
        lines_done: list[list[int]] = []
        blame_ended = self.options.ended_unlabelled == "last_segment"
        blame_capped = self.options.capped_unlabelled == "last_segment"
        ended = ended_with_eos(batch, getattr(self.context.tokenizer, "eos_token_id", None))
        for row, verdict in enumerate(batch.verdicts):
            text = batch.completions[row]
            starts = batch.segment_char_starts[row]
            lines_done.append(completed_lines(text, starts) if starts else [0])
            label = verdict.first_error_step
            blamed = blame_ended if ended[row] else blame_capped
            if label is None and blamed and float(verdict.reward) < 1.0:
                label = text.count("\n")  # no right answer where it stopped: its last line
            if label is None or not starts:
                right_lines.append(math.nan)
                error_segment.append(None)
            elif label < 0:
                right_lines.append(NO_ERROR)
                error_segment.append(None)
            else:
                right_lines.append(float(label))
                error_segment.append(first_error_segment(text, starts, label))
        return right_lines, lines_done, error_segment

    def _values_and_coverage(
        self, batch: RolloutBatch
    ) -> tuple[torch.Tensor, torch.Tensor, float, dict[str, float]]:
        """``(values, mask, fraction of rows with a step label, metrics)``."""
        right_lines, lines_done, error_segment = self._labels(batch)
        labelled = sum(not math.isnan(x) for x in right_lines) / max(len(right_lines), 1)
        device = batch.rewards.device
        if self.options.values == "monte_carlo":
            values, mask, stats = self._monte_carlo(batch, error_segment)
            return values.to(device), mask.to(device), labelled, stats
        group_ids = batch.group_ids.cpu()
        if self.options.values == "pooled":
            group_ids = torch.zeros_like(group_ids)  # the whole batch is one group
        values, mask = oracle_values(
            batch.rewards.cpu(), group_ids, right_lines, lines_done, error_segment
        )
        return values.to(device), mask.to(device), labelled, {}

    def _monte_carlo(self, batch: RolloutBatch, error_segment: list[int | None]):
        """Monte Carlo values of the still-right prefixes, 0 from the first wrong one."""
        n = batch.num_segments.cpu()
        still_right = [
            list(range(int(n[row]) if first is None else min(first, int(n[row])))) or [0]
            for row, first in enumerate(error_segment)
        ]
        mc, mask, stats = context_mc_values(
            self.context, batch, self.options.rollouts, self.batch_size, row_boundaries=still_right
        )
        values = oracle_mc_values(mc.cpu(), n, error_segment)
        metrics = {  # reported, not charged: the Estimate's Cost stays zero
            "credit/oracle_generated_tokens": stats["credit/extra_generated_tokens"],
            "credit/oracle_forward_tokens": stats["credit/extra_forward_tokens"],
            "credit/oracle_mc_prefixes": stats["credit/mc_prefixes"],
        }
        return values, mask.cpu(), metrics

    def estimate(self, rows: CreditRows) -> Estimate:
        """The rows' values with ``V(s_0)`` and lambda 1 at every boundary whose value is unknown
        (NaN), the method's lambda elsewhere: each segment of a row without a label gets
        ``R - V(s_0)``, GRPO's credit."""
        unknown = torch.isnan(rows.values) & rows.value_mask
        if not unknown.any():
            return super().estimate(rows)
        values = torch.where(unknown, rows.values[:, :1].expand_as(rows.values), rows.values)
        lam = torch.where(unknown[:, 1:], 1.0, float(self.lam)).to(values.dtype)
        credit_values = Values(values, rows.value_mask, lam=lam)
        return Estimate(credit_values, rows.cost, rows.metrics)

    def rows(self, batch: RolloutBatch) -> CreditRows:
        """The batch's rows with their ground-truth values."""
        values, mask, labelled, metrics = self._values_and_coverage(batch)
        metrics = {"credit/oracle_labelled_fraction": labelled, **metrics}
        return CreditRows.of(batch).replace(values=values, value_mask=mask, metrics=metrics)
