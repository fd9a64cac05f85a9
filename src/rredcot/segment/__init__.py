"""Segmentation: response text -> character spans -> token boundaries (docs/method.md, segments).

Three rooms; ``strategies`` and ``tokens`` import nothing of rredcot, ``segmenter`` imports both:

1. ``strategies``: the named strategies and their registry; each proposes cut positions.
2. ``tokens``: ``token_offsets`` / ``decode_with_offsets`` give each generated token's character
   span inside the decoded text, and ``spans_to_boundaries`` turns spans + token offsets into
   token boundaries ``0 = b_0 < b_1 < ... < b_n = T`` (segment ``k`` is tokens ``[b_{k-1}, b_k)``).
3. ``segmenter``: ``Segmenter`` / ``split_text`` cut a response into contiguous character spans
   with a strategy, then apply the options (final answer handling, ``min_chars``,
   ``max_segments``); ``segment_completion`` segments a generated completion.

This package's names are the public interface: import them from ``rredcot.segment``.

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

from rredcot.segment.segmenter import (
    DEFAULT_ANSWER_PATTERN,
    Segmenter,
    cut_entropies,
    get_segmenter,
    segment_completion,
    segmenter_from_config,
    split_text,
)
from rredcot.segment.strategies import (
    DEFAULT_KEYWORDS,
    USER_REGEX_SECONDS,
    list_segmenters,
    register_segmenter,
)
from rredcot.segment.tokens import (
    Span,
    decode_with_offsets,
    spans_to_boundaries,
    token_offsets,
    token_positions,
)

__all__ = [
    "DEFAULT_ANSWER_PATTERN",
    "DEFAULT_KEYWORDS",
    "USER_REGEX_SECONDS",
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
