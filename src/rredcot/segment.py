"""Segmentation: response text -> character spans -> token boundaries (docs/method.md, segments).

Two layers:

1. ``split_text`` cuts a response into contiguous character spans with a named strategy, then
   applies the options (final answer handling, ``min_chars``, ``max_segments``).
2. ``token_offsets`` / ``decode_with_offsets`` give each generated token's character span inside
   the decoded text, and ``spans_to_boundaries`` turns spans + token offsets into token boundaries
   ``0 = b_0 < b_1 < ... < b_n = T`` (segment ``k`` is tokens ``[b_{k-1}, b_k)``).

Conventions, shared by every strategy:

- Spans are half-open ``[start, end)``, contiguous, non-empty, and cover the text exactly.
- Whitespace belongs to the segment before it: a line's ``\\n`` ends that line's segment, blank
  lines and indentation go with the segment above, and every segment but the first starts on a
  non-whitespace character. An all-whitespace text is one segment.
- The final answer line (``answer_pattern``: the task's own answer line, ``A:18``, ``#### 18``,
  ``Answer: 18``, ``<answer>18</answer>`` or a ``\\boxed{18}`` line, not a step that mentions "the
  answer") is merged into the last reasoning step unless ``separate_answer=True``: an answer line
  as its own segment lets an uncalibrated value head put the whole blame of a wrong trace on it,
  which collapsed training in our prototype (docs/method.md, failure modes).
- A token belongs to the segment holding its first non-whitespace character (its start when the
  token is all whitespace or when no text is given): ``" So"`` goes with the segment that ``So``
  opens, a lone ``"\\n"`` with the line it ends. A token whose bytes straddle a split goes where it
  starts. Tokens with an empty span (special tokens such as eos) go with the token before them, so
  a trailing eos belongs to the last segment.

Strategies are looked up by name, with an optional argument after a colon: ``newline``,
``paragraph``, ``sentence``, ``step[:REGEX]``, ``keywords[:Word|Word ...]``, ``tokens:N``,
``entropy[:OPTIONS]`` and ``keywords+entropy[:OPTIONS]``. ``tokens:N`` counts tokens, so it needs
offsets: ``Segmenter.boundaries(text, offsets)`` or ``split_text(..., offsets=...)``; without
offsets ``split_text`` raises a ``ValueError`` (a character-count fallback would silently disagree
with the token boundaries).

The entropy strategies also need ``entropies[i]``, the entropy (nats) of the policy's
distribution that token ``i`` was sampled from: ``Segmenter.boundaries(text, offsets,
entropies)``. ``entropy`` cuts before high-entropy tokens (``top=F``: the top fraction F of the
trace's tokens, default 0.1; or ``threshold=H`` nats), keeping segments at least ``min=N`` tokens
long (default 4) and, with ``max=N``, cutting longer ones at their highest entropy.
``keywords+entropy`` cuts at discourse keywords (``words=Word|Word``, default as ``keywords``) and,
inside every stretch without one longer than ``max`` tokens (default 32), at entropy peaks.
``newline+merge`` (``target=N`` or ``fraction=F`` of the lines, default 0.5) cuts after every line
break, then merges adjacent lines at the lowest-entropy boundaries down to the target. A cut
at a whitespace-only token opens the next word; one at a piece of a multi-byte character goes
before that character.
"""

from __future__ import annotations

import codecs
import math
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from heapq import heapify, heappop, heappush
from itertools import accumulate
from operator import not_
from typing import Any

__all__ = [
    "DEFAULT_ANSWER_PATTERN",
    "DEFAULT_KEYWORDS",
    "Segmenter",
    "Span",
    "cut_entropies",
    "decode_with_offsets",
    "segment_completion",
    "get_segmenter",
    "segmenter_from_config",
    "list_segmenters",
    "register_segmenter",
    "spans_to_boundaries",
    "split_text",
    "token_offsets",
    "token_positions",
]

Span = tuple[int, int]

# The last non-blank line is the final answer when it matches (``re.search``): the task's own
# answer line, never a reasoning step that merely mentions "the answer". "A:18" (arithmetic, case
# sensitive), "Answer: 18" / "**Final answer:** 18", "#### 18" (GSM8K), "<answer>18</answer>"
# (reasoning-gym), and a line holding "\boxed{18}".
DEFAULT_ANSWER_PATTERN = (
    r"(?i)^\s*(?:\*\*)?(?:final\s+)?answer\s*(?:\*\*)?\s*:"
    r"|^\s*(?-i:A)\s*:"
    r"|^\s*####"
    r"|^\s*<answer>"
    r"|\\boxed\s*\{"
)

# Discourse markers that open a new reasoning move (matched case-insensitively at a sentence start).
DEFAULT_KEYWORDS = (
    "Wait",
    "So",
    "Therefore",
    "But",
    "Alternatively",
    "Let me",
    "Let's",
    "Hmm",
    "Now",
    "Next",
    "Finally",
    "Thus",
    "Hence",
    "However",
    "Actually",
    "Okay",
    "Hold on",
    "Instead",
    "On second thought",
)

# A "." after these words does not end a sentence (compared lower-case, leading brackets stripped).
_ABBREVIATIONS = frozenset(
    [
        "e.g.",
        "i.e.",
        "etc.",
        "vs.",
        "cf.",
        "mr.",
        "mrs.",
        "ms.",
        "dr.",
        "prof.",
        "sr.",
        "jr.",
        "fig.",
        "eq.",
        "approx.",
        "al.",
        "u.s.",
    ]
)


# --------------------------------------------------------------------------------------------
# Strategy registry
# --------------------------------------------------------------------------------------------


def _no_arg(name: str, arg: str | None) -> None:
    if arg is not None:
        raise ValueError(f"segmentation strategy {name!r} takes no argument, got {name}:{arg}")


@dataclass(frozen=True)
class _Strategy:
    fn: Callable[..., Iterable[int]]
    parse_arg: Callable[[str, str | None], Any]
    uses_tokens: bool
    uses_entropy: bool
    usage: str


_STRATEGIES: dict[str, _Strategy] = {}


