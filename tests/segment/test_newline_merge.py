"""newline+merge segmentation: newline cuts merged at the lowest-entropy boundaries."""

from __future__ import annotations

import pytest

from rredcot.segment import get_segmenter

TEXT = "a=1+2=3\nb=3*4=12\nc=12-5=7\nd=7+1=8\ne=8*2=16"
STARTS = [i + 1 for i, ch in enumerate(TEXT) if ch == "\n"]
assert STARTS == [8, 17, 26, 34]


def _char_tokens(entropy_at: dict[int, float]):
    """One token per character; the token opening line k gets the given entropy."""
    offsets = [(i, i + 1) for i in range(len(TEXT))]
    entropies = [0.01] * len(TEXT)
    for char, h in entropy_at.items():
        entropies[char] = h
    return offsets, entropies


def test_merges_at_the_lowest_entropy_boundaries_down_to_the_target():
    offsets, entropies = _char_tokens({8: 0.9, 17: 0.2, 26: 1.5, 34: 0.4})
    seg = get_segmenter("newline+merge:target=3")
    assert seg.boundaries(TEXT, offsets, entropies) == [0, 8, 26, len(TEXT)]
    # the newline cuts are the same without merges
    assert get_segmenter("newline+merge:target=5").boundaries(TEXT, offsets, entropies) == [
        0,
        *STARTS,
        len(TEXT),
    ]
    assert get_segmenter("newline").boundaries(TEXT, offsets) == [0, *STARTS, len(TEXT)]


@pytest.mark.parametrize(
    ("spec", "count"),
    [
        ("target=1", 1),
        ("target=2", 2),
        ("target=4", 4),
        ("target=9", 5),  # never more segments than lines
        ("fraction=0.5", 3),  # ceil(0.5 * 5)
        ("fraction=1", 5),
        (None, 3),  # default: half the lines
    ],
)
def test_merge_count(spec, count):
    offsets, entropies = _char_tokens({8: 0.3, 17: 0.1, 26: 0.7, 34: 0.5})
    name = "newline+merge" + (f":{spec}" if spec else "")
    bounds = get_segmenter(name).boundaries(TEXT, offsets, entropies)
    assert len(bounds) - 1 == count
    assert set(bounds[1:-1]) <= set(STARTS)  # merges only remove newline cuts


def test_needs_entropies_and_a_valid_target():
    offsets, _ = _char_tokens({})
    with pytest.raises(ValueError, match="entropies"):
        get_segmenter("newline+merge:target=2").boundaries(TEXT, offsets)
    for bad in ("target=0", "fraction=1.5", "top=0.1", "target=x"):
        with pytest.raises(ValueError, match="newline\\+merge"):
            get_segmenter(f"newline+merge:{bad}")
