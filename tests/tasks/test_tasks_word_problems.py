"""The word-problem task: problems, gold text, and the verifier's reward and first wrong line."""

from __future__ import annotations

import pytest

from rredcot.tasks import Problem, get_task
from rredcot.tasks.word_problems import SYSTEM_PROMPT, committed_answer, parse_problem


@pytest.fixture(scope="module")
def task():
    return get_task("word_problems")


def P(prompt: str, answer: str) -> Problem:
    return Problem(prompt, answer)


TWO = "Tom has 9 apples. He buys 8 more, then eats 6. How many apples does Tom have now?"


def test_problems_are_deterministic_split_and_parse(task):
    train = task.train_problems(200, seed=0)
    assert [p.prompt for p in train] == [p.prompt for p in task.train_problems(200, seed=0)]
    evals = task.eval_problems(100, seed=0)
    assert len({p.prompt for p in evals}) == 100
    assert not {p.prompt for p in evals} & {p.prompt for p in train}
    assert {len(p.meta["operators"]) for p in train} == {1, 2}
    for p in train + evals:
        parsed = parse_problem(p.prompt)
        assert parsed is not None, p.prompt
        assert parsed.operators == p.meta["operators"]
        assert parsed.operands == p.meta["operands"]
        assert str(parsed.values[-1]) == p.answer
        assert all(0 <= v <= 99 for v in parsed.values)
        assert "system" not in p.meta
    assert get_task("word_problems", example=True).train_problems(1, 0)[0].meta["system"] == (
        SYSTEM_PROMPT
    )


def test_params_are_checked():
    with pytest.raises(ValueError, match="min_steps"):
        get_task("word_problems", min_steps=3, max_steps=2)
    with pytest.raises(ValueError, match="operators"):
        get_task("word_problems", operators="*")
    three = get_task("word_problems", min_steps="3", max_steps="3")
    p = three.train_problems(1, seed=0)[0]
    assert len(p.meta["operators"]) == 3
    assert p.prompt.count(", then ") == 2


def test_gold_and_injected_errors(task):
    for p in task.train_problems(50, seed=1):
        gold = task.gold_completion(p)
        v = task.verify(p, gold)
        assert (v.reward, v.first_error_step, v.answer) == (1.0, -1, p.answer), (gold, v)
        n = len(p.meta["operators"])
        assert v.num_steps == n
        for step in range(n):
            bad = task.inject_error(p, step, delta=2)
            v = task.verify(p, bad)
            assert v.reward == 0.0 and v.first_error_step == step, (bad, v)
        assert task.truncated_gold(p, 0).startswith("The answer is ")


@pytest.mark.parametrize(
    "completion, reward, first_error",
    [
        # the model's own slips, as SmolLM2-135M-Instruct writes them
        (
            "Tom has 9 apples. He buys 8 more, so he has 9 - 8 = 1 apple left.\nThe answer is 1.",
            0,
            0,
        ),
        ("Tom has 9 apples - 8 apples = 2 apples.\nThe answer is 2.", 0, 0),  # wrong arithmetic
        # the right answer through a wrong line: rewarded, and the line is still reported
        ("Tom has 9 apples - 8 apples = 11 apples.\nThe answer is 11.", 1, 0),
        (
            "He buys 8 more, so he has 9 + 8 = 17 apples.\nHe eats 6, so 17 - 6 = 12.\nThe answer is 12.",
            0,
            1,
        ),
        ("He buys 8 more: 9 + 8 = 17.\nHe eats 6: 17 - 6 = 11.\nThe answer is 11.", 1, -1),
        # one line for everything, restating values, skipping to a later value
        ("9 + 8 = 17 and 17 - 6 = 11. The answer is 11.", 1, -1),
        ("He has 9 + 8 - 6 = 11 apples.\nThe answer is 11.", 1, -1),
        ("9 + 8 = 17\n17 = 17 apples\n17 - 6 = 11\nThe answer is 11.", 1, -1),
        # right steps, wrong answer line; text after the committed answer is not read
        ("9 + 8 = 17\n17 - 6 = 11\nThe answer is 12.", 0, 2),
        ("9 + 8 = 17\n17 - 6 = 11\nThe answer is 11.\nThe answer is 3 + 3 = 7.", 1, -1),
        # no "answer is": the last number counts
        ("9 + 8 = 17\n17 - 6 = 11 apples", 1, -1),
        ("Tom has 11 apples left.", 1, -1),
        ("9 + 8 = 17\n17 - 6 = 11 apples\nSo Tom has 12 apples", 0, 2),  # chain done, then wrong
        # cut short (the token cap) after right lines, no answer stated: no line is known wrong
        ("He buys 8 more, so he has 9 + 8 = 17 apples.\nHe eats 6, so he has 17 -", 0, None),
        ("Tom has 9 apples. He buys 8 more", 0, None),
    ],
)
def test_verify_reward_and_first_wrong_line(task, completion, reward, first_error):
    v = task.verify(P(TWO, "11"), completion)
    assert (v.reward, v.first_error_step) == (reward, first_error), v


