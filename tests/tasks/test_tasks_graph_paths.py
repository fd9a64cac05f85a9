"""graph_paths: layered graphs in the prompt, several right moves per step, dead ends, and the
first move after which the target is out of reach as ``first_error_step``."""

from __future__ import annotations

import pytest

from rredcot.config import SFTConfig
from rredcot.tasks import get_task
from rredcot.tasks.graph_paths import live_nodes, parse_prompt
from rredcot.training import sft


@pytest.fixture(scope="module")
def task():
    return get_task("graph_paths")


def test_gold_traces_are_right_and_problems_deterministic(task):
    problems = task.train_problems(200, seed=1)
    assert [p.prompt for p in problems[:5]] == [p.prompt for p in task.train_problems(5, seed=1)]
    for p in problems:
        gold = task.gold_completion(p)
        verdict = task.verify(p, gold)
        assert (verdict.reward, verdict.first_error_step) == (1.0, -1), (p.prompt, gold)
        assert verdict.num_steps == task.params.num_steps
        assert len(p.prompt) + len(gold) + 2 < 256  # fits the tiny model's context
    assert len(gold) < task.suggested_max_new_tokens()
    held_out = task.eval_problems(50, seed=1)
    assert len({p.prompt for p in held_out}) == 50
    assert not {p.prompt for p in held_out} & {p.prompt for p in problems}
    assert all(task.is_eval_prompt(p.prompt) for p in held_out)


def test_several_right_moves_and_dead_ends_per_problem(task):
    """The point of the task: right steps are uncertain and wrong ones irrecoverable."""
    problems = task.train_problems(200, seed=2)
    choices = traps = 0
    for p in problems:
        edges, start, target = parse_prompt(p.prompt)
        live = live_nodes(edges, target)
        for node in live - {target}:
            right = [s for s in edges[node] if s in live]
            choices += len(right) > 1
            traps += len(right) < len(edges[node])
    assert choices > 200 and traps >= 2 * 200


def test_first_error_is_the_move_into_a_dead_end(task):
    for p in task.train_problems(300, seed=3):
        edges, start, target = parse_prompt(p.prompt)
        live = live_nodes(edges, target)
        gold = task.gold_steps(p)
        i = next(
            (k for k, line in enumerate(gold) if any(s not in live for s in edges[line[0]])), None
        )
        if i is None:
            continue
        node = gold[i][0]
        dead = [s for s in edges[node] if s not in live]
        # right up to line i, then a move into a dead end, then whatever is possible
        prefix = [*gold[:i], f"{node}>{dead[0]}"]
        node = dead[0]
        while edges[node]:
            prefix.append(f"{node}>{edges[node][0]}")
            node = edges[node][0]
        verdict = task.verify(p, "\n".join([*prefix, f"A:{node}"]))
        assert (verdict.reward, verdict.first_error_step) == (0.0, i), verdict.reason
        assert "cannot reach" in verdict.reason
        return
    pytest.fail("no problem with a dead end next to the gold path")


def test_malformed_traces(task):
    p = task.train_problems(1, seed=4)[0]
    gold = task.gold_steps(p)
    edges, start, target = parse_prompt(p.prompt)
    answer = f"A:{target}"
    cases = {
        "": 0,  # nothing: the first move is missing
        "\n".join(gold): len(gold),  # no answer line
        "\n".join([*gold, "A:" + ("z" if target != "z" else "y")]): len(gold),  # wrong answer
        "\n".join([*gold[:-1], answer]): len(gold) - 1,  # a move missing
        "\n".join([*gold, gold[-1], answer]): len(gold),  # an extra move
        "\n".join(["x-y", *gold[1:], answer]): 0,  # not a move
        "\n".join([gold[1], *gold[1:], answer]): 0,  # not from the start
    }
    non_edge = next(c for c in "abcdefghijklmnopqrstuvwxyz" if c not in edges[start])
    cases["\n".join([f"{start}>{non_edge}", *gold[1:], answer])] = 0
    for text, first in cases.items():
        verdict = task.verify(p, text)
        assert verdict.reward == 0.0 and verdict.first_error_step == first, (text, verdict)
    assert task.verify(p, "\n".join([*gold, answer]) + "\n ").reward == 1.0
    assert task.verify(p, None).reward == 0.0


def test_params_are_checked():
    with pytest.raises(ValueError, match="26 letters"):
        get_task("graph_paths", num_steps=9, width=3)
    with pytest.raises(ValueError, match="max_branching"):
        get_task("graph_paths", width=2, max_branching=3)
    with pytest.raises(ValueError, match="width must be >= 2"):
        get_task("graph_paths", width="1")


def test_default_warmstarts_take_the_task_settings_then_the_preset(monkeypatch, tmp_path):
    built: list[SFTConfig] = []
    monkeypatch.setattr(sft, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(sft, "run_sft", lambda cfg, log=print: built.append(cfg))
    graph = get_task("graph_paths")
    arithmetic = get_task("arithmetic", num_steps=12)
    sft.default_policy_source(graph, log=lambda *a: None)  # graph_paths runs the tiny model
    sft.default_warmstart(arithmetic, log=lambda *a: None)
    sft.default_warmstart(graph, log=lambda *a: None, preset="low")
    settings = [
        (c.task, c.target_accuracy, c.max_accuracy, c.stop_at_step, c.max_new_tokens) for c in built
    ]
    assert settings == [
        ("graph_paths", 0.3, 0.6, 0, graph.suggested_max_new_tokens()),
        ("arithmetic", 0.5, 0.75, 0, 136),
        ("graph_paths", 0.3, 0.6, 450, graph.suggested_max_new_tokens()),
    ]
    assert len({c.out for c in built}) == 3  # each cached on its own
    # the 12-step chains' low warm-start ships: nothing is built for it
    shipped = sft.default_warmstart(arithmetic, log=lambda *a: None, preset="low")
    assert shipped.parent == sft.SHIPPED_WARMSTARTS and len(built) == 3
    with pytest.raises(ValueError, match="unknown warm-start preset 'mid'; valid: edge, low"):
        sft.default_warmstart(arithmetic, preset="mid")