def register_segmenter(
    name: str,
    *,
    parse_arg: Callable[[str, str | None], Any] | None = None,
    uses_tokens: bool = False,
    uses_entropy: bool = False,
    usage: str | None = None,
) -> Callable[[Callable[..., Iterable[int]]], Callable[..., Iterable[int]]]:
    """Register a segmentation strategy under ``name`` (decorator).

    The strategy returns cut positions: character offsets where a new segment starts, in any
    order (duplicates, 0 and ``len(text)`` are ignored). A text strategy is ``fn(text, arg)``; its
    cuts are moved past whitespace so that whitespace stays with the segment before. A token
    strategy (``uses_tokens=True``) is ``fn(text, arg, positions)`` with ``positions[i]`` the
    character position of token ``i``; its cuts are moved past whitespace too (a cut at a
    whitespace-only token opens the next word). An entropy strategy
    (``uses_entropy=True``, implies ``uses_tokens``) is ``fn(text, arg, positions, entropies)``
    with ``entropies[i]`` the policy's entropy at token ``i``. ``parse_arg(name, arg)`` turns the
    text after the colon of ``"name:arg"`` (``None`` without a colon) into ``arg`` and raises
    ``ValueError`` on bad input; by default a strategy takes no argument.
    """
    if not name or ":" in name:
        raise ValueError(f"strategy name must be non-empty and contain no ':', got {name!r}")

    def decorator(fn: Callable[..., Iterable[int]]) -> Callable[..., Iterable[int]]:
        if name in _STRATEGIES:
            raise ValueError(f"segmentation strategy {name!r} is already registered")
        _STRATEGIES[name] = _Strategy(
            fn, parse_arg or _no_arg, uses_tokens or uses_entropy, uses_entropy, usage or name
        )
        return fn

    return decorator


def list_segmenters() -> list[str]:
    """Usage strings of the registered strategies, e.g. ``["newline", ..., "tokens:N"]``."""
    return [s.usage for s in _STRATEGIES.values()]


def _parse_strategy(strategy: str) -> tuple[_Strategy, Any]:
    if not isinstance(strategy, str):
        raise TypeError(f"strategy must be a string such as 'sentence', got {strategy!r}")
    name, colon, arg = strategy.partition(":")
    if name not in _STRATEGIES:
        raise ValueError(
            f"unknown segmentation strategy {strategy!r}; valid: {', '.join(list_segmenters())}"
        )
    entry = _STRATEGIES[name]
    return entry, entry.parse_arg(name, arg if colon else None)


# --------------------------------------------------------------------------------------------
# Text strategies: text -> cut positions
# --------------------------------------------------------------------------------------------


@register_segmenter("newline")
def _newline(text: str, arg: None) -> list[int]:
    """Cut after every line break."""
    return [m.end() for m in re.finditer(r"\n", text)]


_BLANK_LINE = re.compile(r"\n[^\S\n]*\n")


@register_segmenter("paragraph")
def _paragraph(text: str, arg: None) -> list[int]:
    """Cut after every blank line (a line holding only whitespace)."""
    return [m.end() for m in _BLANK_LINE.finditer(text)]


_SENTENCE_END = re.compile(
    r"[.!?]+[\"'\u201d\u2019)\]]*(?=\s|\Z)"  # ". " "?\" " "!)" before whitespace or the end
    r"|[\u3002\uff01\uff1f]+[\u300d\u300f\uff09\u201d\u2019]*"  # CJK 。！？ (and closing 」』）)
    r"|\n"
)
_LIST_MARKER = re.compile(r"[^\S\n]*\d{1,3}")
_MATH = re.compile(
    r"\$\$.+?\$\$"  # display $$...$$
    r"|\\\[.+?\\\]"  # display \[...\]
    r"|\\\(.+?\\\)"  # inline \(...\)
    r"|\$(?=[^\s$])[^$\n]*?(?<![\s\\])\$(?!\d)",  # inline $...$ (pandoc's rule)
    re.DOTALL,
)
# Two plain words in a row: an inline "$...$" holding this is prose between two dollar amounts.
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}[.,;:!?]?\s+[A-Za-z]{2,}")


def _math_regions(text: str) -> list[Span]:
    """LaTeX math spans: ``$$..$$``, ``\\[..\\]``, ``\\(..\\)`` and single-line inline ``$..$``.

    Inline ``$`` follows pandoc (non-space after the opening ``$``, non-space before the closing
    one, no digit right after it), and a candidate that reads like prose is rejected, so that
    currency such as ``costs $3. Then $5`` is not taken for math.
    """
    regions, pos = [], 0
    while (m := _MATH.search(text, pos)) is not None:
        inline = m.group().startswith("$") and not m.group().startswith("$$")
        if inline and _PROSE.search(m.group()):
            pos = m.start() + 1  # its closing "$" may open a real formula
            continue
        regions.append(m.span())
        pos = m.end()
    return regions


def _inside(regions: list[Span], pos: int) -> bool:
    k = bisect_right(regions, (pos, float("inf"))) - 1
    return k >= 0 and regions[k][0] <= pos < regions[k][1]


def _is_non_final_period(text: str, dot: int) -> bool:
    """True for the "." of an abbreviation ("e.g.") or of a list marker at a line start ("2.")."""
    if text[dot] != ".":
        return False
    word_start = max(text.rfind(" ", 0, dot), text.rfind("\n", 0, dot), text.rfind("\t", 0, dot))
    word = text[word_start + 1 : dot + 1].lstrip("([{\"'\u201c\u2018")
    if word.lower() in _ABBREVIATIONS:
        return True
    line_start = text.rfind("\n", 0, dot) + 1
    return _LIST_MARKER.fullmatch(text, line_start, dot) is not None


@register_segmenter("sentence")
def _sentence(text: str, arg: None) -> list[int]:
    """Cut after ``.!?`` followed by whitespace or the end, after the CJK sentence ends ``。！？``
    (with their closing quotes or brackets; CJK text puts no space after them), and after every
    line break.

    Not after abbreviations or list markers, never inside LaTeX math; numbers such as ``3.14``
    have no whitespace after the ``.`` so they never split.
    """
    math = _math_regions(text)
    cuts = []
    for m in _SENTENCE_END.finditer(text):
        if _inside(math, m.start()) or _is_non_final_period(text, m.start()):
            continue
        cuts.append(m.end())
    return cuts


_STEP_MARKER = (
    r"^[ \t]*(?:#{1,6}[ \t]*)?\**(?:step|stage)\s*\d+\b"  # "Step 3:", "**Step 3**", "### Step 3"
    r"|^[ \t]*\d{1,3}[.)](?=\s)"  # "1. ", "2) " at a line start (not "3.14")
)


