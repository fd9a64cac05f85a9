"""Final-answer extraction and answer checking for dataset tasks.

Two jobs, kept apart because they fail differently:

- *Reference* answers come from a dataset row in a known format (``answer_format``): GSM8K's
  ``#### 72``, MATH's ``\\boxed{...}``, the last number of the text, or the raw field. A reference
  that cannot be extracted is a data error, reported to the user (``extract_reference`` returns
  ``None`` and the loader names the file and line).
- *Model* completions can be anything. ``extract_completion_answer`` tries the usual ways of stating
  an answer and never raises; ``answers_match`` compares, through ``math-verify`` when it is
  installed (``verifier="auto"``) and by normalised exact match otherwise (``"1,000" == "1000" ==
  "1000.0"``).

Every step is bounded: extraction is linear in the completion's length (a degenerate completion of
20,000 unclosed ``\\boxed{`` costs milliseconds), and math-verify runs in a child process that is
killed when a check passes its deadline, from any thread (``check_answer`` reports the timeout).
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import re
import select
import subprocess
import sys
import threading
import time
from fractions import Fraction
from functools import lru_cache
from pathlib import Path
from typing import Any

from rredcot.tasks.base import TIMEOUT_REASON

__all__ = [
    "ANSWER_FORMATS",
    "VERIFIERS",
    "DEFAULT_VERIFY_TIMEOUT",
    "TIMEOUT_REASON",
    "answers_match",
    "check_answer",
    "equivalent_renderings",
    "extract_boxed",
    "extract_completion_answer",
    "extract_gsm8k",
    "extract_last_number",
    "extract_reference",
    "math_verify_available",
    "normalize_answer",
    "parse_number",
]

ANSWER_FORMATS = ("gsm8k", "boxed", "last_number", "raw")
VERIFIERS = ("auto", "math_verify", "exact")

_NUM = r"-?(?:\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)"
_NUMBER_RE = re.compile(_NUM + r"(?:\s*/\s*" + _NUM + r")?")
_GSM8K_RE = re.compile(r"####\s*([^\n]*)")
_A_LINE_RE = re.compile(r"^[ \t]*(?:A|Answer|Final answer)[ \t]*:[ \t]*([^\n]*)", re.M | re.I)
_ANSWER_IS_RE = re.compile(r"answer is[ \t]*:?[ \t]*([^\n]*)", re.I)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_BOX_WORD_RE = re.compile(r"[^\s$]+")
_BRACE_RE = re.compile(r"[{}]")
_MAX_NUMBER_CHARS = 200  # longer "numbers" are not answers; int() of huge strings is slow
_MAX_MATH_VERIFY_CHARS = 2_000  # math-verify is not asked about longer answers
DEFAULT_VERIFY_TIMEOUT = 10.0


# ---------------------------------------------------------------------------------------------
# Extraction
# ---------------------------------------------------------------------------------------------


def _clean(text: str) -> str:
    """Strip spaces, a trailing full stop and surrounding ``$``/``\\(``...``\\)`` math delimiters."""
    text = text.strip().rstrip(".").strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(text) > len(left) + len(right) and text.startswith(left) and text.endswith(right):
            text = text[len(left) : -len(right)].strip()
    return text


def extract_gsm8k(text: str) -> str | None:
    """The answer after the last ``####`` (GSM8K's format), thousands commas removed."""
    matches = _GSM8K_RE.findall(text)
    if not matches:
        return None
    answer = _clean(matches[-1]).replace(",", "")
    return answer or None


def _matching_braces(text: str) -> dict[int, int]:
    """``{open position: its closing position}`` for every balanced ``{`` of ``text``, in one
    pass (a ``}`` with no open brace is ignored, as a scan from each ``{`` would)."""
    close, stack = {}, []
    for m in _BRACE_RE.finditer(text):
        if m.group() == "{":
            stack.append(m.start())
        elif stack:
            close[stack.pop()] = m.start()
    return close


