"""First-error localisation in ProcessBench terms (docs/method.md, measurement protocol).

A task's verifier reports ``first_error_step``: the index of the first wrong *line* of a
completion. Credit is per *segment*, so the line is mapped to the segment holding its first
character. Then, over a batch:

- error_acc: among incorrect traces with a known first error, the share whose most-blamed segment
  (lowest advantage) is the one holding the first wrong step (ties shared fairly, so uniform
  credit scores exactly chance);
- correct_acc: among correct traces, the share with no segment blamed below ``threshold``;
- f1: their harmonic mean.
"""

from __future__ import annotations

import bisect

import torch


def line_start(text: str, line_index: int) -> int | None:
    """Character offset where line ``line_index`` (0-based, split on newlines) starts."""
    if line_index < 0:
        return None
    pos = 0
    for _ in range(line_index):
        nxt = text.find("\n", pos)
        if nxt < 0:
            return None
        pos = nxt + 1
    return pos if pos <= len(text) else None


def error_segment(
    text: str, first_error_line: int | None, segment_char_starts: list[int]
) -> int | None:
    """Index of the segment holding the first character of the first wrong line (None if the
    trace has no known error or the line is missing from the text)."""
    if first_error_line is None or first_error_line < 0 or not segment_char_starts:
        return None
    start = line_start(text, first_error_line)
    if start is None or start >= len(text):
        return len(segment_char_starts) - 1 if start is not None else None
    return max(0, bisect.bisect_right(segment_char_starts, start) - 1)


def blame_hit(segment_advantages: torch.Tensor, target: int, tol: float = 1e-6) -> float:
    """1 if segment ``target`` is the most-blamed (lowest advantage), shared fairly on ties: a
    tie of m segments that includes the target scores 1/m (so equal credit scores chance)."""
    lowest = segment_advantages.min()
    tied = (segment_advantages <= lowest + tol).nonzero().flatten().tolist()
    return 1.0 / len(tied) if target in tied else 0.0


def localisation_scores(
    segment_advantages: torch.Tensor,
    segment_mask: torch.Tensor,
    completions: list[str],
    rewards: torch.Tensor,
    first_error_steps: list[int | None],
    segment_char_starts: list[list[int]],
    threshold: float = 0.0,
) -> dict[str, float]:
    """error_acc, correct_acc, f1 and counts, from per-segment advantages ``(B, S)``.

    Rows with a single segment are left out of error_acc (nothing to localise), and so are rows
    where the first error falls in no segment.
    """
    hits = 0.0
    wrong = ok = correct = 0
    for row, text in enumerate(completions):
        n = int(segment_mask[row].sum())
        if n == 0:
            continue
        adv = segment_advantages[row, :n]
        if float(rewards[row]) >= 1.0:
            correct += 1
            ok += int(bool((adv >= threshold).all()))
            continue
        target = error_segment(text, first_error_steps[row], segment_char_starts[row])
        if target is None or n < 2:
            continue
        wrong += 1
        hits += blame_hit(adv, target)
    error_acc = hits / wrong if wrong else float("nan")
    correct_acc = ok / correct if correct else float("nan")
    f1 = (
        2 * error_acc * correct_acc / (error_acc + correct_acc)
        if wrong and correct and (error_acc + correct_acc) > 0
        else float("nan")
    )
    return {
        "error_acc": error_acc,
        "correct_acc": correct_acc,
        "f1": f1,
        "n_wrong": wrong,
        "n_correct": correct,
    }


def chance_error_acc(segment_mask: torch.Tensor, rewards: torch.Tensor) -> float:
    """Expected error_acc of a random blame: mean of 1/n over incorrect multi-segment traces."""
    n = segment_mask.sum(-1).float()
    pick = (rewards < 1.0) & (n >= 2)
    return float((1.0 / n[pick]).mean()) if bool(pick.any()) else float("nan")
