"""Evaluation: how often the policy solves held-out problems when it decodes greedily (the
``eval_accuracy`` of ``rredcot train`` and ``rredcot sft``), scored by the task's verifier."""

from __future__ import annotations

import torch

from rredcot.sampling.rollout import render_prompt, sample
from rredcot.tasks.base import Problem, Task, checked_verify


@torch.no_grad()
def greedy_accuracy(
    policy,
    tokenizer,
    task: Task,
    problems: list[Problem],
    max_new_tokens: int,
    batch_size: int = 64,
    decoder: str = "auto",
) -> float:
    """Fraction of problems the policy solves with greedy decoding (``decoder``: the sampling
    loop, ``rollout.resolve_decoder``)."""
    if not problems:
        raise ValueError("evaluation set is empty")
    was_training = policy.training
    policy.eval()
    correct = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        prompts = [render_prompt(p, tokenizer) for p in chunk]
        input_ids, _, P, response_mask = sample(
            policy,
            tokenizer,
            prompts,
            num_generations=1,
            max_new_tokens=max_new_tokens,
            greedy=True,
            decoder=decoder,
        )
        for row, problem in enumerate(chunk):
            length = int(response_mask[row].sum())
            text = tokenizer.decode(input_ids[row, P : P + length], skip_special_tokens=True)
            verdict, ok = checked_verify(task, problem, text)
            correct += float(verdict.reward) if ok else 0.0
    policy.train(was_training)
    return correct / len(problems)


def greedy_accuracy_over_processes(
    policy, tokenizer, task: Task, problems: list[Problem], max_new_tokens: int, collective, **kw
) -> float:
    """:func:`greedy_accuracy` with ``problems`` split over the processes: each solves its
    share and the solved counts are summed (``collective``:
    :class:`rredcot.methods.processes.Collective`). On one process, :func:`greedy_accuracy`."""
    if collective.world == 1:
        return greedy_accuracy(policy, tokenizer, task, problems, max_new_tokens, **kw)
    if not problems:
        raise ValueError("evaluation set is empty")
    n, world, rank = len(problems), collective.world, collective.rank
    share = problems[rank * n // world : (rank + 1) * n // world]
    solved = 0.0
    if share:
        solved = greedy_accuracy(policy, tokenizer, task, share, max_new_tokens, **kw) * len(share)
    return collective.sum([solved])[0] / n