def _last_boxed(text: str) -> tuple[int, str] | None:
    """(start, content) of the last ``\\boxed{...}`` / ``\\boxed 5`` with content; linear time."""
    boxes = list(_BOXED_RE.finditer(text))
    if not boxes:
        return None
    close = _matching_braces(text)
    for m in reversed(boxes):
        pos = m.end()
        if pos >= len(text):
            continue
        if text[pos] != "{":  # \boxed 5
            word = _BOX_WORD_RE.match(text, pos)
            if word:
                return m.start(), word.group(0)
            continue
        end = close.get(pos)
        if end is None:  # unclosed
            continue
        content = text[pos + 1 : end].strip()
        if content:
            return m.start(), content
    return None


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included."""
    found = _last_boxed(text)
    return found[1] if found else None


def extract_last_number(text: str) -> str | None:
    """The last number in ``text`` (``-3``, ``1,000`` -> ``1000``, ``2.5``, ``3/4``), or ``None``."""
    matches = _NUMBER_RE.findall(text)
    if not matches:
        return None
    return re.sub(r"\s+", "", matches[-1]).replace(",", "")


def extract_reference(text: str, answer_format: str) -> str | None:
    """The reference answer of a dataset row's answer field, in ``answer_format``.

    ``"gsm8k"``: after ``####``; ``"boxed"``: the last ``\\boxed{}``; ``"last_number"``: the last
    number; ``"raw"``: the whole field, stripped. ``None`` if the format is not found.
    """
    if answer_format == "gsm8k":
        return extract_gsm8k(text)
    if answer_format == "boxed":
        return extract_boxed(text)
    if answer_format == "last_number":
        return extract_last_number(text)
    if answer_format == "raw":
        return text.strip() or None
    raise ValueError(f"answer_format={answer_format!r}; valid: {', '.join(ANSWER_FORMATS)}")


def extract_completion_answer(text: str) -> str | None:
    """The final answer a model completion states, or ``None``; never raises.

    Explicit statements win over a bare number: the *last* of ``#### 42``, ``\\boxed{42}``, an
    ``A: 42`` / ``Answer: 42`` line and ``The answer is 42`` (by position in the text); if there is
    none, the last number of the text.
    """
    if not isinstance(text, str) or not text.strip():
        return None
    candidates: list[tuple[int, str]] = []
    for regex in (_GSM8K_RE, _A_LINE_RE, _ANSWER_IS_RE):
        for m in regex.finditer(text):
            value = _clean(m.group(1))
            if value:
                candidates.append((m.start(), value))
    boxed = _last_boxed(text)
    if boxed is not None:
        candidates.append(boxed)
    if candidates:
        return max(candidates, key=lambda c: c[0])[1]
    return extract_last_number(text)


# ---------------------------------------------------------------------------------------------
# Comparison
# ---------------------------------------------------------------------------------------------


def parse_number(text: str) -> Fraction | None:
    """Exact value of a number as people write it (``$1,000.00``, ``-3``, ``3/4``, ``50%``)."""
    s = text.strip().replace(",", "").replace("$", "").replace(" ", "").rstrip(".")
    percent = s.endswith("%")
    s = s.rstrip("%")
    if len(s) > _MAX_NUMBER_CHARS:
        return None
    if not re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/-?(?:\d+(?:\.\d*)?|\.\d+))?", s):
        return None
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value / 100 if percent else value


def normalize_answer(text: str) -> str:
    """Canonical text of an answer: numbers as their exact value, other text trimmed, lowercased."""
    text = _clean(text)
    value = parse_number(text)
    if value is not None:
        return str(value)  # Fraction: "1000", "-3", "3/4"
    return re.sub(r"\s+", " ", text).lower()


def _sole_number(text: str) -> Fraction | None:
    """The number of a short answer that holds exactly one: ``18 dollars``, ``x = 18`` -> 18."""
    numbers = _NUMBER_RE.findall(text)
    return parse_number(numbers[0]) if len(numbers) == 1 else None


@lru_cache(maxsize=1)
def _load_math_verify() -> Any:
    """The import spec of ``math_verify`` (``None`` when it is not installed); the package itself
    is only imported by the worker process."""
    return importlib.util.find_spec("math_verify")


def math_verify_available() -> bool:
    """Whether ``math-verify`` can be imported (the ``rredcot[data]`` extra)."""
    return _load_math_verify() is not None


class _MathVerifyWorker:
    """One long-lived child process running math-verify (``_math_verify_worker``). A check's
    deadline covers the whole call: waiting for another thread's check, the child's start-up
    (importing sympy takes seconds) and the check itself. A check that passes its deadline
    while the child is still starting leaves it starting for the next check; one that passes
    it during the check kills the child and starts a fresh one at once, for the next."""

    startup_timeout = 120.0  # a child not ready after this long (a loaded machine) is given up

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self.owner = 0  # pid that started `proc`; a forked child must not share its pipes
        self.buffer = b""
        self.ready = False  # the child said {"ready": true}
        self.started = 0.0  # time.monotonic() when the child was spawned
        self.lock = threading.Lock()

    def _spawn(self) -> None:
        """Start a child without waiting for it (``_wait_ready`` waits)."""
        root = str(Path(__file__).resolve().parents[2])  # the directory holding `rredcot`
        code = (
            f"import sys; sys.path.insert(0, {root!r}); "
            "from rredcot.tasks._math_verify_worker import main; main()"
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self.owner, self.buffer, self.ready = os.getpid(), b"", False
        self.started = time.monotonic()

    def _wait_ready(self, deadline: float) -> bool:
        """Whether the child is ready by ``deadline``; a child that died or is not ready
        ``startup_timeout`` seconds after its start is a ``RuntimeError``."""
        if self.ready:
            return True
        give_up = self.started + self.startup_timeout
        line = self._read_line(min(deadline, give_up) - time.monotonic())
        if line is not None:
            self.ready = True
            return True
        if self.proc is None or self.proc.poll() is not None or time.monotonic() >= give_up:
            self.stop()
            raise RuntimeError("the math-verify worker process did not start")
        return False  # still starting: this check's deadline passed first

    def stop(self) -> None:
        proc, self.proc, self.ready = self.proc, None, False
        if proc is not None and self.owner == os.getpid():
            proc.kill()
            proc.wait()

    def _read_line(self, timeout: float) -> dict | None:
        """The next JSON line from the child, or ``None`` on timeout or if it died."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buffer:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)

    def match(self, predicted: str, reference: str, timeout: float) -> bool | None:
        """Whether math-verify matches the two; ``None`` when the call took longer than
        ``timeout`` seconds in all (waiting, start-up and check)."""
        deadline = time.monotonic() + timeout
        if not self.lock.acquire(timeout=max(timeout, 0.0)):
            return None
        try:
            if self.proc is None or self.owner != os.getpid() or self.proc.poll() is not None:
                self.proc = None
                self._spawn()
            if not self._wait_ready(deadline):
                return None
            assert self.proc is not None and self.proc.stdin is not None
            # math-verify's own alarms (whole seconds) end most slow parses inside the child
            remaining = deadline - time.monotonic()
            request = {
                "predicted": predicted,
                "reference": reference,
                "timeout": max(1, int(remaining)),
            }
            try:
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self.stop()
                return False
            answer = self._read_line(deadline - time.monotonic())
            if answer is None:
                died = self.proc.poll() is not None
                self.stop()
                if not died:
                    self._spawn()  # the next check finds it started, or starting
                return False if died else None
            return bool(answer.get("match"))
        finally:
            self.lock.release()


