"""Step-level ground truth on GSM8K-style traces from their calculator annotations.

GSM8K solutions (and models fine-tuned on them) write each computation twice: a calculator
annotation ``<<48/2=24>>`` and the value after it, ``24``. Re-evaluating the annotation tells us
which line holds the first arithmetic slip, without a judge model. That is the "first wrong step"
the credit benchmark compares each method's most-blamed segment against (ProcessBench's
first-error localisation).

Line indexing: the *reasoning lines* of a solution are its non-blank lines before the final answer
line (``#### 42`` or ``A: 42``). ``first_wrong_line`` returns an index among them, and
``LineCheck.span`` gives the character range of each line so a caller with a different
segmentation can map the index onto its own segments.

Expressions are evaluated by a tiny recursive-descent parser (numbers with thousands commas,
decimals, ``+ - * /``, ``**``/``^``, parentheses, postfix ``%``), never by ``eval``; only
parentheses recurse, at most 32 deep. Nothing here raises on model text: an annotation that cannot
be computed (``5/0``, ``(-8)**0.5``, 170 nested parentheses) is an "unparseable" step.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass

__all__ = [
    "ANNOTATION_RE",
    "LineCheck",
    "UnparseableExpression",
    "check_lines",
    "evaluate",
    "first_wrong_line",
    "inject_gsm8k_error",
    "reasoning_lines",
]

ANNOTATION_RE = re.compile(r"<<([^<>]*)>>")
# A number as GSM8K writes it: thousands commas (1,000,000), decimals, a bare leading point (.5).
_NUMBER = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+"
_NUMBER_RE = re.compile(_NUMBER)
# The value written right after the annotation: optional space / currency sign, then a number.
_AFTER_RE = re.compile(r"\s?\$?\s?(-?(?:" + _NUMBER + r")(?:/(?:" + _NUMBER + r"))?)(\s?%)?")
_ANSWER_LINE_RE = re.compile(r"^\s*(?:####|A\s*:)")
_TOKEN_RE = re.compile(r"\s*(?:(" + _NUMBER + r")|(\*\*|//|[-+*/^()%×÷]))")
_MAX_MAGNITUDE = 1e100  # beyond this an "arithmetic" line is not arithmetic any more
_AFTER_WINDOW = 200  # characters after an annotation searched for its written value


class UnparseableExpression(ValueError):
    """The annotation is not plain arithmetic (variables, words, unbalanced parentheses, ...)."""


def _tokenize(expr: str) -> list[str]:
    tokens, pos = [], 0
    expr = expr.rstrip()
    while pos < len(expr):
        m = _TOKEN_RE.match(expr, pos)
        if m is None or m.end() == pos:
            raise UnparseableExpression(f"cannot read {expr[pos:]!r} in {expr!r}")
        tokens.append(m.group(1) or {"×": "*", "÷": "/", "^": "**"}.get(m.group(2), m.group(2)))
        pos = m.end()
    if not tokens:
        raise UnparseableExpression("empty expression")
    return tokens


_MAX_DEPTH = 32  # nested parentheses; real annotations use two or three
_MAX_TOKENS = 2_000  # an "annotation" longer than this is not a calculator step


class _Parser:
    """expr := term (('+'|'-') term)* ; term := unary (('*'|'/'|'//') unary)* ;
    unary := ('-'|'+')* power ; power := postfix ('**' unary)? ; postfix := atom '%'* ;
    atom := NUMBER | '(' expr ')'.

    Signs and ``**`` chains are read in loops, so only parentheses recurse, and at most
    ``_MAX_DEPTH`` deep (as many signs in a row at most): no input can exhaust the stack."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.pos, self.depth = tokens, 0, 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self) -> str:
        tok = self.peek()
        if tok is None:
            raise UnparseableExpression("expression ends too early")
        self.pos += 1
        return tok

    def expr(self) -> float:
        value = self.term()
        while self.peek() in ("+", "-"):
            value = value + self.term() if self.take() == "+" else value - self.term()
        return value

    def term(self) -> float:
        value = self.unary()
        while self.peek() in ("*", "/", "//"):
            op, rhs = self.take(), self.unary()
            if op == "*":
                value *= rhs
            elif rhs == 0:
                raise UnparseableExpression("division by zero")
            else:
                value = value / rhs if op == "/" else float(value // rhs)
        return value

    def _signs(self) -> float:
        sign, count = 1.0, 0
        while self.peek() in ("-", "+"):
            count += 1
            if count > _MAX_DEPTH:
                raise UnparseableExpression(f"more than {_MAX_DEPTH} signs in a row")
            if self.take() == "-":
                sign = -sign
        return sign

    def unary(self) -> float:
        # `-a ** b ** -c` is -(a ** (b ** (-c))): collect the chain, then fold from the right.
        sign = self._signs()
        bases = [self.postfix()]
        signs = [sign]
        while self.peek() == "**":
            self.take()
            signs.append(self._signs())
            bases.append(self.postfix())
        value = signs[-1] * bases[-1]
        for base, s in zip(reversed(bases[:-1]), reversed(signs[:-1])):
            value = s * _power(base, value)
        return value

    def postfix(self) -> float:
        value = self.atom()
        while self.peek() == "%":
            self.take()
            value /= 100.0
        return value

    def atom(self) -> float:
        tok = self.take()
        if tok == "(":
            self.depth += 1
            if self.depth > _MAX_DEPTH:
                raise UnparseableExpression(f"parentheses nested deeper than {_MAX_DEPTH}")
            value = self.expr()
            if self.take() != ")":
                raise UnparseableExpression("unbalanced parentheses")
            self.depth -= 1
            return value
        if _NUMBER_RE.fullmatch(tok):
            return float(tok.replace(",", ""))
        raise UnparseableExpression(f"unexpected {tok!r}")


def _power(base: float, exponent: float) -> float:
    try:
        value = base**exponent
    except (OverflowError, ZeroDivisionError) as err:
        raise UnparseableExpression(f"({base:g})**{exponent:g} cannot be computed") from err
    if isinstance(value, complex):  # (-8)**0.5
        raise UnparseableExpression(f"({base:g})**{exponent:g} has no real value")
    return float(value)


def evaluate(expr: str) -> float:
    """Value of a plain arithmetic expression; raises ``UnparseableExpression`` (and nothing
    else) otherwise: words, unbalanced or too deeply nested parentheses, division by zero, a
    complex or non-finite result."""
    tokens = _tokenize(expr)
    if len(tokens) > _MAX_TOKENS:
        raise UnparseableExpression(f"longer than {_MAX_TOKENS} tokens")
    parser = _Parser(tokens)
    try:
        value = parser.expr()
    except (ArithmeticError, TypeError, ValueError) as err:
        if isinstance(err, UnparseableExpression):
            raise
        raise UnparseableExpression(f"{expr!r} cannot be computed: {err}") from err
    if parser.peek() is not None:
        raise UnparseableExpression(f"unexpected {parser.peek()!r} in {expr!r}")
    if isinstance(value, complex) or not math.isfinite(value) or abs(value) > _MAX_MAGNITUDE:
        raise UnparseableExpression(f"{expr!r} has no finite real value")
    return value


def _decimals(text: str) -> int:
    """Decimal places a written number shows: '3.33' -> 2, '1,000' -> 0."""
    m = re.search(r"\.(\d+)\s*%?\s*$", text)
    return len(m.group(1)) if m else 0


def _close(computed: float, written: float, written_text: str) -> bool:
    """True when ``written`` is ``computed``, up to float error or rounding to the shown decimals.

    A result written with d >= 1 decimals may be rounded (``10/3=3.33``); an integer result must
    be exact up to float error (``7/2=3`` is wrong, as is ``7/2=4``).
    """
    tol = 1e-6 * max(1.0, abs(written))
    d = _decimals(written_text)
    if d >= 1:
        tol = max(tol, 0.5 * 10.0**-d + 1e-9)
    return abs(computed - written) <= tol


@dataclass
class LineCheck:
    """The verdict on one reasoning line.

    ``status``: ``"ok"`` (every annotation checks out), ``"wrong"`` (an annotation's left side does
    not equal its result, or the value written after ``>>`` differs from the result),
    ``"unparseable"`` (an annotation that is not plain arithmetic, and nothing wrong found; not
    counted as an error) or ``"unchecked"`` (no annotation on the line).
    """

    index: int
    span: tuple[int, int]
    text: str
    status: str
    detail: str = ""


def reasoning_lines(solution: str) -> list[tuple[int, int]]:
    """Character spans ``[start, end)`` (newline excluded) of the non-blank lines before the answer line."""
    spans, start = [], 0
    for line in solution.split("\n"):
        end = start + len(line)
        if _ANSWER_LINE_RE.match(line):
            break
        if line.strip():
            spans.append((start, end))
        start = end + 1
    return spans


def _check_annotation(inner: str, after: str) -> tuple[str, str]:
    """Status and detail of one annotation ``<<inner>>`` followed by the text ``after``."""
    if "=" not in inner:
        return "unparseable", f"<<{inner}>> has no '='"
    *lefts, right_text = inner.split("=")
    right_text = right_text.strip()
    try:
        right = evaluate(right_text)
        values = [evaluate(left) for left in lefts]
    except UnparseableExpression as err:
        return "unparseable", f"<<{inner}>>: {err}"
    for left, value in zip(lefts, values):
        if not _close(value, right, right_text):
            return "wrong", f"<<{inner}>>: {left.strip()} = {value:g}, not {right_text}"
    m = _AFTER_RE.match(after)
    if m is not None:
        try:
            shown = evaluate(m.group(1))  # "5/0 left" after the annotation: not a number
        except UnparseableExpression as err:
            return "unparseable", f"<<{inner}>> is followed by {m.group(1)!r}: {err}"
        if m.group(2) and abs(shown / 100 - right) < abs(shown - right):
            shown /= 100  # <<20/100=20%>>20% (a percent result) rather than <<100-25=75>>75%
        # The text may round or truncate the result to the decimals it shows (<<30/7=4.2857>>4
        # people, <<4.2+9.45+1.35=14.999999999999998>>14.99): anything within one unit of the
        # last shown digit passes. An integer result is therefore copied exactly.
        if abs(shown - right) >= max(10.0 ** -_decimals(m.group(1)), 1e-6 * abs(right)):
            return "wrong", f"<<{inner}>> gives {right_text} but the text says {m.group(1)}"
    return "ok", ""


def check_lines(solution: str) -> list[LineCheck]:
    """Check every reasoning line's calculator annotations (see ``LineCheck`` for the statuses)."""
    checks = []
    for index, (start, end) in enumerate(reasoning_lines(solution)):
        line = solution[start:end]
        status, details = "unchecked", []
        for m in ANNOTATION_RE.finditer(line):
            # the value written after `>>` is a number: a bounded window keeps this linear
            s, detail = _check_annotation(m.group(1), line[m.end() : m.end() + _AFTER_WINDOW])
            if s == "wrong":
                status, details = "wrong", [detail]
                break
            if s == "unparseable":
                status = "unparseable"
                details.append(detail)
            elif status == "unchecked":
                status = "ok"
        checks.append(LineCheck(index, (start, end), line, status, "; ".join(details)))
    return checks


def first_wrong_line(solution: str) -> int:
    """Index (among reasoning lines) of the first line with a wrong annotation, -1 if none.

    Lines whose annotations cannot be parsed are not counted as wrong; ``check_lines`` reports them.
    """
    for check in check_lines(solution):
        if check.status == "wrong":
            return check.index
    return -1


def _format_like(value: float, template: str) -> str:
    d = _decimals(template)
    return f"{value:.{d}f}" if d else str(int(round(value)))


def inject_gsm8k_error(solution: str, line_index: int, rng: random.Random) -> str:
    """Corrupt the result of the first checkable annotation on reasoning line ``line_index``.

    Both the result inside ``<<...=X>>`` and the value written right after ``>>`` change to the same
    wrong number (so the line stays self-consistent in its text and only the arithmetic is off).
    Raises ``ValueError`` if the line does not exist or has no annotation with a numeric result.
    """
    spans = reasoning_lines(solution)
    if not 0 <= line_index < len(spans):
        raise ValueError(f"line_index={line_index}: the solution has {len(spans)} reasoning lines")
    start, end = spans[line_index]
    line = solution[start:end]
    for m in ANNOTATION_RE.finditer(line):
        inner = m.group(1)
        if "=" not in inner:
            continue
        head, _, result_text = inner.rpartition("=")
        try:
            result = evaluate(result_text)
            computed = evaluate(head.split("=")[-1])
        except UnparseableExpression:
            continue
        scale = max(3, int(abs(result) * 0.5))
        while True:
            delta = rng.randint(1, scale) * rng.choice((-1, 1))
            wrong = result + delta
            if result >= 0 > wrong:
                wrong = result + abs(delta)
            new_text = _format_like(wrong, result_text)
            if not _close(computed, float(new_text), new_text):
                break
        after = line[m.end() :]
        a = _AFTER_RE.match(after)
        if a is not None:
            after = after[: a.start(1)] + new_text + after[a.end(1) :]
        new_line = line[: m.start()] + f"<<{head}={new_text}>>" + after
        return solution[:start] + new_line + solution[end:]
    raise ValueError(
        f"reasoning line {line_index} ({line!r}) has no calculator annotation with a numeric result"
    )
