"""Issue 57's findings on input limits: each size, range or input here hung, failed late with a
traceback, or was accepted silently before; now it gets one clear line up front, or the right
behaviour."""

from __future__ import annotations

import time

from rredcot.segment import split_text

# ---------------------------------------------------------------------------------------------
# segment --strategy sentence: linear in a line's length


def test_a_long_line_of_many_sentences_segments_in_linear_time():
    line = "The cat sat. " * 200_000  # one line: each period used to scan back to its start
    start = time.perf_counter()
    spans = split_text(line, "sentence")
    seconds = time.perf_counter() - start
    assert len(spans) == 200_000
    assert seconds < 6, f"{seconds:.1f} s for 200k sentences (quadratic: about 20 s)"


def test_abbreviations_and_list_markers_on_a_long_line_still_do_not_cut():
    text = "Use e.g. this. " * 1000 + "\n  2. Then (e.g. that). Done."
    segments = [text[a:b] for a, b in split_text(text, "sentence")]
    assert segments == ["Use e.g. this. "] * 999 + [
        "Use e.g. this. \n  ",
        "2. Then (e.g. that). ",
        "Done.",
    ]
