"""Step scorers for the process_reward tests, referenced by dotted path or file path
(``credit.process_reward.function``); no test imports here, so a subprocess can load the file."""

from __future__ import annotations

import re

_STEP = re.compile(r"^\s*(-?\d+)\s*([+\-*])\s*(-?\d+)\s*=\s*(-?\d+)\s*$")
CALLS: list[tuple[str, str, list[int]]] = []


def _line_ok(line: str) -> bool | None:
    """True / False for an arithmetic line ``a op b = c``, None for anything else."""
    m = _STEP.match(line)
    if not m:
        return None
    a, op, b, c = int(m[1]), m[2], int(m[3]), int(m[4])
    return {"+": a + b, "-": a - b, "*": a * b}[op] == c


def chain_scores(prompt: str, completion: str, ends: list[int]) -> list[float]:
    """0.9 while every arithmetic line so far is right, 0.1 from the first wrong one on (a PRM
    that sees the slip); recorded in ``CALLS``."""
    CALLS.append((prompt, completion, list(ends)))
    scores, ok, start = [], True, 0
    for end in ends:
        for line in completion[start:end].splitlines():
            ok = ok and _line_ok(line) is not False
        scores.append(0.9 if ok else 0.1)
        start = end
    return scores


def too_few(prompt, completion, ends):
    return [0.5] * (len(ends) - 1)


def not_finite(prompt, completion, ends):
    return [float("nan")] * len(ends)


def out_of_range(prompt, completion, ends):
    return [1.5] * len(ends)


def a_string(prompt, completion, ends):
    return "0.5"


not_callable = 3
