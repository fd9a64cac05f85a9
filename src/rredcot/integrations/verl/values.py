"""Boundary values ``V(s_k)`` that verl's driver computes for the estimator: the
answer-likelihood probes, run through the actor's own log-prob computation
(:func:`build_probe_data`, :func:`probe_values`), and the process-reward scores
(:func:`process_reward_values`)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from rredcot.errors import require_extra
from rredcot.integrations._batch import prompt_text, rollout_batch_from_tensors, span_mask
from rredcot.integrations.verl.config import INSTALL_VERL, credit_settings, make_segmenter
from rredcot.integrations.verl.state import method_for
from rredcot.methods.answer_probes import build_probes
from rredcot.sampling.batch import RolloutBatch
from rredcot.segment import Segmenter
from rredcot.tasks.base import Problem

DataProto = require_extra("verl", "verl", "rredcot.integrations.verl", then=INSTALL_VERL).DataProto

__all__ = ["build_probe_data", "probe_values", "process_reward_values"]


def _reference_answers(data, answer_key: str) -> list[str]:
    """Each row's reference answer from ``data.non_tensor_batch``: ``answer_key`` if present,
    else verl's ``reward_model["ground_truth"]``."""
    nt = data.non_tensor_batch
    if answer_key in nt:
        return [str(a) for a in nt[answer_key]]
    if "reward_model" in nt:
        return [str(dict(r).get("ground_truth", "")) for r in nt["reward_model"]]
    raise ValueError(
        f"the reference answers are in neither data.non_tensor_batch[{answer_key!r}] nor "
        "reward_model['ground_truth']; pass answer_key=... naming the column"
    )


def _driver_batch(data, tokenizer, segmenter, eos_token_ids, problems) -> RolloutBatch:
    """A verl ``DataProto``'s prompts and responses as a :class:`RolloutBatch` on the driver,
    segmented as the estimator segments them (rewards and groups are not needed there)."""
    b = data.batch
    prompts, responses = b["prompts"], b["responses"]
    P = prompts.shape[1]
    attention = b["attention_mask"]
    response_mask = b["response_mask"] if "response_mask" in b.keys() else attention[:, P:]  # noqa: SIM118
    B = responses.shape[0]
    return rollout_batch_from_tensors(
        prompt_ids=prompts,
        prompt_mask=attention[:, :P],
        completion_ids=responses,
        completion_mask=span_mask(response_mask),
        rewards=torch.zeros(B),
        group_ids=torch.arange(B),
        tokenizer=tokenizer,
        segmenter=segmenter,
        eos_token_ids=eos_token_ids,
        problems=problems,
    )


def build_probe_data(
    data,
    tokenizer,
    task,
    segmenter: Segmenter,
    *,
    divisor: int = 1,
    answer_key: str = "answer",
    eos_token_ids: Any = None,
):
    """The answer-likelihood probes of a verl batch as a ``DataProto`` for the actor's
    ``compute_log_prob`` (the driver builds it; the workers score it like any rollout).

    For each trace, each boundary ``k < n`` and each reference answer, one row: prompt =
    ``prompt + response[:b_k]`` (left-padded), response = the probe ``render_answer(a) + EOS``
    (right-padded), with ``attention_mask``, ``position_ids`` and ``response_mask``; the probe
    text and layout are the core's (:func:`rredcot.methods.answer_probes.build_probes`).
    Rows are padded to a multiple of ``divisor`` (the actor's data-parallel size) with copies of
    row 0, so verl splits them evenly and every rank runs the same number of forwards.
    ``non_tensor_batch["rredcot_probe"]`` holds ``(row, k)`` (``(-1, -1)`` on padding rows).

    Args:
        data: verl ``DataProto`` with ``prompts`` (left-padded), ``responses``,
            ``attention_mask`` (over prompt + response) and, optionally, ``response_mask``.
        tokenizer, task: the policy's tokenizer; the rredcot task whose ``render_answer`` writes
            the answer line. segmenter: the segmenter of the estimator.
        answer_key: non-tensor column with the reference answers (default ``answer``, else
            ``reward_model["ground_truth"]``).
    """
    answers = _reference_answers(data, answer_key)
    batch = _driver_batch(
        data, tokenizer, segmenter, eos_token_ids, [Problem("", a) for a in answers]
    )
    P, responses, B = batch.prompt_len, data.batch["responses"], batch.size
    probes, _ = build_probes(batch, tokenizer, task, [[a] if a else [] for a in answers])
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    prefixes, probe_ids, keys = [], [], []
    for p in probes:
        keep = batch.attention_mask[p.row, :P].bool()
        prefix = batch.input_ids[p.row, :P][keep].tolist() + responses[p.row, : p.b].tolist()
        prefixes.append(prefix)
        probe_ids.append(list(p.ids))
        keys.append((p.row, p.k))
    if not probes:  # nothing to probe: one dummy row keeps every rank's work equal
        prefixes, probe_ids, keys = [[pad_id]], [[pad_id]], [(-1, -1)]
    while len(prefixes) % max(divisor, 1):
        prefixes.append(prefixes[0])
        probe_ids.append(probe_ids[0])
        keys.append((-1, -1))
    N = len(prefixes)
    Lp = max(len(x) for x in prefixes)
    Lr = max(len(x) for x in probe_ids)
    prompt_t = torch.full((N, Lp), pad_id, dtype=torch.long)
    resp_t = torch.full((N, Lr), pad_id, dtype=torch.long)
    attn = torch.zeros(N, Lp + Lr, dtype=torch.long)
    for i, (pre, ids) in enumerate(zip(prefixes, probe_ids)):
        prompt_t[i, Lp - len(pre) :] = torch.tensor(pre)
        resp_t[i, : len(ids)] = torch.tensor(ids)
        attn[i, Lp - len(pre) : Lp + len(ids)] = 1
    position_ids = (attn.cumsum(dim=1) - 1).clamp(min=0)
    probe_keys = np.empty(N, dtype=object)
    probe_keys[:] = keys
    return DataProto.from_dict(
        tensors={
            "prompts": prompt_t,
            "responses": resp_t,
            "input_ids": torch.cat([prompt_t, resp_t], dim=1),
            "attention_mask": attn,
            "position_ids": position_ids,
            "response_mask": attn[:, Lp:],
        },
        non_tensors={"rredcot_probe": probe_keys},
        meta_info={"rredcot_rows": B},
    )


