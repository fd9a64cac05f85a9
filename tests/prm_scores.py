"""Step scorers for the process_reward tests, referenced by dotted path or file path
(``credit.process_reward.function``); no test imports here, so a subprocess can load the file."""

from __future__ import annotations

import re

TEXTS = [  # two prompts x three samples; the newline segmenter cuts each into lines
    "2+3=5\n5*4=20\nA:20",  # right: segments "2+3=5", "5*4=20 + answer line"
    "2+3=6\n6*4=24\nA:24",  # slips in segment 1
    "2+3=5\nA:5",  # one segment
    "7-1=6\n6+2=8\n8*2=16\nA:16",
    "7-1=6\n6+2=9\nA:9",  # slips in segment 2
    "7-1=6\n6+2=8\n8*2=16\nA:16",
]
REWARDS = [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]
_G0, _G1 = 1 / 3, 2 / 3  # the two groups' mean rewards
CHAIN_CREDIT = [  # chain_scores on TEXTS at lam 0: segment k gets V(s_k) - V(s_{k-1}), by hand
    [0.9 - _G0, 1.0 - 0.9],
    [0.1 - _G0, 0.0 - 0.1],
    [0.0 - _G0],
    [0.9 - _G1, 0.0, 1.0 - 0.9],
    [0.9 - _G1, 0.0 - 0.9],
    [0.9 - _G1, 0.0, 1.0 - 0.9],
]

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
