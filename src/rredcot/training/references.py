"""Training on the task's reference solutions (``references.mode``): the baselines a credit
method that reads references must beat (DESIGN.md 7d), as pure functions over tensors and
batches, so that the trainer and the TRL adapter share them.

A reference is ``task.gold_completion(problem)`` followed by EOS, scored after the same prompt the
policy's samples had. Three ways of training on it:

``sft`` (a supervised term mixed into the RL loss, as SFT+RL hybrids add an NLL on
demonstrations): each optimiser step adds ``sft_coef * NLL`` of the chosen references,
the NLL aggregated as the policy loss aggregates (``loss_agg``, over the reference rows alone)::

    L = L_PG + c * agg_t(-log pi_theta(y*_t | x, y*_<t))

``luffy`` (LUFFY, Yan et al. 2025, "Learning to Reason under Off-Policy Guidance"): the reference
joins its group as one more sample (``G + 1`` rows; no sampled row is dropped: its tokens were
paid for) with its verified reward (1 on a correct reference), and the credit method computes the
group's advantages with it. Its tokens are off-policy: their behaviour probability is unknown and
taken as ``pi_phi = 1``, so the importance ratio is ``pi_theta(y*_t)`` itself, passed through
LUFFY's policy shaping ``f(x) = x / (x + gamma)`` and never clipped::

    per-token loss (reference row)  = -A_t * f(pi_theta(y*_t)),   f(x) = x / (x + gamma)
    its gradient                    = -A_t * gamma * pi / (pi + gamma)^2 * grad log pi

The plain ratio's gradient ``pi * grad log pi`` vanishes on tokens the policy finds unlikely,
which are the ones it has to learn from a reference; the shaped one peaks at ``pi = gamma``.
On-policy rows keep the clipped PPO term. The published LUFFY mixes a reference into every group;
``references.groups=failed`` (the default) does it only in groups with no correct sample, where
GRPO has no signal (``groups=all``: every group, as LUFFY).

``bread`` (BREAD, "branched rollouts from expert anchors"): in a chosen group, ``branch_rollouts``
more completions are sampled after the prompt and a prefix of the reference (its first
``branch_fraction`` of lines), verified on prefix + completion, as a group of their own (new group
id: their advantages compare rollouts from the same anchor), the prefix being context that is never
trained on. BREAD searches for the shortest anchor from which the policy succeeds; here the anchor
is a fixed share of the reference's lines (one sampling pass, no search).

Each is charged to the token budget (``extra_tokens_generated``): every reference token trained on
in a step counts once (and in ``reference_tokens_trained``), and so does every token of a branched
rollout.

Each mode is a registered strategy (:class:`ReferenceMode`: :class:`Off`, :class:`Sft`,
:class:`Luffy`, :class:`Bread`; :func:`register_reference_mode`, and :func:`reference_mode`, whose
lookup error lists the valid modes). ``rredcot train`` builds the run's once and its step calls it
once (:meth:`ReferenceMode.step`: the step's batch with the rows joined, the sft rows, what to
charge, the metrics), each optimiser step adding sft's term (:meth:`Sft.supervised_loss`); the TRL
adapter builds its references with the same :func:`choose_references` on its rewards, prompt ids
and mask. Both train the sft term's NLL as :func:`reference_nll` aggregates it and luffy's rows
through an ``off_policy`` row mask, which ``rredcot.algebra.loss.policy_loss`` (or
``rredcot.algebra.loss.off_policy_pg`` in TRL's loss) reads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import Tensor

from rredcot.algebra.loss import aggregate
from rredcot.config import ReferencesConfig, SamplingConfig
from rredcot.sampling.batch import RolloutBatch, segment_layout
from rredcot.sampling.rollout import render_prompt, sample, segment_batch
from rredcot.segment import segment_completion
from rredcot.tasks import get_task
from rredcot.tasks.base import Problem, Task, Verdict, checked_verify

__all__ = [
    "REFERENCE_MODE_CLASSES",
    "ReferenceMode",
    "ReferenceParts",
    "ReferenceRows",
    "StepReferences",
    "append_reference_samples",
    "branch_samples",
    "check_run",
    "check_task_references",
    "choose_references",
    "chosen_groups",
    "merge_batches",
    "reference_mode",
    "reference_mode_class",
    "reference_nll",
    "reference_prefix",
    "reference_rows",
    "reference_samples",
    "register_reference_mode",
    "step_references",
]

CORRECT = 1.0  # a sample with reward >= this is correct (as continuation likelihood reads it)


@dataclass(frozen=True)
class ReferenceRows:
    """The references of some groups, laid out as the batch's rows are: ``[left-padded prompt
    (P columns, the group's own) | right-padded reference + EOS (T columns)]``."""

    input_ids: Tensor  # (R, P + T)
    attention_mask: Tensor  # (R, P + T)
    prompt_len: int  # P
    response_mask: Tensor  # (R, T) float
    group_ids: Tensor  # (R,) long: the group each reference belongs to
    problems: list[Problem] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)  # the reference texts (no EOS)
    failed_groups: int = 0  # of the batch they were chosen from: groups with no correct sample

    @property
    def size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def tokens(self) -> int:
        """Reference tokens (EOS included): what training on these rows charges to the budget."""
        return int(self.response_mask.sum())

    def stats(self, trained: float) -> dict[str, float]:
        """A step's reference metrics (docs/metrics.md): groups with no correct sample, the
        groups given a reference (these rows), their tokens and the run's tokens trained so far
        (``trained``)."""
        return {
            "references/failed_groups": float(self.failed_groups),
            "references/groups": float(self.size),
            "references/tokens": float(self.tokens),
            "reference_tokens_trained": trained,
        }

    def nll(
        self, logprobs: Tensor, loss_agg: str, max_len: int, share: Tensor | None = None
    ) -> Tensor:
        """The supervised term (:func:`reference_nll`) of these rows' log-probs ``logprobs``;
        with ``share`` (row indices), of those rows only, aggregated over every row (a
        micro-batch's share: the shares' terms sum to the whole)."""
        if share is None:
            return reference_nll(logprobs, self.response_mask, loss_agg, max_len)
        return reference_nll(
            logprobs,
            self.response_mask[share],
            loss_agg,
            max_len,
            num_rows=self.size,
            num_tokens=float(self.response_mask.sum()),
        )


