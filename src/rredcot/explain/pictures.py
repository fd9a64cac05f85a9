"""Pictures of where the credit went: a terminal view and a self-contained HTML page.

``rredcot explain --demo`` needs no model: it takes a gold arithmetic trace and the same trace with
an injected error, segments both, applies a set of values and prints each segment's redistributed
reward ``r_k = V(s_k) - V(s_{k-1})`` and advantage, so a newcomer sees the idea in one screen.
``rredcot explain --checkpoint DIR`` samples a trace from a trained policy and shows the credit a
method gives it.
"""

from __future__ import annotations

import html
import os
import sys
from dataclasses import dataclass

from rredcot.segment import get_segmenter
from rredcot.tasks import get_task


@dataclass
class SegmentCredit:
    text: str
    value_before: float | None  # V(s_{k-1})
    value_after: float | None  # V(s_k) (R for the last segment)
    reward: float  # r_k
    advantage: float  # A_k
    scaled: float | None = None  # A_k after the normalisation: each token's advantage


def explain_values(
    text: str, values: list[float], reward: float, lam: float = 0.0, strategy: str = "newline"
) -> list[SegmentCredit]:
    """Segment ``text`` and turn the values ``V(s_0..s_{n-1})`` into per-segment credit.

    The algebra of :func:`rredcot.algebra.credit.segment_advantages_from_values` for one trace, in plain
    Python so that the demo starts without torch: ``V(s_n) = R``, ``r_k = V(s_k) - V(s_{k-1})``,
    ``A_k = sum_{j >= k} lam^(j-k) r_j``.
    """
    if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not 0.0 <= lam <= 1.0:
        raise ValueError(f"lam must be a float in [0, 1], got {lam!r}")
    spans = get_segmenter(strategy).split(text)
    n = len(spans)
    if len(values) < n:
        raise ValueError(
            f"need {n} values V(s_0)..V(s_{n - 1}) for {n} segments, got {len(values)}"
        )
    v = [float(x) for x in values[:n]] + [float(reward)]
    rewards = [v[k + 1] - v[k] for k in range(n)]
    advantages, running = [0.0] * n, 0.0
    for k in reversed(range(n)):
        running = rewards[k] + lam * running
        advantages[k] = running
    return [
        SegmentCredit(text[a:b], v[k], v[k + 1], rewards[k], advantages[k])
        for k, (a, b) in enumerate(spans)
    ]


# ---------------------------------------------------------------------------------------------
# rendering


def _use_color(stream) -> bool:
    return hasattr(stream, "isatty") and stream.isatty() and not os.environ.get("NO_COLOR")


def _ansi(value: float, scale: float) -> str:
    """Green for positive credit, red for negative, brighter when larger."""
    x = max(-1.0, min(1.0, value / scale)) if scale > 0 else 0.0
    if abs(x) < 0.05:
        return "\033[0m"
    code = 32 if x > 0 else 31
    return f"\033[{'1;' if abs(x) > 0.5 else ''}{code}m"


def render_terminal(title: str, segments: list[SegmentCredit], color: bool | None = None) -> str:
    color = _use_color(sys.stdout) if color is None else color
    scale = max((abs(s.advantage) for s in segments), default=1.0) or 1.0
    scaled = any(s.scaled is not None for s in segments)
    head = f"  {'k':>2}  {'V(s_k-1)':>8}  {'V(s_k)':>7}  {'r_k':>7}  {'A_k':>7}  "
    lines = [title, head + (f"{'token A':>7}  " if scaled else "") + "segment"]
    for k, s in enumerate(segments, 1):
        seg = s.text.rstrip("\n").replace("\n", "⏎")
        if color:
            seg = f"{_ansi(s.advantage, scale)}{seg}\033[0m"
        before = "" if s.value_before is None else f"{s.value_before:8.3f}"
        after = "" if s.value_after is None else f"{s.value_after:7.3f}"
        token = "" if s.scaled is None else f"{s.scaled:+7.3f}"
        token = f"{token:>7}  " if scaled else ""
        lines.append(
            f"  {k:>2}  {before:>8}  {after:>7}  {s.reward:+7.3f}  {s.advantage:+7.3f}  {token}{seg}"
        )
    total = sum(s.reward for s in segments)
    lines.append(f"  sum of r_k = {total:+.3f}  (= R - V(s_0), whatever the values)")
    return "\n".join(lines)