USER_REGEX_SECONDS = 2.0
"""Time limit of a user's ``step:REGEX`` on one trace: a pattern that backtracks
catastrophically (``(a|aa)+$``) stops with an error instead of hanging the run."""


def _parse_regex(name: str, arg: str | None) -> Any:
    """The default step marker (``re``), or the user's pattern compiled by the ``regex`` module
    (the syntax of ``re``), which can stop a match that runs too long."""
    if not arg:
        return re.compile(_STEP_MARKER, re.IGNORECASE | re.MULTILINE)
    import regex  # a dependency of transformers and of rredcot; only user patterns need it

    try:
        return regex.compile(arg, regex.IGNORECASE | regex.MULTILINE)
    except regex.error as e:
        raise ValueError(f"{name}:REGEX has an invalid regular expression {arg!r}: {e}") from e


@register_segmenter("step", parse_arg=_parse_regex, usage="step[:REGEX]")
def _step(text: str, marker: Any) -> list[int]:
    """Cut before every step marker (``Step 3:``, ``1.``, ``2)`` at a line start by default); a
    user's REGEX gets :data:`USER_REGEX_SECONDS` per trace."""
    if isinstance(marker, re.Pattern):
        return [m.start() for m in marker.finditer(text)]
    try:
        return [m.start() for m in marker.finditer(text, timeout=USER_REGEX_SECONDS)]
    except TimeoutError:
        raise ValueError(
            f"step:REGEX {marker.pattern!r} ran over {USER_REGEX_SECONDS:g} s on a trace of "
            f"{len(text)} characters (catastrophic backtracking, e.g. nested repeats like "
            "(a|aa)+); simplify the pattern"
        ) from None


def _parse_keywords(name: str, arg: str | None) -> re.Pattern[str]:
    words = DEFAULT_KEYWORDS if arg is None else tuple(w.strip() for w in arg.split("|"))
    if not words or not all(words):
        raise ValueError(f"{name}:WORDS needs '|'-separated non-empty words, got {arg!r}")
    alternatives = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
    return re.compile(rf"(?:{alternatives})(?!\w)", re.IGNORECASE)


@register_segmenter("keywords", parse_arg=_parse_keywords, usage="keywords[:Word|Word...]")
def _keywords(text: str, marker: re.Pattern[str]) -> list[int]:
    """Cut before a discourse marker ("Wait", "So", "Let me", ...) that opens a sentence or line."""
    starts = _skip_whitespace(text, [0, *_sentence(text, None)])
    return [p for p in starts if marker.match(text, p)]


# --------------------------------------------------------------------------------------------
# Token strategies: (text, arg, token positions) -> cut positions
# --------------------------------------------------------------------------------------------


def _parse_count(name: str, arg: str | None) -> int:
    try:
        n = int(arg) if arg is not None else 0
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"{name}:N needs a positive integer N (e.g. '{name}:16'), got {arg!r}")
    return n


@register_segmenter("tokens", parse_arg=_parse_count, uses_tokens=True, usage="tokens:N")
def _tokens(text: str, n: int, positions: list[int]) -> list[int]:
    """Cut before every N-th token: segments of N tokens (the last one shorter).

    Tokens that share a character position (pieces of one multi-byte character) cannot be
    separated, so a chunk can be off by one token there; a cut at a whitespace-only token moves
    to the next word (the whitespace stays with the segment before).
    """
    return positions[n::n]


# --------------------------------------------------------------------------------------------
# Entropy strategies: (text, arg, token positions, entropies) -> cut positions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _EntropyArgs:
    top: float | None  # cut at the top fraction of the trace's token entropies...
    threshold: float | None  # ...or at entropies >= this (nats); exactly one is set
    min_tokens: int  # no segment made by an entropy cut is shorter
    max_tokens: int | None  # entropy: no longer segment; keywords+entropy: a "long" stretch
    keywords: re.Pattern[str] | None  # keywords+entropy only


def _parse_entropy(name: str, arg: str | None) -> _EntropyArgs:
    hybrid = name != "entropy"
    keys = ["top", "threshold", "min", "max", *(["words"] if hybrid else [])]
    given: dict[str, str] = {}
    for item in arg.split(",") if arg else []:
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or key not in keys or key in given or not value:
            raise ValueError(
                f"{name}: bad option {item!r}; options are KEY=VALUE, each KEY at most once, "
                f"KEY in {', '.join(keys)} (e.g. '{name}:top=0.1,min=4,max=32')"
            )
        given[key] = value
    if "top" in given and "threshold" in given:
        raise ValueError(f"{name}: give top=FRACTION or threshold=NATS, not both")

    def number(key: str, kind: type, default: str) -> Any:
        text = given.get(key, default)
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value):
            what = "an integer" if kind is int else "a number"
            raise ValueError(f"{name}: {key} must be {what}, got {text!r}")
        return value

    top = threshold = None
    if "threshold" in given:
        threshold = number("threshold", float, "")
    else:
        top = number("top", float, "0.1")
        if not 0.0 < top <= 1.0:
            raise ValueError(f"{name}: top must be a fraction in (0, 1], got {top}")
    min_tokens = number("min", int, "4")
    if min_tokens < 1:
        raise ValueError(f"{name}: min must be >= 1 token, got {min_tokens}")
    max_tokens = None
    if given.get("max", "32" if hybrid else "none").lower() != "none":
        max_tokens = number("max", int, "32")
        if max_tokens < 2 * min_tokens - 1:
            raise ValueError(
                f"{name}: max={max_tokens} must be at least 2*min-1 = {2 * min_tokens - 1}, so "
                "that a long segment can be cut into two of at least min tokens"
            )
    elif hybrid:
        raise ValueError(
            f"{name}: max must be a number of tokens (a stretch without a keyword that is longer "
            "than max tokens is cut at its entropy peaks)"
        )
    keywords = _parse_keywords(name, given.get("words")) if hybrid else None
    return _EntropyArgs(top, threshold, min_tokens, max_tokens, keywords)


