"""The ``Segmenter``: a strategy plus options -> character spans -> token boundaries.

``Segmenter.split`` runs the strategy (``rredcot.segment.strategies``), moves its cuts past
whitespace, keeps the final answer line whole (merged into the last step unless
``separate_answer``), then merges short segments (``min_chars``) and caps their number
(``max_segments``); ``Segmenter.boundaries`` maps the spans onto tokens
(``rredcot.segment.tokens``). ``segment_completion`` is the one entry point for a generated
completion: decode, segment, and a trailing EOS joined to the last segment.
"""

from __future__ import annotations

import math
import re
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from itertools import accumulate
from operator import not_
from typing import Any

from rredcot.segment import strategies as _strategies
from rredcot.segment.strategies import Strategy, entropy_cuts, find_strategy, skip_whitespace
from rredcot.segment.tokens import (
    Span,
    as_token_ids,
    decode_with_offsets,
    spans_to_boundaries,
    token_positions,
)

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


# --------------------------------------------------------------------------------------------
# Options: the answer line, min_chars, max_segments
# --------------------------------------------------------------------------------------------

_WHITESPACE = re.compile(r"\s*")


def _compile_answer_pattern(pattern: str | re.Pattern[str]) -> Any:
    """A compiled ``re.Pattern`` as it is; a pattern given as text, checked by ``re`` and
    compiled by ``regex`` (the same syntax), whose searches can be stopped when they run long."""
    if isinstance(pattern, re.Pattern):
        return pattern
    compiled = re.compile(pattern)
    if pattern == DEFAULT_ANSWER_PATTERN:  # ours, linear: no limit needed
        return compiled
    import regex  # as strategies._parse_regex: only patterns of yours need it

    return regex.compile(pattern)


def _answer_start(text: str, cuts: list[int], pattern: re.Pattern[str]) -> int | None:
    """Start of the final answer (the last non-blank line, if it matches), else ``None``.

    When the strategy cut the line before the match (``"x = 5. So the answer is 5."``), the
    answer starts at the last such cut.
    """
    end = len(text.rstrip())
    if end == 0:
        return None
    line_start = text.rfind("\n", 0, end) + 1
    line = text[line_start:end]
    if isinstance(pattern, re.Pattern):
        m = pattern.search(line)
    else:  # a pattern given as text, compiled by `regex`: bounded as a step:REGEX is
        try:
            m = pattern.search(line, timeout=_strategies.USER_REGEX_SECONDS)
        except TimeoutError:
            raise ValueError(
                f"answer pattern {pattern.pattern!r} ran over {_strategies.USER_REGEX_SECONDS:g} s "
                f"on a line "
                f"of {len(line)} characters (catastrophic backtracking, e.g. nested repeats like "
                "(a+)+$); simplify the pattern"
            ) from None
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
    _entry: Strategy = field(init=False, repr=False, compare=False)
    _arg: Any = field(init=False, repr=False, compare=False)
    _answer_re: re.Pattern[str] | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        entry, arg = find_strategy(self.strategy)
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
            try:  # a pattern given as text runs with a time limit (`regex`, re's syntax)
                answer_re = _compile_answer_pattern(self.answer_pattern)
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
            return skip_whitespace(text, entry.fn(text, self._arg))
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
        positions = token_positions(offsets, text)
        if not entry.uses_entropy:  # a cut at a whitespace-only token opens the next word
            return skip_whitespace(text, entry.fn(text, self._arg, positions))
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


def cut_entropies(
    text: str, offsets: Sequence[Span], entropies: Sequence[float]
) -> list[float | None]:
    """The entropy at a cut before each token, as the entropy strategies see it: entry ``b`` is
    the highest entropy of the tokens whose cut lands before token ``b`` (``None`` where none
    does, always for ``b = 0``)."""
    positions = token_positions(offsets, text)
    cuts = entropy_cuts(text, positions, _as_entropies(entropies, len(positions)))
    return [cuts[b][0] if b in cuts else None for b in range(len(positions))]


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
    ids = as_token_ids(response_ids)
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