def test_verify_never_raises_and_marks_unknowns(task):
    p = P(TWO, "11")
    assert task.verify(p, "").first_error_step is None
    assert task.verify(p, "no numbers here").reward == 0.0
    assert task.verify(p, None).reward == 0.0  # type: ignore[arg-type]
    assert task.verify(p, "1/0 = 5\nThe answer is 11.").reward == 1.0
    other = task.verify(P("What is 2 + 9?", "11"), "2 + 9 = 11")
    assert other.reward == 1.0 and other.first_error_step is None  # steps unknown
    assert committed_answer("x = 3.0, the answer is: 4.50 apples") == ("4.5", 0)


def test_render_answer_and_render_prompt(task, char_tokenizer):
    from rredcot.sampling.rollout import render_prompt

    assert task.render_answer("7") == "The answer is 7."
    p = get_task("word_problems", example=True).train_problems(1, seed=0)[0]
    text = render_prompt(p, char_tokenizer)  # no chat template: system text, blank line, prompt
    assert text == f"{SYSTEM_PROMPT}\n\n{p.prompt}"


def test_a_long_line_of_operators_is_verified_at_once():
    """A degenerate greedy output ("5 - 5 - 5 ..." with no "=") hung the verifier in
    exponential regex backtracking (14 terms: 45 s; a SmolLM2 evaluation stalled on one). Run in
    a child process, so that a regression fails here instead of hanging the suite."""
    import subprocess
    import sys

    code = (
        "from rredcot.tasks import Problem, get_task\n"
        f"p = Problem({TWO!r}, '11')\n"
        "v = get_task('word_problems').verify(p, ' - '.join(['5'] * 400) + '\\n9 + 8 = 17')\n"
        "print(v.reward, v.first_error_step)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    # no answer stated and the chain not finished (9 + 8 = 17 is its right first step): unknown
    assert done.stdout.split() == ["0.0", "None"]


def test_the_equation_pattern_matches_as_its_backtracking_form_did():
    """The atomic, possessive equation pattern finds the same equations (spans, sides) as the
    plain pattern it replaced, on lines short enough for the plain one."""
    import random
    import re

    from rredcot.tasks.word_problems import _EQUATION_RE

    number = r"-?\d+(?:\.\d+)?"
    term = rf"\(?\s*{number}(?:\s+[A-Za-z]+)?\s*\)?"
    plain = re.compile(rf"(?P<left>{term}(?:\s*[-+*/×÷]\s*{term})+)\s*=\s*(?P<right>{number})")
    rng = random.Random(1)

    def space() -> str:
        return rng.choice(["", " ", "  ", "\t"])

    def a_term() -> str:
        text = rng.choice(["", "(", "-"]) + space() + rng.choice(["1", "12", "3.5", "-2"])
        text += rng.choice(["", "", " apples", "x", " a b"])
        return text + space() + rng.choice(["", ")", "))"])

    matched = 0
    for _ in range(5000):
        line = a_term() + "".join(
            space() + rng.choice("-+*/×÷=.") + space() + a_term() for _ in range(rng.randint(0, 4))
        )
        if rng.random() < 0.7:
            line += space() + "=" + space() + rng.choice(["5", "-3", "2.5", "x", ""])
        found = [(m.span(), m["left"], m["right"]) for m in _EQUATION_RE.finditer(line)]
        assert found == [(m.span(), m["left"], m["right"]) for m in plain.finditer(line)], line
        matched += bool(found)
    assert matched > 100  # the corpus holds equations, not only non-matches


def test_chain_split_holds_out_chains_not_only_prompts():
    """split='prompt' lets a held-out chain occur in training told with another name or item;
    split='chain' holds the chain itself out."""

    def chain(p):
        return parse_problem(p.prompt).chain

    for split, overlapping in (("prompt", True), ("chain", False)):
        task = get_task("word_problems", split=split)
        pool = {chain(p) for p in task.train_problems(2048, seed=0)}
        held = [chain(p) for p in task.eval_problems(64, seed=0)]
        assert any(c in pool for c in held) is overlapping, split
    with pytest.raises(ValueError, match="split must be one of prompt, chain"):
        get_task("word_problems", split="question")