def _entropy_cuts(
    text: str, positions: list[int], entropies: list[float]
) -> dict[int, tuple[float, int]]:
    """The possible cuts of a trace: ``{b: (entropy, char)}`` for a cut before token ``b``.

    A cut at token ``i >= 1`` goes before the first piece of its character (byte-level pieces
    share a position) and past whitespace (a whitespace-only token's cut opens the next word), so
    it lands at character ``char``, before token ``b`` (the first token at or after ``char``).
    Where several tokens land on one cut it keeps the highest entropy. A cut needs content
    before it and after it: none lands in leading whitespace or at the end of the text.
    """
    length = len(text)
    content = [length] * (length + 1)  # content[c]: the first non-whitespace index >= c
    for c in range(length - 1, -1, -1):
        content[c] = c if not text[c].isspace() else content[c + 1]
    cuts: dict[int, tuple[float, int]] = {}
    for i in range(1, len(positions)):
        char = content[positions[i]]
        b = bisect_left(positions, char)
        if content[0] < char < length and (b not in cuts or entropies[i] > cuts[b][0]):
            cuts[b] = (entropies[i], char)
    return cuts


def _entropy_threshold(arg: _EntropyArgs, entropies: list[float]) -> float:
    """``threshold``, or the k-th highest entropy of the trace, k = ceil(top * T)."""
    if arg.threshold is not None:
        return arg.threshold
    if not entropies:
        return math.inf
    k = max(1, math.ceil(arg.top * len(entropies)))
    return sorted(entropies, reverse=True)[k - 1]


def _entropy_stretch(
    cuts: dict[int, tuple[float, int]], lo: int, hi: int, threshold: float, arg: _EntropyArgs
) -> list[int]:
    """Token cuts inside the stretch ``[lo, hi)``.

    First the peaks: cuts at entropy >= ``threshold``, highest first (ties: the earlier), each
    kept when it leaves at least ``min_tokens`` to ``lo``, ``hi`` and every peak already kept.
    Then, with ``max_tokens``, each part still longer is cut at its highest entropy among the cuts
    that leave at least ``min_tokens`` on both sides, until none is longer or has such a cut
    (``min_tokens`` wins where the two conflict).
    """
    inside = sorted(b for b in cuts if lo < b < hi)
    chosen: list[int] = []  # sorted
    for b in sorted(inside, key=lambda b: (-cuts[b][0], b)):
        if cuts[b][0] < threshold:
            break
        k = bisect_left(chosen, b)
        left = chosen[k - 1] if k > 0 else lo
        right = chosen[k] if k < len(chosen) else hi
        if b - left >= arg.min_tokens and right - b >= arg.min_tokens:
            chosen.insert(k, b)
    if arg.max_tokens is None:
        return chosen
    bounds = [lo, *chosen, hi]
    parts = list(zip(bounds, bounds[1:]))
    while parts:
        a, z = parts.pop()
        options = inside[bisect_right(inside, a) : bisect_left(inside, z)]
        if z - a <= arg.max_tokens:
            continue
        roomy = [b for b in options if min(b - a, z - b) >= arg.min_tokens]
        if not roomy:
            continue
        b = max(roomy, key=lambda b: (cuts[b][0], -b))
        chosen.append(b)
        parts += [(a, b), (b, z)]
    return chosen


_ENTROPY_USAGE = "top=F|threshold=H,min=N,max=N"


@register_segmenter(
    "entropy", parse_arg=_parse_entropy, uses_entropy=True, usage=f"entropy[:{_ENTROPY_USAGE}]"
)
def _entropy(
    text: str, arg: _EntropyArgs, positions: list[int], entropies: list[float]
) -> list[int]:
    """Cut before tokens where the policy's next-token entropy is high (default: the top 10% of
    the trace's tokens, segments of at least 4 tokens, no maximum)."""
    cuts = _entropy_cuts(text, positions, entropies)
    threshold = _entropy_threshold(arg, entropies)
    return [cuts[b][1] for b in _entropy_stretch(cuts, 0, len(positions), threshold, arg)]


@register_segmenter(
    "keywords+entropy",
    parse_arg=_parse_entropy,
    uses_entropy=True,
    usage=f"keywords+entropy[:{_ENTROPY_USAGE},words=Word|Word...]",
)
def _keywords_entropy(
    text: str, arg: _EntropyArgs, positions: list[int], entropies: list[float]
) -> list[int]:
    """Cut before discourse keywords (as ``keywords``), and at the entropy peaks of every stretch
    without one that is longer than ``max`` tokens (default 32), down to ``max`` tokens."""
    keyword_cuts = _keywords(text, arg.keywords)
    cuts = _entropy_cuts(text, positions, entropies)
    threshold = _entropy_threshold(arg, entropies)
    edges = sorted({0, len(positions), *(bisect_left(positions, c) for c in keyword_cuts)})
    chosen = [
        b
        for lo, hi in zip(edges, edges[1:])
        if hi - lo > arg.max_tokens
        for b in _entropy_stretch(cuts, lo, hi, threshold, arg)
    ]
    return [*keyword_cuts, *(cuts[b][1] for b in chosen)]


@dataclass(frozen=True)
class _MergeArgs:
    target: int | None  # segments to keep...
    fraction: float | None  # ...or this fraction of the lines (rounded up); exactly one is set


def _parse_merge(name: str, arg: str | None) -> _MergeArgs:
    key, eq, value = (part.strip() for part in (arg or "fraction=0.5").partition("="))
    try:
        number = int(value) if key == "target" else float(value)
    except ValueError:
        number = None
    if not eq or key not in ("target", "fraction") or number is None:
        raise ValueError(
            f"{name}: give target=N (segments to keep) or fraction=F (of the lines, in (0, 1]), "
            f"e.g. '{name}:target=4'; got {arg!r}"
        )
    if key == "target":
        if number < 1:
            raise ValueError(f"{name}: target must be >= 1 segment, got {number}")
        return _MergeArgs(number, None)
    if not (0.0 < number <= 1.0):
        raise ValueError(f"{name}: fraction must be in (0, 1], got {number}")
    return _MergeArgs(None, number)


@register_segmenter(
    "newline+merge",
    parse_arg=_parse_merge,
    uses_entropy=True,
    usage="newline+merge[:target=N|fraction=F]",
)
def _newline_merge(
    text: str, arg: _MergeArgs, positions: list[int], entropies: list[float]
) -> list[int]:
    """Cut after every line break, then merge adjacent lines at the lowest-entropy boundaries
    (the policy's entropy at the cut, as ``entropy`` reads it) until ``target`` segments remain
    (or ``fraction`` of the lines, rounded up; default half). Ties merge the earlier boundary
    first; a trace with no more lines than the target keeps every line."""
    starts = _skip_whitespace(text, _newline(text, None))
    starts = [c for c in starts if 0 < c < len(text)]
    lines = len(starts) + 1
    target = arg.target if arg.target is not None else math.ceil(arg.fraction * lines)
    if lines <= target:
        return starts
    cuts = _entropy_cuts(text, positions, entropies)
    entropy_at = {char: entropy for entropy, char in cuts.values()}
    ranked = sorted(starts, key=lambda c: (entropy_at.get(c, -math.inf), c))
    merged = set(ranked[: lines - target])
    return [c for c in starts if c not in merged]


