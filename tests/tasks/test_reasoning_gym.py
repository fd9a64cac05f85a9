"""The reasoning-gym adapter: generated problems, strict 0/1 reward (rredcot.tasks.reasoning_gym)."""

from __future__ import annotations

import json
import sys

import pytest

from rredcot.tasks import get_task
from rredcot.tasks.reasoning_gym import extract_tagged_answer


@pytest.fixture(scope="module")
def chain_sum():
    return get_task("reasoning_gym", dataset_name="chain_sum", size=40, eval_size=20, seed=3)


@pytest.fixture(scope="module")
def countdown():
    return get_task(
        "reasoning_gym",
        dataset_name="countdown",
        size=10,
        eval_size=10,
        dataset_kwargs='{"min_numbers": 3, "max_numbers": 4}',
    )


def test_extract_tagged_answer() -> None:
    assert extract_tagged_answer("think\n<answer> 42 </answer>") == "42"
    assert extract_tagged_answer("<answer>1</answer> no, <answer>2</answer>") == "2"
    assert extract_tagged_answer("<ANSWER>a\nb</ANSWER>") == "a\nb"
    assert extract_tagged_answer("work\nA: 7") == "7"
    assert extract_tagged_answer("work\nAnswer: 3 + 4") == "3 + 4"
    assert extract_tagged_answer("just 42") is None
    assert extract_tagged_answer("<answer>unclosed 4") is None
    assert extract_tagged_answer(None) is None


def test_chain_sum_problems_and_gold_reward(chain_sum) -> None:
    train = chain_sum.train_problems(40, seed=0)
    evals = chain_sum.eval_problems(20, seed=0)
    assert evals and not {p.prompt for p in train} & {p.prompt for p in evals}
    for p in train + evals:
        entry = p.meta["entry"]
        assert p.answer == entry["answer"]
        assert p.prompt.startswith(entry["question"])
        assert "<answer>...</answer>" in p.prompt
        # the expression in the metadata really sums to the answer
        terms = entry["metadata"]["expression"].replace("- ", "+ -").split("+")
        assert sum(int(t) for t in terms) == int(p.answer)
        gold = chain_sum.gold_completion(p)
        assert gold == f"<answer>{p.answer}</answer>" == chain_sum.render_answer(p.answer)
        v = chain_sum.verify(p, f"Adding up step by step.\n{gold}")
        assert (v.reward, v.answer) == (1.0, p.answer), v
        assert chain_sum.verify(p, f"A: {p.answer}").reward == 1.0
        json.dumps(p.meta)  # problems are serialisable
    assert chain_sum.train_problems(5, seed=1) == chain_sum.train_problems(5, seed=1)


def test_chain_sum_wrong_and_partial_answers_get_zero(chain_sum) -> None:
    for p in chain_sum.train_problems(20, seed=0):
        off_by_one = str(int(p.answer) + 1)
        assert chain_sum.verify(p, f"<answer>{off_by_one}</answer>").reward == 0.0
        # an extra digit: reasoning-gym gives partial credit, the task gives none
        partial = p.answer + "0"
        score = chain_sum.score(p, partial)
        assert 0.0 < score < 1.0
        v = chain_sum.verify(p, f"<answer>{partial}</answer>")
        assert v.reward == 0.0 and v.answer == partial
        assert f"reasoning-gym score {score:.2f}; only 1.0 counts" in v.reason
        missing = chain_sum.verify(p, f"the sum is {p.answer}")  # no tags, no A: line
        assert (missing.reward, missing.answer) == (0.0, None)


def test_countdown_gold_alternatives_and_wrong(countdown) -> None:
    problems = countdown.train_problems(10, seed=0) + countdown.eval_problems(10, seed=0)
    assert len(problems) == 20
    for p in problems:
        entry = p.meta["entry"]
        assert 3 <= len(entry["metadata"]["numbers"]) <= 4  # dataset_kwargs reached the config
        assert countdown.verify(p, countdown.gold_completion(p)).reward == 1.0
        # another valid expression for the same target also scores 1
        assert countdown.verify(p, f"<answer>({p.answer})</answer>").reward == 1.0
        # a well-formed expression with the wrong value: partial credit upstream, 0 here
        wrong = f"{p.answer} + 1"
        assert 0.0 < countdown.score(p, wrong) < 1.0
        assert countdown.verify(p, f"<answer>{wrong}</answer>").reward == 0.0
        assert countdown.verify(p, "<answer>not math</answer>").reward == 0.0


def test_verify_never_raises(chain_sum) -> None:
    p = chain_sum.train_problems(1, seed=0)[0]
    for text in ["", "<answer></answer>", "<answer>" + "9" * 500 + "</answer>", "A: ∞", None]:
        v = chain_sum.verify(p, text)
        assert v.reward == 0.0


def test_parameters() -> None:
    task = get_task(
        "reasoning_gym",
        dataset_name="chain_sum",
        size="5",
        eval_size="0",
        dataset_kwargs={"min_terms": 2, "max_terms": 2},
    )
    problems = task.train_problems(5, seed=0)
    assert all(p.meta["entry"]["metadata"]["num_terms"] == 2 for p in problems)
    assert task.eval_problems(5, seed=0) == []
    with pytest.raises(
        ValueError, match="unknown reasoning-gym dataset 'chainsum'; valid: .*chain_sum"
    ):
        get_task("reasoning_gym", dataset_name="chainsum")
    with pytest.raises(ValueError, match="dataset_kwargs='{min_terms: 2}' is not valid JSON"):
        get_task("reasoning_gym", dataset_kwargs="{min_terms: 2}")
    with pytest.raises(ValueError, match="set seed as its own task parameter"):
        get_task("reasoning_gym", dataset_kwargs='{"seed": 1}')
    with pytest.raises(ValueError, match="rejected dataset_kwargs"):
        get_task("reasoning_gym", dataset_kwargs='{"colour": 1}')
    with pytest.raises(ValueError, match="must contain '{question}'"):
        get_task("reasoning_gym", prompt_template="Solve it.")


def test_missing_reasoning_gym_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # makes `import reasoning_gym` fail
    with pytest.raises(ImportError, match=r"pip install 'rredcot\[gym\]'"):
        get_task("reasoning_gym", dataset_name="chain_sum")
