"""``rredcot segment``: split a reasoning trace and print one JSON object per segment.

    rredcot segment --strategy sentence trace.txt
    cat trace.txt | rredcot segment --strategy keywords --min-chars 20
    rredcot segment --strategy tokens:16 --tokenizer path/to/tokenizer trace.txt

Each line is ``{"index": k, "start": s, "end": e, "text": ...}`` with ``[s, e)`` character offsets
into the trace as read (a file keeps its ``\\r\\n`` line ends; stdin is read in text mode).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rredcot.segment import DEFAULT_ANSWER_PATTERN, Segmenter, list_segmenters


def add_segment_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``segment`` sub-command to an ``argparse`` sub-parser collection."""
    p = subparsers.add_parser(
        "segment",
        help="Split a reasoning trace into segments (one JSON object per line).",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "file", nargs="?", default=None, help="trace file (UTF-8); stdin if omitted or -"
    )
    p.add_argument(
        "--strategy",
        default="newline",
        help=f"segmentation strategy: {', '.join(list_segmenters())} (default: newline)",
    )
    p.add_argument(
        "--min-chars",
        type=int,
        default=0,
        help="merge segments with fewer non-whitespace characters into the next one (default: 0)",
    )
    p.add_argument(
        "--max-segments",
        type=int,
        default=None,
        help="at most this many segments; the shortest adjacent pair merges first",
    )
    p.add_argument(
        "--separate-answer",
        action="store_true",
        help="keep the final answer line as its own segment (default: merged into the last step)",
    )
    p.add_argument(
        "--answer-pattern",
        default=DEFAULT_ANSWER_PATTERN,
        help="regex that marks the last non-blank line as the final answer",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer directory (AutoTokenizer); needed by tokens:N",
    )
    p.set_defaults(func=run_segment)
    return p


def _read_trace(path: str | None) -> str:
    """The trace as UTF-8 text; bytes that are not UTF-8 are refused the same way from a file and
    from stdin (whose line ends are read as text mode reads them)."""
    if path is None or path == "-":
        raw = getattr(sys.stdin, "buffer", None)
        if raw is None:  # stdin replaced by a text stream
            return sys.stdin.read()
        text = _decode(raw.read(), "stdin")
        return text.replace("\r\n", "\n").replace("\r", "\n")
    with open(path, "rb") as f:
        return _decode(f.read(), path)


def _decode(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(
            f"{where} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "segment a text trace"
        ) from None


def _offsets(tokenizer_path: str, text: str) -> list[tuple[int, int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [tuple(pair) for pair in encoding["offset_mapping"]]


def run_segment(args: argparse.Namespace) -> int:
    """Run ``rredcot segment``; returns the exit status (2 on bad input, with a message on
    stderr)."""
    try:
        segmenter = Segmenter(
            args.strategy,
            args.min_chars,
            args.max_segments,
            args.separate_answer,
            args.answer_pattern,
        )
        if segmenter.uses_tokens and args.tokenizer is None:
            raise ValueError(
                f"--strategy {args.strategy} counts tokens: pass --tokenizer PATH "
                "(a local tokenizer directory)"
            )
        text = _read_trace(args.file)
        offsets = _offsets(args.tokenizer, text) if args.tokenizer is not None else None
        spans = segmenter.split(text, offsets)
    except (ValueError, TypeError, OSError) as e:
        print(f"rredcot segment: error: {e}", file=sys.stderr)
        return 2
    for k, (start, end) in enumerate(spans):
        record = {"index": k, "start": start, "end": end, "text": text[start:end]}
        print(json.dumps(record, ensure_ascii=False))
    return 0