@dataclass(frozen=True)
class StepReferences:
    """What ``references.mode`` gives one step of ``rredcot train`` (:meth:`ReferenceMode.step`)."""

    batch: RolloutBatch  # the step's batch, its reference (luffy) or branch (bread) rows joined
    sft_rows: ReferenceRows | None = None  # sft: the rows whose NLL the optimiser steps add
    own_rows: Tensor | None = None  # (B,) bool: the step's own samples, where other rows joined
    generated: int = 0  # tokens charged to the budget (extra_tokens_generated)
    trained: int = 0  # reference tokens trained on (reference_tokens_trained)
    stats: dict[str, float] = field(default_factory=dict)  # the step's references/ metrics


def check_task_references(task: Task, problems: list[Problem], task_name: str) -> None:
    """Refuse a task whose problems have no reference solution (``gold_completion`` is None),
    naming the task and the fix."""
    if not problems or any(task.gold_completion(p) is None for p in problems):
        raise ValueError(
            f"references.mode needs reference solutions, but task {task_name!r} gives none "
            "(Task.gold_completion returns None); set references.mode off, or use a task that "
            "ships them (arithmetic, gsm8k, a dataset with a solution column)"
        )


def chosen_groups(rewards: Tensor, group_ids: Tensor, which: str) -> list[int]:
    """The groups given a reference, in order of first appearance: ``failed`` (no sample with
    reward >= 1) or ``all``. ``rewards``, ``group_ids``: ``(B,)``."""
    out: list[int] = []
    for gid in dict.fromkeys(group_ids.tolist()):
        if which == "all" or not bool((rewards[group_ids == gid] >= CORRECT).any()):
            out.append(int(gid))
    return out


