"""``references`` in TRL's step (issue 40's baselines): the reference rows of a training
generation batch, sft's share of their NLL in each micro-batch's loss, and luffy's references in
place of rollouts with their shaped, unclipped term (the trainer's ``_with_references``)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from rredcot.algebra.layout import fit_columns
from rredcot.algebra.loss import off_policy_pg, shaped_ratio
from rredcot.config import ReferencesConfig
from rredcot.integrations.trl.config import LOSS_AGG_OF_LOSS_TYPE
from rredcot.methods.processes import Collective
from rredcot.tasks.base import Problem, Task
from rredcot.training import references as training_refs

__all__ = [
    "COMPLETION_COLUMNS",
    "LossShape",
    "ReferenceTerm",
    "batch_references",
    "check_reference_data",
    "luffy_inputs",
    "luffy_term",
    "put_references",
    "reference_rewards",
    "reference_stats",
    "replace_rollouts",
    "sft_share",
]

# TRL's (B, T) completion columns of a generation batch (luffy widens them to a reference)
COMPLETION_COLUMNS = (
    "completion_ids",
    "completion_mask",
    "old_per_token_logps",
    "sampling_per_token_logps",
    "importance_sampling_ratio",
    "tool_mask",
)


@dataclass
class ReferenceTerm:
    """``references.mode`` sft: a training generation batch's reference rows, whose NLL its
    micro-batches add to their losses in shares (:func:`sft_share`)."""

    rows: training_refs.ReferenceRows  # this process's
    parts: int  # steps_per_generation: the micro-batches of the batch, one share each
    total_rows: int = 0  # the reference rows of every process (the NLL's normalisers)
    total_tokens: float = 0.0
    nll: float = 0.0  # the shares' NLL summed so far (logged once the last share is in)
    done: int = 0  # shares added so far (num_iterations passes each add every share)


@dataclass(frozen=True)
class LossShape:
    """How TRL normalises and scales a micro-batch's loss, as the trainer holds it at the call."""

    loss_type: str
    max_completion_length: int
    steps_per_generation: int
    accumulation: float  # current_gradient_accumulation_steps in training, else 1
    world: int  # processes


def check_reference_data(
    mode: str, data, column: str, task: Task | None, task_name: str | None, problem
) -> None:
    """With ``references`` on: a training set whose first rows give the task a reference
    solution each (``problem``: a row as the task's problem); refused before training starts."""
    if mode == "off" or data is None:
        return
    columns = getattr(data, "column_names", None)
    if columns is not None and column not in columns:
        raise ValueError(
            f"references.mode={mode!r} reads each row's reference solution from the task and "
            f"the {column!r} column, which the training set lacks (columns: {columns}); set "
            "answer_column to the column with the answers or solutions"
        )
    rows = list(itertools.islice(iter(data), 4))
    training_refs.check_task_references(task, [problem(r) for r in rows], task_name)


def batch_references(
    cfg: ReferencesConfig,
    rewards: Tensor,
    num_generations: int,
    output: dict,
    problems: list[Problem],
    task: Task | None,
    tokenizer,
    rank: int,
) -> tuple[training_refs.ReferenceRows, int]:
    """``(refs, start)``: the references of the groups ``cfg.groups`` chooses on every process's
    ``rewards`` whose anchor row this process holds (sft: the group's first; luffy: its last),
    after the group's prompt; ``start``: this process's first row in the generation batch."""
    G = num_generations
    group_ids = torch.arange(rewards.shape[0]) // G
    B = output["prompt_ids"].shape[0]
    start = rank * B
    anchor = G - 1 if cfg.mode == "luffy" else 0  # the row of its group that holds it
    mine = [
        g
        for g in training_refs.chosen_groups(rewards.cpu(), group_ids, cfg.groups)
        if start <= g * G + anchor < start + B
    ]
    refs = training_refs.reference_rows(
        output["prompt_ids"],
        output["prompt_mask"],
        group_ids[start : start + B],
        problems,
        mine,
        task,
        tokenizer,
    )
    return refs, start


def reference_stats(
    refs, rewards: Tensor, num_generations: int, totals: tuple[int, int], trained: int
) -> dict[str, float]:
    """The metrics of a batch's references (``totals``: rows and tokens over every process;
    ``trained``: the run's reference tokens so far), as rredcot train logs them."""
    group_ids = torch.arange(rewards.shape[0]) // num_generations
    failed = len(training_refs.chosen_groups(rewards.cpu(), group_ids, "failed"))
    stats = dataclasses.replace(refs, failed_groups=failed).stats(float(trained))
    stats.update({"references/groups": totals[0], "references/tokens": totals[1]})
    return stats