# --------------------------------------------------------------------------------------------
# Options: whitespace, the answer line, min_chars, max_segments
# --------------------------------------------------------------------------------------------

_WHITESPACE = re.compile(r"\s*")


def _skip_whitespace(text: str, cuts: Iterable[int]) -> list[int]:
    """Move each cut past the whitespace that follows it (sorted, deduplicated; O(len(text)))."""
    out: list[int] = []
    reach = -1  # text[c:reach] is whitespace for every cut c already passed
    for c in sorted(set(cuts)):
        c = reach if c <= reach else _WHITESPACE.match(text, c).end()
        reach = c
        if not out or out[-1] != c:
            out.append(c)
    return out


def _answer_start(text: str, cuts: list[int], pattern: re.Pattern[str]) -> int | None:
    """Start of the final answer (the last non-blank line, if it matches), else ``None``.

    When the strategy cut the line before the match (``"x = 5. So the answer is 5."``), the
    answer starts at the last such cut.
    """
    end = len(text.rstrip())
    if end == 0:
        return None
    line_start = text.rfind("\n", 0, end) + 1
    m = pattern.search(text[line_start:end])
    if m is None:
        return None
    k = bisect_right(cuts, line_start + m.start()) - 1
    start = max(line_start, cuts[k]) if k >= 0 else line_start
    return _WHITESPACE.match(text, start).end()


def _merge_short(cuts: list[int], nonws: list[int], end: int, min_chars: int) -> list[int]:
    """Merge segments with fewer than ``min_chars`` non-whitespace characters into the next one
    (a short last segment into the previous one)."""
    if min_chars <= 0:
        return cuts
    kept: list[int] = []
    start = 0
    for c in cuts:
        if nonws[c] - nonws[start] >= min_chars:
            kept.append(c)
            start = c
    if kept and nonws[end] - nonws[start] < min_chars:
        kept.pop()
    return kept


def _cap(cuts: list[int], nonws: list[int], end: int, limit: int | None) -> list[int]:
    """Merge adjacent segments until at most ``limit`` remain.

    Repeatedly merges the adjacent pair with the fewest non-whitespace characters together
    (leftmost on ties): boundaries between long segments survive and merged segments come out
    balanced. A heap over a linked list of segments: O(n log n).
    """
    if limit is None or len(cuts) < limit:
        return cuts
    bounds = [0, *cuts, end]
    n = len(bounds) - 1
    size = [nonws[b] - nonws[a] for a, b in zip(bounds, bounds[1:])]
    prev, nxt, alive = list(range(-1, n - 1)), list(range(1, n + 1)), [True] * n
    heap = [(size[i] + size[i + 1], i) for i in range(n - 1)]
    heapify(heap)
    count = n
    while count > limit:
        total, i = heappop(heap)
        j = nxt[i]
        if not alive[i] or j >= n or size[i] + size[j] != total:
            continue  # stale entry: one of the two segments changed since it was pushed
        size[i] += size[j]
        alive[j] = False
        nxt[i] = nxt[j]
        if nxt[j] < n:
            prev[nxt[j]] = i
        count -= 1
        if prev[i] >= 0:
            heappush(heap, (size[prev[i]] + size[i], prev[i]))
        if nxt[i] < n:
            heappush(heap, (size[i] + size[nxt[i]], i))
    return [bounds[i] for i in range(1, n) if alive[i]]


# --------------------------------------------------------------------------------------------
# Segmenter
# --------------------------------------------------------------------------------------------


def _as_entropies(entropies: Sequence[float] | Any, n_tokens: int) -> list[float]:
    """``entropies`` as a list of finite floats, one per token."""
    if hasattr(entropies, "tolist"):  # a (T,) tensor or array
        entropies = entropies.tolist()
    try:
        values = [float(h) for h in entropies]
    except (TypeError, ValueError) as e:
        raise ValueError(
            "entropies must be a 1-D sequence of floats, one per response token"
        ) from e
    if len(values) != n_tokens:
        raise ValueError(
            f"entropies has {len(values)} values but there are {n_tokens} tokens: pass one "
            "entropy per token of offsets (the same response tokens, eos included if it is)"
        )
    bad = next((i for i, h in enumerate(values) if not math.isfinite(h)), None)
    if bad is not None:
        raise ValueError(f"entropies[{bad}] is {values[bad]}: every entropy must be finite")
    return values