def choose_references(
    rewards: Tensor,
    group_ids: Tensor,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    problems: list[Problem],
    which: str,
    task: Task,
    tokenizer,
) -> ReferenceRows:
    """A batch's references, as ``rredcot train`` and the TRL adapter build them: those of the
    groups ``which`` chooses (:func:`chosen_groups`), after their prompts
    (:func:`reference_rows`), with the batch's count of groups that have no correct sample.
    ``rewards``, ``group_ids``: ``(B,)``; ``prompt_ids`` / ``prompt_mask``: ``(B, P)``, left-padded;
    ``problems``: each row's."""
    rewards, group_ids = rewards.cpu(), group_ids.cpu()
    failed = chosen_groups(rewards, group_ids, "failed")
    groups = chosen_groups(rewards, group_ids, which)
    rows = reference_rows(prompt_ids, prompt_mask, group_ids, problems, groups, task, tokenizer)
    return dataclasses.replace(rows, failed_groups=len(failed))


def reference_rows(
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    group_ids: Tensor,
    problems: list[Problem],
    groups: list[int],
    task: Task,
    tokenizer,
) -> ReferenceRows:
    """One reference row per group of ``groups`` whose problem has a reference (others are left
    out): the group's left-padded prompt ``prompt_ids`` / ``prompt_mask (B, P)`` copied from its
    first row, then the reference's tokens and EOS, right-padded to the longest. ``group_ids
    (B,)`` and ``problems`` (B) name each row's group and problem (any trainer's batch: TRL's
    ``prompt_ids`` / ``prompt_mask`` too)."""
    P = prompt_ids.shape[1]
    first_row = {}
    for row, gid in enumerate(group_ids.tolist()):
        first_row.setdefault(int(gid), row)
    eos = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    picked, responses, texts = [], [], []
    for gid in groups:
        row = first_row[gid]
        gold = task.gold_completion(problems[row])
        if gold is None:
            continue
        picked.append((gid, row))
        responses.append(list(tokenizer(gold, add_special_tokens=False)["input_ids"]) + eos)
        texts.append(gold)
    device = prompt_ids.device
    T = max((len(r) for r in responses), default=0)
    R = len(picked)
    response_ids = torch.full((R, T), pad, dtype=torch.long, device=device)
    response_mask = torch.zeros(R, T, dtype=torch.float, device=device)
    for i, ids in enumerate(responses):
        response_ids[i, : len(ids)] = torch.tensor(ids, dtype=torch.long, device=device)
        response_mask[i, : len(ids)] = 1.0
    rows = torch.tensor([row for _, row in picked], dtype=torch.long, device=device)
    return ReferenceRows(
        input_ids=torch.cat([prompt_ids[rows], response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask[rows], response_mask.long()], dim=1),
        prompt_len=P,
        response_mask=response_mask,
        group_ids=torch.tensor([g for g, _ in picked], dtype=torch.long, device=device),
        problems=[problems[row] for _, row in picked],
        completions=texts,
    )