def probe_values(probe_data, log_probs: Tensor, num_segments: Tensor) -> Tensor:
    """``(B, S+1)`` values ``V(s_k) = min(1, sum_a exp(sum log pi(probe_a | s_k)))`` from the
    actor's log-probs of the probe rows (``compute_log_prob(probe_data)``'s ``old_log_probs``,
    ``(N, R)``). Column ``n_b`` (the outcome, set by the algebra) and padding are 0.

    Args:
        probe_data: what :func:`build_probe_data` returned.
        log_probs: ``(N, R)`` per-token log-probs of its ``responses``.
        num_segments: ``(B,)`` segments per trace (``segment_ids.max(1) + 1``).
    """
    mask = probe_data.batch["response_mask"].bool()
    if log_probs.shape != mask.shape:
        raise ValueError(
            f"log_probs must be (N, R) = {tuple(mask.shape)} like the probes' responses; got "
            f"{tuple(log_probs.shape)}"
        )
    B = int(probe_data.meta_info["rredcot_rows"])
    S = int(num_segments.max()) if len(num_segments) else 0
    values = torch.zeros(B, S + 1)
    totals = torch.where(mask, log_probs.float().cpu(), torch.zeros_like(log_probs.float().cpu()))
    for (row, k), lp in zip(probe_data.non_tensor_batch["rredcot_probe"], totals.sum(dim=1)):
        if row >= 0 and k < S + 1:
            values[row, k] += float(lp.exp())
    return values.clamp(max=1.0)


def _prompt_texts(data, tokenizer) -> list[str]:
    """Each row's prompt text: the user turn of ``non_tensor_batch["raw_prompt"]`` (verl's
    ``data.return_raw_chat``) when present, else the prompt ids decoded without special tokens."""
    nt = data.non_tensor_batch
    if "raw_prompt" in nt:
        return [prompt_text(p) for p in nt["raw_prompt"]]
    b = data.batch
    prompts = b["prompts"]
    keep = b["attention_mask"][:, : prompts.shape[1]].bool()
    return [
        tokenizer.decode(prompts[row][keep[row]].tolist(), skip_special_tokens=True)
        for row in range(prompts.shape[0])
    ]


def process_reward_values(data, tokenizer, config: Any = None, eos_token_ids: Any = None) -> Tensor:
    """``(B, S+1)`` process-reward values of a verl batch, computed on the driver: the responses
    are decoded and segmented exactly as the estimator segments them (:func:`make_segmenter`),
    and the method's source (``algorithm.rredcot.process_reward.function`` or ``.model``) scores
    every boundary (:meth:`rredcot.methods.process_reward.ProcessRewardCredit.boundary_values`;
    column 0 and column ``n`` are set by the estimator).

    Args:
        data: verl ``DataProto`` with ``prompts`` (left-padded), ``responses``,
            ``attention_mask`` (over prompt + response) and, optionally, ``response_mask`` and
            ``non_tensor_batch["raw_prompt"]``.
        tokenizer: the policy's tokenizer; config: verl's algorithm config.
    """
    method_name, cfg = credit_settings(config)
    if method_name != "process_reward":
        raise ValueError(
            f"process_reward_values needs algorithm.rredcot.credit_method=process_reward, not "
            f"{method_name!r}"
        )
    problems = [Problem(text, "") for text in _prompt_texts(data, tokenizer)]
    batch = _driver_batch(data, tokenizer, make_segmenter(cfg, config), eos_token_ids, problems)
    values, _, _ = method_for(method_name, cfg, config).boundary_values(batch)
    return values.cpu()
