"""Interval estimates for the benchmarks, from the field's libraries rather than by hand.

``rliable`` (Agarwal et al., 2021) gives the stratified bootstrap confidence intervals and the
probability of improvement that RL papers now report; ``scipy.stats`` the rank statistics. Both
come with the ``bench`` extra (``pip install 'rredcot[bench]'``).

Scores are ``(runs,)`` arrays, one entry per seed (one task, so the stratified bootstrap
resamples seeds). Paired comparisons (the same seed of two variants shares its warm start,
prompt stream and held-out set) use ``scipy.stats`` on the per-seed differences.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from rredcot.errors import require_extra

BOOTSTRAP_REPS = 2000
CONFIDENCE = 0.95


def require(module: str) -> Any:
    """Import ``module`` or say which extra brings it."""
    return require_extra(module, "bench", "the benchmark statistics")


def interval_estimate(scores: list[float], seed: int = 0) -> dict[str, float]:
    """Mean and IQM over seeds with stratified-bootstrap 95% intervals (``rliable``)."""
    xs = np.asarray([s for s in scores if math.isfinite(s)], dtype=float)
    if xs.size == 0:
        return {k: float("nan") for k in ("mean", "mean_lo", "mean_hi", "iqm", "iqm_lo", "iqm_hi")}
    rly = require("rliable.library")
    metrics = require("rliable.metrics")
    np.random.seed(seed)  # rliable draws from numpy's global generator
    point, ci = rly.get_interval_estimates(
        {"x": xs.reshape(-1, 1)},
        lambda s: np.array([metrics.aggregate_mean(s), metrics.aggregate_iqm(s)]),
        reps=BOOTSTRAP_REPS,
        confidence_interval_size=CONFIDENCE,
    )
    (m, iqm), ((m_lo, iqm_lo), (m_hi, iqm_hi)) = point["x"], ci["x"]
    return {
        "mean": float(m),
        "mean_lo": float(m_lo),
        "mean_hi": float(m_hi),
        "iqm": float(iqm),
        "iqm_lo": float(iqm_lo),
        "iqm_hi": float(iqm_hi),
    }


def probability_of_improvement(
    scores: list[float], reference: list[float], seed: int = 0
) -> dict[str, float]:
    """``P(X > Y)`` of a run of this variant over a run of the reference, with its
    stratified-bootstrap 95% interval (``rliable``); ties count one half."""
    x = np.asarray([s for s in scores if math.isfinite(s)], dtype=float)
    y = np.asarray([s for s in reference if math.isfinite(s)], dtype=float)
    if x.size == 0 or y.size == 0:
        return {"p": float("nan"), "lo": float("nan"), "hi": float("nan")}
    rly = require("rliable.library")
    metrics = require("rliable.metrics")
    np.random.seed(seed)
    point, ci = rly.get_interval_estimates(
        {"pair": (x.reshape(-1, 1), y.reshape(-1, 1))},
        metrics.probability_of_improvement,
        reps=BOOTSTRAP_REPS,
        confidence_interval_size=CONFIDENCE,
    )
    lo, hi = np.asarray(ci["pair"]).flatten()
    return {"p": float(point["pair"]), "lo": float(lo), "hi": float(hi)}


def paired_difference(diffs: list[float]) -> dict[str, float]:
    """Mean of per-seed differences, its standard error, a 95% t interval and the p-value of a
    one-sample t-test against 0 (``scipy.stats``)."""
    xs = np.asarray([d for d in diffs if math.isfinite(d)], dtype=float)
    nan = float("nan")
    if xs.size == 0:
        return {"mean": nan, "sem": nan, "lo": nan, "hi": nan, "p_value": nan, "n": 0}
    stats = require("scipy.stats")
    mean = float(xs.mean())
    if xs.size < 2:
        return {"mean": mean, "sem": nan, "lo": nan, "hi": nan, "p_value": nan, "n": 1}
    sem = float(stats.sem(xs))
    if sem == 0:
        return {"mean": mean, "sem": 0.0, "lo": mean, "hi": mean, "p_value": nan, "n": xs.size}
    lo, hi = stats.t.interval(CONFIDENCE, xs.size - 1, loc=mean, scale=sem)
    p = float(stats.ttest_1samp(xs, 0.0).pvalue)
    return {"mean": mean, "sem": sem, "lo": float(lo), "hi": float(hi), "p_value": p, "n": xs.size}