@dataclass(frozen=True)
class Segmenter:
    """A strategy plus options; ``split(text)`` gives character spans, ``boundaries(text,
    offsets)`` token boundaries.

    - ``strategy``: ``"newline"``, ``"sentence"``, ``"tokens:16"``, ``"entropy"``, ...
      (``list_segmenters()``).
    - ``min_chars``: segments with fewer non-whitespace characters merge into the next one (a
      short last segment into the previous one).
    - ``max_segments``: at most this many segments; the adjacent pair with the fewest
      non-whitespace characters merges first.
    - ``separate_answer``: keep the final answer line (``answer_pattern``, ``re.search`` on the
      last non-blank line) as its own last segment, exempt from ``min_chars``/``max_segments``
      merging (unless ``max_segments == 1``). When False (default) the answer line is merged into
      the last reasoning step (docs/method.md, failure modes). A text without an answer line (truncated) is
      split as is; an empty ``answer_pattern`` (or ``None``) never finds one.
    """

    strategy: str = "newline"
    min_chars: int = 0
    max_segments: int | None = None
    separate_answer: bool = False
    answer_pattern: str | re.Pattern[str] | None = DEFAULT_ANSWER_PATTERN
    _entry: _Strategy = field(init=False, repr=False, compare=False)
    _arg: Any = field(init=False, repr=False, compare=False)
    _answer_re: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        entry, arg = _parse_strategy(self.strategy)
        if isinstance(self.min_chars, bool) or not isinstance(self.min_chars, int):
            raise TypeError(f"min_chars must be an int >= 0, got {self.min_chars!r}")
        if self.min_chars < 0:
            raise ValueError(f"min_chars must be >= 0, got {self.min_chars}")
        if self.max_segments is not None and (
            isinstance(self.max_segments, bool)
            or not isinstance(self.max_segments, int)
            or self.max_segments < 1
        ):
            raise ValueError(f"max_segments must be None or an int >= 1, got {self.max_segments!r}")
        answer_re = None
        if getattr(self.answer_pattern, "pattern", self.answer_pattern):  # not None, not empty
            try:
                answer_re = re.compile(self.answer_pattern)
            except re.error as e:
                raise ValueError(
                    f"answer_pattern {self.answer_pattern!r} is not a regex: {e}"
                ) from e
        object.__setattr__(self, "_entry", entry)
        object.__setattr__(self, "_arg", arg)
        object.__setattr__(self, "_answer_re", answer_re)

    @property
    def uses_tokens(self) -> bool:
        """True when the strategy counts tokens and so needs offsets (``tokens:N``, entropy)."""
        return self._entry.uses_tokens

    @property
    def uses_entropy(self) -> bool:
        """True when the strategy cuts at the policy's entropy and so needs ``entropies``."""
        return self._entry.uses_entropy

    def split(
        self,
        text: str,
        offsets: Sequence[Span] | None = None,
        entropies: Sequence[float] | None = None,
    ) -> list[Span]:
        """Character spans of ``text``: contiguous, non-empty, covering ``[0, len(text))``.

        ``offsets`` (token character spans, see ``token_offsets``) are needed only by token
        strategies such as ``tokens:N``, ``entropies`` (one per token) only by ``entropy`` and
        ``keywords+entropy``; other strategies ignore them. Empty text gives ``[]``.
        """
        return self._split(text, offsets, entropies)[0]

    def find_answer(
        self,
        text: str,
        offsets: Sequence[Span] | None = None,
        entropies: Sequence[float] | None = None,
    ) -> int | None:
        """Where the final answer line starts in ``text`` (the segment it was merged into, or its
        own with ``separate_answer``), or ``None`` when the last line is no answer line."""
        return self._split(text, offsets, entropies)[1]

    def boundaries(
        self, text: str, offsets: Sequence[Span], entropies: Sequence[float] | None = None
    ) -> list[int]:
        """Token boundaries ``[0, b_1, ..., T]`` of a response with token ``offsets`` in ``text``.

        ``offsets`` come from ``token_offsets``/``decode_with_offsets`` (generated ids) or from
        ``tokenizer(text, return_offsets_mapping=True)["offset_mapping"]`` (re-tokenized text).
        ``entropies[i]``: the entropy (nats) of the policy's distribution that token ``i`` was
        sampled from, e.g. ``policy_forward(..., with_entropy=True).entropy[row, :T]``; needed by
        the entropy strategies only.
        """
        return spans_to_boundaries(self.split(text, offsets, entropies), offsets, text=text)

    def _strategy_cuts(
        self, text: str, offsets: Sequence[Span] | None, entropies: Sequence[float] | None
    ) -> list[int]:
        """The strategy's cut positions, sorted, before the options."""
        entry = self._entry
        if not entry.uses_tokens:
            return _skip_whitespace(text, entry.fn(text, self._arg))
        if offsets is None or (entry.uses_entropy and entropies is None):
            needs = "token offsets and entropies" if entry.uses_entropy else "token offsets"
            raise ValueError(
                f"strategy {self.strategy!r} counts tokens: pass {needs}, e.g. "
                f"Segmenter.boundaries(text, offsets{', entropies' if entry.uses_entropy else ''})"
                " with offsets from token_offsets(tokenizer, token_ids)"
                + (
                    " and entropies[i] the policy's entropy at token i "
                    "(rredcot segment --strategy entropy --checkpoint DIR computes them)"
                    if entry.uses_entropy
                    else ""
                )
            )
        positions = _token_positions(offsets, text, len(text))
        if not entry.uses_entropy:  # a cut at a whitespace-only token opens the next word
            return _skip_whitespace(text, entry.fn(text, self._arg, positions))
        values = _as_entropies(entropies, len(positions))
        return sorted(set(entry.fn(text, self._arg, positions, values)))

    def _split(
        self, text: str, offsets: Sequence[Span] | None, entropies: Sequence[float] | None
    ) -> tuple[list[Span], int | None]:
        """The spans, and where the final answer starts (``None``: no answer line)."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        length = len(text)
        if length == 0:
            return [], None
        cuts = self._strategy_cuts(text, offsets, entropies)
        nonws = list(
            accumulate(map(not_, map(str.isspace, text)), initial=0)
        )  # content prefix sums
        cuts = [c for c in cuts if 0 < c < length and nonws[c] > 0]

        end = length  # the segments [0, end) are merged by the options; [end, length) is the answer
        answer = None if self._answer_re is None else _answer_start(text, cuts, self._answer_re)
        if answer is not None:
            cuts = [c for c in cuts if c < answer]  # the answer line in one piece, merged back
            if self.separate_answer and nonws[answer] > 0 and self.max_segments != 1:
                end = answer
        limit = self.max_segments
        if limit is not None and end < length:
            limit -= 1
        cuts = _cap(_merge_short(cuts, nonws, end, self.min_chars), nonws, end, limit)
        if end < length:
            cuts.append(end)
        bounds = [0, *cuts, length]
        return list(zip(bounds, bounds[1:])), answer


def get_segmenter(strategy: str = "newline", **options: Any) -> Segmenter:
    """The ``Segmenter`` for a strategy name such as ``"sentence"`` or ``"tokens:16"``."""
    return Segmenter(strategy, **options)


def segmenter_from_config(
    credit: Any, answer_pattern: str | None = None, strategy: str | None = None
) -> Segmenter:
    """The one way a run builds its segmenter: ``credit`` is a ``CreditConfig`` (its
    ``segmenter``, ``min_chars``, ``max_segments`` and ``separate_answer``); ``answer_pattern`` is
    the task's own final-answer line (``Task.answer_line_pattern``; None: the default pattern);
    ``strategy`` replaces the config's (the credit benchmark's resegmentation)."""
    return Segmenter(
        strategy or credit.segmenter,
        min_chars=credit.min_chars,
        max_segments=credit.max_segments or None,
        separate_answer=credit.separate_answer,
        answer_pattern=DEFAULT_ANSWER_PATTERN if answer_pattern is None else answer_pattern,
    )


def split_text(
    text: str,
    strategy: str = "newline",
    *,
    min_chars: int = 0,
    max_segments: int | None = None,
    separate_answer: bool = False,
    answer_pattern: str | re.Pattern[str] | None = DEFAULT_ANSWER_PATTERN,
    offsets: Sequence[Span] | None = None,
    entropies: Sequence[float] | None = None,
) -> list[Span]:
    """Split ``text`` into contiguous character spans covering it exactly (see ``Segmenter``)."""
    segmenter = Segmenter(strategy, min_chars, max_segments, separate_answer, answer_pattern)
    return segmenter.split(text, offsets, entropies)


# --------------------------------------------------------------------------------------------
# Token layer: token ids -> character offsets -> boundaries
# --------------------------------------------------------------------------------------------


def _as_pairs(offsets: Sequence[Span] | Any) -> list[Span]:
    if hasattr(offsets, "tolist"):  # a (T, 2) tensor or array
        offsets = offsets.tolist()
    try:
        return [(s, e) for s, e in offsets]
    except (TypeError, ValueError) as e:
        raise ValueError("offsets must be a sequence of (start, end) character pairs") from e


_NON_WHITESPACE = re.compile(r"\S")


def _token_positions(offsets: Sequence[Span], text: str | None, length: int) -> list[int]:
    """The character position that decides each token's segment (non-decreasing).

    A token's first non-whitespace character when ``text`` is given, else its start; a token with
    an empty span takes the position of the token before, and positions never decrease.
    """
    positions, prev = [], 0
    for k, (s, e) in enumerate(_as_pairs(offsets)):
        if not 0 <= s <= e <= length:
            raise ValueError(
                f"token {k} has offsets ({s}, {e}) outside the text [0, {length}]: the offsets "
                "must come from the same text as the spans (decode_with_offsets returns both)"
            )
        if s == e and positions:  # an empty span (special token) goes with the token before
            positions.append(prev)
            continue
        p = s
        if text is not None and s < e and text[s].isspace():
            m = _NON_WHITESPACE.search(text, s, e)
            if m is not None:
                p = m.start()
        if p > prev:
            prev = p
        positions.append(prev)
    return positions


def token_positions(offsets: Sequence[Span], text: str) -> list[int]:
    """The character position that decides each token's segment (non-decreasing): its first
    non-whitespace character (its start when it is all whitespace), the position of the token
    before for an empty span. The tokens of a span ``(s, e)`` start at
    ``bisect_left(positions, s)``."""
    return _token_positions(offsets, text, len(text))


def cut_entropies(
    text: str, offsets: Sequence[Span], entropies: Sequence[float]
) -> list[float | None]:
    """The entropy at a cut before each token, as the entropy strategies see it: entry ``b`` is
    the highest entropy of the tokens whose cut lands before token ``b`` (``None`` where none
    does, always for ``b = 0``)."""
    positions = _token_positions(offsets, text, len(text))
    cuts = _entropy_cuts(text, positions, _as_entropies(entropies, len(positions)))
    return [cuts[b][0] if b in cuts else None for b in range(len(positions))]


def spans_to_boundaries(
    spans: Sequence[Span], offsets: Sequence[Span], *, text: str | None = None
) -> list[int]:
    """Token boundaries ``[0, b_1, ..., b_n = T]`` from character spans and token offsets.

    ``spans``: contiguous character spans from ``split_text``; ``offsets``: ``(T, 2)`` token
    character spans in the same text. A token belongs to the span holding its position (its first
    non-whitespace character when ``text`` is given, else its start; empty-span tokens follow the
    token before; a position at the end of the text is in the last span). Spans that hold no
    token are dropped, so boundaries strictly increase and every token is in exactly one segment.
    No tokens give ``[0]``; tokens over an empty text one segment ``[0, T]``.
    """
    offsets = _as_pairs(offsets)
    n_tokens = len(offsets)
    if n_tokens == 0:
        return [0]
    if not spans:
        _token_positions(offsets, text, 0)  # validates: an empty text has only empty tokens
        return [0, n_tokens]
    starts = [s for s, _ in spans]
    ends = [e for _, e in spans]
    if (
        starts[0] != 0
        or any(e != s for e, s in zip(ends, starts[1:]))
        or any(s >= e for s, e in spans)
    ):
        raise ValueError("spans must be non-empty, contiguous and start at 0 (from split_text)")
    if text is not None and len(text) != ends[-1]:
        raise ValueError(f"spans cover {ends[-1]} characters but the text has {len(text)}")
    positions = _token_positions(offsets, text, ends[-1])
    segment = [bisect_right(starts, p) - 1 for p in positions]
    inner = [i for i in range(1, n_tokens) if segment[i] != segment[i - 1]]
    return [0, *inner, n_tokens]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: every byte maps to a printable character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_DECODER = {ch: b for b, ch in _bytes_to_unicode().items()}


@lru_cache(maxsize=1 << 16)
def _byte_level_bytes(token: str) -> bytes:
    """Bytes of a byte-level token; a token outside the alphabet (an added token) is its UTF-8,
    as the ``tokenizers`` ByteLevel decoder does."""
    try:
        return bytes(_BYTE_DECODER[ch] for ch in token)
    except KeyError:
        return token.encode("utf-8")


def _pieces_byte_level(tokenizer: Any, ids: list[int], skip_special: bool) -> list[bytes] | None:
    """Per-token bytes through the byte-level alphabet: exact and O(T) for GPT-2/Llama-3/Qwen."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or b'"ByteLevel"' not in decoder.__getstate__():
        return None
    skipped = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    id_to_token = backend.id_to_token
    pieces = []
    for i in ids:
        if skip_special and i in skipped:
            pieces.append(b"")
            continue
        token = id_to_token(i)
        if token is None:
            return None
        pieces.append(_byte_level_bytes(token))
    return pieces