def _pad_columns(t: Tensor | None, width: int, value) -> Tensor | None:
    """``t (B, T)`` right-padded with ``value`` to ``width`` columns."""
    if t is None or t.shape[1] >= width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def append_reference_samples(
    batch: RolloutBatch,
    refs: ReferenceRows,
    verdicts: list[Verdict],
    boundaries: list[list[int]],
    char_starts: list[list[int]],
    pad_token_id: int,
) -> RolloutBatch:
    """``batch`` with each reference row placed after the last row of its group (groups stay
    contiguous), marked ``off_policy``, its reward its ``verdicts``' and its segments
    ``boundaries`` / ``char_starts`` (from the run's segmenter). Response columns are padded to
    the longer of the two; ``segment_ids`` are rebuilt. Forward outputs (old log-probs, hidden states,
    entropies) must not be filled yet; ``prefix_ids`` are recomputed over the merged batch."""
    if refs.size == 0:
        return batch
    if batch.old_logprobs is not None or batch.hidden_states is not None:
        raise ValueError("append reference samples before the forward pass fills the batch")
    if batch.token_share_counts is not None:
        raise ValueError("reference samples cannot join tree-sampled groups (sampling.tree)")
    P = batch.prompt_len
    T = max(batch.response_len, refs.response_mask.shape[1])
    device = batch.input_ids.device
    response_ids = torch.cat(
        [
            _pad_columns(batch.input_ids[:, P:], T, pad_token_id),
            _pad_columns(refs.input_ids[:, P:], T, pad_token_id),
        ]
    )
    response_mask = torch.cat(
        [_pad_columns(batch.response_mask, T, 0.0), _pad_columns(refs.response_mask, T, 0.0)]
    )
    prompt_ids = torch.cat([batch.input_ids[:, :P], refs.input_ids[:, :P]])
    prompt_mask = torch.cat([batch.attention_mask[:, :P], refs.attention_mask[:, :P]])
    rewards = torch.tensor([float(v.reward) for v in verdicts], dtype=torch.float, device=device)
    all_bounds = [*batch.boundaries, *boundaries]
    merged = RolloutBatch(
        input_ids=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask, response_mask.long()], dim=1),
        prompt_len=P,
        response_mask=response_mask,
        rewards=torch.cat([batch.rewards, rewards]),
        group_ids=torch.cat([batch.group_ids, refs.group_ids.to(device)]),
        boundaries=all_bounds,
        segment_ids=segment_layout(all_bounds, response_mask)[0],
        segment_char_starts=[*batch.segment_char_starts, *char_starts],
        problems=[*batch.problems, *refs.problems],
        completions=[*batch.completions, *refs.completions],
        verdicts=[*batch.verdicts, *verdicts],
        off_policy=torch.cat(
            [
                torch.zeros(batch.size, dtype=torch.bool, device=device),
                torch.ones(refs.size, dtype=torch.bool, device=device),
            ]
        ),
        probe_cache=None if batch.probe_cache is None else batch.probe_cache.appended(refs.size),
    )
    # each reference right after its group's last sampled row
    refs_of: dict[int, list[int]] = {}
    for i, gid in enumerate(refs.group_ids.tolist()):
        refs_of.setdefault(int(gid), []).append(batch.size + i)
    gids = batch.group_ids.tolist()
    order = []
    for row, gid in enumerate(gids):
        order.append(row)
        if row == len(gids) - 1 or gids[row + 1] != gid:
            order.extend(refs_of.pop(int(gid), []))
    merged = merged.select(order)
    return merged.with_segments(merged.boundaries, merged.segment_char_starts)


# ---------------------------------------------------------------------------------------------
# the supervised term


def reference_nll(
    logprobs: Tensor,
    response_mask: Tensor,
    loss_agg: str,
    max_len: int,
    *,
    num_rows: int | None = None,
    num_tokens: float | None = None,
) -> Tensor:
    """The supervised term: ``-log pi`` of the reference tokens ``logprobs (R, T)`` aggregated
    over the reference rows as the policy loss aggregates (``loss.aggregate``). ``num_rows`` /
    ``num_tokens``: those of every reference row when ``logprobs`` holds only some of them (a
    micro-batch's share; the shares then sum to the whole term); default: these rows'."""
    return aggregate(
        -logprobs,
        response_mask,
        loss_agg,
        num_rows=logprobs.shape[0] if num_rows is None else num_rows,
        num_tokens=float(response_mask.sum()) if num_tokens is None else num_tokens,
        max_len=max_len,
    )


# ---------------------------------------------------------------------------------------------
# references.mode: one registered strategy per mode, what the trainer calls


@dataclass(frozen=True)
class ReferenceParts:
    """What a run's references read beside a step's batch: its task and tokenizer, its
    segmenter, and (bread) the policy, sampling settings and decoding loop its branches are
    sampled with."""

    task: Task
    tokenizer: Any
    segmenter: Any
    policy: Any = None
    sampling: SamplingConfig | None = None
    decoder: str = "auto"


