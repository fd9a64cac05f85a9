"""``rredcot explain``: the demo, and ``--checkpoint`` on a real (tiny) training run."""

from __future__ import annotations

import argparse
import html
import re

import pytest
import torch

from helpers import make_rollout_batch
from rredcot.cli.commands import main
from rredcot.explain.model import (
    _reference_answer,
    explain_checkpoint,
    resolve_checkpoint,
    segment_credits,
    segment_texts,
)


@pytest.fixture(scope="module")
def run_dir(init_dir, tmp_path_factory):
    """A one-step value-head run on 2-step arithmetic, segmented every 4 tokens."""
    from rredcot.config import TrainConfig
    from rredcot.training.trainer import Trainer

    out = tmp_path_factory.mktemp("explain") / "run"
    cfg = TrainConfig(
        init=str(init_dir),
        out=str(out),
        task_args={"num_steps": 2},
        credit_method="value_head",
        steps=1,
        prompts_per_step=2,
        eval_size=2,
        progress=False,
    )
    cfg.sampling.num_generations = 3
    cfg.sampling.max_new_tokens = 12
    cfg.credit.segmenter = "tokens:4"
    Trainer(cfg, log=lambda *_: None).train()
    return out


def _args(checkpoint, **kw) -> argparse.Namespace:
    base = dict(
        checkpoint=str(checkpoint),
        prompt=None,
        method="value_head",
        run=None,
        html=None,
        samples=4,
        seed=0,
        task_name=None,
        answer=None,
        no_color=True,
    )
    base.update(kw)
    return argparse.Namespace(**base)


def test_resolve_checkpoint_accepts_model_checkpoint_and_run_dirs(init_dir, run_dir, tmp_path):
    ckpt = run_dir / "checkpoints" / "step_000001"
    r = resolve_checkpoint(run_dir)
    assert (r.policy_dir, r.checkpoint_dir, r.run_dir) == (ckpt / "policy", ckpt, run_dir)
    assert resolve_checkpoint(ckpt).run_dir == run_dir
    assert resolve_checkpoint(ckpt / "policy").checkpoint_dir == ckpt
    plain = resolve_checkpoint(init_dir)
    assert (plain.policy_dir, plain.checkpoint_dir, plain.run_dir) == (init_dir, None, None)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_checkpoint(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="neither a model directory"):
        resolve_checkpoint(tmp_path)


def test_explain_checkpoint_writes_html_with_every_segment(run_dir, tmp_path, capsys):
    page = tmp_path / "credit.html"
    argv = ["explain", "--checkpoint", str(run_dir), "--samples", "4", "--no-color"]
    assert main(argv + ["--html", str(page)]) == 0
    printed = capsys.readouterr().out
    assert "head from" in printed and f"wrote {page}" in printed
    sections = explain_checkpoint(_args(run_dir), {})  # the same seed: the same samples
    text = page.read_text()
    assert text.startswith("<!doctype html>")
    correct = int(re.search(r"\((\d+) correct\)", sections[0][0]).group(1))
    # a group whose samples agree shows every sample; otherwise one right and one wrong one
    assert len(sections) == (4 if correct in (0, 4) else 2)
    for title, prompt, segments in sections:
        assert html.escape(title) in text and html.escape(prompt) in text
        assert len(segments) >= 2  # tokens:4 from the run's config
        for s in segments:
            assert html.escape(s.text) in text
        # the numbers are the credit algebra's: r_k telescopes to R - V(s_0), V(s_n) = R
        reward = float(title.split("R = ")[1].split(",")[0])
        assert segments[-1].value_after == reward
        assert sum(s.reward for s in segments) == pytest.approx(reward - segments[0].value_before)
        for a, b in zip(segments, segments[1:]):
            assert a.value_after == b.value_before
    # the trained head (one step of updates) no longer predicts its neutral initial 0.5
    assert any(abs(s.value_before - 0.5) > 1e-6 for _, _, segs in sections for s in segs)


def test_explain_untrained_head_warns_and_predicts_neutral_values(init_dir, capsys):
    sections = explain_checkpoint(_args(init_dir, samples=2), {"num_steps": "2"})
    assert "untrained" in capsys.readouterr().err
    values = [s.value_before for _, _, segs in sections for s in segs]
    # A zero-initialised last layer predicts 0.5 everywhere: no increments, so the values shown
    # (anchored on the group's mean reward, as the credit uses them) are that mean throughout.
    total, correct = map(int, re.search(r"of (\d+) \((\d+) correct\)", sections[0][0]).groups())
    assert values and all(v == pytest.approx(correct / total) for v in values)


def test_explain_free_prompt_gets_its_reference_answer(init_dir, capsys):
    from rredcot.tasks import get_task

    assert _reference_answer(get_task("arithmetic"), "3+4*2=?") == ("3+4*2=?\n", "14")
    assert _reference_answer(get_task("arithmetic"), "hello") == ("hello", "")
    argv = ["explain", "--checkpoint", str(init_dir), "--method", "uniform", "--samples", "2"]
    assert main(argv + ["--prompt", "3+4*2=?", "--no-color"]) == 0
    captured = capsys.readouterr()
    assert "prompt: 3+4*2=?" in captured.out and "uniform: sample" in captured.out
    assert "no reference answer" not in captured.err


