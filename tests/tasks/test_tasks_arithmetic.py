"""The task registry and the arithmetic task: generation, splits, verifier, error injection."""

import random
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rredcot.tasks import (
    Problem,
    Task,
    Verdict,
    describe_params,
    get_task,
    get_task_class,
    list_tasks,
    register_task,
    safe_verify,
)
from rredcot.tasks.arithmetic import (
    ArithmeticTask,
    apply_op,
    chain_results,
    format_prompt,
    inject_error,
    parse_prompt,
)


@pytest.fixture(scope="module")
def task() -> ArithmeticTask:
    return get_task("arithmetic")


@pytest.fixture(scope="module")
def problems(task) -> list[Problem]:
    return task.eval_problems(40, seed=0)


# -- registry ---------------------------------------------------------------------------------


def test_registry_lists_arithmetic_and_rejects_unknown_names():
    assert "arithmetic" in list_tasks()
    assert get_task_class("arithmetic") is ArithmeticTask
    with pytest.raises(ValueError, match=r"unknown task 'nope'.*arithmetic"):
        get_task("nope")


def test_unknown_param_is_named_with_the_valid_ones():
    with pytest.raises(TypeError, match=r"num_stepz.*valid:.*num_steps"):
        get_task("arithmetic", num_stepz=3)


def test_cli_strings_are_converted_to_field_types():
    t = get_task("arithmetic", num_steps="3", max_value="50", eval_fraction="0.2")
    assert (t.params.num_steps, t.params.max_value, t.params.eval_fraction) == (3, 50, 0.2)
    with pytest.raises(ValueError, match="num_steps.*expects int.*'three'"):
        get_task("arithmetic", num_steps="three")


@pytest.mark.parametrize(
    "params, match",
    [
        ({"num_steps": 0}, "num_steps must be >= 1"),
        ({"operators": "+%"}, "subset of"),
        ({"operators": ""}, "subset of"),
        ({"operators": "++"}, "duplicates"),
        ({"min_operand": 5, "max_operand": 2}, "min_operand <= max_operand"),
        ({"max_operand": 200}, "exceeds max_value"),
        ({"eval_fraction": 0.0}, "eval_fraction"),
        ({"operators": "-", "num_steps": 20}, "no 20-step chain"),
    ],
)
def test_params_are_validated(params, match):
    with pytest.raises(ValueError, match=match):
        get_task("arithmetic", **params)


def test_describe_params_carries_help_text():
    rows = {
        name: (default, help_) for name, default, help_ in describe_params(ArithmeticTask.Params)
    }
    assert rows["num_steps"][0] == 4
    assert "Operations per chain" in rows["num_steps"][1]


def test_a_new_task_registers_by_decorator():
    @dataclass
    class P:
        size: int = field(default=2, metadata={"help": "size"})

    @register_task("_test_echo")
    class Echo(Task):
        Params = P

        def verify(self, problem, completion):
            raise RuntimeError("boom")

    t = get_task("_test_echo", size="5")
    assert t.name == "_test_echo" and t.params.size == 5
    assert t.render_answer("7") == "A:7"
    v = safe_verify(t, Problem("p", "1"), "x")
    assert v.reward == 0.0 and "RuntimeError: boom" in v.reason
    with pytest.raises(ValueError, match="already registered"):
        register_task("_test_echo")(type("Other", (Task,), {}))


# -- generation -------------------------------------------------------------------------------


def test_generation_is_deterministic_per_seed(task):
    a, b = task.train_problems(30, seed=1), task.train_problems(30, seed=1)
    c = task.train_problems(30, seed=2)
    assert a == b
    assert [p.prompt for p in a] != [p.prompt for p in c]
    assert task.eval_problems(10, seed=0) == task.eval_problems(10, seed=0)
    assert len(set(a + b)) == len({p.prompt for p in a})  # problems are hashable
    # The eval set grows by extension: the first n of a bigger set are the n-set.
    assert task.eval_problems(25, seed=0)[:10] == task.eval_problems(10, seed=0)