class ReferenceMode:
    """One ``references.mode`` (a registered strategy, :func:`reference_mode`): what it does to
    a step's batch (:meth:`step`, the step's one call here) and the supervised term it adds to
    each optimiser step (:meth:`supervised_loss`; sft's alone). The base is ``off``'s: the batch
    as it is, no term."""

    name: ClassVar[str] = ""
    reads_references: ClassVar[bool] = True  # the task must give reference solutions

    def __init__(self, cfg: ReferencesConfig, parts: ReferenceParts) -> None:
        self.cfg, self.parts = cfg, parts

    def step(self, batch: RolloutBatch, trained_before: int) -> StepReferences:
        """This step's references: the batch with their rows joined, the sft rows, what to
        charge and the metrics. ``trained_before``: the run's reference tokens trained on before
        this step (the metric counts on from there)."""
        return StepReferences(batch)

    def supervised_loss(
        self, logprobs: Tensor, response_mask: Tensor | None, **options
    ) -> tuple[Tensor, dict[str, float]] | None:
        """The term this mode adds to an optimiser step, from the policy's log-probs of the
        step's references (None: none)."""
        return None

    def _chosen(self, batch: RolloutBatch) -> tuple[ReferenceRows, dict]:
        """The chosen groups' references after their prompts (:func:`choose_references`) and
        what they charge: their tokens, as generated and as trained."""
        P = batch.prompt_len
        refs = choose_references(
            batch.rewards,
            batch.group_ids,
            batch.input_ids[:, :P],
            batch.attention_mask[:, :P],
            batch.problems,
            self.cfg.groups,
            self.parts.task,
            self.parts.tokenizer,
        )
        return refs, {"generated": refs.tokens, "trained": refs.tokens}


REFERENCE_MODE_CLASSES: dict[str, type[ReferenceMode]] = {}
"""``references.mode`` -> its strategy (:func:`register_reference_mode`)."""


def register_reference_mode(name: str):
    """Register a :class:`ReferenceMode` subclass as ``references.mode`` ``name``."""

    def register(cls: type[ReferenceMode]) -> type[ReferenceMode]:
        if name in REFERENCE_MODE_CLASSES:
            raise ValueError(f"references.mode {name!r} is registered already")
        cls.name = name
        REFERENCE_MODE_CLASSES[name] = cls
        return cls

    return register


def reference_mode_class(name: str) -> type[ReferenceMode]:
    """The strategy registered as ``references.mode`` ``name``; an unknown name is refused with
    the valid ones."""
    try:
        return REFERENCE_MODE_CLASSES[name]
    except KeyError:
        valid = ", ".join(REFERENCE_MODE_CLASSES)
        raise ValueError(f"unknown references.mode {name!r}; valid: {valid}") from None


def reference_mode(cfg: ReferencesConfig, parts: ReferenceParts) -> ReferenceMode:
    """The run's ``references.mode`` (``cfg.mode``) as its strategy, over the run's ``parts``."""
    return reference_mode_class(cfg.mode)(cfg, parts)


@register_reference_mode("off")
class Off(ReferenceMode):
    """``off``: no reference is read; the batch is left as it is."""

    reads_references = False


@register_reference_mode("sft")
class Sft(ReferenceMode):
    """``sft``: the chosen groups' references are kept for the supervised term every optimiser
    step adds (:meth:`supervised_loss`)."""

    def step(self, batch: RolloutBatch, trained_before: int) -> StepReferences:
        refs, charged = self._chosen(batch)
        stats = refs.stats(trained_before + refs.tokens)
        return StepReferences(batch, sft_rows=refs, stats=stats, **charged)

    def supervised_loss(
        self,
        logprobs: Tensor,
        response_mask: Tensor | None,
        *,
        num_rows: int,
        num_tokens: float,
        scale: float,
        loss_agg: str,
        max_len: int,
    ) -> tuple[Tensor, dict[str, float]]:
        """``(loss, metrics)``: ``sft_coef`` times the NLL (:func:`reference_nll`) of this
        process's references, the policy's ``logprobs (R, T)`` of their tokens
        (``response_mask``), aggregated over every process's (``num_rows``, ``num_tokens``) and
        times ``scale`` (the processes). ``response_mask`` None: a process with no reference,
        while another has some, gives a stand-in pass (``logprobs`` of any token) weight 0, so
        that every process runs the same passes."""
        weight = 0.0 if response_mask is None else 1.0
        mask = response_mask if weight else torch.zeros_like(logprobs)
        nll = reference_nll(
            logprobs, mask, loss_agg, max_len, num_rows=num_rows, num_tokens=num_tokens
        )
        loss = self.cfg.sft_coef * weight * scale * nll
        return loss, {"references/sft_nll": float(nll.detach()) * weight}


