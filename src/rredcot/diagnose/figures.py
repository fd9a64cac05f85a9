"""The figures of ``rredcot diagnose`` (docs/diagnose.md defines every one): tensors and arrays
in, numbers out, each tested on hand-built cases.

- Where GRPO is blind: :func:`agreement_by_group_size` (exact over every ``G'``-subset of each
  prompt's samples), :func:`clopper_pearson`.
- Where GRPO's update lands: :func:`grpo_gradient_mass` (``|A| (1 - p(y_t))`` per token),
  :func:`token_kinds` (correct prefix, first wrong step, after it, answer line), and over sampled
  chunks (:class:`Chunk`, :func:`chunk_from_batch`) :func:`gradient_figures` and
  :func:`trace_figures`.
- What step-level credit could change: :func:`step_credit_figures`, from Monte Carlo values.

Intervals: a percentile bootstrap over prompts (:func:`ratio_interval`, :func:`label_shares`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rredcot.algebra import credit as credit_algebra
from rredcot.algebra import layout
from rredcot.algebra.normalization import group_mean_std
from rredcot.config.diagnose import DiagnoseConfig
from rredcot.methods.auto import SUCCESS
from rredcot.methods.oracle import first_error_segment
from rredcot.sampling.batch import RolloutBatch

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
    :func:`rredcot.algebra.normalization.group_mean_std` (Bessel's correction, as TRL), and 0 in a group whose
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
    step_tok = layout.segments_to_tokens(
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


def interval_entry(point, lo, hi, j: int) -> dict[str, float]:
    """Entry ``j`` of a ``(point, lo, hi)`` interval triple as a JSON-ready dict."""
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
            "tokens": interval_entry(*tok_pt, j),
            "mass": interval_entry(*mass_pt, j),
            "mean_1_minus_p": float(one_minus_p[j]),
            "uncertain_share": float(uncertain[j]),
        }
        if name in WRONG_KINDS:
            wrong_out[name] = {
                "tokens": interval_entry(*wrong_tok, j),
                "mass": interval_entry(*wrong_mass, j),
            }
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
                "mass": interval_entry(*pos_mass, j),
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
            "mass": interval_entry(*seg_mass, j),
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
        "entropy_by_position": [interval_entry(*e, j) for j in range(bins)],
        "one_minus_p_by_position": [interval_entry(*o, j) for j in range(bins)],
        "uncertain_per_trace": interval_entry(*u, 0),
        "traces_without_uncertain": float(none.sum() / max(traces.sum(), 1)),
        "mean_entropy": float(ent.sum() / max(tok.sum(), 1)),
        "tokens_per_trace": float(tok.sum() / max(traces.sum(), 1)),
    }
