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
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from functools import lru_cache
from typing import Any

__all__ = [
    "ANSWER_FORMATS",
    "VERIFIERS",
    "answers_match",
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


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), nested braces included."""
    for m in reversed(list(_BOXED_RE.finditer(text))):
        pos = m.end()
        if pos < len(text) and text[pos] != "{":  # \boxed 5
            word = re.match(r"[^\s$]+", text[pos:])
            if word:
                return word.group(0)
            continue
        depth = 0
        for i in range(pos, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    content = text[pos + 1 : i].strip()
                    if content:
                        return content
                    break
    return None


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
    for m in _BOXED_RE.finditer(text):
        value = extract_boxed(text[m.start() :])
        if value:
            candidates.append((m.start(), value))
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
    try:
        import math_verify
    except ImportError:
        return None
    return math_verify


def math_verify_available() -> bool:
    """Whether ``math-verify`` can be imported (the ``rredcot[data]`` extra)."""
    return _load_math_verify() is not None


def _math_verify_match(predicted: str, reference: str) -> bool:
    mv = _load_math_verify()
    # math-verify's timeouts use signal.alarm, which only works in the main thread.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None

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
    except Exception:  # a verifier must not crash training on odd model text
        return False


def answers_match(predicted: str | None, reference: str, verifier: str = "auto") -> bool:
    """Whether ``predicted`` states ``reference``; never raises.

    First a normalised exact match (numbers by exact value: ``"1,000" == "1000" == "1000.0"``; a
    answer holding exactly one number matches by that number: ``18 dollars``), then, for
    ``verifier`` ``"auto"`` or ``"math_verify"`` when ``math-verify`` is installed, a symbolic check
    (``\\frac{1}{2}`` == ``0.5``). ``"exact"`` skips math-verify. Tasks refuse ``"math_verify"``
    at construction when it is not installed.
    """
    if verifier not in VERIFIERS:
        raise ValueError(f"verifier={verifier!r}; valid: {', '.join(VERIFIERS)}")
    if predicted is None or not isinstance(predicted, str) or not predicted.strip():
        return False
    if normalize_answer(predicted) == normalize_answer(reference):
        return True
    ref_value = parse_number(_clean(reference))
    if ref_value is not None and _sole_number(predicted) == ref_value:
        return True
    if verifier == "exact" or not math_verify_available():
        return False
    return _math_verify_match(predicted, reference)


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
