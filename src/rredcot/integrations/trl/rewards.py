"""Rewards: TRL reward functions from rredcot tasks (:func:`task_reward`), a dataset row as a
task's problem, and each completion's outcome ``R`` from TRL's reward functions. No TRL import."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from rredcot.integrations._batch import prompt_text
from rredcot.tasks import get_task
from rredcot.tasks.answers import extract_reference
from rredcot.tasks.base import Problem, Task, safe_verify

__all__ = [
    "completion_text",
    "outcome_rewards",
    "problem_of_row",
    "reference_answer",
    "task_reward",
]


def completion_text(completion: Any) -> str:
    """A TRL completion's text (a string, or a conversational list of messages)."""
    if isinstance(completion, list):  # conversational: [{"role": "assistant", "content": ...}]
        return "".join(str(m.get("content", "")) for m in completion if isinstance(m, dict))
    return str(completion)


def reference_answer(task: Task | None, answer: Any) -> str:
    """The reference answer in a dataset row's ``answer`` cell, as the task's verifier and the
    answer-likelihood probes need it: GSM8K's native column (the reasoning, then ``#### 72``)
    gives ``72``, a ``\\boxed{}`` solution its box (the task's ``answer_format``); a cell that holds
    the bare answer is returned as it is."""
    text = str(answer)
    fmt = getattr(getattr(task, "params", None), "answer_format", None)
    if not fmt:
        return text
    return extract_reference(text, fmt) or text


def task_reward(task: str | Task, answer_column: str = "answer", **task_args: Any):
    """A TRL reward function that scores completions with an rredcot task's verifier.

    The dataset needs a ``prompt`` column and an ``answer_column`` with each reference answer:
    the bare answer, or the task's native solution (GSM8K's ``answer`` column as it comes, ending
    in ``#### 72``: :func:`reference_answer`). Verifier errors score 0 (``safe_verify``).
    """
    the_task = get_task(task, **task_args) if isinstance(task, str) else task

    def reward(prompts, completions, **kwargs) -> list[float]:
        if answer_column not in kwargs:
            raise ValueError(
                f"the dataset has no {answer_column!r} column with the reference answers "
                f"(columns seen: {sorted(k for k in kwargs if not k.startswith('trainer'))})"
            )
        answers = kwargs[answer_column]
        return [
            float(
                safe_verify(
                    the_task,
                    Problem(prompt_text(p), reference_answer(the_task, a)),
                    completion_text(c),
                ).reward
            )
            for p, c, a in zip(prompts, completions, answers)
        ]

    reward.__name__ = f"rredcot_{the_task.name}"
    return reward


def problem_of_row(row: dict, task: Task | None, answer_column: str) -> Problem:
    """A dataset row as ``task``'s :class:`Problem`: the prompt's text, the reference answer,
    and the answer cell as the reference solution where it holds more than the answer
    (GSM8K's worked solution: continuation likelihood's reference)."""
    cell = str(row.get(answer_column, ""))
    answer = reference_answer(task, cell)
    meta = {"solution": cell} if cell != answer else {}
    return Problem(prompt_text(row.get("prompt", "")), answer, meta)


def outcome_rewards(
    rewards_per_func: Tensor, reward_weights: Tensor, num_generations: int
) -> tuple[Tensor, Tensor]:
    """``(R (N,), unscorable (N,) bool)`` of every process's rows: the weighted sum of the reward
    functions (TRL's ``sum_then_normalize`` before scaling). Unscorable rows (every function
    returned None) get their group's mean, so they move no group statistic."""
    weights = reward_weights.to(rewards_per_func.device).unsqueeze(0)
    rewards = (rewards_per_func * weights).nansum(dim=1)
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    rewards[unscorable] = torch.nan
    groups = rewards.float().view(-1, num_generations)
    mean = torch.nanmean(groups, dim=1, keepdim=True).nan_to_num(0.0)
    filled = torch.where(torch.isnan(groups), mean.expand_as(groups), groups)
    return filled.view(-1), unscorable