def _pieces_per_token(tokenizer: Any, ids: list[int], skip_special: bool) -> list[bytes] | None:
    """Each token decoded alone (one batched call): right for character/word-level tokenizers."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    singles = [[i] for i in ids]
    if backend is not None:
        texts = backend.decode_batch(singles, skip_special_tokens=skip_special)
    else:
        texts = tokenizer.batch_decode(singles, skip_special_tokens=skip_special)
    return [t.encode("utf-8") for t in texts]


def _pieces_incremental(tokenizer: Any, ids: list[int], skip_special: bool) -> list[bytes]:
    """Incremental detokenization over a short sliding window (as vLLM does): O(T) decodes.

    Handles decoders that depend on context (SentencePiece's leading-space strip). A token whose
    text is not complete yet (partial UTF-8) gets an empty piece and the token that completes the
    character carries it, so both start at that character.
    """

    def decode(chunk: list[int]) -> str:
        return tokenizer.decode(chunk, skip_special_tokens=skip_special)

    pieces: list[bytes] = []
    prefix, read = 0, 0  # ids[prefix:read] has been emitted; it is decoded again for context
    emitted = ""
    for i in range(len(ids)):
        new = decode(ids[prefix : i + 1])
        if len(new) > len(emitted) and new.startswith(emitted) and not new.endswith("\ufffd"):
            pieces.extend([b""] * (i - read))
            pieces.append(new[len(emitted) :].encode("utf-8"))
            prefix, read = read, i + 1
            emitted = decode(ids[prefix:read])
    pieces.extend([b""] * (len(ids) - read))
    return pieces


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:  # largest k with a[:k] == b[:k]
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _offsets_by_prefix(tokenizer: Any, ids: list[int], skip_special: bool, text: str) -> list[Span]:
    """Last resort, right for any tokenizer: token ``i`` starts where the decoded prefix
    ``ids[:i]`` stops agreeing with ``text``. O(T) decodes of O(T) tokens each."""
    stable = [0]
    for i in range(1, len(ids) + 1):
        prefix = tokenizer.decode(ids[:i], skip_special_tokens=skip_special)
        stable.append(max(stable[-1], _common_prefix_len(prefix, text)))
    stable[-1] = len(text)
    return list(zip(stable, stable[1:]))


def _offsets_from_pieces(pieces: list[bytes]) -> tuple[str, list[Span]]:
    """Decode per-token byte pieces as UTF-8; each token spans the characters its bytes touch.

    A token that starts inside a multi-byte character starts at that character, so starts never
    decrease; a token without bytes gets an empty span at the current position.
    """
    if all(piece.isascii() for piece in pieces):  # one byte per character
        ends = list(accumulate(map(len, pieces)))
        return b"".join(pieces).decode("ascii"), list(zip([0, *ends], ends))
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    chunks, spans, n = [], [], 0
    for piece in pieces:
        start = n
        chunk = decoder.decode(piece)
        chunks.append(chunk)
        n += len(chunk)
        pending = bool(piece) and bool(decoder.getstate()[0])
        spans.append((start, n + pending))
    chunk = decoder.decode(b"", final=True)
    chunks.append(chunk)
    n += len(chunk)
    return "".join(chunks), [(min(s, n), min(e, n)) for s, e in spans]


def _as_id_list(token_ids: Sequence[int] | Any) -> list[int]:
    if hasattr(token_ids, "tolist"):
        token_ids = token_ids.tolist()
    if isinstance(token_ids, int):
        raise ValueError("token_ids must be a 1-D sequence of ints, got a single int")
    ids = list(token_ids)
    if any(isinstance(t, (list, tuple)) for t in ids):
        raise ValueError("token_ids must be one response (1-D), got a nested sequence")
    return [int(t) for t in ids]


def decode_with_offsets(
    tokenizer: Any, token_ids: Sequence[int], *, skip_special_tokens: bool = True
) -> tuple[str, list[Span]]:
    """Decode generated ``token_ids`` and give each token's character span in the decoded text.

    ``text = tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)``; with the
    default ``True`` special tokens (eos, pad) have an empty span where they stand, so an eos at
    the end sits at ``len(text)`` and belongs to the last segment. Byte-level BPE: a token that
    holds part of a multi-byte character spans that whole character, and tokens sharing a
    character share its start (starts never decrease).

    Tries, in order, keeping the first whose pieces reproduce ``text`` exactly: per-token bytes
    via the byte-level alphabet, each token decoded alone, incremental detokenization; else
    decoded prefixes (quadratic, always consistent).
    """
    ids = _as_id_list(token_ids)
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    if not ids:
        return text, []
    for make_pieces in (_pieces_byte_level, _pieces_per_token, _pieces_incremental):
        pieces = make_pieces(tokenizer, ids, skip_special_tokens)
        if pieces is not None:
            decoded, spans = _offsets_from_pieces(pieces)
            if decoded == text:
                return text, spans
    return text, _offsets_by_prefix(tokenizer, ids, skip_special_tokens, text)


def token_offsets(
    tokenizer: Any, token_ids: Sequence[int], *, skip_special_tokens: bool = True
) -> list[Span]:
    """Character spans of ``token_ids`` in ``tokenizer.decode(token_ids, skip_special_tokens=...)``
    (see ``decode_with_offsets``, which also returns that text)."""
    return decode_with_offsets(tokenizer, token_ids, skip_special_tokens=skip_special_tokens)[1]


def segment_completion(
    segmenter: Segmenter,
    tokenizer: Any,
    response_ids: Sequence[int],
    *,
    text: str | None = None,
    eos_ids: Sequence[int] | None = None,
    entropies: Sequence[float] | None = None,
) -> tuple[list[int], list[int], str]:
    """The one segmentation entry point for a generated completion (the trainer's rollouts, the
    TRL and verl adapters, the benchmarks).

    Args:
        response_ids: the completion's token ids, a trailing EOS included where it ended so.
        text: the decoded completion, if the caller has it (else decoded here, special tokens
            skipped).
        eos_ids: the ids that end a completion (default: the tokenizer's ``eos_token_id``); a
            trailing one is not decoded and joins the last segment.
        entropies: the policy's next-token entropy at each response token (entropy strategies).

    Returns ``(boundaries [0, b_1, ..., b_n = len(response_ids)], char start of each segment,
    text)``; ``[0]`` and no starts for an empty completion.
    """
    if eos_ids is None:
        eos_ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    ids = _as_id_list(response_ids)
    content = ids[:-1] if ids and ids[-1] in set(eos_ids) else ids
    decoded, offsets = decode_with_offsets(tokenizer, content)
    text = decoded if text is None else text
    if content:
        ent = None if entropies is None else list(entropies[: len(content)])
        bounds = segmenter.boundaries(text, offsets, entropies=ent)
    else:
        bounds = [0]
    if len(ids) > len(content):  # the EOS token joins the last segment
        bounds = bounds[:-1] + [len(ids)] if len(bounds) > 1 else [0, len(ids)]
    starts = [offsets[b][0] if b < len(offsets) else len(text) for b in bounds[:-1]]
    return bounds, starts, text
