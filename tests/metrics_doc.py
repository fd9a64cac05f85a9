"""The metric keys docs/metrics.md documents, for tests that check every logged key is there."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "metrics.md"


def documented_keys() -> tuple[set[str], list[str]]:
    """``(keys, prefixes)``: every backticked key in the first column of the doc's tables, and
    the prefixes of its wildcard rows (``value_pretrain/*``)."""
    keys, prefixes = set(), []
    for line in DOC.read_text().splitlines():
        if not line.startswith("| `"):
            continue
        for key in re.findall(r"`([^`]+)`", line.split(" | ")[0]):
            if key.endswith("/*"):
                prefixes.append(key[:-1])
            else:
                keys.add(key)
    return keys, prefixes


def undocumented(logged: set[str], prefix: str = "") -> list[str]:
    """The keys of ``logged`` (less ``prefix``: TRL's ``rredcot/``) that docs/metrics.md does
    not list."""
    keys, prefixes = documented_keys()
    missing = []
    for key in sorted(logged):
        name = key[len(prefix) :] if prefix and key.startswith(prefix) else key
        if key not in keys and name not in keys and not name.startswith(tuple(prefixes)):
            missing.append(key)
    return missing