def test_problems_follow_the_params():
    t = get_task("arithmetic", num_steps=3, operators="+*", min_operand=2, max_operand=5)
    for p in t.train_problems(200, seed=0):
        operands, ops = parse_prompt(p.prompt)
        assert len(ops) == 3 and set(ops) <= {"+", "*"}
        assert all(2 <= x <= 5 for x in operands)
        results = chain_results(operands, ops)
        assert all(0 <= r <= 99 for r in results)
        assert p.answer == str(results[-1]) == str(p.meta["results"][-1])
        assert p.prompt == format_prompt(operands, ops) and p.prompt.endswith("=?\n")


def test_left_to_right_no_precedence(task):
    p = Problem("7+3*2-5=?\n", "15")
    assert task.gold_completion(p) == "7+3=10\n10*2=20\n20-5=15\nA:15"
    assert task.verify(p, task.gold_completion(p)).reward == 1.0


def test_division_is_exact_only():
    assert apply_op(12, "/", 4) == 3
    assert apply_op(12, "/", 5) is None and apply_op(3, "/", 0) is None
    t = get_task("arithmetic", operators="*/", num_steps=3)
    for p in t.train_problems(100, seed=0):
        assert t.verify(p, t.gold_completion(p)).reward == 1.0


def test_train_and_eval_are_disjoint(task):
    train = {p.prompt for p in task.train_problems(3000, seed=0)}
    evals = task.eval_problems(300, seed=0)
    assert len({p.prompt for p in evals}) == 300  # distinct
    assert train.isdisjoint(p.prompt for p in evals)
    assert all(task.is_eval_prompt(p.prompt) for p in evals)
    assert not any(task.is_eval_prompt(p) for p in train)
    # The split depends on the problem-set seed.
    other = get_task("arithmetic", seed=1)
    assert [other.is_eval_prompt(p.prompt) for p in evals].count(True) < 150


def test_too_small_a_space_is_a_clear_error():
    t = get_task("arithmetic", num_steps=1, operators="+", max_operand=2, max_value=9)
    with pytest.raises(ValueError, match="distinct held-out problems"):
        t.eval_problems(50, seed=0)


# -- gold text --------------------------------------------------------------------------------


def test_gold_and_truncated_gold(task, problems):
    for p in problems:
        gold = task.gold_completion(p)
        lines = gold.split("\n")
        assert len(lines) == 5 and lines[-1] == task.render_answer(p.answer) == f"A:{p.answer}"
        assert not gold.endswith("\n")
        assert task.verify(p, gold) == Verdict(1.0, p.answer, -1, "correct", 4)
        for k in range(5):
            cut = task.truncated_gold(p, k)
            assert cut == task.gold_completion(p, num_steps_shown=k)
            assert cut.split("\n") == lines[:k] + [lines[-1]]
            v = task.verify(p, cut)
            assert (v.reward, v.answer, v.num_steps) == (1.0, p.answer, k)
            assert v.first_error_step == (k if k < 4 else -1)  # a missing step is wrong
    with pytest.raises(ValueError, match=r"k must be in \[0, 4\]"):
        task.truncated_gold(problems[0], 5)
    assert task.gold_completion(Problem("what is 2+2?", "4")) is None


# -- verifier ---------------------------------------------------------------------------------


def test_injected_errors_are_localised_at_every_step(task, problems):
    rng = random.Random(0)
    for p in problems:
        for step in range(5):  # 4 = the answer line itself
            bad = task.inject_error(p, step, rng)
            v = task.verify(p, bad)
            assert v.reward == 0.0, (p.prompt, bad)
            assert v.first_error_step == step, (p.prompt, bad, v)
            assert v.answer != p.answer and v.num_steps == 4
            lines, gold = bad.split("\n"), task.gold_completion(p).split("\n")
            assert lines[:step] == gold[:step] and lines[step] != gold[step]


def test_injected_error_carries_forward_with_explicit_delta():
    p = Problem("7+3*2-5=?\n", "15")
    assert inject_error(p, 1, delta=1) == "7+3=10\n10*2=21\n21-5=16\nA:16"
    assert inject_error(p, 0, delta=-2) == "7+3=8\n8*2=16\n16-5=11\nA:11"
    with pytest.raises(ValueError, match="leaves the final answer unchanged"):
        inject_error(Problem("3+4*0=?\n", "0"), 0, delta=1)
    with pytest.raises(ValueError, match="step must be in"):
        inject_error(p, 4)


