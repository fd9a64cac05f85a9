"""First-error localisation scores: line -> segment mapping, fair ties, chance level."""

import math

import torch

from rredcot.algebra.localisation import (
    blame_hit,
    chance_error_acc,
    error_segment,
    localisation_scores,
)


def test_error_line_maps_to_the_segment_holding_it():
    text = "1+2=3\n3*4=13\n13-1=12\nA:12"
    starts = [0, 6, 13]  # answer merged into the last segment
    assert error_segment(text, 1, starts) == 1
    assert error_segment(text, 3, starts) == 2  # the answer line lives in the last segment
    assert error_segment(text, -1, starts) is None
    assert error_segment(text, None, starts) is None


def test_ties_are_shared_so_uniform_credit_scores_chance():
    assert blame_hit(torch.tensor([-1.0, -1.0, -1.0]), 0) == 1 / 3
    assert blame_hit(torch.tensor([-2.0, -1.0, 0.0]), 0) == 1.0
    assert blame_hit(torch.tensor([-2.0, -1.0, 0.0]), 1) == 0.0


def test_scores_on_a_small_batch():
    texts = ["a\nb\nc", "a\nb\nc", "a\nb"]
    starts = [[0, 2, 4], [0, 2, 4], [0, 2]]
    adv = torch.tensor([[0.0, -1.0, 0.2], [-0.5, -0.5, -0.5], [0.3, 0.1, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    rewards = torch.tensor([0.0, 0.0, 1.0])
    scores = localisation_scores(adv, mask, texts, rewards, [1, 2, -1], starts)
    assert scores["n_wrong"] == 2 and scores["n_correct"] == 1
    assert math.isclose(scores["error_acc"], (1.0 + 1 / 3) / 2)
    assert scores["correct_acc"] == 1.0
    assert math.isclose(chance_error_acc(mask, rewards), 1 / 3, rel_tol=1e-6)
