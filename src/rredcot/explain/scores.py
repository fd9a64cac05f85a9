"""How good is a method's credit? Its segment advantages and values scored against Monte Carlo
ground truth on the same traces (docs/method.md, s. 6): the one scoring that ``rredcot bench
credit`` and ``rredcot diagnose`` share.

- :class:`Traces`: the evaluated traces, pooled over chunks; :class:`GroundTruth`: per trace, the
  ground-truth segment advantages ``A*_k`` and values ``V_MC(s_k)``.
- :func:`evaluate_method`: a method's credit on every chunk, run as the trainer runs it (one
  ``fill_forward``, then ``compute``), its segment advantages at the comparison lambda
  (:func:`comparison_advantages`: from its values where it has them, so the estimator is judged
  and not its hand-over schedule).
- :func:`method_scores`: rank agreement (:func:`spearman`, :func:`per_trace_spearman`),
  :func:`sign_agreement`, :func:`value_errors`, first-error localisation
  (:mod:`rredcot.algebra.localisation`) and cost per trace.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from rredcot.algebra import credit as credit_algebra
from rredcot.algebra import layout
from rredcot.algebra.localisation import chance_error_acc, localisation_scores
from rredcot.algebra.normalization import group_mean_std
from rredcot.explain.model import segment_credits
from rredcot.methods.value_head import expected_calibration_error
from rredcot.sampling.batch import RolloutBatch
from rredcot.sampling.forward import fill_forward

__all__ = [
    "Collected",
    "GroundTruth",
    "Traces",
    "comparison_advantages",
    "evaluate_method",
    "masked_rows",
    "method_scores",
    "per_trace_spearman",
    "sign_agreement",
    "spearman",
    "value_errors",
]

# ---------------------------------------------------------------------------------------------
# statistics


def spearman(x: torch.Tensor, y: torch.Tensor, decimals: int | None = 9) -> float:
    """Spearman rank correlation (``scipy.stats.spearmanr``: average ranks for ties).

    ``decimals`` rounds both inputs first so that float noise (``0.1 + 0.2`` vs ``0.3``) ties.
    NaN when fewer than two entries or either side is constant.
    """
    from scipy.stats import spearmanr  # a base dependency, imported where a rank is taken

    x = x.detach().flatten().double().cpu()
    y = y.detach().flatten().double().cpu()
    if x.numel() != y.numel():
        raise ValueError(f"spearman needs equal lengths, got {x.numel()} and {y.numel()}")
    if x.numel() < 2:
        return float("nan")
    if decimals is not None:
        x, y = torch.round(x, decimals=decimals), torch.round(y, decimals=decimals)
    if bool((x == x[0]).all()) or bool((y == y[0]).all()):
        return float("nan")
    return float(spearmanr(x.numpy(), y.numpy()).statistic)


def sign_agreement(pred: torch.Tensor, truth: torch.Tensor, tol: float = 1e-9) -> float:
    """Share of entries with ``|truth| > tol`` where ``pred`` has the same sign; ``|pred| <= tol``
    counts 1/2. NaN when every ``truth`` is zero."""
    pred, truth = pred.double().flatten(), truth.double().flatten()
    keep = truth.abs() > tol
    if not bool(keep.any()):
        return float("nan")
    p, t = pred[keep], truth[keep]
    score = torch.where(p.abs() <= tol, 0.5, ((p * t) > 0).double())
    return float(score.mean())


def per_trace_spearman(preds: list[list[float]], truths: list[list[float]]) -> tuple[float, int]:
    """Mean per-trace rho over traces with >= 2 segments and a non-constant truth (a constant
    prediction scores 0). Returns ``(mean, traces used)``."""
    rhos = []
    for p, t in zip(preds, truths):
        if len(t) < 2:
            continue
        tt = torch.round(torch.tensor(t, dtype=torch.float64), decimals=9)
        if bool((tt == tt[0]).all()):
            continue
        rho = spearman(torch.tensor(p), tt)
        rhos.append(0.0 if math.isnan(rho) else rho)
    return (sum(rhos) / len(rhos) if rhos else float("nan")), len(rhos)


def value_errors(
    values: list[list[float]], targets: list[list[float]], num_bins: int = 10
) -> tuple[float, float]:
    """``(MSE, ECE)`` of predicted values against target values over all entries."""
    v = torch.tensor([x for row in values for x in row], dtype=torch.float64)
    t = torch.tensor([x for row in targets for x in row], dtype=torch.float64)
    if v.numel() == 0:
        return float("nan"), float("nan")
    mse = float(((v - t) ** 2).mean())
    ece = expected_calibration_error(v, t, torch.ones_like(v, dtype=torch.bool), num_bins)
    return mse, ece


# ---------------------------------------------------------------------------------------------
# per-trace rows


def masked_rows(t: torch.Tensor, mask: torch.Tensor) -> list[list[float]]:
    return [t[i][mask[i].bool()].double().cpu().tolist() for i in range(t.shape[0])]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _pad(rows: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros(len(rows), max(width, 1), dtype=torch.float64)
    mask = torch.zeros(len(rows), max(width, 1), dtype=torch.bool)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.float64)
        mask[i, : len(r)] = True
    return out, mask


# ---------------------------------------------------------------------------------------------
# a method's credit, and its scores


@dataclass
class Collected:
    """Per-row results of one method on one segmentation, pooled over chunks."""

    adv: list[list[float]] = field(default_factory=list)
    values: list[list[float]] | None = field(default_factory=list)  # V(s_k), k < n
    metrics: dict[str, float] = field(default_factory=dict)
    forward_seconds: float = 0.0
    credit_seconds: float = 0.0
    examples: dict[int, list] = field(default_factory=dict)


def comparison_advantages(
    out, rewards: torch.Tensor, lam: float, method=None, batch: RolloutBatch | None = None
) -> torch.Tensor:
    """Segment advantages of a method's output at the comparison lambda (see module doc); under
    ``credit.form=reweight`` GRPO's advantage times the sigma of the method's values, unblended
    (hand-over weight 1, as the values are compared unblended under ``redistribute``)."""
    config = getattr(method, "config", None)
    if out.values is not None and getattr(config, "form", "") == "reweight" and method.reweights:
        r = rewards.double().to(out.values.device)
        seg_rewards, seg_mask = credit_algebra.redistribute(out.values.double(), out.value_mask, r)
        grpo = r - group_mean_std(r, batch.group_ids.to(r.device))[0]
        lengths = layout.segment_token_counts(
            batch.segment_ids.to(r.device), batch.response_mask.to(r.device), seg_mask.shape[1]
        )
        sigma = credit_algebra.reweight_coefficients(
            seg_rewards, seg_mask, lengths, grpo, config.reweight.rule, config.reweight.temperature
        )
        return credit_algebra.reweight_grpo(grpo, sigma, seg_mask, 1.0)
    if out.values is not None:
        adv, _, _ = credit_algebra.segment_advantages_from_values(
            out.values.double(), out.value_mask, rewards.double().to(out.values.device), lam
        )
        return adv
    return credit_algebra.segment_gae(out.segment_advantages.double(), out.segment_mask, lam)


@dataclass
class Traces:
    """The evaluated traces of one segmentation, pooled over chunks (row i = trace i)."""

    batches: list[RolloutBatch]
    rewards: torch.Tensor  # (N,)
    completions: list[str]
    first_errors: list[int | None]
    char_starts: list[list[int]]

    @classmethod
    def of(cls, batches: list[RolloutBatch]) -> Traces:
        return cls(
            batches,
            torch.cat([b.rewards.detach().cpu() for b in batches]),
            [c for b in batches for c in b.completions],
            [v.first_error_step for b in batches for v in b.verdicts],
            [s for b in batches for s in b.segment_char_starts],
        )

    @property
    def size(self) -> int:
        return len(self.completions)

    def select(self, keep: list[bool] | None) -> Traces:
        """The traces where ``keep`` is true (all of them for None), for scoring; ``batches``
        stay whole (they locate rows for the pages)."""
        if keep is None:
            return self
        rows = [i for i, k in enumerate(keep) if k]
        return Traces(
            self.batches,
            self.rewards[rows],
            [self.completions[i] for i in rows],
            [self.first_errors[i] for i in rows],
            [self.char_starts[i] for i in rows],
        )

    @property
    def has_labels(self) -> bool:
        return any(e is not None for e in self.first_errors)

    def locate(self, i: int) -> tuple[int, int]:
        """(chunk, row in chunk) of trace ``i``."""
        for c, b in enumerate(self.batches):
            if i < b.size:
                return c, i
            i -= b.size
        raise IndexError(i)

    def localisation(self, adv_rows: list[list[float]], threshold: float) -> dict[str, float]:
        """error_acc / correct_acc / f1 (+ chance) of per-trace segment advantages; empty when the
        task reports no first wrong step."""
        if not self.has_labels:
            return {}
        adv, mask = _pad(adv_rows)
        scores = localisation_scores(
            adv,
            mask,
            self.completions,
            self.rewards,
            self.first_errors,
            self.char_starts,
            threshold,
        )
        scores["chance_error_acc"] = chance_error_acc(mask, self.rewards)
        return scores

    def example_rows(
        self, count: int, num_segments: list[int], keep: list[bool] | None = None
    ) -> list[int]:
        """Up to ``count`` traces to show: incorrect ones with a known first error and >= 2
        segments, and one correct trace (among the ``keep`` ones, when given)."""
        judged = [True] * self.size if keep is None else keep
        wrong = [
            i
            for i in range(self.size)
            if float(self.rewards[i]) < 1.0
            and num_segments[i] >= 2
            and self.first_errors[i] is not None
            and judged[i]
        ]
        right = [
            i
            for i in range(self.size)
            if float(self.rewards[i]) >= 1.0 and num_segments[i] and judged[i]
        ]
        rows = sorted(wrong[: max(count - 1, 0)] + right[:1])[:count]
        return rows or ([0] if self.size and count else [])


@dataclass
class GroundTruth:
    adv: list[list[float]]  # per trace, A*_k at the comparison lambda
    values: list[list[float]]  # per trace, V*(s_k) for k < n
    full: list[tuple[torch.Tensor, torch.Tensor]]  # per chunk (values, mask), for the pages
    stats: dict[str, float]
    seconds: float
    label: str = "V_MC"
    keep: list[bool] | None = None  # per trace, judged by the ground truth (None: every trace)

    def kept(self, rows: list) -> list:
        """The entries of ``rows`` (one per trace) of the traces the ground truth judges."""
        return list(rows) if self.keep is None else [r for r, k in zip(rows, self.keep) if k]


def evaluate_method(
    method,
    policy,
    traces: Traces,
    *,
    temperature: float,
    lam: float,
    device,
    example_rows: list[int] = (),
) -> Collected:
    """Run ``method`` on every chunk as the trainer would (forward at the sampling
    ``temperature``, then ``compute``), timed; its segment advantages at the comparison ``lam``
    (:func:`comparison_advantages`), and the credit pages of ``example_rows``."""
    layers = method.hidden_layers if method.needs_hidden_states else None
    col = Collected(values=[])
    wanted = {i: traces.locate(i) for i in example_rows}
    for c, b in enumerate(traces.batches):
        _sync(device)
        t_a = time.perf_counter()
        b = fill_forward(policy, b, hidden_layers=layers, temperature=temperature)
        _sync(device)
        t_b = time.perf_counter()
        out = method.compute(b)
        _sync(device)
        t_c = time.perf_counter()
        col.forward_seconds += t_b - t_a
        col.credit_seconds += t_c - t_b
        adv = comparison_advantages(out, b.rewards, lam, method, b)
        col.adv += masked_rows(adv, out.segment_mask.bool())
        if out.values is None:
            col.values = None
        elif col.values is not None:
            col.values += [r[:-1] for r in masked_rows(out.values, out.value_mask)]
        for k, x in out.metrics.items():
            if k.startswith("credit/extra_"):
                col.metrics[k] = col.metrics.get(k, 0.0) + float(x)
        for i, (ci, r) in wanted.items():
            if ci == c:
                col.examples[i] = segment_credits(b, r, adv, out.values, out.value_mask)
    return col


def method_scores(
    col: Collected, gt: GroundTruth, traces: Traces, blame_threshold: float
) -> dict[str, Any]:
    """Agreement with the ground truth, localisation (blame below ``blame_threshold``) and cost
    of one method's results, over the traces the ground truth judges (``gt.keep``); the cost is
    per trace scored by the method (every trace)."""
    n = max(traces.size, 1)
    judged = traces.select(gt.keep)
    adv, truth_adv = gt.kept(col.adv), gt.kept(gt.adv)
    pred = torch.tensor([x for r in adv for x in r], dtype=torch.float64)
    truth = torch.tensor([x for r in truth_adv for x in r], dtype=torch.float64)
    row: dict[str, Any] = {"num_traces": judged.size, "num_segments": int(pred.numel())}
    row["spearman_pooled"] = spearman(pred, truth)
    row["spearman_trace_mean"], row["traces_ranked"] = per_trace_spearman(adv, truth_adv)
    row["sign_agreement"] = sign_agreement(pred, truth)
    if col.values is not None:
        row["value_mse"], row["value_ece"] = value_errors(gt.kept(col.values), gt.kept(gt.values))
    else:
        row["value_mse"] = row["value_ece"] = None
    row.update(judged.localisation(adv, blame_threshold))
    for key in ("forward", "generated", "backward"):
        total = col.metrics.get(f"credit/extra_{key}_tokens")
        row[f"extra_{key}_tokens_per_trace"] = None if total is None else total / n
    row["seconds_per_trace"] = (col.forward_seconds + col.credit_seconds) / n
    row["credit_seconds_per_trace"] = col.credit_seconds / n
    return row
