"""Generic tensors from another trainer -> a :class:`~rredcot.methods.base.RolloutBatch`.

TRL and verl both hand over the same things: left-padded prompt ids, right-padded completion ids
with a mask, one outcome reward per completion and a prompt-group id. This module decodes each
completion with token offsets, segments it with :mod:`rredcot.segment` and fills a
``RolloutBatch`` exactly as :func:`rredcot.sampling.rollout.build_rollout_batch` does for rredcot's own
loop (a trailing EOS joins the last segment), so every credit method sees the same batch whichever
trainer sampled it. Nothing here knows about TRL or verl.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from rredcot.sampling.batch import RolloutBatch, segment_layout
from rredcot.segment import Segmenter, segment_completion
from rredcot.tasks.base import Problem, Verdict

__all__ = [
    "METRICS_PREFIX",
    "group_ids_from_keys",
    "prompt_text",
    "rollout_batch_from_tensors",
    "segment_completions",
    "span_mask",
]

METRICS_PREFIX = "rredcot/"  # every metric an adapter logs: rredcot/<the core's key>


def _eos_set(tokenizer, eos_token_ids: Sequence[int] | int | None) -> set[int]:
    if eos_token_ids is None:
        eos_token_ids = tokenizer.eos_token_id
    if eos_token_ids is None:
        return set()
    if isinstance(eos_token_ids, int):
        return {eos_token_ids}
    return {int(i) for i in eos_token_ids}


def segment_completions(
    completion_ids: Tensor,
    completion_mask: Tensor,
    tokenizer,
    segmenter: Segmenter,
    eos_token_ids: Sequence[int] | int | None = None,
) -> tuple[list[list[int]], list[list[int]], list[str]]:
    """Decode and segment each completion.

    Args:
        completion_ids: ``(B, T)`` right-padded generated ids.
        completion_mask: ``(B, T)`` 1 on real tokens (EOS included), a prefix of each row.
        tokenizer: the policy's fast tokenizer.
        segmenter: how to cut the decoded text.
        eos_token_ids: ids that end a completion (default: ``tokenizer.eos_token_id``); a trailing
            one is not decoded and joins the last segment.

    Returns:
        ``(boundaries, char_starts, texts)``: per row the token boundaries ``[0, b_1, ..., T_b]``
        (``[0]`` for an empty completion), the character start of each segment in the text, and
        the decoded text (special tokens skipped).
    """
    if completion_ids.dim() != 2 or completion_ids.shape != completion_mask.shape:
        raise ValueError(
            f"completion_ids and completion_mask must both be (B, T); got "
            f"{tuple(completion_ids.shape)} and {tuple(completion_mask.shape)}"
        )
    eos = _eos_set(tokenizer, eos_token_ids)
    lengths = completion_mask.bool().sum(-1).tolist()
    ids_rows = completion_ids.tolist()
    boundaries, char_starts, texts = [], [], []
    for row, length in enumerate(lengths):
        bounds, starts, text = segment_completion(
            segmenter, tokenizer, ids_rows[row][:length], eos_ids=sorted(eos)
        )
        boundaries.append(bounds)
        char_starts.append(starts)
        texts.append(text)
    return boundaries, char_starts, texts


def prompt_text(prompt: Any) -> str:
    """The user text of a standard (str) or conversational (list of messages) prompt."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)) or hasattr(prompt, "tolist"):
        prompt = list(prompt.tolist() if hasattr(prompt, "tolist") else prompt)
        users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
        content = (users or prompt)[-1].get("content", "") if (users or prompt) else ""
        if isinstance(content, list):  # multimodal content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return str(content)
    return str(prompt)


def group_ids_from_keys(keys: Sequence) -> Tensor:
    """``(B,)`` long group ids from any hashable per-row keys (verl's ``uid`` strings, prompt
    indices), numbered in order of first appearance."""
    index: dict = {}
    return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long)


