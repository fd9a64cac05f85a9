"""Replace the absolute paths of the machine a result was made on with portable ones.

Results record where their runs and warm-starts lay (``init``, ``out``, log folders). Those
paths mean nothing on another machine, so committed files carry these forms instead:

- a checkout (the main one or a work tree): the path inside the repository (``src/...``);
- a home folder: ``~`` (the cache is ``~/.cache/rredcot/...``);
- the machine's shared data folder: ``<data>/...``; any other scratch folder: ``<work>/...``;
- under ``benchmarks/results/`` a temporary folder too: ``<tmp>/...``.

Text files are rewritten in place; a ``.tar.gz`` is rewritten member by member (its members'
names, sizes and times kept, the gzip header's time set to 0). Run it on new results before
committing them (``tests/repository/test_repository.py`` fails on a machine path in any tracked
file):

    python benchmarks/strip_machine_paths.py $(git ls-files benchmarks/results src/rredcot/warmstarts)
"""

from __future__ import annotations

import gzip
import io
import re
import sys
import tarfile
from pathlib import Path

# built from pieces so that this file holds no machine path itself
_W, _R, _H, _U, _T = ("/" + d for d in ("work", "root", "home", "Users", "tmp"))
_NAME = r"[A-Za-z0-9_.+-]+"
RULES: list[tuple[re.Pattern[str], str]] = [
    # a checkout: /w/main/, /w/wt/NAME/, /w/wt_NAME/ -> the repository's own paths
    (re.compile(re.escape(_W) + rf"/(?:main|wt/{_NAME}|wt_{_NAME})/"), ""),
    (re.compile(re.escape(_W) + rf"/(?:main|wt/{_NAME}|wt_{_NAME})(?![A-Za-z0-9_.+/-])"), "."),
    (re.compile(re.escape(_R) + r"(?=/)"), "~"),
    (re.compile(rf"(?:{re.escape(_H)}|{re.escape(_U)})/{_NAME}(?=/)"), "~"),
    (re.compile(re.escape(_W) + r"/shared/data/"), "<data>/"),
    (re.compile(re.escape(_W) + r"/"), "<work>/"),
]
RESULT_RULES = [(re.compile(re.escape(_T) + "/"), "<tmp>/")]


def strip(text: str, results: bool) -> str:
    for pattern, new in RULES + (RESULT_RULES if results else []):
        text = pattern.sub(new, text)
    return text


def _rewrite_tarball(path: Path, results: bool) -> bool:
    with tarfile.open(path, "r:gz") as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar]
    changed = False
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for member, data in members:
            if data is not None:
                try:
                    text = data.decode()
                except UnicodeDecodeError:
                    text = None
                if text is not None:
                    new = strip(text, results)
                    if new != text:
                        data, changed = new.encode(), True
                        member.size = len(data)
            tar.addfile(member, io.BytesIO(data) if data is not None else None)
    if changed:
        path.write_bytes(gzip.compress(out.getvalue(), compresslevel=9, mtime=0))
    return changed


def main(paths: list[str]) -> None:
    for name in paths:
        path = Path(name)
        results = "benchmarks/results/" in path.as_posix()
        if name.endswith((".tar.gz", ".tgz")):
            if _rewrite_tarball(path, results):
                print(f"rewrote {name}")
            continue
        try:
            text = path.read_text()
        except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
            continue
        new = strip(text, results)
        if new != text:
            path.write_text(new)
            print(f"rewrote {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