def _html_color(value: float, scale: float) -> str:
    """Green for positive credit, red for negative, none for (about) zero, as in the terminal."""
    x = max(-1.0, min(1.0, value / scale)) if scale > 0 else 0.0
    if abs(x) < 0.05:
        return "transparent"
    alpha = 0.15 + 0.6 * abs(x)
    return f"rgba(46,160,67,{alpha:.2f})" if x >= 0 else f"rgba(218,54,51,{alpha:.2f})"


def render_html(sections: list[tuple[str, str, list[SegmentCredit]]]) -> str:
    """A self-contained page: each section is (title, prompt, segments)."""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'><title>rredcot: where the credit went</title>",
        "<style>body{font-family:system-ui,sans-serif;max-width:960px;margin:2em auto;color:#222}"
        "pre{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:15px;line-height:1.6}"
        ".seg{border-radius:3px;padding:1px 0}.prompt{color:#666}"
        "table{border-collapse:collapse;font-size:13px}td,th{padding:2px 8px;text-align:right}"
        "td.t{text-align:left;font-family:ui-monospace,monospace}</style></head><body>",
        "<h1>Where the credit went</h1><p>Each segment is shaded by its advantage A<sub>k</sub>: "
        "green pushes its tokens up, red pushes them down. Hover a segment for its numbers.</p>",
    ]
    for title, prompt, segments in sections:
        scale = max((abs(s.advantage) for s in segments), default=1.0) or 1.0
        parts.append(
            f"<h2>{html.escape(title)}</h2><pre><span class='prompt'>{html.escape(prompt)}</span>"
        )
        for s in segments:
            tip = (
                f"V(s_k-1)={s.value_before:.3f} V(s_k)={s.value_after:.3f} r={s.reward:+.3f} A={s.advantage:+.3f}"
                if s.value_before is not None
                else f"r={s.reward:+.3f} A={s.advantage:+.3f}"
            )
            parts.append(
                f"<span class='seg' style='background:{_html_color(s.advantage, scale)}' "
                f"title='{tip}'>{html.escape(s.text)}</span>"
            )
        scaled = any(s.scaled is not None for s in segments)
        parts.append(
            "</pre><table><tr><th>k</th><th>V(s_k-1)</th><th>V(s_k)</th><th>r_k</th><th>A_k</th>"
            + ("<th>token A</th>" if scaled else "")
            + "<th>segment</th></tr>"
        )
        for k, s in enumerate(segments, 1):
            vb = "" if s.value_before is None else f"{s.value_before:.3f}"
            va = "" if s.value_after is None else f"{s.value_after:.3f}"
            token = "" if s.scaled is None else f"{s.scaled:+.3f}"
            parts.append(
                f"<tr><td>{k}</td><td>{vb}</td><td>{va}</td><td>{s.reward:+.3f}</td>"
                f"<td>{s.advantage:+.3f}</td>"
                + (f"<td>{token}</td>" if scaled else "")
                + f"<td class='t'>{html.escape(s.text.strip())}</td></tr>"
            )
        parts.append("</table>")
    parts.append("</body></html>")
    return "".join(parts)


# ---------------------------------------------------------------------------------------------
# the demo


def demo_sections(
    error_step: int = 1, seed: int = 0, lam: float = 0.0
) -> list[tuple[str, str, list[SegmentCredit]]]:
    """A gold trace and the same trace with an error injected at ``error_step``, with the values
    an ideal estimator would give (the probability of finishing right from each prefix), next to
    GRPO's uniform credit for the wrong trace."""
    task = get_task("arithmetic")
    problem = task.eval_problems(1, seed=seed)[0]
    gold = task.gold_completion(problem)
    wrong = task.inject_error(problem, error_step)
    n = len(get_segmenter("newline").split(gold))
    # An ideal V: p(correct | prefix) for a policy that solves 60% of problems from scratch and
    # rises as right steps accumulate; 0 once a wrong step is in the prefix.
    good_values = [0.6 + 0.4 * k / n for k in range(n)]
    bad_values = [good_values[k] if k <= error_step else 0.0 for k in range(n)]
    group_mean = 0.5  # uniform credit: every segment valued at the group's mean reward, λ = 1
    return [
        (
            "Correct trace (R = 1), ideal values",
            problem.prompt,
            explain_values(gold, good_values, 1.0, lam),
        ),
        (
            f"Error injected at step {error_step + 1} (R = 0), ideal values: the blame lands on it",
            problem.prompt,
            explain_values(wrong, bad_values, 0.0, lam),
        ),
        (
            "Same wrong trace under GRPO (uniform credit): every step is blamed equally",
            problem.prompt,
            explain_values(wrong, [group_mean] * n, 0.0, lam=1.0),
        ),
    ]