def rollout_batch_from_tensors(
    *,
    completion_ids: Tensor,
    completion_mask: Tensor,
    rewards: Tensor,
    group_ids: Tensor,
    tokenizer,
    segmenter: Segmenter,
    prompt_ids: Tensor | None = None,
    prompt_mask: Tensor | None = None,
    eos_token_ids: Sequence[int] | int | None = None,
    problems: list[Problem] | None = None,
    verdicts: list[Verdict] | None = None,
    hidden_states: Tensor | None = None,
    old_logprobs: Tensor | None = None,
) -> RolloutBatch:
    """Build a segmented ``RolloutBatch`` from a trainer's tensors.

    Args:
        completion_ids: ``(B, T)`` right-padded response ids; completion_mask: ``(B, T)``.
        rewards: ``(B,)`` outcome rewards (finite); group_ids: ``(B,)`` integer prompt groups.
        tokenizer, segmenter, eos_token_ids: see :func:`segment_completions`.
        prompt_ids: ``(B, P)`` left-padded prompt ids with ``prompt_mask (B, P)``; ``None`` gives
            a zero-width prompt (enough for methods that do not read the prompt, e.g. values
            computed elsewhere).
        problems, verdicts: per row, when the caller has them (answer likelihood reads them).
        hidden_states: ``(B, P+T, D)`` from a no-grad forward over ``[prompt | completion]``.
        old_logprobs: ``(B, T)``.

    Returns:
        the batch; ``response_mask`` is ``completion_mask`` as float.
    """
    B, T = completion_ids.shape
    device = completion_ids.device
    if rewards.shape != (B,) or group_ids.shape != (B,):
        raise ValueError(
            f"rewards and group_ids must be (B,) = ({B},); got {tuple(rewards.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if not bool(torch.isfinite(rewards).all()):
        raise ValueError("rewards must be finite; give unscorable completions a reward (e.g. 0)")
    if prompt_ids is None:
        prompt_ids = completion_ids.new_zeros(B, 0)
        prompt_mask = completion_mask.new_zeros(B, 0)
    elif prompt_mask is None or prompt_mask.shape != prompt_ids.shape or prompt_ids.shape[0] != B:
        raise ValueError("prompt_ids and prompt_mask must both be (B, P) with the completions' B")
    boundaries, char_starts, texts = segment_completions(
        completion_ids, completion_mask, tokenizer, segmenter, eos_token_ids
    )
    response_mask = completion_mask.to(device=device, dtype=torch.float)
    input_ids = torch.cat([prompt_ids.to(device), completion_ids], dim=1)
    attention_mask = torch.cat(
        [prompt_mask.to(device=device, dtype=torch.long), completion_mask.to(torch.long)], dim=1
    )
    for name, rows in (("problems", problems), ("verdicts", verdicts)):
        if rows is not None and len(rows) != B:
            raise ValueError(f"{name} must have one entry per row ({B}), got {len(rows)}")
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_len=prompt_ids.shape[1],
        response_mask=response_mask,
        rewards=rewards.to(device=device, dtype=torch.float),
        group_ids=group_ids.to(device=device, dtype=torch.long),
        boundaries=boundaries,
        segment_ids=segment_layout(boundaries, response_mask)[0],
        segment_char_starts=char_starts,
        problems=list(problems or []),
        completions=texts,
        verdicts=list(verdicts or []),
        old_logprobs=old_logprobs,
        hidden_states=hidden_states,
    )


def span_mask(response_mask: Tensor) -> Tensor:
    """``(B, T)`` 1 on every token up to each row's last real token: a multi-turn response whose
    mask has holes (tool outputs the policy did not write) is one contiguous text, and the holes
    are part of the states ``s_k``."""
    mask = response_mask.bool()
    T = mask.shape[1]
    cols = torch.arange(T, device=mask.device).unsqueeze(0)
    last = torch.where(mask, cols, torch.full_like(cols, -1)).max(dim=1, keepdim=True).values
    return (cols <= last).to(response_mask.dtype)