_WORKER = _MathVerifyWorker()
atexit.register(_WORKER.stop)


def check_answer(
    predicted: str | None,
    reference: str,
    verifier: str = "auto",
    timeout: float = DEFAULT_VERIFY_TIMEOUT,
) -> tuple[bool, str | None]:
    """``(matched, problem)``: whether ``predicted`` states ``reference`` (as ``answers_match``)
    and, when the check could not finish, why (``"verify timed out after 10s (math-verify)"``,
    starting with ``TIMEOUT_REASON``); never raises, and never takes much longer than
    ``timeout`` seconds, from any thread."""
    if verifier not in VERIFIERS:
        raise ValueError(f"verifier={verifier!r}; valid: {', '.join(VERIFIERS)}")
    if predicted is None or not isinstance(predicted, str) or not predicted.strip():
        return False, None
    if normalize_answer(predicted) == normalize_answer(reference):
        return True, None
    ref_value = parse_number(_clean(reference))
    if ref_value is not None and _sole_number(predicted) == ref_value:
        return True, None
    if verifier == "exact" or not math_verify_available():
        return False, None
    if len(predicted) > _MAX_MATH_VERIFY_CHARS or len(reference) > _MAX_MATH_VERIFY_CHARS:
        return False, None
    try:
        matched = _WORKER.match(predicted, reference, timeout)
    except (RuntimeError, OSError) as err:
        return False, f"math-verify unavailable: {err}"
    if matched is None:
        return False, f"{TIMEOUT_REASON} after {timeout:g}s (math-verify)"
    return matched, None


