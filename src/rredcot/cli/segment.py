"""``rredcot segment``: split a reasoning trace and print one JSON object per segment.

    rredcot segment --strategy sentence trace.txt
    cat trace.txt | rredcot segment --strategy keywords --min-chars 20
    rredcot segment --strategy tokens:16 --tokenizer path/to/tokenizer trace.txt
    rredcot segment --strategy entropy --checkpoint runs/warmstart --prompt "Q: ..." trace.txt

Each line is ``{"index": k, "start": s, "end": e, "text": ...}`` with ``[s, e)`` character offsets
into the trace as read (a file or stdin keeps its ``\\r\\n`` line ends). The
entropy strategies (``entropy``, ``keywords+entropy``) compute the policy's next-token entropy of
every trace token with ``--checkpoint`` (after ``--prompt``) and add ``"tokens": [a, b]`` (the
segment's tokens) and ``"entropy"`` (nats, at the cut that opens the segment; ``null`` for the
first). Whether the final answer line was merged into the last step is said on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from bisect import bisect_left
from typing import Any

from rredcot.segment import (
    DEFAULT_ANSWER_PATTERN,
    USER_REGEX_SECONDS,
    Segmenter,
    Span,
    cut_entropies,
    list_segmenters,
    token_positions,
)
from rredcot.tasks.base import Problem


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
        help=f"segmentation strategy: {', '.join(list_segmenters())} (default: newline); "
        f"a step:REGEX of yours runs with a {USER_REGEX_SECONDS:g} s limit per trace",
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
        "--no-merge-answer",
        dest="separate_answer",
        action="store_true",
        help="keep the final answer line as its own segment (default: merged into the last step)",
    )
    p.add_argument(
        "--answer-pattern",
        default=DEFAULT_ANSWER_PATTERN,
        help="regex that marks the last non-blank line as the final answer ('': none does)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="local tokenizer directory (AutoTokenizer); needed by tokens:N",
    )
    p.add_argument(
        "--checkpoint",
        default=None,
        help="policy (directory or hub id) whose entropies the entropy strategies cut at",
    )
    p.add_argument(
        "--prompt",
        default="",
        help="prompt the trace answers, for --checkpoint (chat template applied if the "
        "tokenizer has one; default: empty)",
    )
    p.add_argument("--device", default=None, help="device for --checkpoint (default: cpu)")
    p.set_defaults(func=run_segment)
    return p


def _read_trace(path: str | None) -> str:
    """The trace as UTF-8 text, its bytes decoded as they are (``\\r\\n`` line ends kept, so
    offsets point into the trace as given), from a file or stdin alike; bytes that are not UTF-8
    are refused."""
    if path is None or path == "-":
        raw = getattr(sys.stdin, "buffer", None)
        if raw is None:  # stdin replaced by a text stream
            return sys.stdin.read()
        return _decode(raw.read(), "stdin")
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


def _encode(tokenizer: Any, text: str) -> tuple[list[int], list[Span]]:
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoding["input_ids"]), [tuple(pair) for pair in encoding["offset_mapping"]]


def _offsets(tokenizer_path: str, text: str) -> list[Span]:
    from transformers import AutoTokenizer  # lazy: CLI start-up (only --tokenizer needs it)

    return _encode(AutoTokenizer.from_pretrained(tokenizer_path, trust_remote_code=False), text)[1]


def token_entropies(
    model: Any, tokenizer: Any, text: str, prompt: str = ""
) -> tuple[list[Span], list[float]]:
    """Token offsets of ``text`` and the policy's entropy (nats) at each of its tokens, scored
    after ``prompt`` as training scores a completion (``forward.policy_forward``, temperature 1).

    The prompt goes through the chat template when the tokenizer has one and gets the tokenizer's
    special tokens otherwise; an empty prompt that encodes to nothing is replaced by the bos (else
    eos) token, so that the first token of ``text`` has a distribution.
    """
    # lazy: CLI start-up (the entropy strategies alone need torch; the text ones start without it)
    import torch

    from rredcot.sampling.forward import policy_forward  # lazy: as torch
    from rredcot.sampling.rollout import (  # lazy: as torch
        context_limit,
        prompt_special_tokens,
        render_prompt,
    )

    prompt_text = render_prompt(Problem(prompt, "", {}), tokenizer) if prompt else ""
    prompt_ids = tokenizer(prompt_text, add_special_tokens=prompt_special_tokens(tokenizer))[
        "input_ids"
    ]
    if not prompt_ids:
        bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
        start = bos if bos is not None else eos
        if start is None:
            raise ValueError(
                "the tokenizer has no bos or eos token to start an empty prompt: pass --prompt"
            )
        prompt_ids = [start]
    ids, offsets = _encode(tokenizer, text)
    if not ids:
        return [], []
    limit = context_limit(model)
    if limit is not None and len(prompt_ids) + len(ids) > limit:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + trace ({len(ids)} tokens) exceed the model's "
            f"context of {limit} tokens: shorten the trace or the prompt"
        )
    device = next(model.parameters()).device
    input_ids = torch.tensor([prompt_ids + ids], device=device)
    with torch.no_grad():
        forward = policy_forward(
            model, input_ids, torch.ones_like(input_ids), len(prompt_ids), with_entropy=True
        )
    return offsets, forward.entropy[0].tolist()


def _entropy_records(
    text: str, spans: list[Span], offsets: list[Span], entropies: list[float]
) -> list[dict[str, Any]]:
    """The ``tokens`` and ``entropy`` fields of each segment."""
    positions = token_positions(offsets, text)
    at_cut = cut_entropies(text, offsets, entropies)
    firsts = [bisect_left(positions, start) for start, _ in spans[1:]]
    bounds = [0, *firsts, len(offsets)]
    return [
        {"tokens": [a, b], "entropy": at_cut[a] if 0 < a < len(at_cut) else None}
        for a, b in zip(bounds, bounds[1:])
    ]


def _answer_note(segmenter: Segmenter, spans: list[Span], answer: int | None) -> str:
    """One line for stderr: whether the final answer line was found and merged."""
    if answer is None:
        return "no final answer line found (--answer-pattern); nothing merged"
    k = next(i for i, (s, e) in enumerate(spans) if s <= answer < e)
    if spans[k][0] == answer:
        return f"final answer line (from character {answer}) is segment {k}, not merged"
    return (
        f"final answer line (from character {answer}) merged into segment {k}; "
        "--no-merge-answer keeps it separate"
    )


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
        if segmenter.uses_entropy and args.checkpoint is None:
            raise ValueError(
                f"--strategy {args.strategy} cuts at the policy's entropy: pass --checkpoint DIR "
                "(a policy directory, e.g. the output of `rredcot sft`) and --prompt TEXT"
            )
        if segmenter.uses_tokens and not segmenter.uses_entropy and args.tokenizer is None:
            raise ValueError(
                f"--strategy {args.strategy} counts tokens: pass --tokenizer PATH "
                "(a local tokenizer directory)"
            )
        text = _read_trace(args.file)
        offsets = entropies = None
        if segmenter.uses_entropy:
            from rredcot.models import load_policy  # lazy: CLI start-up (imports torch)

            model, tokenizer = load_policy(args.checkpoint, device=args.device)
            offsets, entropies = token_entropies(model, tokenizer, text, args.prompt)
        elif args.tokenizer is not None:
            offsets = _offsets(args.tokenizer, text)
        spans = segmenter.split(text, offsets, entropies)
        answer = segmenter.find_answer(text, offsets, entropies)
    except (ValueError, TypeError, OSError) as e:
        print(f"rredcot segment: error: {e}", file=sys.stderr)
        return 2
    extra = (
        _entropy_records(text, spans, offsets, entropies)
        if entropies is not None
        else [{}] * len(spans)
    )
    for k, ((start, end), fields) in enumerate(zip(spans, extra)):
        record = {"index": k, "start": start, "end": end, "text": text[start:end], **fields}
        print(json.dumps(record, ensure_ascii=False))
    print(f"rredcot segment: {_answer_note(segmenter, spans, answer)}", file=sys.stderr)
    return 0