def replace_rollouts(
    output: dict,
    refs,
    start: int,
    total_rows: int,
    num_generations: int,
    pad: int,
    collective: Collective,
) -> list[int] | None:
    """luffy: each reference ``refs`` (of the groups whose last row this process holds, rows
    ``start ..`` of the generation batch being its own) in place of its group's last rollout, in
    ``output`` before the credit reads it (LUFFY's recipe: G rows, one off-policy): old (and
    sampling) log-probs 0 (``pi_phi = 1``), the completion columns widened where the reference is
    longer, ``num_items_in_batch`` recounted over every process, ``rredcot_reference`` marking
    the rows for the loss. Returns the replaced local rows; None where no process has a
    reference (``total_rows`` 0: nothing changes)."""
    B = output["completion_ids"].shape[0]
    reference = torch.zeros(B, dtype=torch.bool, device=output["completion_ids"].device)
    output["rredcot_reference"] = reference
    if total_rows == 0:
        return None
    rows = ((refs.group_ids + 1) * num_generations - 1 - start).tolist()
    if refs.size:
        put_references(output, refs, rows, pad)
        reference[rows] = True
    mask = output["completion_mask"]
    loss_mask = mask if "tool_mask" not in output else mask * output["tool_mask"]
    count = collective.gather(loss_mask.sum().reshape(1)).sum()
    output["num_items_in_batch"] = count.to(output["num_items_in_batch"].dtype)
    return rows


def put_references(output: dict, refs, rows: list[int], pad: int) -> None:
    """The reference rows ``refs`` written into ``output``'s local rows ``rows``: completion
    ids and mask, old and sampling log-probs 0, importance ratio and tool mask 1; the
    completion columns widened to the longest reference (``pad``: the pad token id)."""
    B, T = output["completion_ids"].shape
    width = max(T, refs.response_mask.shape[1])
    fills = {"completion_ids": pad, "importance_sampling_ratio": 1.0, "tool_mask": 1}
    for key in COMPLETION_COLUMNS:  # widened to the longest reference
        value = output.get(key)
        if isinstance(value, Tensor) and value.dim() == 2 and value.shape[1] == T:
            output[key] = fit_columns(value, width)
            output[key][:, T:] = fills.get(key, 0)
    P = refs.prompt_len
    Tr = refs.response_mask.shape[1]
    ids, mask = output["completion_ids"], output["completion_mask"]
    ids[rows] = pad
    ids[rows, :Tr] = refs.input_ids[:, P:].to(ids.dtype)
    mask[rows] = 0
    mask[rows, :Tr] = refs.response_mask.to(mask.dtype)
    for key, value in (
        ("old_per_token_logps", 0.0),
        ("sampling_per_token_logps", 0.0),
        ("importance_sampling_ratio", 1.0),
        ("tool_mask", 1),
    ):
        if isinstance(output.get(key), Tensor) and output[key].shape[0] == B:
            output[key][rows] = value


def reference_rewards(
    inputs: list[dict],
    output: dict,
    refs,
    rows: list[int],
    start: int,
    chat: bool,
    score: Callable,
    tokenizer,
    collective: Collective,
    rewards_per_func: Tensor,
) -> None:
    """The reward functions on the references (``score``: TRL's ``_calculate_rewards``), written
    into every process's ``rewards_per_func`` at their rows. ``score`` gathers its result, so
    every process scores as many rows as the busiest one (repeats of one of its own, whose
    scores are dropped) and the gathered rows' places are gathered with them."""
    most = collective.max_int(refs.size)
    P = refs.prompt_len
    texts = list(refs.completions)
    ids = [refs.input_ids[i, P:][refs.response_mask[i].bool()].tolist() for i in range(len(rows))]
    picked = [inputs[r] for r in rows]
    if not picked:  # a stand-in: this process's first rollout (its score is dropped)
        first = output["completion_ids"][0][output["completion_mask"][0].bool()].tolist()
        picked, ids = [inputs[0]], [first]
        texts = [tokenizer.decode(first, skip_special_tokens=True)]
    extra = most - len(picked)
    picked, texts, ids = (
        picked + picked[:1] * extra,
        texts + texts[:1] * extra,
        ids + ids[:1] * extra,
    )
    completions = [[{"role": "assistant", "content": t}] if chat else t for t in texts]
    rewards = score(picked, [x["prompt"] for x in picked], completions, ids)
    index = torch.full((most,), -1, dtype=torch.long, device=collective.device)
    index[: refs.size] = torch.tensor(rows, dtype=torch.long, device=index.device) + start
    every = collective.gather(index).to(rewards.device)
    state = rewards_per_func
    state[every[every >= 0].to(state.device)] = rewards[every >= 0].to(state.dtype)


def luffy_inputs(inputs: dict) -> tuple[dict, Tensor]:
    """``(trl_inputs, mask)``: the micro-batch as TRL's loss should see it, its reference rows
    left out (their tokens masked as TRL masks tool output), and its loss mask (all rows)."""
    mask = inputs["completion_mask"].float()
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    trl_inputs = dict(inputs)
    trl_inputs["tool_mask"] = mask * (~inputs["rredcot_reference"]).unsqueeze(1).to(mask.dtype)
    return trl_inputs, mask