def test_segment_credits_by_hand(tiny_policy, char_tokenizer, arithmetic_task):
    batch = make_rollout_batch(
        tiny_policy,
        char_tokenizer,
        arithmetic_task,
        num_prompts=1,
        num_generations=2,
        segmenter="tokens:5",
        max_new_tokens=16,
    )
    row = 0
    n = len(batch.boundaries[row]) - 1
    assert n >= 2
    assert "".join(segment_texts(batch, row)) == batch.completions[row]
    S = max(len(b) - 1 for b in batch.boundaries)
    values = torch.zeros(batch.size, S + 1)
    values[row, : n + 1] = torch.linspace(0.1, 0.9, n + 1)
    mask = torch.arange(S + 1).unsqueeze(0) <= batch.num_segments.unsqueeze(1)
    adv = torch.arange(batch.size * S, dtype=torch.float).view(batch.size, S)
    segs = segment_credits(batch, row, adv, values, mask)
    R = float(batch.rewards[row])
    expected_v = torch.linspace(0.1, 0.9, n + 1).tolist()[:n] + [R]
    for k, s in enumerate(segs):
        assert s.value_before == pytest.approx(expected_v[k])
        assert s.value_after == pytest.approx(expected_v[k + 1])
        assert s.reward == pytest.approx(expected_v[k + 1] - expected_v[k])
        assert s.advantage == float(adv[row, k])
    plain = segment_credits(batch, row, adv)  # no values: the credit is shown as r_k and A_k
    assert [s.value_before for s in plain] == [None] * n
    assert [s.reward for s in plain] == adv[row, :n].tolist()


def test_explain_demo_html(tmp_path, capsys):
    page = tmp_path / "demo.html"
    assert main(["explain", "--demo", "--no-color", "--html", str(page)]) == 0
    assert "sum of r_k" in capsys.readouterr().out
    assert "Where the credit went" in page.read_text()


@pytest.mark.parametrize("lam", [0.0, 0.3, 1.0])
def test_explain_values_match_the_credit_algebra(lam):
    """The demo's plain-Python credit is credit.segment_advantages_from_values, exactly."""
    from rredcot.algebra.credit import segment_advantages_from_values
    from rredcot.explain.pictures import explain_values

    text = "a=1\nb=2\nc=3\nA:3"  # three segments: the A: line merges into the last step
    values = [0.5, 0.7, 0.2]
    segments = explain_values(text, values, reward=0.0, lam=lam)
    v = torch.tensor([values + [0.0]], dtype=torch.float64)
    adv, _, rewards = segment_advantages_from_values(
        v, torch.ones_like(v, dtype=torch.bool), torch.tensor([0.0], dtype=torch.float64), lam
    )
    assert [s.text for s in segments] == ["a=1\n", "b=2\n", "c=3\nA:3"]
    assert [s.reward for s in segments] == rewards[0].tolist()
    assert [s.advantage for s in segments] == adv[0].tolist()
    assert [s.value_before for s in segments] == values
    assert [s.value_after for s in segments] == [0.7, 0.2, 0.0]
    with pytest.raises(ValueError, match=r"lam must be a float in \[0, 1\]"):
        explain_values(text, values, reward=0.0, lam=1.5)


def test_html_leaves_a_zero_advantage_segment_unshaded():
    from rredcot.explain.pictures import SegmentCredit, render_html

    page = render_html(
        [
            (
                "t",
                "p",
                [
                    SegmentCredit("up\n", 0.5, 0.6, 0.1, 0.4),
                    SegmentCredit("zero\n", 0.6, 0.6, 0.0, 0.0),
                    SegmentCredit("down", 0.6, 0.0, -0.6, -0.4),
                ],
            )
        ]
    )
    shade = dict(
        re.findall(r"background:([^']+)' title='[^']*'>([^<]*)<", page)[i][::-1] for i in range(3)
    )
    assert shade["zero\n"] == "transparent"
    assert shade["up\n"].startswith("rgba(46,160,67") and shade["down"].startswith("rgba(218,54,51")


def test_explain_all_wrong_group_shows_every_sample_with_r_normaliser_and_w(init_dir):
    """A group whose samples are all wrong: every sample, each with its R, what its credit is
    divided by and the hand-over weight, and each segment's token advantage beside A_k."""
    args = _args(init_dir, samples=3, prompt="3+4*2=?", answer="never")
    sections = explain_checkpoint(args, {"num_steps": "2"})
    assert len(sections) == 3
    for title, _, segments in sections:
        assert "(0 correct)" in title and "R = 0" in title
        assert "normaliser: group std 0.000 < credit.agreeing_std 0.1" in title
        assert "w = 0.00" in title  # an untrained head earned no trust: GRPO's credit, 0 here
        assert all(s.scaled == 0.0 for s in segments)
    page = __import__("rredcot.explain.pictures", fromlist=["render_html"]).render_html(sections)
    assert "<th>token A</th>" in page and "rgba(46,160,67" not in page  # nothing shaded green


def test_explain_run_without_settings_names_what_is_missing(init_dir, tmp_path, capsys):
    explain_checkpoint(_args(init_dir, samples=2, run=str(tmp_path)), {"num_steps": "2"})
    err = capsys.readouterr().err
    assert "no --run given" not in err
    assert f"--run {str(tmp_path)!r} holds no rredcot run" in err
