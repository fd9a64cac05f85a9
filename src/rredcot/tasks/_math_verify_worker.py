"""The child process that runs math-verify for :mod:`rredcot.tasks.answers`.

math-verify can take seconds (or hang) on odd text, and its own timeouts use ``signal.alarm``,
which works only in a main thread. Running it in a child process bounds every check from any
thread: the parent waits with a deadline and kills the child when it passes.

Protocol: one JSON object a line. The child first writes ``{"ready": true}``; then, for each
request ``{"predicted": str, "reference": str, "timeout": int}`` it writes ``{"match": bool}``.
It exits when its stdin closes (the parent is gone).
"""

from __future__ import annotations

import json
import sys
from typing import Any

from rredcot.errors import require_extra


def match(mv: Any, predicted: str, reference: str, timeout: int | None) -> bool:
    """Whether math-verify (module ``mv``) finds ``predicted`` equal to ``reference``; any
    exception inside math-verify is a non-match."""

    def parse(text: str) -> list:
        # bare LaTeX such as \dfrac{1}{2} or (x+1)^2 is only read inside math delimiters
        return mv.parse(text, parsing_timeout=timeout) or mv.parse(
            f"${text}$", parsing_timeout=timeout
        )

    try:
        gold, pred = parse(reference), parse(predicted)
        if not gold or not pred:
            return False
        return bool(mv.verify(gold, pred, timeout_seconds=timeout))
    except Exception:  # noqa: BLE001 - odd model text must never crash the verifier
        return False


def main() -> None:
    """Serve requests on stdin until it closes."""
    math_verify = require_extra("math_verify", "data", "the math-verify answer check")
    out = sys.stdout
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            request = json.loads(line)
            result = match(
                math_verify, request["predicted"], request["reference"], request.get("timeout")
            )
        except (ValueError, KeyError, TypeError):
            result = False
        out.write(json.dumps({"match": result}) + "\n")
        out.flush()


if __name__ == "__main__":
    main()
