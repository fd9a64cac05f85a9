"""Step-level ground truth from GSM8K calculator annotations (rredcot.tasks.gsm8k_steps)."""

from __future__ import annotations

import json
import random

import pytest

from helpers import FIXTURES
from rredcot.tasks.gsm8k_steps import (
    UnparseableExpression,
    check_lines,
    evaluate,
    first_wrong_line,
    inject_gsm8k_error,
    reasoning_lines,
)

GSM8K = FIXTURES / "data" / "gsm8k"


def _rows(name: str) -> list[dict]:
    with open(GSM8K / name, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize(
    "expr, value",
    [
        ("48/2", 24.0),
        ("16-3-4", 9.0),
        ("2+3*4", 14.0),
        ("(2+3)*4", 20.0),
        ("-3+5", 2.0),
        ("2*-3", -6.0),
        ("12*20,000", 240000.0),
        ("50000*5%", 2500.0),
        (".25*8", 2.0),
        ("0.2*50", 10.0),
        ("2**3", 8.0),
        ("2^3", 8.0),
        ("560//10", 56.0),
        ("7//2", 3.0),
        ("3 × 4 ÷ 2", 6.0),
        ("100-(20+30)/5", 90.0),
    ],
)
def test_evaluate(expr: str, value: float) -> None:
    assert evaluate(expr) == pytest.approx(value)


@pytest.mark.parametrize(
    "expr", ["x+56", "28-2x", "¾*3", "", "(2+3", "2+3)", "5/0", "48/3-quarters", "2,5*3", "9**9**9"]
)
def test_evaluate_rejects_non_arithmetic(expr: str) -> None:
    with pytest.raises(UnparseableExpression):
        evaluate(expr)


def test_reasoning_lines_skip_blank_lines_and_the_answer_line() -> None:
    text = "a = <<1+1=2>>2\n\nb = <<2*3=6>>6\n#### 6\ntrailing"
    spans = reasoning_lines(text)
    assert [text[s:e] for s, e in spans] == ["a = <<1+1=2>>2", "b = <<2*3=6>>6"]
    assert reasoning_lines("x\nA: 5") == [(0, 1)]
    assert reasoning_lines("") == []


def test_check_lines_statuses() -> None:
    text = (
        "She has 16 - 3 = <<16-3=13>>13 eggs.\n"  # ok
        "No calculation here.\n"  # unchecked
        "Let X be <<X*.25=19.5>>19.5\n"  # unparseable, not wrong
        "So 13 * 2 = $<<13*2=27>>27\n"  # wrong annotation
        "A: 27"
    )
    checks = check_lines(text)
    assert [c.status for c in checks] == ["ok", "unchecked", "unparseable", "wrong"]
    assert "X*.25" in checks[2].detail
    assert "13*2 = 26" in checks[3].detail
    assert text[slice(*checks[3].span)] == "So 13 * 2 = $<<13*2=27>>27"
    assert first_wrong_line(text) == 3


@pytest.mark.parametrize(
    "line, wrong",
    [
        ("<<10/3=3.33>>3.33", False),  # rounded to the decimals written
        ("<<10/3=3.3>>3.3", False),
        ("<<10/3=3.4>>3.4", True),
        ("<<7/2=3>>3", True),  # an integer result must be exact
        ("<<7/2=3.5>>3.5", False),
        ("<<30/7=4.285714285714286>>4 people", False),  # the text may truncate a fraction
        ("<<4.20+9.45+1.35=14.999999999999998>>14.99", False),
        ("<<2+2=4>>5", True),  # the text disagrees with the annotation
        ("<<2880-5760=-2880>>-28,800", True),
        ("<<5-8=-3>>3", True),  # sign lost
        ("<<2+2=4>> apples", False),  # no number after: nothing to compare
        ("<<1000*2=2,000>>2,000", False),
        ("<<20/100=20%>>20%", False),
        ("<<3/4=3/4>>3/4", False),
        ("<<2+3=5=5>>5", False),
        ("<<2+3=5=6>>6", True),
    ],
)
def test_tolerance_and_written_value(line: str, wrong: bool) -> None:
    assert first_wrong_line(f"Step {line}\n#### 0") == (0 if wrong else -1)


def test_gold_solutions_have_no_wrong_line() -> None:
    golds = [r["answer"] for r in _rows("train.jsonl") + _rows("test.jsonl")]
    golds += [r["ground_truth"] for r in _rows("example_model_solutions.jsonl")]
    assert len(golds) == 150
    statuses = [c.status for g in golds for c in check_lines(g)]
    assert statuses.count("wrong") == 0
    assert statuses.count("ok") > 300  # the check did look at the annotations


def test_model_solutions_known_errors() -> None:
    """Real GPT-3 traces from the fixture: errors found where a reader finds them."""
    rows = _rows("example_model_solutions.jsonl")
    found = {}
    for i, row in enumerate(rows):
        for key, value in row.items():
            if isinstance(value, dict):
                fw = first_wrong_line(value["solution"])
                if fw >= 0:
                    found[(i, key)] = fw
                    assert not value["is_correct"]  # no correct trace is flagged in this sample
    # 130000*.15 is 19500, which the text copies as 195,000 on its second line
    assert found[(2, "175b_finetuning")] == 1
    # 10*(2/3) is not 8, on the first line
    assert found[(20, "175b_verification")] == 0
    assert found[(47, "6b_verification")] == 2
    assert len(found) == 5
    # an annotation with a variable is reported, not counted as an error
    checks = check_lines(rows[29]["175b_verification"]["solution"])
    assert any(c.status == "unparseable" and "x+56" in c.detail for c in checks)
    assert first_wrong_line(rows[29]["175b_verification"]["solution"]) == -1


def test_injected_errors_are_found_at_the_injected_line() -> None:
    rng = random.Random(0)
    rows = _rows("example_model_solutions.jsonl")
    solutions = [r["ground_truth"] for r in rows]
    solutions += [v["solution"] for r in rows for v in r.values() if isinstance(v, dict)]
    injected = 0
    for solution in solutions:
        if first_wrong_line(solution) != -1:
            continue
        for check in check_lines(solution):
            if check.status != "ok":
                continue
            corrupted = inject_gsm8k_error(solution, check.index, rng)
            assert corrupted != solution
            assert first_wrong_line(corrupted) == check.index
            # only that line changed, and both copies of the result changed
            old_lines = [solution[s:e] for s, e in reasoning_lines(solution)]
            new_lines = [corrupted[s:e] for s, e in reasoning_lines(corrupted)]
            changed = [k for k, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b]
            assert changed == [check.index]
            injected += 1
    assert injected > 400


def test_inject_changes_annotation_and_text() -> None:
    text = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72"
    out = inject_gsm8k_error(text, 0, random.Random(1))
    line = out.split("\n")[0]
    result = line.split("=")[-1].split(">>")[0]
    assert result != "24"
    assert f">>{result} clips" in line
    assert out.endswith("\n#### 72")
    # deterministic in the rng
    assert inject_gsm8k_error(text, 0, random.Random(1)) == out


def test_inject_rejects_lines_without_annotation() -> None:
    text = "No annotation here.\nX is <<X*2=4>>4\nA: 4"
    with pytest.raises(ValueError, match="no calculator annotation"):
        inject_gsm8k_error(text, 0, random.Random(0))
    with pytest.raises(ValueError, match="no calculator annotation"):
        inject_gsm8k_error(text, 1, random.Random(0))  # left side not arithmetic
    with pytest.raises(ValueError, match="2 reasoning lines"):
        inject_gsm8k_error(text, 2, random.Random(0))


# ---------------------------------------------------------------------------------------------
# issue 13, finding 4: model text that made the step checker raise


DEGENERATE_ANNOTATIONS = {
    "a division by zero after the annotation": "Half of 10 is <<10/2=5>>5/0 left",
    "a complex power": "<<(-8)**0.5=2>>2",
    "170 nested parentheses": "<<" + "(" * 170 + "1" + ")" * 170 + "=1>>1",
    "990 leading minus signs": "<<" + "-" * 990 + "1=1>>1",
    "500 chained powers": "<<" + "**".join(["2"] * 500) + "=4>>4",
    "a power that overflows": "<<10**400=1>>1",
    "an over-long annotation": "<<" + "+".join(["1"] * 3000) + "=3000>>3000",
}


@pytest.mark.parametrize("line", DEGENERATE_ANNOTATIONS.values(), ids=DEGENERATE_ANNOTATIONS)
def test_degenerate_annotations_are_unparseable_steps(line):
    (check,) = check_lines(line + "\n#### 5")
    assert check.status == "unparseable", check
    assert first_wrong_line(line + "\n#### 5") == -1


@pytest.mark.parametrize(
    "expr",
    ["5/0", "(-8)**0.5", "(" * 170 + "1" + ")" * 170, "-" * 990 + "1"],
    ids=["division by zero", "complex", "deep nesting", "many signs"],
)
def test_evaluate_raises_only_unparseable(expr):
    with pytest.raises(UnparseableExpression):
        evaluate(expr)


def test_shallow_nesting_signs_and_power_chains_still_evaluate():
    assert evaluate("(" * 30 + "2" + ")" * 30) == 2.0
    assert evaluate("--3") == 3.0 and evaluate("-2**2") == -4.0
    assert evaluate("2**3**2") == 512.0  # right-associative
    assert evaluate("2**-2**2") == 2.0**-4


def test_a_correct_answer_with_an_odd_step_scores_one():
    from rredcot.tasks import Problem, get_task

    task = get_task("gsm8k", data=str(GSM8K / "train.jsonl"))
    for line in DEGENERATE_ANNOTATIONS.values():
        verdict = task.verify(Problem("q", "5"), line + "\n#### 5")
        assert verdict.reward == 1.0, verdict
        assert "verifier error" not in verdict.reason
        assert "not plain arithmetic" in verdict.reason
