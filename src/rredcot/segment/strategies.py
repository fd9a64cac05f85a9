"""Segmentation strategies: a response's text -> the character positions where segments start.

A registry of named strategies (``register_segmenter``, ``list_segmenters``,
``find_strategy``) and the built-in ones: text strategies (``newline``, ``paragraph``,
``sentence``, ``step[:REGEX]``, ``keywords[:WORDS]``), the token strategy ``tokens:N`` and the
entropy strategies (``entropy``, ``keywords+entropy``, ``newline+merge``). A strategy only
proposes cut positions; ``rredcot.segment.segmenter.Segmenter`` turns them into spans and
applies the options (the package docstring, ``rredcot.segment``, states the conventions).
"""

from __future__ import annotations

import math
import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

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
class Strategy:
    """A registered strategy: its function, argument parser and what it needs."""

    fn: Callable[..., Iterable[int]]
    parse_arg: Callable[[str, str | None], Any]
    uses_tokens: bool
    uses_entropy: bool
    usage: str


_STRATEGIES: dict[str, Strategy] = {}


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
        _STRATEGIES[name] = Strategy(
            fn, parse_arg or _no_arg, uses_tokens or uses_entropy, uses_entropy, usage or name
        )
        return fn

    return decorator


def list_segmenters() -> list[str]:
    """Usage strings of the registered strategies, e.g. ``["newline", ..., "tokens:N"]``."""
    return [s.usage for s in _STRATEGIES.values()]


def find_strategy(strategy: str) -> tuple[Strategy, Any]:
    """The registered strategy of ``"name[:arg]"`` and its parsed argument (``ValueError`` on an
    unknown name or a bad argument)."""
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
# Whitespace: a cut moves past the whitespace after it (it stays with the segment before)
# --------------------------------------------------------------------------------------------

_WHITESPACE = re.compile(r"\s*")


def skip_whitespace(text: str, cuts: Iterable[int]) -> list[int]:
    """Move each cut past the whitespace that follows it (sorted, deduplicated; O(len(text)))."""
    out: list[int] = []
    reach = -1  # text[c:reach] is whitespace for every cut c already passed
    for c in sorted(set(cuts)):
        c = reach if c <= reach else _WHITESPACE.match(text, c).end()
        reach = c
        if not out or out[-1] != c:
            out.append(c)
    return out


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
_LINE_BLANKS = re.compile(r"[^\S\n]*")  # a list marker is these, then 1-3 digits and "."
_DIGITS = re.compile(r"\d{1,3}")
_MATH = re.compile(
    r"\$\$.+?\$\$"  # display $$...$$
    r"|\\\[.+?\\\]"  # display \[...\]
    r"|\\\(.+?\\\)"  # inline \(...\)
    r"|\$(?=[^\s$])[^$\n]*?(?<![\s\\])\$(?!\d)",  # inline $...$ (pandoc's rule)
    re.DOTALL,
)
# Two plain words in a row: an inline "$...$" holding this is prose between two dollar amounts.
_PROSE = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{2,}[.,;:!?]?\s+[A-Za-z]{2,}")


def _math_regions(text: str) -> list[tuple[int, int]]:
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


def _inside(regions: list[tuple[int, int]], pos: int) -> bool:
    k = bisect_right(regions, (pos, float("inf"))) - 1
    return k >= 0 and regions[k][0] <= pos < regions[k][1]


_OPENERS = "([{\"'\u201c\u2018"  # stripped from the front of a word before the abbreviation test
_LONGEST_ABBREVIATION = max(map(len, _ABBREVIATIONS))


class _PeriodTest:
    """Tells the "." of an abbreviation ("e.g.") or of a list marker at a line start ("2.")
    from a sentence end, for the dots of one text in increasing order: the last word break and
    line start are carried forward, so a text is read once (a long line of many sentences stays
    linear, not quadratic)."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.seen = 0  # text[:seen] has been searched for word breaks and line starts
        self.word_break = -1  # the last " ", "\n" or "\t" before `seen`
        self.line_start = 0
        self.word_start = (-2, 0)  # (word_break, first character after it that is no opener)
        self.first_blank = (-1, 0)  # (line_start, first character of that line that is no blank)

    def non_final(self, dot: int) -> bool:
        text = self.text
        if text[dot] != ".":
            return False
        if dot > self.seen:
            found = max(text.rfind(c, self.seen, dot) for c in " \n\t")
            self.word_break = max(self.word_break, found)
            self.line_start = max(self.line_start, text.rfind("\n", self.seen, dot) + 1)
            self.seen = dot
        if self.word_start[0] != self.word_break:
            start = self.word_break + 1
            while start < dot and text[start] in _OPENERS:
                start += 1
            self.word_start = (self.word_break, start)
        start = self.word_start[1]
        if (
            dot + 1 - start <= _LONGEST_ABBREVIATION
            and text[start : dot + 1].lower() in _ABBREVIATIONS
        ):
            return True
        if self.first_blank[0] != self.line_start:
            blank = _LINE_BLANKS.match(text, self.line_start)
            self.first_blank = (self.line_start, blank.end())
        first = self.first_blank[1]
        return 1 <= dot - first <= 3 and _DIGITS.fullmatch(text, first, dot) is not None


@register_segmenter("sentence")
def _sentence(text: str, arg: None) -> list[int]:
    """Cut after ``.!?`` followed by whitespace or the end, after the CJK sentence ends ``。！？``
    (with their closing quotes or brackets; CJK text puts no space after them), and after every
    line break.

    Not after abbreviations or list markers, never inside LaTeX math; numbers such as ``3.14``
    have no whitespace after the ``.`` so they never split.
    """
    math = _math_regions(text)
    period = _PeriodTest(text)
    cuts = []
    for m in _SENTENCE_END.finditer(text):
        if _inside(math, m.start()) or period.non_final(m.start()):
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
    starts = skip_whitespace(text, [0, *_sentence(text, None)])
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


def entropy_cuts(
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
    cuts = entropy_cuts(text, positions, entropies)
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
    cuts = entropy_cuts(text, positions, entropies)
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
    starts = skip_whitespace(text, _newline(text, None))
    starts = [c for c in starts if 0 < c < len(text)]
    lines = len(starts) + 1
    target = arg.target if arg.target is not None else math.ceil(arg.fraction * lines)
    if lines <= target:
        return starts
    cuts = entropy_cuts(text, positions, entropies)
    entropy_at = {char: entropy for entropy, char in cuts.values()}
    ranked = sorted(starts, key=lambda c: (entropy_at.get(c, -math.inf), c))
    merged = set(ranked[: lines - target])
    return [c for c in starts if c not in merged]