@register_reference_mode("luffy")
class Luffy(ReferenceMode):
    """``luffy``: the chosen groups' references join them as off-policy samples
    (:func:`reference_samples`)."""

    def step(self, batch: RolloutBatch, trained_before: int) -> StepReferences:
        refs, charged = self._chosen(batch)
        stats = refs.stats(trained_before + refs.tokens)
        parts = self.parts
        joined = reference_samples(batch, refs, parts.task, parts.tokenizer, parts.segmenter)
        own = None if joined.off_policy is None else ~joined.off_policy  # None: no group chose one
        return StepReferences(joined, own_rows=own, stats=stats, **charged)


@register_reference_mode("bread")
class Bread(ReferenceMode):
    """``bread``: the chosen groups' branched rollouts from a reference prefix
    (:func:`branch_samples`), appended as groups of their own (:func:`merge_batches`; the prefix
    is context: no reference token is trained on); their tokens are charged as generated."""

    def step(self, batch: RolloutBatch, trained_before: int) -> StepReferences:
        cfg, parts = self.cfg, self.parts
        failed = chosen_groups(batch.rewards, batch.group_ids, "failed")
        groups = chosen_groups(batch.rewards, batch.group_ids, cfg.groups)
        parts.policy.eval()
        branch, generated = branch_samples(
            parts.policy,
            batch,
            groups,
            parts.task,
            parts.tokenizer,
            parts.segmenter,
            parts.sampling,
            parts.decoder,
            fraction=cfg.branch_fraction,
            rollouts=cfg.branch_rollouts or parts.sampling.num_generations,
        )
        stats = {
            "references/failed_groups": float(len(failed)),
            "references/groups": float(len(set(branch.group_ids.tolist())))
            if branch is not None
            else 0.0,
            "references/branch_tokens": float(generated),
            "references/branch_reward_mean": float(branch.rewards.mean())
            if branch is not None
            else 0.0,
            "reference_tokens_trained": trained_before,
        }
        if branch is None:
            return StepReferences(batch, generated=generated, stats=stats)
        pad = parts.tokenizer.pad_token_id if parts.tokenizer.pad_token_id is not None else 0
        own = torch.cat(
            [torch.ones(batch.size, dtype=torch.bool), torch.zeros(branch.size, dtype=torch.bool)]
        )
        return StepReferences(
            merge_batches(batch, branch, pad),
            own_rows=own.to(batch.input_ids.device),
            generated=generated,
            stats=stats,
        )


def check_run(cfg) -> None:
    """Refuse a run (``TrainConfig``) whose ``references.mode`` reads reference solutions but
    whose task has none, before a model is loaded (a few training problems are looked at)."""
    if not reference_mode_class(cfg.references.mode).reads_references:
        return

    task = get_task(cfg.task, **cfg.task_args)
    check_task_references(task, task.train_problems(4, seed=cfg.seed), cfg.task)


def step_references(
    batch: RolloutBatch,
    cfg: ReferencesConfig,
    task: Task,
    tokenizer,
    segmenter,
    *,
    policy,
    sampling: SamplingConfig,
    decoder: str,
    trained_before: int,
) -> StepReferences:
    """``references.mode`` (``cfg``) in one step: :meth:`ReferenceMode.step` of its strategy
    (:func:`reference_mode`), built for this call."""
    parts = ReferenceParts(task, tokenizer, segmenter, policy, sampling, decoder)
    return reference_mode(cfg, parts).step(batch, trained_before)


