"""``rredcot diagnose``: will finer credit help this run? An answer before anyone pays for it.

Read top to bottom (every figure is defined in docs/diagnose.md):

1. Sample ``P`` held-out prompts x ``G`` completions from a frozen policy at the run's sampling
   settings, verify and segment them (the final answer line always its own segment), and read
   each sampled token's probability ``p(y_t)`` and the policy's entropy at the sampling
   temperature (one no-grad forward, as the loss scores them).
2. **Where GRPO is blind**: the share of groups whose rewards all agree (all wrong, all right),
   at ``G`` and at smaller group sizes ``G'`` computed exactly over every ``G'``-subset of each
   prompt's samples (:func:`agreement_by_group_size`).
3. **Where GRPO's update lands**: on the traces of groups whose rewards differ, each token's
   share of GRPO's logit-gradient mass ``|A| (1 - p(y_t))`` (:func:`grpo_gradient_mass`: the
   gradient of ``log p(y_t)`` with respect to the logits is ``e_y - p``, whose size is about
   ``1 - p(y_t)``), against its share of the tokens, per segment kind (correct prefix, first
   wrong step, after the error, answer line: :func:`token_kinds`, from the verifier's
   ``first_error_step`` where the task has step labels), per segment position and per relative
   position along the trace; the entropy along the trace and the uncertain decisions per trace
   (tokens with ``p(y_t) < uncertain_p``).
4. **What better credit could change**: on a seeded random subset, Monte Carlo values at every
   segment boundary (:func:`rredcot.methods.monte_carlo.mc_values`, cost printed and capped
   first), and from them the share of the per-token advantage's mean square that step-level
   credit removes and the blame GRPO puts on the still-right prefix of wrong traces
   (:func:`step_credit_figures`).
5. Optionally, cheap estimators (a run's value head, answer likelihood, a process reward function
   or model) scored against the Monte Carlo values with the credit benchmark's code
   (:mod:`rredcot.bench.credit`).
6. A verdict in plain words with its reasons (:func:`verdict`), the figures as JSON and a picture.

Intervals: Clopper-Pearson (``scipy.stats.binomtest``, exact) on the share of agreeing groups at
``G`` (one Bernoulli outcome per prompt); a percentile bootstrap over prompts (the unit that was
sampled independently) on every other share, mean and ratio; over traces for the Monte Carlo
figures (the subset's traces come from different prompts).

The Python API is :func:`diagnose` (a loaded policy) and :func:`diagnose_source` (what the CLI
calls: loads the policy from a path, alias or run directory first); both return a
:class:`DiagnoseReport` (``.to_json()``, ``.summary()``, ``.write(out_dir)``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from rredcot import credit as credit_algebra
from rredcot.batch import RolloutBatch
from rredcot.bench.configs import CreditBenchConfig
from rredcot.bench.credit import GroundTruth, Traces, evaluate_method, masked_rows, method_scores
from rredcot.config import CreditConfig, SamplingConfig
from rredcot.config_io import from_dict
from rredcot.credit_choice import ALL_WRONG_HIGH, REWARD_LOW, SUCCESS, flow_flags
from rredcot.diagnose_config import DEFAULT_UNCERTAIN_P, DiagnoseConfig
from rredcot.errors import UserError
from rredcot.explain_model import (
    ResolvedCheckpoint,
    choose_task,
    load_method_state,
    resolve_checkpoint,
    run_credit_config,
)
from rredcot.methods.base import CreditContext, build_credit
from rredcot.methods.monte_carlo import mc_values
from rredcot.methods.oracle import first_error_segment
from rredcot.models import load_policy
from rredcot.normalization import group_mean_std
from rredcot.rollout import build_rollout_batch, eval_mode, policy_forward, segment_batch
from rredcot.segment import segmenter_from_config
from rredcot.sft import default_policy_source
from rredcot.tasks import get_task
from rredcot.tasks.base import Task, read_task_data
from rredcot.train_setup import resolve_device

__all__ = [
    "CONFIDENCE",
    "KINDS",
    "DiagnoseConfig",
    "DiagnoseReport",
    "Chunk",
    "agreement_by_group_size",
    "chunk_from_batch",
    "clopper_pearson",
    "diagnose",
    "diagnose_source",
    "estimator_specs",
    "grpo_advantages",
    "gradient_figures",
    "grpo_gradient_mass",
    "label_shares",
    "per_unit_sums",
    "ratio_interval",
    "row_kind_inputs",
    "step_credit_figures",
    "token_kinds",
    "token_probabilities",
    "trace_figures",
    "verdict",
]

CONFIDENCE = 0.95

# Segment kinds of a token (docs/diagnose.md). Right traces: their reasoning and their answer
# line. Wrong traces with a step label: the still-right steps before the first wrong one, the
# segment that holds the first wrong line, the steps after it, and the answer line (when it is
# not itself the first error). Wrong traces the verifier cannot label: their steps and answer.
KINDS = (
    "right_steps",
    "right_answer",
    "correct_prefix",
    "first_error",
    "after_error",
    "wrong_answer",
    "wrong_unlabelled",
)
KIND = {name: i for i, name in enumerate(KINDS)}
WRONG_KINDS = KINDS[2:]


# ---------------------------------------------------------------------------------------------
# pure figures (tensors and arrays in, numbers out; tested on hand-built cases)


def grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """GRPO's advantage of each row, ``(R - mean_g) / std_g`` with the group statistics of
    :func:`rredcot.normalization.group_mean_std` (Bessel's correction, as TRL), and 0 in a group whose
    rewards all agree (std 0: GRPO has no update there). ``rewards``, ``group_ids``: ``(B,)``.
    Returns ``(B,)`` float."""
    mean, std = group_mean_std(rewards.float(), group_ids)
    centred = rewards.float() - mean
    return torch.where(std > 0, centred / std.clamp_min(1e-12), torch.zeros_like(centred))


def grpo_gradient_mass(
    advantages: torch.Tensor, token_p: torch.Tensor, response_mask: torch.Tensor
) -> torch.Tensor:
    """GRPO's logit-gradient mass per token, ``|A| (1 - p(y_t))`` on response tokens, 0 on
    padding. ``advantages (B,)``, ``token_p (B, T)`` the probability of each sampled token at the
    sampling temperature, ``response_mask (B, T)``. Returns ``(B, T)``.

    Uniform credit gives every token of a trace the same ``A``; the gradient of ``log p(y_t)``
    with respect to the logits is ``e_y - p``, of L1 size ``2 (1 - p(y_t))``, so a token the
    policy already emits with ``p ~ 1`` receives almost none of the update."""
    mask = response_mask.float()
    return advantages.float().abs()[:, None] * (1.0 - token_p.float()) * mask


def token_kinds(
    segment_ids: torch.Tensor,
    rewards: torch.Tensor,
    error_segments: list[int | None],
    answer_segments: list[int | None],
) -> torch.Tensor:
    """Each response token's kind (an index into :data:`KINDS`), ``-1`` on padding.

    Args:
        segment_ids: ``(B, T)`` 0-based segment of each token, ``-1`` on padding.
        rewards: ``(B,)``; a reward ``>= 1`` is a right trace.
        error_segments: per row, the 0-based segment holding the first wrong line, or None where
            the verifier gives no label (or says no line is wrong).
        answer_segments: per row, the 0-based segment that is the final answer line, or None.
    """
    B, T = segment_ids.shape
    kinds = torch.full((B, T), -1, dtype=torch.long)
    seg = segment_ids.cpu()
    for row in range(B):
        ids = seg[row]
        real = ids >= 0
        answer = answer_segments[row]
        is_answer = (ids == answer) & real if answer is not None else torch.zeros_like(real)
        if float(rewards[row]) >= SUCCESS:
            kinds[row] = torch.where(is_answer, KIND["right_answer"], KIND["right_steps"])
        elif error_segments[row] is None:
            kinds[row] = torch.where(is_answer, KIND["wrong_answer"], KIND["wrong_unlabelled"])
        else:
            err = error_segments[row]
            row_kinds = torch.full((T,), KIND["after_error"], dtype=torch.long)
            row_kinds[is_answer] = KIND["wrong_answer"]
            row_kinds[ids < err] = KIND["correct_prefix"]
            row_kinds[ids == err] = KIND["first_error"]
            kinds[row] = row_kinds
        kinds[row][~real] = -1
    return kinds


def row_kind_inputs(batch: RolloutBatch, segmenter) -> tuple[list[int | None], list[int | None]]:
    """``(error_segments, answer_segments)`` of :func:`token_kinds` for a segmented batch: the
    segment holding the verifier's first wrong line (:func:`rredcot.methods.oracle.
    first_error_segment`, 0-based here; a wrong line past the text, such as a missing answer
    line, belongs to the last segment), and the segment where ``segmenter`` finds the final
    answer line (``Segmenter.find_answer``)."""
    errors: list[int | None] = []
    answers: list[int | None] = []
    for row, text in enumerate(batch.completions):
        starts = batch.segment_char_starts[row]
        label = batch.verdicts[row].first_error_step if batch.verdicts else None
        if not starts or label is None or label < 0:
            errors.append(None)
        else:
            errors.append(first_error_segment(text, starts, label) - 1)
        at = segmenter.find_answer(text) if starts else None
        answers.append(
            None if at is None else max(0, int(np.searchsorted(starts, at, "right")) - 1)
        )
    return errors, answers


def per_unit_sums(
    labels: torch.Tensor,
    weights: torch.Tensor,
    units: torch.Tensor,
    num_units: int,
    num_labels: int,
) -> np.ndarray:
    """``out[u, l]`` = the sum of ``weights`` over the entries of unit ``u`` with label ``l``
    (entries labelled ``-1`` or outside ``[0, num_labels)`` are left out). ``labels``,
    ``weights``: ``(B, T)`` (or ``(B,)``); ``units``: ``(B,)`` the unit (prompt) of each row."""
    labels = labels.cpu().long()
    weights = weights.detach().cpu().double()
    if labels.dim() == 1:
        labels, weights = labels[:, None], weights[:, None]
    unit = units.cpu().long()[:, None].expand_as(labels)
    keep = (labels >= 0) & (labels < num_labels)
    flat = unit[keep] * num_labels + labels[keep]
    out = torch.zeros(num_units * num_labels, dtype=torch.float64)
    out.index_add_(0, flat, weights[keep])
    return out.view(num_units, num_labels).numpy()


def label_shares(num: np.ndarray) -> np.ndarray:
    """Each label's share of the total, ``num.sum(0) / num.sum()`` (NaN for an empty total)."""
    total = num.sum()
    return num.sum(0) / total if total > 0 else np.full(num.shape[1], np.nan)


def ratio_interval(
    num: np.ndarray,
    den: np.ndarray | None = None,
    reps: int = 2000,
    seed: int = 0,
    confidence: float = CONFIDENCE,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Point estimate and percentile-bootstrap interval (units resampled with replacement) of
    ``sum_u num[u, l] / sum_u den[u, l]`` for every label ``l``.

    ``num``: ``(U, L)`` per-unit sums. ``den``: ``(U, L)`` or ``(U,)`` per-unit denominators;
    None gives shares, ``den[u] = sum_l num[u, l]``. Returns ``(point, lo, hi)``, each ``(L,)``;
    NaN where a denominator is 0; with ``reps = 0`` the interval is NaN."""
    num = np.asarray(num, dtype=float)
    if num.ndim == 1:
        num = num[:, None]
    den = num.sum(1) if den is None else np.asarray(den, dtype=float)
    if den.ndim == 1:
        den = np.repeat(den[:, None], num.shape[1], axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        point = num.sum(0) / den.sum(0)
    point = np.where(den.sum(0) > 0, point, np.nan)
    units = num.shape[0]
    if reps <= 0 or units == 0:
        nan = np.full(num.shape[1], np.nan)
        return point, nan, nan
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, units, size=(reps, units))
    counts = np.stack([np.bincount(i, minlength=units) for i in idx])  # (reps, U)
    with np.errstate(invalid="ignore", divide="ignore"):
        boots = (counts @ num) / (counts @ den)
    alpha = (1.0 - confidence) / 2
    lo = np.nanquantile(boots, alpha, axis=0) if np.isfinite(boots).any() else point * np.nan
    hi = np.nanquantile(boots, 1 - alpha, axis=0) if np.isfinite(boots).any() else point * np.nan
    return point, np.where(np.isnan(point), np.nan, lo), np.where(np.isnan(point), np.nan, hi)


def clopper_pearson(k: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Exact (Clopper-Pearson) interval of a binomial proportion ``k / n``
    (``scipy.stats.binomtest``); NaN for ``n = 0``."""
    if n == 0:
        return float("nan"), float("nan")
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(confidence_level=confidence, method="exact")
    return float(ci.low), float(ci.high)


def _subset_agreement(values: list[float], size: int) -> tuple[float, float, float]:
    """For one prompt's rewards: the probability that ``size`` of them drawn without replacement
    all agree, all are right, all are wrong (exact: counts of equal rewards, hypergeometric)."""
    total = math.comb(len(values), size)
    counts: dict[float, int] = {}
    for v in values:
        counts[round(v, 9)] = counts.get(round(v, 9), 0) + 1
    agree = right = wrong = 0.0
    for v, c in counts.items():
        p = math.comb(c, size) / total
        agree += p
        right += p if v >= SUCCESS else 0.0
        wrong += p if v <= 0.0 else 0.0
    return agree, right, wrong


def agreement_by_group_size(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    sizes: list[int],
    reps: int = 2000,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """The share of groups whose rewards all agree (and all right, all wrong), at every group
    size in ``sizes``.

    At the sampled size ``G`` a group agrees or not: the share is a binomial proportion over the
    prompts, with its Clopper-Pearson interval. At ``G' < G`` each prompt's share is the exact
    probability that ``G'`` of its ``G`` samples drawn without replacement agree (the mean over
    every ``G'``-subset, hypergeometric: ``sum_v C(n_v, G') / C(G, G')`` over the distinct reward
    values ``v`` held by ``n_v`` samples), and the interval is a bootstrap over prompts.
    "All right": every reward ``>= 1``; "all wrong": every reward ``<= 0``.
    """
    by_group: dict[int, list[float]] = {}
    for r, g in zip(rewards.tolist(), group_ids.tolist()):
        by_group.setdefault(int(g), []).append(float(r))
    groups = list(by_group.values())
    out = []
    for size in sizes:
        usable = [g for g in groups if len(g) >= size]
        per = np.array([_subset_agreement(g, size) for g in usable]).reshape(-1, 3)
        full = all(len(g) == size for g in usable)
        row: dict[str, Any] = {"group_size": size, "groups": len(usable), "exact_subsets": not full}
        point, lo, hi = ratio_interval(per, np.ones(len(usable)), reps=reps, seed=seed)
        for j, name in enumerate(("agree", "all_right", "all_wrong")):
            row[name] = float(point[j])
            if full:  # whole groups: each prompt agrees or not
                row[f"{name}_ci"] = list(clopper_pearson(int(round(per[:, j].sum())), len(usable)))
            else:
                row[f"{name}_ci"] = [float(lo[j]), float(hi[j])]
        row["interval"] = "clopper-pearson" if full else "bootstrap over prompts"
        out.append(row)
    return out


def step_credit_figures(
    values: torch.Tensor,
    value_mask: torch.Tensor,
    rewards: torch.Tensor,
    segment_ids: torch.Tensor,
    response_mask: torch.Tensor,
    token_p: torch.Tensor,
    grpo_adv: torch.Tensor,
    prefix_ends: list[int | None],
) -> dict[str, np.ndarray]:
    """Per-trace sums behind the Monte Carlo figures (docs/diagnose.md), to be pooled over
    traces (:func:`ratio_interval`).

    Args:
        values, value_mask: ``(B, S+1)`` ``V(s_k)`` (``V(s_n)`` is replaced by ``R``).
        rewards: ``(B,)``. segment_ids, response_mask, token_p: ``(B, T)``.
        grpo_adv: ``(B,)`` GRPO's advantage (:func:`grpo_advantages`).
        prefix_ends: per row, the 0-based segment where the still-right prefix ends (the first
            wrong segment; the prefix is the segments before it), None for rows left out.

    Returns per-row arrays ``(B,)``:

    - ``outcome_sq``: ``sum_t (R - V(s_0))^2``, the mean square of the outcome advantage with the
      true prompt value as baseline (GRPO's advantage in expectation);
    - ``step_sq``: ``sum_t r_k(t)^2`` with ``r_k = V(s_k) - V(s_{k-1})`` (step-level credit);
    - ``outcome_sq_grad`` / ``step_sq_grad``: the same weighted by ``(1 - p_t)^2``, the squared
      size of the token's logit gradient per unit of advantage (what reaches the update);
    - ``prefix_tokens`` / ``tokens``: response tokens in the still-right prefix / in the trace;
    - ``grpo_prefix`` / ``grpo_blame``: ``|A| (1 - p)`` summed over the prefix / the trace;
    - ``step_prefix`` / ``step_blame``: ``max(-r_k, 0) (1 - p)`` summed over the prefix / trace
      (the blame step-level credit would give, through the same softmax).
    """
    seg_r, _ = credit_algebra.redistribute(values.double(), value_mask, rewards.double())
    mask = response_mask.double().cpu()
    step_tok = credit_algebra.segments_to_tokens(
        seg_r.cpu(), segment_ids.cpu(), response_mask.cpu()
    ).double()
    outcome = (rewards.double().cpu() - values[:, 0].double().cpu())[:, None] * mask
    u = (1.0 - token_p.double().cpu()) * mask
    seg = segment_ids.cpu()
    B = values.shape[0]
    prefix = torch.zeros_like(mask, dtype=torch.bool)
    for row, end in enumerate(prefix_ends):
        if end is not None:
            prefix[row] = (seg[row] >= 0) & (seg[row] < end)
    grpo = grpo_adv.double().cpu().abs()[:, None] * u
    step_blame = (-step_tok).clamp_min(0) * u
    out = {
        "outcome_sq": (outcome**2).sum(1),
        "step_sq": (step_tok**2 * mask).sum(1),
        "outcome_sq_grad": (outcome**2 * u**2).sum(1),
        "step_sq_grad": (step_tok**2 * u**2).sum(1),
        "tokens": mask.sum(1),
        "prefix_tokens": (prefix * mask).sum(1),
        "grpo_prefix": (grpo * prefix).sum(1),
        "grpo_blame": grpo.sum(1),
        "step_prefix": (step_blame * prefix).sum(1),
        "step_blame": step_blame.sum(1),
    }
    return {k: v.numpy().reshape(B) for k, v in out.items()}


# the verdict's thresholds (docs/diagnose.md, "the verdict"); REWARD_LOW and ALL_WRONG_HIGH are
# --credit auto's too (rredcot.credit_choice)
ALL_RIGHT_HIGH = 0.5  # share of all-right groups at G above which the prompts are too easy
PREFIX_LOW, PREFIX_HIGH = 0.15, 0.30  # GRPO's gradient share on still-right prefixes
UNCERTAIN_LOW, UNCERTAIN_HIGH = 1.0, 4.0  # uncertain decisions per trace
VARIANCE_LOW, VARIANCE_HIGH = 0.2, 0.5  # share of the advantage's mean square step credit removes


def verdict(figures: dict[str, Any]) -> tuple[str, list[str]]:
    """A plain-words verdict and its reasons from the headline figures (``None`` = not measured):

    ``mean_reward``, ``all_wrong``, ``all_right`` (shares of groups at G), ``prefix_share`` and ``prefix_tokens``
    (GRPO's gradient share and token share of the still-right prefix of wrong traces),
    ``error_share`` (the first wrong step's gradient share), ``uncertain_per_trace``,
    ``uncertain_p``, ``variance_removed`` (Monte Carlo: the share of the logit gradient's mean
    square that step-level values remove, ``gradient_variance_removed`` of the report).

    Each figure past a threshold (module constants, docs/diagnose.md) is a reason for or against;
    the verdict: at least two reasons for and more for than against: "finer credit is likely to
    help"; no reason for and at least one against: "little to win"; otherwise "may help a little".
    """
    found = [
        *_outcome_reasons(figures),
        *_prefix_reasons(figures),
        *_uncertainty_reasons(figures),
        *_variance_reasons(figures),
    ]
    pros = [text for sign, text in found if sign == "+"]
    cons = [text for sign, text in found if sign == "-"]
    notes = [text for sign, text in found if sign == " "]
    if len(pros) >= 2 and len(pros) > len(cons):
        head = "finer credit is likely to help this run"
    elif not pros and cons:
        head = "credit assignment has little to win here"
    else:
        head = "finer credit may help a little; measure a ceiling before paying for it"
    reasons = [f"+ {p}" for p in pros] + [f"- {c}" for c in cons] + [f"  {n}" for n in notes]
    return head, reasons


# A reason of the verdict: ("+", text) for finer credit, ("-", text) against, (" ", text) a note.
_Reason = tuple[str, str]


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _outcome_reasons(figures: dict[str, Any]) -> list[_Reason]:
    """Reasons from the mean reward and the shares of all-wrong and all-right groups."""
    reasons: list[_Reason] = []
    wrong, right = figures.get("all_wrong"), figures.get("all_right")
    mean_reward = figures.get("mean_reward")
    if mean_reward is not None and mean_reward < REWARD_LOW:
        reasons.append(
            (
                "-",
                f"the policy solves only {_pct(mean_reward)} of its samples: an outcome reward "
                "gives almost no signal to any credit method; warm-start it or use easier "
                "prompts first",
            )
        )
    elif wrong is not None and wrong >= ALL_WRONG_HIGH:
        reasons.append(
            (
                "+",
                f"{_pct(wrong)} of groups are all wrong: GRPO learns nothing from them; "
                "credit that blames the line where a trace broke can, without generating: "
                f"where the task has reference solutions, {flow_flags()} (measured ahead of "
                "GRPO where the value head was not; --credit auto, the default, chooses it; "
                "docs/diagnose.md)",
            )
        )
    if right is not None and right >= ALL_RIGHT_HIGH:
        reasons.append(
            (
                " ",
                f"{_pct(right)} of groups are all right: those prompts are too easy for this "
                "policy and give no update whatever the credit; harder prompts help more than "
                "finer credit",
            )
        )
    return reasons


def _prefix_reasons(figures: dict[str, Any]) -> list[_Reason]:
    """Reasons from GRPO's gradient share on the still-right prefix of wrong traces."""
    prefix, tokens = figures.get("prefix_share"), figures.get("prefix_tokens")
    error = figures.get("error_share")
    if prefix is None:
        return []
    where = (
        f"only {_pct(prefix)} of GRPO's gradient on wrong traces lands on their still-right "
        f"prefix ({_pct(tokens)} of their tokens)"
        if tokens is not None
        else f"{_pct(prefix)} of GRPO's gradient on wrong traces lands on their still-right prefix"
    )
    if prefix <= PREFIX_LOW:
        return [
            (
                "-",
                where
                + (f", and {_pct(error)} on the step that failed" if error is not None else "")
                + ": the softmax already points uniform credit at the uncertain tokens",
            )
        ]
    if prefix >= PREFIX_HIGH:
        return [
            (
                "+",
                f"{_pct(prefix)} of GRPO's gradient on wrong traces blames their still-right "
                f"prefix ({_pct(tokens or float('nan'))} of their tokens): uniform credit spends "
                "much of its update on steps that were right",
            )
        ]
    return []


def _uncertainty_reasons(figures: dict[str, Any]) -> list[_Reason]:
    """Reasons from the uncertain decisions per trace."""
    uncertain = figures.get("uncertain_per_trace")
    thr = figures.get("uncertain_p", DEFAULT_UNCERTAIN_P)
    if uncertain is None:
        return []
    if uncertain < UNCERTAIN_LOW:
        return [
            (
                "-",
                f"a trace holds {uncertain:.1f} uncertain decisions (p < {thr:g}) on average: "
                "there are few choices for credit to sort out",
            )
        ]
    if uncertain >= UNCERTAIN_HIGH:
        return [
            (
                "+",
                f"a trace holds {uncertain:.1f} uncertain decisions (p < {thr:g}) on average: "
                "many choices share one outcome, which is where segment credit pays",
            )
        ]
    return []


def _variance_reasons(figures: dict[str, Any]) -> list[_Reason]:
    """Reasons from the share of the logit gradient's mean square that step values remove."""
    removed = figures.get("variance_removed")
    if removed is None or not math.isfinite(removed):
        return []
    if removed >= VARIANCE_HIGH:
        return [
            (
                "+",
                f"step-level values would remove {_pct(removed)} of the logit gradient's mean "
                "square (Monte Carlo)",
            )
        ]
    if removed <= VARIANCE_LOW:
        return [
            (
                "-",
                f"step-level values would remove only {_pct(removed)} of the logit gradient's "
                "mean square (Monte Carlo): the noise they cut sits on tokens the policy is sure "
                "of",
            )
        ]
    return []


# ---------------------------------------------------------------------------------------------
# the forward the figures read


LOGIT_BUDGET = 64_000_000
"""Logits (rows x response length x vocabulary) scored per forward in :func:`token_probabilities`;
a real model's vocabulary makes one forward over every row of a big batch run out of memory
(256 rows x 72 tokens x 49k vocabulary: 3.6 GB per float32 copy)."""


@torch.no_grad()
def token_probabilities(
    policy, batch: RolloutBatch, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p(y_t) (B, T), entropy (B, T))`` of the sampled response tokens under ``policy`` at
    the sampling ``temperature`` (logits / T, as the loss scores them); no-grad forwards over
    as many rows at a time as :data:`LOGIT_BUDGET` allows."""
    vocab = policy.get_output_embeddings().weight.shape[0]
    rows = max(1, LOGIT_BUDGET // max(1, batch.response_len * vocab))
    probs, entropies = [], []
    with eval_mode(policy):
        for start in range(0, batch.size, rows):
            part = slice(start, start + rows)
            fwd = policy_forward(
                policy,
                batch.input_ids[part],
                batch.attention_mask[part],
                batch.prompt_len,
                temperature=temperature,
                with_entropy=True,
            )
            probs.append(fwd.logprobs.exp())
            entropies.append(fwd.entropy)
    return torch.cat(probs), torch.cat(entropies)


# ---------------------------------------------------------------------------------------------
# the report


@dataclass
class DiagnoseReport:
    """What :func:`diagnose` measured: settings, figures, verdict. ``to_json()`` is the whole of
    it (``diagnose.json``); ``summary()`` the terminal text; ``write(out_dir)`` the files."""

    settings: dict[str, Any]
    groups: dict[str, Any]
    gradient: dict[str, Any]
    trace: dict[str, Any]
    monte_carlo: dict[str, Any] | None
    estimators: list[dict[str, Any]] | None
    verdict: str
    reasons: list[str]
    headline: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, path: str | Path) -> DiagnoseReport:
        """A report read back from its ``diagnose.json`` (to redraw or compare it)."""
        return cls(**json.loads(Path(path).read_text(encoding="utf-8")))

    def to_json(self, indent: int | None = 1) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def summary(self) -> str:
        return summary_text(self)

    def write(self, out_dir: str | Path) -> list[Path]:
        """Write ``diagnose.json``, ``diagnose.md`` and ``diagnose.png`` into ``out_dir``."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "diagnose.json", out / "diagnose.md"]
        _write_atomic(paths[0], self.to_json() + "\n")
        _write_atomic(paths[1], self.summary())
        picture = plot_report(self, out / "diagnose.png")
        return paths + ([picture] if picture else [])


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(float(x)) else None
    if isinstance(x, np.integer):
        return int(x)
    if isinstance(x, torch.Tensor):
        return _jsonable(x.tolist())
    return x


def _fmt(x: Any, spec: str = ".1%") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return format(x, spec)


def _ci(entry: dict[str, Any], spec: str = ".1%") -> str:
    return f"{_fmt(entry['value'], spec)} [{_fmt(entry['lo'], spec)}, {_fmt(entry['hi'], spec)}]"


def summary_text(report: DiagnoseReport) -> str:
    """The report in plain text (Markdown): verdict first, then each figure with its interval."""
    lines = [
        *_summary_head(report),
        *_groups_table(report.groups),
        *_gradient_tables(report.gradient, report.trace),
        *_trace_summary(report.settings, report.trace),
        *_monte_carlo_summary(report.monte_carlo),
        *_estimators_table(report.estimators),
        "",
        "Figures defined in docs/diagnose.md; the numbers are in diagnose.json.",
    ]
    return "\n".join(lines) + "\n"


def _summary_head(report: DiagnoseReport) -> list[str]:
    """The verdict, its reasons and what was sampled."""
    s = report.settings
    return [
        f"# rredcot diagnose: {report.verdict}",
        "",
        *[f"{r}" for r in report.reasons],
        "",
        f"Policy `{s['policy']}`, task `{s['task']}` {s.get('task_params') or ''}, "
        f"{s['prompts']} prompts x {s['samples']} samples at temperature {s['temperature']:g} "
        f"(top-p {s['top_p']:g}, {s['max_new_tokens']} new tokens), segmenter `{s['segmenter']}`;"
        f" mean reward {_fmt(s['mean_reward'], '.3f')}; {s['seconds']:.0f} s.",
    ]


def _groups_table(groups: dict[str, Any]) -> list[str]:
    """Section 1: the shares of agreeing groups at every group size."""
    lines = [
        "",
        "## 1. Where GRPO is blind: groups whose rewards all agree",
        "",
        "| G | agree | all wrong | all right | interval |",
        "|---|---|---|---|---|",
    ]
    for row in groups["by_group_size"]:

        def cell(name: str, row=row) -> str:
            lo, hi = row[f"{name}_ci"]
            return f"{_fmt(row[name])} [{_fmt(lo)}, {_fmt(hi)}]"

        lines.append(
            f"| {row['group_size']} | {cell('agree')} | {cell('all_wrong')} | "
            f"{cell('all_right')} | {row['interval']} |"
        )
    return lines


def _gradient_tables(g: dict[str, Any], tr: dict[str, Any]) -> list[str]:
    """Section 2: where the gradient mass lands by segment kind, relative position (with the
    entropy there) and segment position."""
    lines = [
        "",
        "## 2. Where GRPO's update lands (traces of groups whose rewards differ)",
        "",
        f"Logit-gradient mass |A|(1 - p) per token; {g['wrong_traces']} wrong traces "
        f"({g['labelled_wrong_traces']} with a step label), {g['right_traces']} right traces.",
        "",
        "| kind | share of tokens | share of gradient mass | of wrong traces: tokens | of wrong "
        "traces: gradient | mean 1 - p | uncertain tokens |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in KINDS:
        k = g["kinds"][name]
        w = g["wrong_kinds"].get(name)
        lines.append(
            f"| {name} | {_ci(k['tokens'])} | {_ci(k['mass'])} | "
            + (f"{_ci(w['tokens'])} | {_ci(w['mass'])}" if w else "— | —")
            + f" | {_fmt(k['mean_1_minus_p'], '.4f')} | {_fmt(k['uncertain_share'])} |"
        )
    lines += [
        "",
        "Along the trace (relative position, all traces of mixed groups):",
        "",
        "| position | share of tokens | share of gradient mass | mean entropy (nats) |",
        "|---|---|---|---|",
    ]
    for b in g["positions"]:
        lines.append(
            f"| {b['label']} | {_fmt(b['tokens'])} | {_ci(b['mass'])} | "
            f"{_fmt(tr['entropy_by_position'][b['index']]['value'], '.3f')} |"
        )
    lines += [
        "",
        "By segment position (1 = first segment; the last row pools the later ones):",
        "",
        "| segment | share of tokens | share of gradient mass |",
        "|---|---|---|",
    ]
    used = [b for b in g["segments"] if b["tokens"] and b["tokens"] > 0]
    for b in used or g["segments"]:
        lines.append(f"| {b['label']} | {_fmt(b['tokens'])} | {_ci(b['mass'])} |")
    return lines


def _trace_summary(s: dict[str, Any], tr: dict[str, Any]) -> list[str]:
    """The uncertain decisions, entropy and length of a trace."""
    u = tr["uncertain_per_trace"]
    return [
        "",
        f"Uncertain decisions (sampled tokens with p < {s['uncertain_p']:g}) per trace: "
        f"{_ci(u, '.2f')}; traces with none: {_fmt(tr['traces_without_uncertain'])}; mean "
        f"entropy per token {_fmt(tr['mean_entropy'], '.3f')} nats; tokens per trace "
        f"{_fmt(tr['tokens_per_trace'], '.1f')}.",
    ]


def _monte_carlo_summary(mc: dict[str, Any] | None) -> list[str]:
    """Section 3: what step-level values would change, or that it was not measured."""
    lines = ["", "## 3. What better credit could change (Monte Carlo)", ""]
    if not mc:
        return lines + ["Not measured (--mc-traces 0)."]
    return lines + [
        f"{mc['traces']} traces ({mc['wrong_traces']} wrong), K = {mc['k']} continuations "
        f"per boundary, {mc['continuations']} continuations, "
        f"{mc['generated_tokens']:.0f} generated tokens, {mc['seconds']:.0f} s.",
        "",
        f"- share of the per-token advantage's mean square that step-level values remove: "
        f"{_ci(mc['variance_removed'])}; of the logit gradient's (weighted by (1 - p)^2): "
        f"{_ci(mc['gradient_variance_removed'])}",
        f"- still-right prefix of wrong traces ({mc['prefix_definition']}): "
        f"{_ci(mc['prefix_tokens'])} of their tokens; GRPO's blame there "
        f"{_ci(mc['grpo_prefix_blame'])}; step-level credit's blame there "
        f"{_ci(mc['step_prefix_blame'])}",
    ]


def _estimators_table(estimators: list[dict[str, Any]] | None) -> list[str]:
    """Section 4 (only where estimators were scored): each against the Monte Carlo values."""
    if not estimators:
        return []
    lines = [
        "",
        "## 4. Cheap estimators against the Monte Carlo values",
        "",
        "| estimator | ρ pooled | ρ per trace | sign agr. | value MSE | error_acc | "
        "correct_acc | F1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for e in estimators:
        lines.append(
            f"| {e['method']} | {_fmt(e.get('spearman_pooled'), '.3f')} | "
            f"{_fmt(e.get('spearman_trace_mean'), '.3f')} | "
            f"{_fmt(e.get('sign_agreement'), '.3f')} | {_fmt(e.get('value_mse'), '.4f')} | "
            f"{_fmt(e.get('error_acc'), '.3f')} | {_fmt(e.get('correct_acc'), '.3f')} | "
            f"{_fmt(e.get('f1'), '.3f')} |"
        )
    return lines


def plot_report(report: DiagnoseReport, path: str | Path) -> Path | None:
    """``diagnose.png``: GRPO's gradient mass along the trace stacked by segment kind, token
    share against gradient share per kind (with intervals), and entropy and 1 - p along the
    trace."""
    import matplotlib  # only when a picture is drawn (the Agg backend)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g, tr = report.gradient, report.trace
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    labels = [b["label"] for b in g["positions"]]
    x = np.arange(len(labels))
    bottom = np.zeros(len(labels))
    by_kind = g["mass_by_position_and_kind"]
    colors = plt.get_cmap("tab10")
    for i, name in enumerate(KINDS):
        heights = np.array([by_kind[name][j] for j in range(len(labels))], dtype=float)
        heights = np.nan_to_num(heights)
        if heights.sum() <= 0:
            continue
        ax.bar(x, heights, bottom=bottom, label=name, color=colors(i))
        bottom += heights
    tokens = np.array([b["tokens"] for b in g["positions"]], dtype=float)
    ax.plot(x, tokens, "k--", marker="o", markersize=3, label="share of tokens")
    top = np.nanmax(np.concatenate([bottom, tokens, [0.0]]))
    ax.set_ylim(0, 1.6 * top if top > 0 else 1.0)  # room for the legend above the bars
    ax.set_xticks(x, labels, rotation=45, fontsize=7)
    ax.set_xlabel("relative position along the trace")
    ax.set_title("GRPO gradient mass |A|(1-p) along the trace")
    ax.legend(fontsize=6, ncol=3, loc="upper center")

    ax = axes[1]
    kinds = [k for k in KINDS if (g["kinds"][k]["tokens"]["value"] or 0) > 0]
    xk = np.arange(len(kinds))
    for off, key, name in ((-0.2, "tokens", "share of tokens"), (0.2, "mass", "share of gradient")):
        vals = np.array([g["kinds"][k][key]["value"] for k in kinds], dtype=float)
        lo = np.array([g["kinds"][k][key]["lo"] for k in kinds], dtype=float)
        hi = np.array([g["kinds"][k][key]["hi"] for k in kinds], dtype=float)
        err = np.nan_to_num(np.vstack([vals - lo, hi - vals]))
        ax.bar(xk + off, vals, width=0.4, yerr=err, capsize=2, label=name)
    ax.set_xticks(xk, kinds, rotation=30, fontsize=7, ha="right")
    ax.set_title("per segment kind (traces of mixed groups)")
    ax.legend(fontsize=7, loc="upper right")

    ax = axes[2]
    ent = [tr["entropy_by_position"][j]["value"] for j in range(len(labels))]
    unc = [tr["one_minus_p_by_position"][j]["value"] for j in range(len(labels))]
    ax.plot(x, ent, marker="o", markersize=3, label="entropy (nats)")
    ax.plot(x, unc, marker="s", markersize=3, label="mean 1 - p(y_t)")
    ax.set_xticks(x, labels, rotation=45, fontsize=7)
    ax.set_title("the policy's uncertainty along the trace")
    ax.legend(fontsize=7)
    fig.suptitle(f"rredcot diagnose: {report.verdict}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=100, format="png")
    tmp.replace(path)
    plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------------
# the measurement


@dataclass
class Chunk:
    """One sampled chunk of prompts with what the figures read."""

    batch: RolloutBatch
    units: torch.Tensor  # (B,) global prompt index of each row
    token_p: torch.Tensor  # (B, T)
    entropy: torch.Tensor  # (B, T)
    advantages: torch.Tensor  # (B,) GRPO's
    mixed: torch.Tensor  # (B,) bool: the row's group has rewards that differ
    kinds: torch.Tensor  # (B, T)
    error_segments: list[int | None]


def _entry(point, lo, hi, j: int) -> dict[str, float]:
    return {"value": float(point[j]), "lo": float(lo[j]), "hi": float(hi[j])}


def _bins(mask: torch.Tensor, bins: int) -> torch.Tensor:
    """``(B, T)`` relative-position bin of each response token: ``floor(bins * t / length)``."""
    length = mask.sum(1, keepdim=True).clamp_min(1)
    t = torch.arange(mask.shape[1])[None, :].expand_as(mask)
    out = torch.div(t * bins, length, rounding_mode="floor").long()
    return torch.where(mask.bool(), out, torch.full_like(out, -1))


def chunk_from_batch(
    batch: RolloutBatch,
    first_unit: int,
    token_p: torch.Tensor,
    entropy: torch.Tensor,
    segmenter,
) -> Chunk:
    """What the figures read of one segmented batch: its prompts are units ``first_unit +
    group_id``; ``token_p``, ``entropy``: ``(B, T)`` (:func:`token_probabilities`)."""
    rewards, group_ids = batch.rewards.cpu(), batch.group_ids.cpu()
    _, std = group_mean_std(rewards.float(), group_ids)
    errors, answers = row_kind_inputs(batch, segmenter)
    return Chunk(
        batch=batch,
        units=group_ids + first_unit,
        token_p=token_p.cpu(),
        entropy=entropy.cpu(),
        advantages=grpo_advantages(rewards, group_ids),
        mixed=std > 0,
        kinds=token_kinds(batch.segment_ids, rewards, errors, answers),
        error_segments=errors,
    )


def _sample_chunks(policy, tokenizer, task, problems, segmenter, cfg, s, log) -> list[Chunk]:
    """Sample, verify, segment and score every chunk of prompts."""
    chunks: list[Chunk] = []
    bar = tqdm(
        total=len(problems), desc="sampling", unit="prompt", disable=not cfg.progress, leave=False
    )
    for i in range(0, len(problems), cfg.chunk_prompts):
        part = problems[i : i + cfg.chunk_prompts]
        torch.manual_seed(cfg.seed + i)
        batch, _ = build_rollout_batch(
            policy,
            tokenizer,
            task,
            part,
            segmenter,
            num_generations=cfg.samples,
            max_new_tokens=s["max_new_tokens"],
            temperature=s["temperature"],
            top_p=s["top_p"],
        )
        token_p, entropy = token_probabilities(policy, batch, s["temperature"])
        if segmenter.uses_entropy:
            batch = segment_batch(batch, tokenizer, segmenter, entropy)
        chunks.append(chunk_from_batch(batch, i, token_p, entropy, segmenter))
        bar.update(len(part))
    bar.close()
    return chunks


def gradient_figures(chunks: list[Chunk], cfg: DiagnoseConfig, num_units: int) -> dict:
    """Section 2: token and gradient-mass shares per kind, relative position and segment."""
    acc, counts = _gradient_sums(chunks, cfg, num_units)
    reps, seed = cfg.bootstrap, cfg.seed
    return {
        **counts,
        **_kind_shares(acc, reps, seed),
        **_position_shares(acc, cfg.position_bins, reps, seed),
        "segments": _segment_shares(acc, cfg.max_positions, reps, seed),
    }


def _gradient_sums(
    chunks: list[Chunk], cfg: DiagnoseConfig, num_units: int
) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    """Per-prompt sums ``(U, labels)`` of tokens and gradient mass over the traces of mixed
    groups, by kind, relative position and segment (and the wrong traces' by kind); and the
    counts of wrong, right and step-labelled wrong traces."""
    L = len(KINDS)
    bins, positions = cfg.position_bins, cfg.max_positions
    acc: dict[str, np.ndarray] = {}

    def add(name: str, labels, weights, units, width):
        part = per_unit_sums(labels, weights, units, num_units, width)
        acc[name] = acc[name] + part if name in acc else part

    wrong_traces = right_traces = labelled = 0
    for c in chunks:
        b = c.batch
        mask = b.response_mask.cpu().float()
        live = mask * c.mixed[:, None].float()  # tokens of traces GRPO updates
        mass = grpo_gradient_mass(c.advantages, c.token_p, live)
        kinds = torch.where(live.bool(), c.kinds, torch.full_like(c.kinds, -1))
        wrong = (b.rewards.cpu() < SUCCESS) & c.mixed
        wrong_kinds = torch.where(wrong[:, None], kinds, torch.full_like(kinds, -1))
        u = c.units
        add("kind_tokens", kinds, live, u, L)
        add("kind_mass", kinds, mass, u, L)
        add("kind_one_minus_p", kinds, (1 - c.token_p) * live, u, L)
        add("kind_uncertain", kinds, (c.token_p < cfg.uncertain_p).float() * live, u, L)
        add("wrong_tokens", wrong_kinds, live, u, L)
        add("wrong_mass", wrong_kinds, mass, u, L)
        pos = torch.where(live.bool(), _bins(mask, bins), torch.full_like(kinds, -1))
        add("pos_tokens", pos, live, u, bins)
        add("pos_mass", pos, mass, u, bins)
        pos_kind = torch.where(pos >= 0, pos * L + kinds.clamp_min(0), pos)
        add("pos_kind_mass", pos_kind, mass, u, bins * L)
        seg = torch.where(
            live.bool(), b.segment_ids.cpu().clamp(max=positions - 1), torch.full_like(kinds, -1)
        )
        add("seg_tokens", seg, live, u, positions)
        add("seg_mass", seg, mass, u, positions)
        wrong_traces += int(wrong.sum())
        right_traces += int(((b.rewards.cpu() >= SUCCESS) & c.mixed).sum())
        labelled += sum(
            1 for r in range(b.size) if bool(wrong[r]) and c.error_segments[r] is not None
        )
    counts = {
        "wrong_traces": wrong_traces,
        "right_traces": right_traces,
        "labelled_wrong_traces": labelled,
    }
    return acc, counts


def _kind_shares(acc: dict[str, np.ndarray], reps: int, seed: int) -> dict[str, Any]:
    """Each segment kind's share of tokens and gradient mass (all traces and wrong ones), with
    its mean 1 - p and share of uncertain tokens."""
    tok_share = label_shares(acc["kind_tokens"])
    mass_pt = ratio_interval(acc["kind_mass"], reps=reps, seed=seed)
    tok_pt = ratio_interval(acc["kind_tokens"], reps=reps, seed=seed)
    one_minus_p = ratio_interval(acc["kind_one_minus_p"], acc["kind_tokens"], reps=0)[0]
    uncertain = ratio_interval(acc["kind_uncertain"], acc["kind_tokens"], reps=0)[0]
    wrong_tok = ratio_interval(acc["wrong_tokens"], reps=reps, seed=seed)
    wrong_mass = ratio_interval(acc["wrong_mass"], reps=reps, seed=seed)
    kinds_out, wrong_out = {}, {}
    for j, name in enumerate(KINDS):
        kinds_out[name] = {
            "tokens": _entry(*tok_pt, j),
            "mass": _entry(*mass_pt, j),
            "mean_1_minus_p": float(one_minus_p[j]),
            "uncertain_share": float(uncertain[j]),
        }
        if name in WRONG_KINDS:
            wrong_out[name] = {"tokens": _entry(*wrong_tok, j), "mass": _entry(*wrong_mass, j)}
    return {
        "kinds": kinds_out,
        "wrong_kinds": wrong_out,
        "token_share_by_kind": {n: float(tok_share[j]) for j, n in enumerate(KINDS)},
    }


def _position_shares(acc: dict[str, np.ndarray], bins: int, reps: int, seed: int) -> dict[str, Any]:
    """Each relative-position bin's share of tokens and gradient mass, and the mass of every
    (bin, kind) pair."""
    L = len(KINDS)
    pos_mass = ratio_interval(acc["pos_mass"], reps=reps, seed=seed)
    pos_tok = label_shares(acc["pos_tokens"])
    total_mass = acc["pos_kind_mass"].sum()
    by_kind = acc["pos_kind_mass"].sum(0).reshape(bins, L) / (total_mass if total_mass else 1)
    return {
        "positions": [
            {
                "index": j,
                "label": f"{j / bins:.1f}-{(j + 1) / bins:.1f}",
                "tokens": float(pos_tok[j]),
                "mass": _entry(*pos_mass, j),
            }
            for j in range(bins)
        ],
        "mass_by_position_and_kind": {
            n: [float(by_kind[j, i]) for j in range(bins)] for i, n in enumerate(KINDS)
        },
    }


def _segment_shares(
    acc: dict[str, np.ndarray], positions: int, reps: int, seed: int
) -> list[dict[str, Any]]:
    """Each segment position's share of tokens and gradient mass (the last pools the later)."""
    seg_mass = ratio_interval(acc["seg_mass"], reps=reps, seed=seed)
    seg_tok = label_shares(acc["seg_tokens"])
    return [
        {
            "index": j + 1,
            "label": f"{j + 1}" if j < positions - 1 else f"{j + 1}+",
            "tokens": float(seg_tok[j]),
            "mass": _entry(*seg_mass, j),
        }
        for j in range(positions)
    ]


def trace_figures(chunks: list[Chunk], cfg: DiagnoseConfig, num_units: int) -> dict:
    """Entropy and 1 - p along the trace, uncertain decisions per trace (every trace)."""
    bins = cfg.position_bins
    ent = tok = one = None
    unc_num = np.zeros((num_units, 1))
    traces = np.zeros(num_units)
    none = np.zeros((num_units, 1))
    for c in chunks:
        mask = c.batch.response_mask.cpu().float()
        pos = _bins(mask, bins)
        parts = (
            per_unit_sums(pos, c.entropy * mask, c.units, num_units, bins),
            per_unit_sums(pos, mask, c.units, num_units, bins),
            per_unit_sums(pos, (1 - c.token_p) * mask, c.units, num_units, bins),
        )
        ent, tok, one = parts if ent is None else (ent + parts[0], tok + parts[1], one + parts[2])
        count = ((c.token_p < cfg.uncertain_p).float() * mask).sum(1)
        rows = torch.zeros_like(c.units)
        unc_num += per_unit_sums(rows, count, c.units, num_units, 1)
        none += per_unit_sums(rows, (count == 0).float(), c.units, num_units, 1)
        traces += per_unit_sums(rows, torch.ones(len(count)), c.units, num_units, 1)[:, 0]
    reps, seed = cfg.bootstrap, cfg.seed
    e = ratio_interval(ent, tok, reps=reps, seed=seed)
    o = ratio_interval(one, tok, reps=reps, seed=seed)
    u = ratio_interval(unc_num, traces, reps=reps, seed=seed)
    return {
        "entropy_by_position": [_entry(*e, j) for j in range(bins)],
        "one_minus_p_by_position": [_entry(*o, j) for j in range(bins)],
        "uncertain_per_trace": _entry(*u, 0),
        "traces_without_uncertain": float(none.sum() / max(traces.sum(), 1)),
        "mean_entropy": float(ent.sum() / max(tok.sum(), 1)),
        "tokens_per_trace": float(tok.sum() / max(traces.sum(), 1)),
    }


def _mc_subset(chunks: list[Chunk], cfg: DiagnoseConfig, budget: int) -> list[tuple[int, int]]:
    """A seeded random sample of up to ``cfg.mc_traces`` traces ``(chunk, row)`` with at least
    one segment."""
    rows = [
        (ci, r)
        for ci, c in enumerate(chunks)
        for r in range(c.batch.size)
        if len(c.batch.boundaries[r]) > 1
    ]
    return random.Random(cfg.seed).sample(rows, min(budget, len(rows)))


def _mc_cost(chunks: list[Chunk], picked: list[tuple[int, int]], k: int) -> tuple[int, int, float]:
    """``(unique prefixes, continuations, estimated generated tokens)`` of Monte Carlo values at
    every boundary ``s_0 .. s_{n-1}`` of the picked traces; a continuation of ``s_k`` is expected
    to be as long as the rest of its own trace (``length - b_k``, EOS included)."""
    seen: set = set()
    tokens = 0.0
    for ci, r in picked:
        b = chunks[ci].batch
        P = b.prompt_len
        keep = b.attention_mask[r, :P].bool()
        prompt = tuple(b.input_ids[r, :P][keep].tolist())
        length = int(b.response_mask[r].sum())
        for bk in b.boundaries[r][:-1]:
            key = (prompt, tuple(b.input_ids[r, P : P + bk].tolist()))
            if key in seen:
                continue
            seen.add(key)
            tokens += k * max(1, length - bk)
    return len(seen), len(seen) * k, tokens


def _monte_carlo(policy, tokenizer, task, chunks, cfg: DiagnoseConfig, s, rate, log):
    """Section 3 (and the batches and values section 4 scores against)."""
    picked, prefixes, conts, tokens = _mc_plan(chunks, cfg, rate, log)
    if not picked:
        return None, []
    t0 = time.perf_counter()
    by_chunk: dict[int, list[int]] = {}
    for ci, r in sorted(picked):
        by_chunk.setdefault(ci, []).append(r)
    bar = tqdm(total=prefixes, desc="Monte Carlo", unit="prefix", disable=not cfg.progress)
    subs = []
    sums: dict[str, list[np.ndarray]] = {}
    stats: dict[str, float] = {}
    wrong = 0
    definition = set()
    for ci, rows in by_chunk.items():
        c = chunks[ci]
        sub = c.batch.select(rows)
        values, vmask, st = _mc_values(policy, tokenizer, task, sub, cfg, s, bar)
        for key, x in st.items():
            stats[key] = stats.get(key, 0.0) + x
        ends = _prefix_ends(c, sub, rows, values, vmask, definition)
        wrong += sum(end is not None for end in ends)
        rows_t = torch.tensor(rows)
        figures = step_credit_figures(
            values.cpu(),
            vmask.cpu(),
            sub.rewards.cpu(),
            sub.segment_ids.cpu(),
            sub.response_mask.cpu(),
            c.token_p[rows_t],
            c.advantages[rows_t],
            ends,
        )
        for key, x in figures.items():
            sums.setdefault(key, []).append(x)
        subs.append((sub, values, vmask, c.batch, rows))
    bar.close()
    seconds = time.perf_counter() - t0
    result = {
        "traces": len(picked),
        "wrong_traces": wrong,
        "k": cfg.mc_k,
        "prefixes": int(stats.get("credit/mc_prefixes", prefixes)),
        "continuations": int(stats.get("credit/mc_continuations", conts)),
        "estimated_tokens": tokens,
        "generated_tokens": stats.get("credit/extra_generated_tokens", 0.0),
        "seconds": seconds,
        **_mc_shares(sums, subs, definition, cfg.bootstrap, cfg.seed),
    }
    return result, subs


def _mc_plan(chunks: list[Chunk], cfg: DiagnoseConfig, rate, log):
    """The Monte Carlo subset ``(chunk, row)`` and its cost ``(prefixes, continuations,
    estimated tokens)``, cut from the end until the cost fits ``cfg.mc_max_tokens``; logs both."""
    picked = _mc_subset(chunks, cfg, cfg.mc_traces)
    prefixes, conts, tokens = _mc_cost(chunks, picked, cfg.mc_k)
    log(
        f"Monte Carlo values: {len(picked)} traces, {prefixes} boundary prefixes x K = "
        f"{cfg.mc_k}: {conts} continuations, about {tokens:,.0f} generated tokens"
        + (f" (~{tokens / rate:.0f} s at this run's sampling rate)" if rate else "")
    )
    if tokens > cfg.mc_max_tokens:
        while picked and _mc_cost(chunks, picked, cfg.mc_k)[2] > cfg.mc_max_tokens:
            picked = picked[:-1]
        prefixes, conts, tokens = _mc_cost(chunks, picked, cfg.mc_k)
        log(
            f"  over --mc-max-tokens {cfg.mc_max_tokens:,}: the subset is cut to {len(picked)} "
            f"traces ({conts} continuations, about {tokens:,.0f} tokens)"
        )
    return picked, prefixes, conts, tokens


def _mc_values(policy, tokenizer, task, sub: RolloutBatch, cfg: DiagnoseConfig, s, bar):
    """:func:`mc_values` of ``sub``'s boundaries at the report's sampling settings, advancing
    ``bar`` by the prefixes done."""

    def advance(n: int, total: int) -> None:
        bar.update(n - advance.last)
        advance.last = n

    advance.last = 0
    return mc_values(
        policy,
        tokenizer,
        task,
        sub,
        cfg.mc_k,
        temperature=s["temperature"],
        top_p=s["top_p"],
        max_new_tokens=s["max_new_tokens"],
        progress=advance,
    )


def _prefix_ends(
    c: Chunk, sub: RolloutBatch, rows: list[int], values, vmask, definition: set[str]
) -> list[int | None]:
    """Where the still-right prefix of each of ``rows`` (of chunk ``c``; ``sub`` holds them)
    ends: ``None`` for a right trace; else the segment of the verifier's first wrong line, or
    failing that the segment Monte Carlo blames most. Adds the definitions used to
    ``definition``."""
    seg_r, _ = credit_algebra.redistribute(values.double(), vmask, sub.rewards.double())
    ends: list[int | None] = []
    for j, r in enumerate(rows):
        if float(c.batch.rewards[r]) >= SUCCESS:
            ends.append(None)
            continue
        if c.error_segments[r] is not None:
            ends.append(c.error_segments[r])
            definition.add("before the segment of the verifier's first wrong line")
        else:
            n = len(sub.boundaries[j]) - 1
            ends.append(int(torch.argmin(seg_r[j, :n]).item()))
            definition.add("before the segment Monte Carlo blames most (min r_k)")
    return ends


def _mc_shares(
    sums: dict[str, list[np.ndarray]], subs: list, definition: set[str], reps: int, seed: int
) -> dict[str, Any]:
    """The Monte Carlo figures with their intervals: the mean square step values remove, and
    the still-right prefix's share of tokens and of GRPO's and step credit's blame."""
    f = {k: np.concatenate(v) for k, v in sums.items()}
    removed = ratio_interval(f["step_sq"], f["outcome_sq"], reps=reps, seed=seed)
    removed_grad = ratio_interval(f["step_sq_grad"], f["outcome_sq_grad"], reps=reps, seed=seed)
    # prefix sums are 0 on right traces (no prefix); the denominators count wrong traces only
    wrong_rows = np.concatenate([(sub.rewards.cpu() < SUCCESS).numpy() for sub, *_ in subs])
    only_wrong = lambda x: np.where(wrong_rows, x, 0.0)  # noqa: E731
    pt = ratio_interval(f["prefix_tokens"], only_wrong(f["tokens"]), reps=reps, seed=seed)
    gp = ratio_interval(f["grpo_prefix"], only_wrong(f["grpo_blame"]), reps=reps, seed=seed)
    sp = ratio_interval(f["step_prefix"], only_wrong(f["step_blame"]), reps=reps, seed=seed)
    return {
        "variance_removed": _one_minus(removed),
        "gradient_variance_removed": _one_minus(removed_grad),
        "prefix_definition": "; ".join(sorted(definition)) or "no wrong trace in the subset",
        "prefix_tokens": _entry(*pt, 0),
        "grpo_prefix_blame": _entry(*gp, 0),
        "step_prefix_blame": _entry(*sp, 0),
    }


def _one_minus(interval) -> dict[str, float]:
    """``1 - x`` of a :func:`ratio_interval` result with one label (the bounds swap)."""
    point, lo, hi = interval
    return {"value": float(1 - point[0]), "lo": float(1 - hi[0]), "hi": float(1 - lo[0])}


def _select(batch: RolloutBatch, rows: list[int]) -> RolloutBatch:
    """``batch.select(rows)`` with ``prefix_ids`` cut to the selected rows' own segment count
    (the value head checks that they match the boundaries)."""
    sub = batch.select(rows)
    if sub.prefix_ids is None:
        return sub
    width = max((len(b) for b in sub.boundaries), default=1)
    return sub.replace(prefix_ids=sub.prefix_ids[:, :width])


def estimator_specs(cfg: DiagnoseConfig) -> list[tuple[str, str, CreditConfig]]:
    """``(name, credit method, CreditConfig)`` of every estimator the flags ask for, uniform
    first; a run that is not a value_head run or a bad process-reward setting is refused here,
    before any sampling."""
    wanted: list[tuple[str, str, CreditConfig]] = [("uniform", "uniform", CreditConfig())]
    if cfg.value_head_run:
        saved = run_credit_config(cfg.value_head_run)
        if saved is None or saved[0] != "value_head":
            raise UserError(
                f"--value-head-run {cfg.value_head_run}: not a run directory of a value_head run "
                "(its config.yaml names another credit method, or there is none)"
            )
        wanted.append(("value_head", "value_head", saved[1]))
    if cfg.answer_likelihood:
        wanted.append(("answer_likelihood", "answer_likelihood", CreditConfig()))
    if cfg.process_reward_function or cfg.process_reward_model:
        pr = {
            "function": cfg.process_reward_function or "",
            "model": cfg.process_reward_model or "",
        }
        wanted.append(
            ("process_reward", "process_reward", from_dict(CreditConfig, {"process_reward": pr}))
        )
    return wanted


def _estimators(policy, tokenizer, task, subs, segmenter, wanted, cfg: DiagnoseConfig, s, log):
    """Section 4: each cheap estimator asked for, scored against the Monte Carlo values with the
    credit benchmark's definitions (:mod:`rredcot.bench.credit`), uniform credit as reference."""
    bench_cfg = CreditBenchConfig(
        temperature=s["temperature"],
        top_p=s["top_p"],
        max_new_tokens=s["max_new_tokens"],
        lam=0.0,
        blame_threshold=0.0,
    )
    # Each method runs on the whole groups the subset came from (its group statistics, anchors
    # and hand-over see every sample of a prompt, as in training); the subset's rows are then
    # scored against the Monte Carlo values. One batch per group: a real model's forward over a
    # whole chunk runs out of memory.
    traces = Traces.of([sub for sub, *_ in subs])
    groups, picked, offset = [], [], 0
    for _, _, _, batch, rows in subs:
        ids = batch.group_ids.cpu()
        for g in sorted({int(ids[r]) for r in rows}):
            members = (ids == g).nonzero().flatten().tolist()
            groups.append(_select(batch, members))
            picked += [offset + members.index(r) for r in rows if int(ids[r]) == g]
            offset += len(members)
    full = Traces.of(groups)
    adv_rows, value_rows = [], []
    for sub, v, m, _, _ in subs:
        adv, seg_mask, _ = credit_algebra.segment_advantages_from_values(
            v.double(), m, sub.rewards.double().to(v.device), 0.0
        )
        adv_rows += masked_rows(adv, seg_mask)
        value_rows += [r[:-1] for r in masked_rows(v, m)]
    gt = GroundTruth(adv_rows, value_rows, [(v, m) for _, v, m, _, _ in subs], {}, 0.0)
    sampling = SamplingConfig(
        num_generations=cfg.samples,
        temperature=s["temperature"],
        top_p=s["top_p"],
        max_new_tokens=s["max_new_tokens"],
    )
    device = next(policy.parameters()).device
    rows = []
    for name, method_name, credit_cfg in wanted:
        credit_cfg = dataclasses.replace(credit_cfg, segmenter=segmenter.strategy)
        ctx = CreditContext(
            policy=policy,
            tokenizer=tokenizer,
            task=task,
            segmenter=segmenter,
            sampling=sampling,
            device=device,
        )
        method = build_credit(method_name, credit_cfg, ctx)
        if name == "value_head":
            load_method_state(method, cfg.value_head_run)
        col = evaluate_method(method, policy, full, bench_cfg, [], device)
        col.adv = [col.adv[i] for i in picked]
        col.values = None if col.values is None else [col.values[i] for i in picked]
        scores = method_scores(col, gt, traces, bench_cfg)
        # the cost columns are a cost benchmark's (`rredcot bench credit`); here they would count
        # the whole groups the methods ran on against the subset's traces
        row = {"method": name, **{k: v for k, v in scores.items() if not k.endswith("_per_trace")}}
        rows.append(row)
        log(f"  {name}: rho {row['spearman_pooled']:.3f}, error_acc {row.get('error_acc')}")
    return rows


def _settings(task: Task, cfg: DiagnoseConfig, sampling: SamplingConfig | None) -> dict:
    """Sampling settings: the config's, else the run's, else the defaults."""
    run = sampling or SamplingConfig()
    temperature = cfg.temperature if cfg.temperature is not None else run.temperature
    top_p = cfg.top_p if cfg.top_p is not None else run.top_p
    max_new = cfg.max_new_tokens or run.max_new_tokens or task.suggested_max_new_tokens() or 64
    return {"temperature": temperature, "top_p": top_p, "max_new_tokens": int(max_new)}


def diagnose(
    policy,
    tokenizer,
    task: Task,
    config: DiagnoseConfig | None = None,
    *,
    sampling: SamplingConfig | None = None,
    credit: CreditConfig | None = None,
    source: str = "",
    log=print,
) -> DiagnoseReport:
    """Will finer credit help this policy on this task? Sample, measure, and say (module doc).

    Args:
        policy, tokenizer: a causal LM (``rredcot.models.load_policy``) and its tokenizer.
        task: a :class:`~rredcot.tasks.base.Task` (``rredcot.tasks.get_task``).
        config: what to sample and measure (:class:`DiagnoseConfig`; its ``policy``, ``task``,
            ``out``, ``device`` and ``threads`` are the CLI's and are not read here).
        sampling: a run's sampling settings (temperature, top-p, length) where the config leaves
            them unset.
        credit: a run's credit settings (its segmenter); the answer line is always its own
            segment here.
        source: where the policy came from (for the report).

    Returns a :class:`DiagnoseReport`. Deterministic for a seed on the CPU.
    """
    cfg = config or DiagnoseConfig()
    t_start = time.perf_counter()
    s = _settings(task, cfg, sampling)
    credit_cfg = dataclasses.replace(credit or CreditConfig(), separate_answer=True)
    if cfg.segmenter:
        credit_cfg = dataclasses.replace(credit_cfg, segmenter=cfg.segmenter)
    segmenter = segmenter_from_config(credit_cfg, task.answer_line_pattern)
    problems = task.eval_problems(cfg.prompts, seed=cfg.seed)
    if not problems:
        raise UserError(f"task {task.name!r} gave no evaluation problems; check its data")
    sizes = cfg.group_size_list()
    wanted = estimator_specs(cfg)  # bad estimator flags are refused before any sampling
    policy.eval()
    log(
        f"diagnose: {len(problems)} prompts x {cfg.samples} samples of {task.name} at temperature "
        f"{s['temperature']:g}, {s['max_new_tokens']} new tokens, segmenter {segmenter.strategy}"
    )
    m = _measure(policy, tokenizer, task, problems, segmenter, wanted, sizes, cfg, s, log)
    headline = _headline(m, cfg.uncertain_p)
    head, reasons = verdict(headline)
    settings = {
        "policy": source or getattr(getattr(policy, "config", None), "_name_or_path", ""),
        "task": task.name,
        "task_params": dataclasses.asdict(task.params)
        if dataclasses.is_dataclass(task.params)
        else {},
        "prompts": len(problems),
        "samples": cfg.samples,
        "group_sizes": sizes,
        **s,
        "segmenter": segmenter.strategy,
        "uncertain_p": cfg.uncertain_p,
        "position_bins": cfg.position_bins,
        "mc_traces": cfg.mc_traces,
        "mc_k": cfg.mc_k,
        "bootstrap": cfg.bootstrap,
        "confidence": CONFIDENCE,
        "seed": cfg.seed,
        "traces": m.traces,
        "mean_reward": m.groups["mean_reward"],
        "sample_seconds": m.sample_seconds,
        "seconds": time.perf_counter() - t_start,
    }
    return DiagnoseReport(
        settings=settings,
        groups=m.groups,
        gradient=m.gradient,
        trace=m.trace,
        monte_carlo=m.monte_carlo,
        estimators=m.estimators,
        verdict=head,
        reasons=reasons,
        headline=headline,
    )


@dataclass
class _Measured:
    """The four sections of a report (:func:`_measure`), and what sampling took."""

    groups: dict[str, Any]
    gradient: dict[str, Any]
    trace: dict[str, Any]
    monte_carlo: dict[str, Any] | None
    estimators: list[dict[str, Any]] | None
    traces: int  # rows sampled (skipped samples left out)
    sample_seconds: float


def _measure(
    policy, tokenizer, task, problems, segmenter, wanted, sizes, cfg: DiagnoseConfig, s, log
) -> _Measured:
    """Sample, verify, segment and score every prompt's group, then measure each section
    (``sizes``: the group sizes of section 1; ``wanted``: :func:`estimator_specs`)."""
    t0 = time.perf_counter()
    chunks = _sample_chunks(policy, tokenizer, task, problems, segmenter, cfg, s, log)
    sample_seconds = time.perf_counter() - t0
    num_units = len(problems)
    rewards = torch.cat([c.batch.rewards.cpu() for c in chunks])
    units = torch.cat([c.units for c in chunks])
    generated = float(sum(c.batch.response_mask.sum() for c in chunks))
    rate = generated / sample_seconds if sample_seconds > 0 else None

    # 1. where GRPO is blind
    groups = {
        "by_group_size": agreement_by_group_size(rewards, units, sizes, cfg.bootstrap, cfg.seed),
        "mean_reward": float(rewards.mean()) if len(rewards) else float("nan"),
    }
    # 2. where its update lands
    gradient = gradient_figures(chunks, cfg, num_units)
    trace = trace_figures(chunks, cfg, num_units)
    # 3. what better credit could change
    monte_carlo, subs = None, []
    if cfg.mc_traces > 0:
        monte_carlo, subs = _monte_carlo(policy, tokenizer, task, chunks, cfg, s, rate, log)
    # 4. the cheap estimators against it
    estimators = None
    if subs:
        estimators = _estimators(policy, tokenizer, task, subs, segmenter, wanted, cfg, s, log)
    return _Measured(
        groups, gradient, trace, monte_carlo, estimators, int(len(rewards)), sample_seconds
    )


def _headline(m: _Measured, uncertain_p: float) -> dict[str, Any]:
    """The figures :func:`verdict` reads. GRPO's share on the still-right prefix comes from the
    step labels where the verifier gives them, else from the Monte Carlo subset."""
    at_g = m.groups["by_group_size"][-1]
    wrong_kinds = m.gradient["wrong_kinds"]
    labelled = m.gradient["labelled_wrong_traces"] > 0
    prefix_share = wrong_kinds["correct_prefix"]["mass"]["value"] if labelled else None
    prefix_tokens = wrong_kinds["correct_prefix"]["tokens"]["value"] if labelled else None
    monte_carlo = m.monte_carlo
    if not labelled and monte_carlo and monte_carlo["wrong_traces"]:
        prefix_share = monte_carlo["grpo_prefix_blame"]["value"]
        prefix_tokens = monte_carlo["prefix_tokens"]["value"]
    return {
        "mean_reward": m.groups["mean_reward"],
        "all_wrong": at_g["all_wrong"],
        "all_right": at_g["all_right"],
        "agree": at_g["agree"],
        "prefix_share": prefix_share,
        "prefix_tokens": prefix_tokens,
        "error_share": wrong_kinds["first_error"]["mass"]["value"] if labelled else None,
        "uncertain_per_trace": m.trace["uncertain_per_trace"]["value"],
        "uncertain_p": uncertain_p,
        "variance_removed": monte_carlo["gradient_variance_removed"]["value"]
        if monte_carlo
        else None,
    }


def diagnose_source(cfg: DiagnoseConfig, log=print) -> DiagnoseReport:
    """:func:`diagnose` on the policy ``cfg.policy`` names (a model, checkpoint or run directory,
    a .gguf file, a hub id or a shipped alias; empty: `rredcot train`'s default for the task),
    with a run directory's sampling and credit settings where ``cfg`` leaves them unset."""
    device = resolve_device(cfg.device)  # a device the machine lacks is refused first
    estimator_specs(cfg)  # and bad estimator flags, before the policy loads
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    source = cfg.policy
    if not source:
        task0 = get_task(cfg.task or "arithmetic", **cfg.task_args)
        read_task_data(task0)  # a bad data file is refused before a model is built
        source = default_policy_source(task0, None, log=log)
    local = Path(source).expanduser()
    try:
        resolved = resolve_checkpoint(source)
    except FileNotFoundError:
        if local.exists() or source.startswith((".", "/", "~")):
            raise
        resolved = ResolvedCheckpoint(Path(source), None, None)  # a hub id
    task = choose_task(resolved, cfg.task, cfg.task_args)
    read_task_data(task)
    saved = run_credit_config(resolved.run_dir)
    credit_cfg, sampling = (saved[1], saved[2]) if saved else (None, None)
    policy, tokenizer = load_policy(str(resolved.policy_dir))
    policy.to(device)
    return diagnose(
        policy,
        tokenizer,
        task,
        cfg,
        sampling=sampling,
        credit=credit_cfg,
        source=str(source),
        log=log,
    )
