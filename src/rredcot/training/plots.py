"""PNG plots of a run's ``metrics.jsonl`` (written at the end of every run)."""

from __future__ import annotations

from pathlib import Path

from rredcot.safe_fs import make_dirs, save_figure_atomic
from rredcot.training.runio import CURVES, METRICS, PLOTS, MetricsLog, plot_file_name


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``plots/<metric>.png`` for every metric of ``CURVES`` that the run logged (a link
    at ``plots`` is refused, one at a PNG replaced: nothing outside the run is written)."""
    import matplotlib  # only when a plot is drawn (seconds of import; the Agg backend)

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    records = MetricsLog(run_dir / METRICS).read()
    out_dir = make_dirs(run_dir, PLOTS)
    written = []
    for key, title in CURVES:
        points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
        if not points:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        xs, ys = zip(*points)
        ax.plot(xs, ys, marker="o" if len(points) < 30 else None, markersize=3)
        ax.set_xlabel("RL step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        fig.tight_layout()
        try:
            path = save_figure_atomic(fig, out_dir / plot_file_name(key), dpi=100)
        finally:
            plt.close(fig)
        written.append(path)
    return written