def reference_samples(
    batch: RolloutBatch, refs: ReferenceRows, task: Task, tokenizer, segmenter
) -> RolloutBatch:
    """``batch`` with ``refs`` joined to their groups as off-policy samples
    (:func:`append_reference_samples`): each verified by the task (its reward is the verdict's)
    and segmented by ``segmenter`` as a sampled completion is (one segment under an entropy
    segmenter, whose cuts come with the forward pass)."""
    verdicts, boundaries, char_starts = [], [], []
    lengths = refs.response_mask.sum(-1).long().tolist()
    for i, (problem, text) in enumerate(zip(refs.problems, refs.completions)):
        verdicts.append(checked_verify(task, problem, text)[0])
        ids = refs.input_ids[i, refs.prompt_len : refs.prompt_len + lengths[i]].tolist()
        if segmenter.uses_entropy:
            bounds, starts = [0, lengths[i]], [0]
        else:
            bounds, starts, _ = segment_completion(segmenter, tokenizer, ids, text=text)
        boundaries.append(bounds)
        char_starts.append(starts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return append_reference_samples(batch, refs, verdicts, boundaries, char_starts, pad)


# ---------------------------------------------------------------------------------------------
# bread: rollouts from a reference prefix


def reference_prefix(task: Task, problem: Problem, fraction: float) -> str | None:
    """The anchor of a branched rollout: the reference's first ``floor(fraction * n)`` lines of
    its ``n`` (at least 1, fewer than ``n``), each with its newline; None when the reference has
    fewer than 2 lines (or none)."""
    gold = task.gold_completion(problem)
    if gold is None:
        return None
    lines = gold.split("\n")
    if len(lines) < 2:
        return None
    k = min(max(int(fraction * len(lines)), 1), len(lines) - 1)
    return "\n".join(lines[:k]) + "\n"


def _left_pad_columns(t: Tensor, width: int, value) -> Tensor:
    """``t (B, P)`` left-padded with ``value`` to ``width`` columns."""
    if t.shape[1] >= width:
        return t
    pad = torch.full((t.shape[0], width - t.shape[1]), value, dtype=t.dtype, device=t.device)
    return torch.cat([pad, t], dim=1)


def merge_batches(a: RolloutBatch, b: RolloutBatch, pad_token_id: int) -> RolloutBatch:
    """The rows of ``a`` then ``b`` in one batch: prompt columns left-padded and response columns
    right-padded to the wider of the two, ``segment_ids`` and ``prefix_ids`` rebuilt. Neither
    batch may carry forward outputs yet, nor tree share counts."""
    for x in (a, b):
        if x.old_logprobs is not None or x.hidden_states is not None:
            raise ValueError("merge batches before the forward pass fills them")
        if x.token_share_counts is not None:
            raise ValueError("tree-sampled groups (sampling.tree) cannot be merged")
    P = max(a.prompt_len, b.prompt_len)
    T = max(a.response_len, b.response_len)

    def columns(x: RolloutBatch) -> tuple[Tensor, Tensor, Tensor]:
        p = x.prompt_len
        ids = torch.cat(
            [
                _left_pad_columns(x.input_ids[:, :p], P, pad_token_id),
                _pad_columns(x.input_ids[:, p:], T, pad_token_id),
            ],
            dim=1,
        )
        mask = _pad_columns(x.response_mask, T, 0.0)
        attn = torch.cat([_left_pad_columns(x.attention_mask[:, :p], P, 0), mask.long()], dim=1)
        return ids, attn, mask

    (ia, aa, ma), (ib, ab, mb) = columns(a), columns(b)
    off = None
    if a.off_policy is not None or b.off_policy is not None:
        flag = lambda x: (  # noqa: E731
            x.off_policy
            if x.off_policy is not None
            else torch.zeros(x.size, dtype=torch.bool, device=x.input_ids.device)
        )
        off = torch.cat([flag(a), flag(b)])
    bounds = [*a.boundaries, *b.boundaries]
    response_mask = torch.cat([ma, mb])
    input_ids = torch.cat([ia, ib])
    group_ids = torch.cat([a.group_ids, b.group_ids])
    segment_ids, prefix_ids = segment_layout(bounds, response_mask, input_ids[:, P:], group_ids)
    return RolloutBatch(
        input_ids=input_ids,
        attention_mask=torch.cat([aa, ab]),
        prompt_len=P,
        response_mask=response_mask,
        rewards=torch.cat([a.rewards, b.rewards]),
        group_ids=group_ids,
        boundaries=bounds,
        segment_ids=segment_ids,
        segment_char_starts=[*a.segment_char_starts, *b.segment_char_starts],
        problems=[*a.problems, *b.problems],
        completions=[*a.completions, *b.completions],
        verdicts=[*a.verdicts, *b.verdicts],
        prefix_ids=prefix_ids,
        off_policy=off,
    )


def _anchors(
    batch: RolloutBatch, groups: list[int], task: Task, fraction: float
) -> list[tuple[Problem, str]]:
    """``(problem, reference prefix)`` of each group of ``groups`` whose reference has 2+ lines
    (:func:`reference_prefix`), in the order of ``groups``."""
    first_row: dict[int, int] = {}
    for row, gid in enumerate(batch.group_ids.tolist()):
        first_row.setdefault(int(gid), row)
    anchors = []
    for gid in groups:
        problem = batch.problems[first_row[gid]]
        prefix = reference_prefix(task, problem, fraction)
        if prefix is not None:
            anchors.append((problem, prefix))
    return anchors


def _branch_batch(
    input_ids: Tensor,
    attention_mask: Tensor,
    prompt_len: int,
    response_mask: Tensor,
    anchors: list[tuple[Problem, str]],
    rollouts: int,
    first_group: int,
    task: Task,
    tokenizer,
) -> tuple[RolloutBatch, list[bool]]:
    """The sampled branches as a batch, one segment each: ``rollouts`` rows per anchor, each
    verified on prefix + completion, anchor ``i``'s rows in group ``first_group + i``. Returns
    it and whether each row's verdict is usable (:func:`rredcot.tasks.base.checked_verify`)."""
    P = prompt_len
    eos = tokenizer.eos_token_id
    lengths = response_mask.sum(-1).long().tolist()
    problems, completions, verdicts, keep = [], [], [], []
    for row in range(input_ids.shape[0]):
        problem, prefix = anchors[row // rollouts]
        ids = input_ids[row, P : P + lengths[row]].tolist()
        text = tokenizer.decode(
            ids[:-1] if ids and ids[-1] == eos else ids, skip_special_tokens=True
        )
        verdict, ok = checked_verify(task, problem, prefix + text)
        problems.append(problem)
        completions.append(text)
        verdicts.append(verdict)
        keep.append(ok)
    device = input_ids.device
    whole = [[0, n] if n else [0] for n in lengths]
    branch = RolloutBatch(
        input_ids=input_ids,
        attention_mask=attention_mask,
        prompt_len=P,
        response_mask=response_mask,
        rewards=torch.tensor([float(v.reward) for v in verdicts], device=device),
        group_ids=first_group
        + torch.arange(len(anchors), device=device).repeat_interleave(rollouts),
        boundaries=whole,
        segment_ids=segment_layout(whole, response_mask)[0],
        segment_char_starts=[[0] if n else [] for n in lengths],
        problems=problems,
        completions=completions,
        verdicts=verdicts,
    )
    return branch, keep


def branch_samples(
    policy,
    batch: RolloutBatch,
    groups: list[int],
    task: Task,
    tokenizer,
    segmenter,
    sampling: SamplingConfig,
    decoder: str,
    *,
    fraction: float,
    rollouts: int,
) -> tuple[RolloutBatch | None, int]:
    """BREAD-style branched rollouts: for each group of ``groups`` whose reference has 2+ lines,
    ``rollouts`` completions sampled from the policy after the prompt *and* the reference's
    prefix (:func:`reference_prefix`), each verified on prefix + completion. The prefix is
    context (prompt columns: never trained on); each branch is a new group (id after the batch's
    last), so its advantages compare rollouts from the same state. Returns the branch rows
    (None when no group has a prefix) and the tokens generated for them."""
    anchors = _anchors(batch, groups, task, fraction)
    if not anchors:
        return None, 0
    prompts = [render_prompt(p, tokenizer) + prefix for p, prefix in anchors]
    input_ids, attention_mask, P, response_mask = sample(
        policy,
        tokenizer,
        prompts,
        num_generations=rollouts,
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        use_model_generation_config=sampling.use_model_generation_config,
        decoder=decoder,
    )
    generated = int(response_mask.sum())
    branch, keep = _branch_batch(
        input_ids,
        attention_mask,
        P,
        response_mask,
        anchors,
        rollouts,
        int(batch.group_ids.max()) + 1,
        task,
        tokenizer,
    )
    if not all(keep):
        branch = branch.select([row for row, ok in enumerate(keep) if ok])
        if branch.size == 0:
            return None, generated
    if not segmenter.uses_entropy:
        branch = segment_batch(branch, tokenizer, segmenter)
    return branch, generated
