"""Writing benchmark results: JSON without NaN, Markdown tables, PNG plots of mean ± std curves."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rredcot.safe_fs import save_figure_atomic, write_text_atomic


def clean(value: Any) -> Any:
    """JSON-safe copy: NaN/inf become None, tensors and numpy scalars become numbers/lists."""
    if isinstance(value, dict):
        return {str(k): clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    if hasattr(value, "tolist"):  # torch tensors, numpy arrays and scalars
        return clean(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(data: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(clean(data), indent=2) + "\n")
    return path


def write_report(report: dict, out_dir: str | Path, stem: str, markdown) -> str:
    """Write ``<stem>.json`` and ``<stem>.md`` (rendered by ``markdown(report)``) under
    ``out_dir``, both atomically; returns the Markdown."""
    out_dir = Path(out_dir)
    write_json(report, out_dir / f"{stem}.json")
    md = markdown(report)
    write_text_atomic(out_dir / f"{stem}.md", md)
    return md


def fmt(value: Any, spec: str = ".3f") -> str:
    """A table cell: ``–`` for missing or NaN values."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float) and not math.isfinite(value):
        return "–"
    if isinstance(value, (int, float)):
        return format(value, spec)
    return str(value)


def fmt_mean_std(mean: float | None, std: float | None, spec: str = ".3f") -> str:
    if mean is None or (isinstance(mean, float) and not math.isfinite(mean)):
        return "–"
    if std is None or (isinstance(std, float) and not math.isfinite(std)):
        return fmt(mean, spec)
    return f"{format(mean, spec)} ± {format(std, spec)}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub Markdown table; cells are used as given (format them with :func:`fmt`)."""
    cells = [[str(h) for h in headers]] + [[str(c).replace("|", "\\|") for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    sep = "| " + " | ".join("-" * w for w in widths) + " |"
    return "\n".join([line(cells[0]), sep] + [line(r) for r in cells[1:]])


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample std (0 for one value) of the finite values; NaN, NaN when none."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not xs:
        return float("nan"), float("nan")
    return float(np.mean(xs)), float(np.std(xs, ddof=1)) if len(xs) > 1 else 0.0


def interpolate_runs(
    runs: Sequence[tuple[Sequence[float], Sequence[float]]], num: int = 50
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Put several ``(xs, ys)`` curves on one grid (linear interpolation, from 0 to the smallest
    of the runs' last x, so every grid point is covered by every run) and return
    ``(grid, mean, std)`` over runs."""
    runs = [(np.asarray(x, float), np.asarray(y, float)) for x, y in runs if len(x)]
    if not runs:
        return np.zeros(0), np.zeros(0), np.zeros(0)
    end = min(float(x[-1]) for x, _ in runs)
    start = max(float(x[0]) for x, _ in runs)
    grid = np.linspace(start, end, num) if end > start else np.array([start])
    ys = np.stack([np.interp(grid, x, y) for x, y in runs])
    std = ys.std(axis=0, ddof=1) if len(runs) > 1 else np.zeros(len(grid))
    return grid, ys.mean(axis=0), std


def plot_mean_std(
    curves: dict[str, tuple[np.ndarray, np.ndarray, np.ndarray]],
    path: str | Path,
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    hlines: dict[str, float] | None = None,
) -> Path:
    """One line per curve name with a shaded ± std band; optional labelled horizontal lines."""
    import matplotlib  # only when a plot is drawn (seconds of import; the Agg backend)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, (x, mean, std) in curves.items():
        if len(x) == 0:
            continue
        (line,) = ax.plot(x, mean, label=name, marker="o" if len(x) < 12 else None, markersize=3)
        ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.2)
    for label, y in (hlines or {}).items():
        if y is not None and math.isfinite(y):
            ax.axhline(y, color="grey", linestyle="--", linewidth=1)
            ax.annotate(label, (0, y), xycoords=("axes fraction", "data"), fontsize=8, va="bottom")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        save_figure_atomic(fig, path, dpi=110)  # a link planted there: not followed
    finally:
        plt.close(fig)
    return path