def answers_match(predicted: str | None, reference: str, verifier: str = "auto") -> bool:
    """Whether ``predicted`` states ``reference``; never raises.

    First a normalised exact match (numbers by exact value: ``"1,000" == "1000" == "1000.0"``; a
    answer holding exactly one number matches by that number: ``18 dollars``), then, for
    ``verifier`` ``"auto"`` or ``"math_verify"`` when ``math-verify`` is installed, a symbolic check
    (``\\frac{1}{2}`` == ``0.5``) in a worker process, bounded by ``DEFAULT_VERIFY_TIMEOUT``
    seconds (a check that takes longer is a non-match; ``check_answer`` says so). ``"exact"``
    skips math-verify. Tasks refuse ``"math_verify"`` at construction when it is not installed.
    """
    return check_answer(predicted, reference, verifier)[0]


# ---------------------------------------------------------------------------------------------
# Renderings
# ---------------------------------------------------------------------------------------------


def _plain(value: Fraction) -> str | None:
    """A finite decimal for ``value`` (``5/2`` -> ``2.5``), None for a repeating one."""
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den != 1:
        return None
    digits = 0
    while (value * 10**digits).denominator != 1:
        digits += 1
    return f"{float(value):.{digits}f}" if digits else str(value.numerator)


def equivalent_renderings(answer: str) -> list[str]:
    """``answer`` followed by other ways people write the same number, without repeats.

    Integers: ``20``, ``20.0``, ``$20`` (and ``1,000``, ``$1,000`` from 1000 on); finite
    decimals: ``2.5``, ``2.50``, ``$2.50``, ``5/2``, ``\\frac{5}{2}``; other fractions: ``1/3``,
    ``\\frac{1}{3}``. Text that is not a number gives ``[answer]``. Which of these a task counts
    as correct is the task's verifier's call (``answer_likelihood`` keeps only those it accepts).
    """
    out = [answer]
    value = parse_number(_clean(answer))
    if value is None or answer.strip().endswith("%"):
        return out
    sign = "-" if value < 0 else ""
    mag = abs(value)
    plain = _plain(mag)
    if mag.denominator == 1:
        n = mag.numerator
        forms = [f"{n}", f"{n}.0", f"${n}"]
        if n >= 1000:
            forms += [f"{n:,}", f"${n:,}"]
    else:
        num, den = mag.numerator, mag.denominator
        frac = [f"{num}/{den}", f"\\frac{{{num}}}{{{den}}}"]
        if plain is not None:
            cents = f"{float(mag):.2f}" if (mag * 100).denominator == 1 else None
            forms = [plain, *([cents, f"${cents}"] if cents else []), *frac]
        else:
            forms = frac
    for form in forms:
        text = f"{sign}{form}"
        if text not in out:
            out.append(text)
    return out
