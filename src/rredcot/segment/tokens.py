"""The token layer: where each generated token sits in the text, and which segment holds it.

- ``decode_with_offsets`` / ``token_offsets``: generated token ids -> the decoded text and each
  token's character span in it (byte-level BPE, SentencePiece and character tokenizers alike).
- ``token_positions``: the character that decides each token's segment.
- ``spans_to_boundaries``: character spans (from a ``Segmenter``) + token offsets -> token
  boundaries ``0 = b_0 < b_1 < ... < b_n = T`` (segment ``k`` is tokens ``[b_{k-1}, b_k)``).

No torch: a tensor is read with ``.tolist()``.
"""

from __future__ import annotations

import codecs
import re
from bisect import bisect_right
from collections.abc import Sequence
from functools import lru_cache
from itertools import accumulate
from typing import Any

Span = tuple[int, int]
"""A half-open character range ``[start, end)``."""


# --------------------------------------------------------------------------------------------
# Decoding: token ids -> the text and each token's character span
# --------------------------------------------------------------------------------------------


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


def as_token_ids(token_ids: Sequence[int] | Any) -> list[int]:
    """One response's token ids as a list of ints (a tensor or array is read with ``tolist``)."""
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
    ids = as_token_ids(token_ids)
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


# --------------------------------------------------------------------------------------------
# Positions: token offsets + character spans -> token boundaries
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
