"""Fuzz every segmenter with a stated seed and count the cases that break a convention.

    python benchmarks/fuzz_segmenters.py --cases 10000 --seed 3101

A case is one drawn text (the adversarial pieces of ``tests/test_fuzz.py``: markers of every
strategy, math, CJK, emoji, line ends of every kind, long runs, control characters, and single
random characters) with drawn options (``min_chars``, ``max_segments``, ``separate_answer``) and
random per-token entropies, segmented by every strategy of ``tests/test_fuzz.py`` (one character
per token). A case fails when any strategy breaks one of ``rredcot.segment``'s conventions:

- the spans are non-empty, contiguous and cover the text exactly (``[]`` for ``""``);
- every segment but the first starts on a non-whitespace character;
- at most ``max_segments`` spans;
- the token boundaries strictly increase from 0 to T and ``Segmenter.boundaries`` agrees;
- nothing raises.

Prints the number of failing cases (and the first few, each with the broken rule) and exits 1 if
any failed. Unlike the hypothesis test (a fixed set of cases, stopping at the first failure), this
draws fresh cases from ``--seed`` and counts every failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
from pathlib import Path

from rredcot.segment import Segmenter, spans_to_boundaries

_FUZZ = Path(__file__).resolve().parents[1] / "tests" / "test_fuzz.py"


def _fuzz_module():
    """``tests/test_fuzz.py`` (its PIECES and STRATEGIES: one source for both fuzzers)."""
    sys.path.insert(0, str(_FUZZ.parent))
    spec = importlib.util.spec_from_file_location("rredcot_test_fuzz", _FUZZ)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def draw_text(rng: random.Random, pieces: list[str]) -> str:
    """Up to 30 parts, each a piece or one random character (any plane, surrogates excluded)."""
    parts = []
    for _ in range(rng.randint(0, 30)):
        if rng.random() < 0.6:
            parts.append(rng.choice(pieces))
        else:
            code = rng.choice(
                [rng.randint(0, 0x7F), rng.randint(0, 0xFFFF), rng.randint(0, 0x10FFFF)]
            )
            parts.append(chr(code) if not 0xD800 <= code <= 0xDFFF else "?")
    return "".join(parts)


def check(text: str, strategy: str, options: dict, entropies: list[float]) -> str | None:
    """The first convention ``strategy`` breaks on ``text`` (``None``: it keeps them all)."""
    offsets = [(i, i + 1) for i in range(len(text))]
    try:
        segmenter = Segmenter(strategy, **options)
        ent = entropies if segmenter.uses_entropy else None
        spans = segmenter.split(text, offsets if segmenter.uses_tokens else None, entropies=ent)
        if not text:
            return None if spans == [] else "empty text: spans not []"
        if spans[0][0] != 0 or spans[-1][1] != len(text):
            return "spans do not cover the text"
        if not all(s < e for s, e in spans) or any(
            e != s for (_, e), (s, _) in zip(spans, spans[1:])
        ):
            return "spans empty or not contiguous"
        if any(text[s].isspace() for s, _ in spans[1:]):
            return "a segment after the first starts on whitespace"
        if options["max_segments"] is not None and len(spans) > options["max_segments"]:
            return "more than max_segments spans"
        bounds = spans_to_boundaries(spans, offsets)
        if (
            bounds[0] != 0
            or bounds[-1] != len(offsets)
            or any(a >= b for a, b in zip(bounds, bounds[1:]))
        ):
            return "token boundaries not strictly increasing from 0 to T"
        if segmenter.boundaries(text, offsets, entropies=ent) != bounds:
            return "Segmenter.boundaries disagrees with split"
    except Exception as err:  # noqa: BLE001 - counted, not raised
        return f"raised {type(err).__name__}: {err}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=3101)
    parser.add_argument("--show", type=int, default=5, help="failing cases to print")
    args = parser.parse_args(argv)
    fuzz = _fuzz_module()
    rng = random.Random(args.seed)
    failures: list[tuple[str, str, dict, str]] = []
    for _ in range(args.cases):
        text = draw_text(rng, fuzz.PIECES)
        options = {
            "min_chars": rng.choice([0, 0, 1, 5, 40]),
            "max_segments": rng.choice([None, None, 1, 2, 4]),
            "separate_answer": rng.random() < 0.5,
        }
        entropies = [rng.uniform(0.0, 3.0) for _ in text]
        for strategy in fuzz.STRATEGIES:
            problem = check(text, strategy, options, entropies)
            if problem is not None:
                failures.append((strategy, text, options, problem))
                break  # one failure per case
    print(f"seed {args.seed}: {len(failures)} of {args.cases} cases break a convention")
    for strategy, text, options, problem in failures[: args.show]:
        print(f"  {strategy} {options}: {problem}: {text!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