def luffy_term(
    inputs: dict,
    mask: Tensor,
    logps: Tensor,
    gamma: float,
    shape: LossShape,
    train: bool,
    collective: Collective,
) -> tuple[Tensor, float | None]:
    """LUFFY's term on the micro-batch's reference rows (``mask``: its loss mask), and their
    tokens' mean shaped ratio over every process (None without any): per token
    ``-A * f(pi_theta)``, ``f(x) = x / (x + gamma)`` (:func:`rredcot.algebra.loss.off_policy_pg`,
    unclipped, ``logps`` from the loss forward), normalised as ``loss_type`` normalises the
    micro-batch (per-row means over its rows for grpo/sapo, rows x ``max_completion_length`` for
    dr_grpo, the generation batch's tokens for dapo/cispo/vespo) and scaled for gradient
    accumulation as TRL scales its own."""
    ref = inputs["rredcot_reference"]
    advantages = inputs["advantages"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    per_token = off_policy_pg(logps, advantages, gamma) * mask
    per_token = per_token[ref]
    accumulation = shape.accumulation if train else 1.0
    B = mask.shape[0]
    if shape.loss_type in ("grpo", "sapo"):
        term = (per_token.sum(-1) / mask[ref].sum(-1).clamp(min=1.0)).sum() / B
    elif shape.loss_type == "dr_grpo":
        term = per_token.sum() / (B * shape.max_completion_length)
    else:  # dapo, cispo, vespo: the generation batch's tokens, as TRL's normaliser
        normalizer = inputs["num_items_in_batch"].clamp(min=1.0) / shape.world
        if train:
            normalizer = normalizer * accumulation / shape.steps_per_generation
        term, accumulation = per_token.sum() / normalizer, 1.0
    with torch.no_grad():  # the reference tokens' mean shaped ratio, over every process
        weights = mask * ref.unsqueeze(1).to(mask.dtype)
        sums = torch.stack([(shaped_ratio(logps, gamma) * weights).sum(), weights.sum()])
        sums = collective.gather(sums.double().unsqueeze(0)).sum(dim=0)
    ratio = float(sums[0] / sums[1]) if float(sums[1]) > 0 else None
    return term / accumulation, ratio


def sft_share(
    term: ReferenceTerm,
    step: int,
    model,
    trl_logps: Callable,
    shape: LossShape,
    coef: float,
    collective: Collective,
) -> tuple[Tensor, float | None]:
    """This micro-batch's share of ``coef`` times the references' NLL, and the batch's NLL over
    every process once its last share is in (else None). The NLL
    (:func:`rredcot.training.references.reference_nll`) is aggregated over every reference row of
    the generation batch, on every process, as ``loss_type`` aggregates
    (:data:`~rredcot.integrations.trl.config.LOSS_AGG_OF_LOSS_TYPE`); the rows are split over the
    batch's ``steps_per_generation`` micro-batches, so the shares sum to the whole term; scaled by
    ``steps_per_generation / gradient_accumulation_steps`` as TRL scales its own loss, an
    optimiser step gets ``coef * NLL`` once (TRL's defaults: one generation batch per optimiser
    step, as rredcot train adds it). Under several processes each loss is scaled by their number
    (their gradients are averaged), and a process whose share is empty while another has
    references runs a stand-in forward of zero weight, so that all run the same forwards.
    ``trl_logps``: TRL's ``_get_per_token_logps_and_entropies``."""
    rows, S = term.rows, term.parts
    share = torch.tensor_split(torch.arange(rows.size), S)[step % S]
    nll = torch.zeros((), device=rows.input_ids.device)
    world = collective.world
    if len(share):
        logps, _, _ = trl_logps(
            model, rows.input_ids[share], rows.attention_mask[share], rows.response_mask.shape[1]
        )
        nll = training_refs.reference_nll(
            logps,
            rows.response_mask[share],
            LOSS_AGG_OF_LOSS_TYPE[shape.loss_type],
            shape.max_completion_length,
            num_rows=term.total_rows,
            num_tokens=term.total_tokens,
        )
    elif world > 1 and term.total_rows:  # another process has references here
        ids = torch.zeros(1, 2, dtype=torch.long, device=collective.device)
        logps, _, _ = trl_logps(model, ids, torch.ones_like(ids), 1)
        nll = 0.0 * logps.sum()
    term.nll, term.done = term.nll + float(nll.detach()), term.done + 1
    logged = None
    if term.done % S == 0:  # the last share of a pass over the batch
        nll_sum = collective.gather(torch.tensor([term.nll], device=collective.device))
        logged = float(nll_sum.sum())
        term.nll = 0.0
    scale = S / shape.accumulation * world
    return coef * scale * nll, logged
