"""A step scorer for ``seam_equivalence.py``'s process_reward run: the share of digits among a
prefix's characters (any deterministic function of the text serves: the run checks that the same
scores become the same credit before and after a change)."""


def score_steps(prompt: str, completion: str, ends: list[int]) -> list[float]:
    return [sum(c.isdigit() for c in completion[:end]) / max(end, 1) for end in ends]