def test_step_checks_each_kind_of_mistake(task):
    p = Problem("7+3*2-5=?\n", "15")
    cases = {
        "7+3=10\n10*2=20\n20-5=15\nA:15": (1.0, -1),
        "7+3=10\n11*2=22\n22-5=17\nA:17": (0.0, 1),  # does not continue from 10
        "7+3=10\n10+2=12\n12-5=7\nA:7": (0.0, 1),  # wrong operator
        "7+3=10\n10*3=30\n30-5=25\nA:25": (0.0, 1),  # wrong operand
        "3+7=10\n10*2=20\n20-5=15\nA:15": (
            1.0,
            0,
        ),  # not from the first operand; answer still right
        "7+3=10\n10*2=20\nA:20": (0.0, 2),  # missing step, wrong answer
        "7+3=10\n10*2=20\n20-5=15\nhmm\nA:15": (1.0, 3),  # extra garbage line
        "7+3=10\n\n10*2=20\n20-5=15\nA:15": (1.0, 1),  # blank line is an extra line
        "7+3=10\n10*2=20\n20-5=15\nA:14": (0.0, 3),  # every step right, answer wrong
        "7+3=10\n10*2=20\n20-5=15": (0.0, 3),  # no answer line
        "7+3=10\n10*2=20\n20-5=15\nA:15\n": (1.0, -1),  # trailing whitespace is ignored
        "7+3=10\n10*2=20\n20-5=15\nA:015": (1.0, -1),  # leading zero: same integer
    }
    for text, (reward, first) in cases.items():
        v = task.verify(p, text)
        assert (v.reward, v.first_error_step) == (reward, first), (text, v)


@pytest.mark.parametrize(
    "text, reason",
    [
        ("", "empty completion"),
        ("   \n\n ", "empty completion"),
        ("garbage !@#", "no answer line"),
        ("7+3=10\n10*2=20", "no answer line"),
        ("A:16", "wrong answer 16"),
        ("A: 15", "malformed answer line"),
        (" A:15", "no answer line"),
        ("7 + 3 = 10\n10 * 2 = 20\n20 - 5 = 15\nA: 15", "malformed answer line"),
        ("7+3=10\n10*2=20\n20-5=15\nA:fifteen", "malformed answer line"),
        ("7+3=10\n10*2=20\n20-5=15\nA:15.0", "malformed answer line"),
        ("7+3=10\n10*2=20\n20-5=15\nA:" + "9" * 5000, "malformed answer line"),
        ("7+3=10\n10*2=20\n20-5=15\nA:15\n7+3=10", "text after the answer line"),
        ("A:", "malformed answer line"),
    ],
)
def test_malformed_outputs_score_zero_with_a_reason(task, text, reason):
    v = task.verify(Problem("7+3*2-5=?\n", "15"), text)
    assert v.reward == 0.0
    assert reason in v.reason
    assert v.first_error_step is not None and v.first_error_step >= 0


def test_answer_only_counts_the_answer(task):
    p = Problem("7+3*2-5=?\n", "15")
    v = task.verify(p, "A:15")
    assert (v.reward, v.answer, v.first_error_step, v.num_steps) == (1.0, "15", 0, 0)


def test_foreign_prompt_checks_answer_only(task):
    v = task.verify(Problem("How much is 2 and 2?", "4"), "think\nA:4")
    assert (v.reward, v.first_error_step) == (1.0, None)
    v = task.verify(Problem("x", "not a number"), "A:4")
    assert v.reward == 0.0 and "not an integer" in v.reason


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_verifier_never_raises_on_arbitrary_text(text):
    t = ArithmeticTask()
    v = t.verify(Problem("7+3*2-5=?\n", "15"), text)
    assert v.reward in (0.0, 1.0) and isinstance(v.reason, str) and v.reason
    v2 = t.verify(Problem(text, "15"), text)  # even a garbage problem
    assert v2.reward in (0.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(["7+3=10", "10*2=20", "20-5=15", "A:15", "A:", "", " ", "x", "-1-1=-2"]),
        max_size=8,
    )
)
def test_verifier_never_raises_on_near_miss_lines(lines):
    v = ArithmeticTask().verify(Problem("7+3*2-5=?\n", "15"), "\n".join(lines))
    assert v.reward in (0.0, 1.0) and v.first_error_step is not None
