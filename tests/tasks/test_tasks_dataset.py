"""The dataset / gsm8k tasks and answer extraction (rredcot.tasks.dataset, rredcot.tasks.answers)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import FIXTURES
from rredcot.tasks import Problem, get_task, list_tasks
from rredcot.tasks import answers as answers_mod
from rredcot.tasks.answers import (
    answers_match,
    extract_boxed,
    extract_completion_answer,
    extract_gsm8k,
    extract_last_number,
    extract_reference,
    normalize_answer,
    parse_number,
)
from rredcot.tasks.dataset import DataError, load_rows, render_prompt
from rredcot.tasks.gsm8k_steps import inject_gsm8k_error

GSM8K = FIXTURES / "data" / "gsm8k"
TRAIN = GSM8K / "train.jsonl"


def _rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


MATH_ROWS = [
    {"problem": "What is 1/2 as a fraction?", "solution": "It is $\\boxed{\\frac{1}{2}}$."},
    {"problem": "Add 2 and 3.", "solution": "2+3=5, so \\boxed{5}."},
    {"problem": "Square of x+1?", "solution": "\\boxed{x^{2}+2x+1}"},
    {"problem": "One thousand?", "solution": "\\boxed{1,000}"},
]


# ---------------------------------------------------------------------------------------------
# answer extraction and matching
# ---------------------------------------------------------------------------------------------


def test_reference_extraction_formats() -> None:
    assert extract_gsm8k("He has <<2*3=6>>6.\n#### 1,000") == "1000"
    assert extract_gsm8k("no marker 42") is None
    assert extract_boxed("so $\\boxed{\\frac{1}{2}}$ and more") == "\\frac{1}{2}"
    assert extract_boxed("\\boxed{a} then \\boxed{x^{2}+{y}}") == "x^{2}+{y}"
    assert extract_boxed("\\boxed 5") == "5"
    assert extract_boxed("\\boxed{unclosed") is None
    assert extract_last_number("from 3 to -1,250.5 apples") == "-1250.5"
    assert extract_last_number("ratio 3/4") == "3/4"
    assert extract_last_number("none") is None
    assert extract_reference("  yes  ", "raw") == "yes"
    assert extract_reference("ans \\boxed{7}", "boxed") == "7"
    with pytest.raises(ValueError, match="gsm8k, boxed, last_number, raw"):
        extract_reference("1", "latex")


@pytest.mark.parametrize(
    "completion, answer",
    [
        ("2 + 3 = 5\n#### 5", "5"),
        ("so the total is \\boxed{42}.", "42"),
        ("Step one\nA: 18", "18"),
        ("Answer: $1,000.", "$1,000"),
        ("Thus the answer is 7.", "7"),
        ("The answer is: -3", "-3"),
        ("I computed 3 then 12 apples", "12"),  # last number fallback
        ("The answer is 5. Wait, no.\n#### 6", "6"),  # the last statement wins
        ("#### 6\nActually the answer is 7", "7"),
        ("Plan A: add things, total 9", "9"),  # 'A:' mid-line is not an answer line
    ],
)
def test_completion_answer_extraction(completion: str, answer: str) -> None:
    assert extract_completion_answer(completion) == answer


@pytest.mark.parametrize("completion", ["", "   ", "no digits at all", None, 42])
def test_completion_without_answer(completion) -> None:
    assert extract_completion_answer(completion) is None


def test_numbers_normalise() -> None:
    assert parse_number("$1,000.00") == 1000
    assert parse_number("50%") == parse_number("0.5")
    assert parse_number("3/4") == parse_number("0.75")
    assert parse_number("abc") is None
    assert normalize_answer("1,000") == normalize_answer("1000") == normalize_answer("1000.0")
    assert normalize_answer(" Yes. ") == "yes"


@pytest.mark.parametrize("verifier", ["exact", "math_verify", "auto"])
def test_answers_match_plain_numbers(verifier: str) -> None:
    assert answers_match("1,000", "1000", verifier)
    assert answers_match("1000.0", "1000", verifier)
    assert answers_match("18 dollars", "18", verifier)
    assert answers_match("$18.", "18", verifier)
    assert not answers_match("18 or 19", "18", verifier)
    assert not answers_match("-4", "4", verifier)
    assert not answers_match("17", "18", verifier)
    assert not answers_match(None, "18", verifier)
    assert not answers_match("", "18", verifier)


def test_math_verify_and_exact_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    assert answers_mod.math_verify_available()
    # symbolic equality needs math-verify
    assert answers_match("0.5", "\\frac{1}{2}", "auto")
    assert answers_match("\\dfrac{1}{2}", "\\frac{1}{2}", "math_verify")
    assert not answers_match("0.5", "\\frac{1}{2}", "exact")
    # without math-verify, auto falls back to the exact match (and still sees 1,000 == 1000.0)
    monkeypatch.setattr(answers_mod, "_load_math_verify", lambda: None)
    assert not answers_mod.math_verify_available()
    assert not answers_match("0.5", "\\frac{1}{2}", "auto")
    assert answers_match("1,000", "1000.0", "auto")
    with pytest.raises(ValueError, match="needs the math-verify package"):
        get_task("dataset", data=str(TRAIN), answer_format="gsm8k", verifier="math_verify")


def test_math_verify_errors_do_not_escape() -> None:
    from rredcot.tasks._math_verify_worker import match

    class Broken:
        @staticmethod
        def parse(*args, **kwargs):
            raise RuntimeError("boom")

    # what the worker process runs: an exception inside math-verify is a non-match
    assert match(Broken, "\\frac{1}{2}", "0.5", 5) is False
    assert answers_match("0.50", "0.5", "auto")  # decided before math-verify is asked


# ---------------------------------------------------------------------------------------------
# issue 13, finding 5: extraction linear in the completion's length, every verify time-bounded


def _seconds(fn, text: str, repeats: int = 3) -> float:
    """Best CPU time of ``fn(text)``: CPU time of this process, so other load does not count."""
    import time

    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn(text)
        best = min(best, time.process_time() - start)
    return best


DEGENERATE_COMPLETIONS = {
    "unclosed boxes": lambda n: "\\boxed{" * n,
    "nested closed boxes": lambda n: "\\boxed{" * n + "}" * n,
    "bare boxed words": lambda n: "\\boxed x " * n,
    "open braces": lambda n: "{" * n,
    "answer markers": lambda n: "#### answer is A: " * n,
    "numbers and slashes": lambda n: "1 / " * n,
    "annotations on one line": lambda n: "<<1+1=2>>2 " * (n // 4),
}


@pytest.mark.parametrize("make", DEGENERATE_COMPLETIONS.values(), ids=DEGENERATE_COMPLETIONS)
def test_extraction_scales_linearly(make) -> None:
    """8x the text costs well under 64x the time (quadratic); the old boxed scan was cubic: 800
    unclosed boxes took 30 s, here the large size is 20,000."""
    task = get_task("dataset", data=str(TRAIN), answer_format="gsm8k", verifier="exact")
    problem = Problem("Q", "7", {})
    for fn in (extract_completion_answer, lambda t: task.verify(problem, t)):
        fn(make(100))  # warm caches
        small, large = _seconds(fn, make(2_500), repeats=5), _seconds(fn, make(20_000), 2)
        assert large < 24 * max(small, 1e-3), (small, large)


def test_twenty_thousand_unclosed_boxes_then_an_answer() -> None:
    text = "\\boxed{" * 20_000 + " so \\boxed{7}"
    assert extract_completion_answer(text) == "7"
    assert extract_boxed("\\boxed{" * 20_000) is None


def test_a_math_verify_check_past_its_deadline_scores_zero_from_any_thread() -> None:
    import threading

    from rredcot.tasks.answers import TIMEOUT_REASON, check_answer

    results = []
    worker = threading.Thread(
        target=lambda: results.append(check_answer("x^2+2x+1", "(x+1)^2", "auto", timeout=1e-6))
    )
    worker.start()
    worker.join(timeout=60)
    assert results == [(False, f"{TIMEOUT_REASON} after 1e-06s (math-verify)")]
    # the killed worker is replaced: the next check runs normally
    assert check_answer("x^2+2x+1", "(x+1)^2", "auto") == (True, None)


def test_a_math_verify_deadline_holds_for_the_whole_call_including_start_up() -> None:
    """The deadline covers the worker's start-up (seconds of importing sympy) as well as the
    check: a slow input (``10**10^10**10``) on a fresh worker returns at the deadline, not
    start-up + deadline later; the worker goes on starting, and a later check uses it."""
    import time

    from rredcot.tasks import answers

    answers._WORKER.stop()  # a fresh worker: its start-up counts against the deadline
    started = time.monotonic()
    result = answers.check_answer("10**10^10**10", "1", "math_verify", timeout=1.0)
    elapsed = time.monotonic() - started
    assert result == (False, f"{answers.TIMEOUT_REASON} after 1s (math-verify)")
    assert elapsed < 1.0 + 0.5, elapsed
    # with a ready worker the slow check ends by the deadline too (math-verify's own alarm, set
    # to the time left, or the kill)
    assert answers.check_answer("1", "1/1+0", "auto", timeout=120) == (True, None)
    assert answers._WORKER.ready
    started = time.monotonic()
    assert answers.check_answer("10**10^10**10", "1", "math_verify", timeout=1.0)[0] is False
    assert time.monotonic() - started < 1.0 + 0.5
    assert answers.check_answer("x^2+2x+1", "(x+1)^2", "auto", timeout=120) == (True, None)


@pytest.mark.slow
def test_timed_out_verifies_score_zero_and_are_counted(
    tiny_policy, char_tokenizer, tmp_path
) -> None:
    from rredcot.sampling.rollout import build_rollout_batch
    from rredcot.segment import get_segmenter
    from rredcot.tasks import Task

    rows = [{"question": f"half of {i}?", "answer": "\\frac{1}{2}"} for i in range(4)]
    inner = get_task(
        "dataset", data=str(_write_jsonl(tmp_path / "d.jsonl", rows)), verify_timeout=1e-6
    )

    class AlwaysAsksMathVerify(Task):
        def verify(self, problem, completion):  # a number is never \\frac{1}{2} by exact match
            return inner.verify(problem, completion + "\n#### 3")

    problems = inner.train_problems(2, seed=0)
    batch, stats = build_rollout_batch(
        tiny_policy,
        char_tokenizer,
        AlwaysAsksMathVerify(),
        problems,
        get_segmenter("newline"),
        num_generations=1,
        max_new_tokens=4,
    )
    assert stats["rollout/verify_timeouts"] == 2.0
    assert all(v.timed_out and v.reward == 0.0 for v in batch.verdicts)
    assert batch.verdicts[0].reason.startswith("verify timed out after 1e-06s")


# ---------------------------------------------------------------------------------------------
# the gsm8k task on the fixture
# ---------------------------------------------------------------------------------------------


def test_registered() -> None:
    assert {"dataset", "gsm8k", "reasoning_gym"} <= set(list_tasks())


def test_gsm8k_problems_from_a_file() -> None:
    task = get_task("gsm8k", data=str(TRAIN))
    rows = _rows(TRAIN)
    by_question = {r["question"]: r for r in rows}
    train = task.train_problems(45, seed=0)
    evals = task.eval_problems(100, seed=0)
    assert len(evals) == 5  # a single file: eval_fraction 0.1 of 50 rows held out
    assert len({p.prompt for p in train}) == 45  # one epoch: each training row once
    assert not {p.prompt for p in train} & {p.prompt for p in evals}
    for p in train + evals:
        row = by_question[p.meta["question"]]
        assert p.meta["solution"] == row["answer"]
        assert p.answer == row["answer"].split("####")[-1].strip().replace(",", "")
        assert p.prompt == f"Question: {row['question']}\nAnswer:\n"
        assert p.meta["source"].startswith(str(TRAIN) + " line ")
        json.dumps(p.meta)  # serialisable
    # deterministic, and more problems than rows cycles through shuffled epochs
    assert task.train_problems(10, seed=3) == task.train_problems(10, seed=3)
    assert task.train_problems(10, seed=3) != task.train_problems(10, seed=4)
    many = task.train_problems(100, seed=1)
    assert len(many) == 100 and len({p.prompt for p in many}) == 45


def test_gsm8k_gold_verifies_and_steps() -> None:
    task = get_task("gsm8k", data=str(TRAIN))
    rng = random.Random(0)
    for p in task.train_problems(45, seed=0):
        gold = task.gold_completion(p)
        assert gold == p.meta["solution"]
        v = task.verify(p, gold)
        assert (v.reward, v.answer, v.first_error_step) == (1.0, p.answer, -1), v
        assert v.num_steps == len(gold.strip().split("\n")) - 1
        # a corrupted step is localised at its line, whatever the final answer says
        line = rng.randrange(v.num_steps)
        try:
            bad = inject_gsm8k_error(gold, line, rng)
        except ValueError:
            continue  # a line without an annotation
        v_bad = task.verify(p, bad)
        assert v_bad.first_error_step == line, (bad, v_bad)
        assert f"step {line} wrong" in v_bad.reason


def test_gsm8k_verify_outcomes() -> None:
    task = get_task("gsm8k", data=str(TRAIN))
    p = Problem("Q", "72", {"solution": "x\n#### 72"})
    assert task.verify(p, "48+24 = <<48+24=72>>72\nA: 72").reward == 1.0
    assert task.verify(p, "Total 72 clips").reward == 1.0  # last number fallback
    wrong = task.verify(p, "48+24 = <<48+24=72>>72\n#### 70")
    assert (wrong.reward, wrong.answer, wrong.first_error_step) == (0.0, "70", None)
    assert "expected '72'" in wrong.reason
    none = task.verify(p, "I do not know")
    assert (none.reward, none.answer) == (0.0, None)
    assert "no final answer" in none.reason
    odd = task.verify(p, "Let X be <<X*2=4>>4\nA: 72")
    assert odd.first_error_step == -1 and "not plain arithmetic" in odd.reason


_GSM8K_TASK = get_task("gsm8k", data=str(TRAIN), verifier="exact")
_GSM8K_PROBLEM = Problem("Q", "72", {})


@settings(max_examples=150, deadline=None)
@given(
    st.text(
        alphabet=st.sampled_from(list("0123456789#<>=+-*/.,%$A:boxed{}\\ \nanswer is")), max_size=60
    )
)
def test_verify_never_raises(text: str) -> None:
    v = _GSM8K_TASK.verify(_GSM8K_PROBLEM, text)
    assert v.reward in (0.0, 1.0)
    assert v.first_error_step is None or v.first_error_step >= -1


def test_gsm8k_directory_with_split_files_and_answer_rendering() -> None:
    task = get_task("gsm8k", data=str(GSM8K))  # train.jsonl + test.jsonl, eval_split=test
    assert len(task.train_problems(50, 0)) == 50
    evals = task.eval_problems(1000, 0)
    assert {p.meta["question"] for p in evals} == {
        r["question"] for r in _rows(GSM8K / "test.jsonl")
    }
    assert task.render_answer("42") == "#### 42"
    assert task.answer_cue == "#### "
    p = evals[0]
    short = task.truncated_gold(p, 1)
    assert short.split("\n")[0] == p.meta["solution"].split("\n")[0]
    assert short.endswith(f"\n#### {p.answer}") and short.count("\n") == 1
    assert task.verify(p, short).reward == 1.0


def test_eval_sources_and_limits(tmp_path: Path) -> None:
    test_file = GSM8K / "test.jsonl"
    task = get_task("gsm8k", data=str(TRAIN), eval_data=str(test_file), max_examples="20")
    assert len(set(p.prompt for p in task.train_problems(40, 0))) == 20  # nothing held out
    assert len(task.eval_problems(100, 0)) == 20
    none = get_task("gsm8k", data=str(TRAIN), eval_fraction="0")
    assert len({p.prompt for p in none.train_problems(50, 0)}) == 50
    with pytest.raises(DataError, match="no evaluation problems"):
        none.eval_problems(5, 0)
    tiny = _write_jsonl(tmp_path / "one.jsonl", [_rows(TRAIN)[0]])
    with pytest.raises(DataError, match="too few to hold out"):
        get_task("gsm8k", data=str(tiny)).train_problems(1, 0)


# ---------------------------------------------------------------------------------------------
# other sources: parquet, save_to_disk, hub (stubbed), .json lists
# ---------------------------------------------------------------------------------------------


def test_boxed_dataset_from_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "math.parquet"
    pq.write_table(pa.Table.from_pylist(MATH_ROWS), path)
    task = get_task(
        "dataset",
        data=str(path),
        question_field="problem",
        answer_field="solution",
        answer_format="boxed",
        prompt_template="Solve: {question}\nPut the answer in \\boxed{}.",
        eval_fraction=0.0,
    )
    problems = sorted(task.train_problems(4, 0), key=lambda p: p.meta["source"])
    assert [p.answer for p in problems] == ["\\frac{1}{2}", "5", "x^{2}+2x+1", "1,000"]
    assert problems[0].prompt == "Solve: What is 1/2 as a fraction?\nPut the answer in \\boxed{}."
    assert problems[0].meta["source"] == f"{path} row 1"
    assert task.render_answer("5") == "\\boxed{5}"
    half, thousand = problems[0], problems[3]
    assert task.verify(half, "so \\boxed{0.5}").reward == 1.0
    assert task.verify(half, "so \\boxed{\\frac{2}{4}}").reward == 1.0
    assert task.verify(thousand, "The answer is 1000.0").reward == 1.0
    assert task.verify(problems[2], "\\boxed{(x+1)^2}").reward == 1.0
    assert task.verify(problems[2], "\\boxed{x^2+1}").reward == 0.0
    assert task.verify(half, task.gold_completion(half)).reward == 1.0
    v = task.verify(half, "\\boxed{1/2}")
    assert v.first_error_step is None and v.num_steps is None  # no step checks outside gsm8k
    # the same data with the exact verifier: only the normalised string / number matches
    exact = get_task(
        "dataset",
        data=str(path),
        question_field="problem",
        answer_field="solution",
        answer_format="boxed",
        verifier="exact",
        eval_fraction=0.0,
    )
    assert exact.verify(half, "so \\boxed{0.5}").reward == 0.0
    assert exact.verify(half, "so \\boxed{\\frac{1}{2}}").reward == 1.0
    assert exact.verify(thousand, "#### 1000").reward == 1.0


def test_save_to_disk_dataset_and_dataset_dict(tmp_path: Path) -> None:
    import datasets

    rows = _rows(TRAIN)[:6]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    task = get_task("gsm8k", data=str(tmp_path / "single"), eval_fraction=0.5)
    assert len({p.prompt for p in task.train_problems(10, 0)}) == 3
    assert len(task.eval_problems(10, 0)) == 3  # a single Dataset has no "test" split
    dd = datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_list(rows[:4]),
            "test": datasets.Dataset.from_list(rows[4:]),
        }
    )
    dd.save_to_disk(str(tmp_path / "dict"))
    task = get_task("gsm8k", data=str(tmp_path / "dict"))
    assert len({p.prompt for p in task.train_problems(10, 0)}) == 4
    assert [p.meta["question"] for p in task.eval_problems(10, 0)] != []
    assert {p.meta["question"] for p in task.eval_problems(10, 0)} == {
        r["question"] for r in rows[4:]
    }
    assert "[test] row " in task.eval_problems(10, 0)[0].meta["source"]
    with pytest.warns(UserWarning, match="has no split 'validation'; holding out eval_fraction"):
        held = get_task("gsm8k", data=str(tmp_path / "dict"), eval_split="validation")
        assert len(held.eval_problems(10, 0)) == 1  # 10% of the 4 train rows, rounded up
    with pytest.raises(DataError, match="has splits train, test; no split 'validation'"):
        get_task("gsm8k", data=str(tmp_path / "dict"), split="validation").load()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{oops", "is not valid JSON"),
        pytest.param("[" * 100_000 + "]" * 100_000, "nests JSON deeper", id="deep"),
        ('["train", "test"]', "is not a datasets save_to_disk dataset_dict.json"),
        ('{"splits": "train"}', "is not a datasets save_to_disk dataset_dict.json"),
        pytest.param(" " * (17 << 20), "is over 16 MiB", id="huge"),
    ],
)
def test_a_bad_dataset_dict_json_is_one_line_naming_it(tmp_path: Path, text, expected) -> None:
    import datasets

    rows = _rows(TRAIN)[:4]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)}).save_to_disk(str(tmp_path))
    (tmp_path / "dataset_dict.json").write_text(text)
    for read in (
        lambda: load_rows(str(tmp_path)),
        lambda: get_task("gsm8k", data=str(tmp_path), eval_split="validation").load(),
    ):
        with pytest.raises(DataError, match=expected) as err:
            read()
        assert str(tmp_path / "dataset_dict.json") in str(err.value)


def test_hub_name_goes_through_load_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    calls = []
    rows = _rows(TRAIN)[:8]

    def fake_load_dataset(name, subset=None, split=None):
        calls.append((name, subset, split))
        return datasets.Dataset.from_list(rows[:5] if split == "train" else rows[5:])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    task = get_task("gsm8k")  # defaults: openai/gsm8k, subset main, eval split test
    assert calls == []  # loaded lazily
    assert len(task.eval_problems(10, 0)) == 3
    assert calls == [("openai/gsm8k", "main", "train"), ("openai/gsm8k", "main", "test")]
    assert task.train_problems(1, 0)[0].meta["source"].startswith("openai/gsm8k[train] row ")

    def failing(*args, **kwargs):
        raise ConnectionError("offline")

    monkeypatch.setattr(datasets, "load_dataset", failing)
    with pytest.raises(DataError, match="could not load 'someone/data'.*offline"):
        get_task("gsm8k", data="someone/data").load()


def test_without_the_datasets_package_the_error_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import datasets

    datasets.Dataset.from_list(_rows(TRAIN)[:2]).save_to_disk(str(tmp_path / "saved"))
    monkeypatch.setitem(sys.modules, "datasets", None)  # what `import datasets` meets uninstalled
    with pytest.raises(ImportError, match=r"saved dataset .*saved needs the datasets package: pip"):
        load_rows(str(tmp_path / "saved"))
    with pytest.raises(ImportError, match=r"hub dataset 'someone/data' needs .*rredcot\[data\]"):
        load_rows("someone/data")


def test_json_list_file(tmp_path: Path) -> None:
    path = tmp_path / "qa.json"
    path.write_text(json.dumps({"data": [{"q": "Capital of France?", "a": "Paris"}] * 3}))
    task = get_task(
        "dataset", data=str(path), question_field="q", answer_field="a", eval_fraction=0
    )
    p = task.train_problems(1, 0)[0]
    assert p.answer == "Paris" and p.meta["source"] == f"{path} item 1"
    assert task.render_answer("Paris") == "Answer: Paris"
    assert task.gold_completion(p) == "Answer: Paris"
    assert task.verify(p, "Answer: paris.").reward == 1.0
    assert task.verify(p, "Answer: Lyon").reward == 0.0


# ---------------------------------------------------------------------------------------------
# bad data and bad parameters
# ---------------------------------------------------------------------------------------------


def _load(path: Path, **kw) -> None:
    get_task("gsm8k", data=str(path), **kw).load()


def test_missing_field(tmp_path: Path) -> None:
    path = _write_jsonl(
        tmp_path / "d.jsonl", [{"question": "a", "answer": "#### 1"}, {"question": "b"}]
    )
    with pytest.raises(
        DataError, match=r"d\.jsonl line 2 has no field 'answer' \(its fields: question\)"
    ):
        _load(path)
    with pytest.raises(DataError, match=r"line 1 has no field 'problem'.*--task.question_field"):
        _load(path, question_field="problem")


def test_answer_that_cannot_be_extracted(tmp_path: Path) -> None:
    rows = [{"question": "a", "answer": "#### 1"}, {"question": "b", "answer": "just 7, no marker"}]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(
        DataError, match=r"d\.jsonl line 2: cannot extract a gsm8k answer from field 'answer'"
    ):
        _load(path)
    _load(path, answer_format="last_number")  # the same rows read fine as last numbers


def test_empty_null_and_nested_fields(tmp_path: Path) -> None:
    for value, message in [("  ", "is empty"), (None, "is null"), ([1], r"is \[1\]")]:
        path = _write_jsonl(tmp_path / "d.jsonl", [{"question": "a", "answer": value}])
        with pytest.raises(DataError, match=rf"d\.jsonl line 1: field 'answer' {message}"):
            _load(path)


def test_empty_file(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(DataError, match=r"empty\.jsonl is empty: it holds no examples"):
        _load(path)


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(
        b'{"question": "ok", "answer": "#### 1"}\n{"question": "caf\xe9", "answer": "#### 2"}\n'
    )
    with pytest.raises(DataError, match=r"latin1\.jsonl line 2 is not UTF-8 text \(byte 0xe9"):
        _load(path)


def test_invalid_json_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "a", "answer": "#### 1"}\n{"question": "b", answer: 2}\n[1, 2]\n')
    with pytest.raises(
        DataError, match=r"bad\.jsonl line 2 is not valid JSON \(Expecting property name"
    ):
        _load(path)
    path.write_text('{"question": "a", "answer": "#### 1"}\n[1, 2]\n')
    with pytest.raises(DataError, match=r"line 2 is a JSON list, expected an object"):
        _load(path)


def test_missing_path_and_unsupported_type(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        _load(tmp_path / "nope.jsonl")
    csv = tmp_path / "d.csv"
    csv.write_text("question,answer\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        _load(csv)
    with pytest.raises(DataError, match="without a datasets save_to_disk dataset or split files"):
        load_rows(str(tmp_path), split="validation")


@pytest.mark.parametrize(
    "params, message",
    [
        ({"prompt_template": "Q: {q}"}, "must contain '{question}'"),
        ({"answer_format": "latex"}, "valid: gsm8k, boxed, last_number, raw"),
        ({"verifier": "sympy"}, "valid: auto, math_verify, exact"),
        ({"eval_fraction": "1.5"}, "must be in"),
        ({"max_examples": "0"}, "must be >= 1"),
        ({"eval_fraction": "lots"}, "expects float"),
        ({"colour": "red"}, "unknown parameter"),
    ],
)
def test_bad_parameters(params: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        get_task("gsm8k", data=str(TRAIN), **params)


def test_dataset_needs_data() -> None:
    with pytest.raises(ValueError, match="'data' is required: --task.data PATH"):
        get_task("dataset")


# ---------------------------------------------------------------------------------------------
# prompts through a chat template
# ---------------------------------------------------------------------------------------------


def _char_tokenizer(chat_template: str | None):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = sorted(set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:?$<>|\n"))
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.chat_template = chat_template
    return fast


def test_render_prompt_with_and_without_chat_template() -> None:
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    task = get_task("gsm8k", data=str(TRAIN))
    p = task.train_problems(1, 0)[0]
    chat = _char_tokenizer(template)
    rendered = render_prompt(p, chat)
    assert rendered == f"<|user|>{p.prompt}\n<|assistant|>"
    assert task.render_prompt(p, chat) == rendered
    assert render_prompt(p.prompt, chat) == rendered
    plain = _char_tokenizer(None)
    assert render_prompt(p, plain) == p.prompt
    assert render_prompt(p, None) == p.prompt
