"""The build screen's figures: per build and learning rate, the pooled oracle's mean held-out
accuracy over training minus GRPO's, paired by seed (tar xzf runs.tar.gz first).

    python benchmarks/investigations/headroom_screen_builds.py BUILD_ROOT ...   # e.g. s450 s475
"""

import statistics
import sys
from pathlib import Path

# the learn bench's own reading of a run and its "mean accuracy over training"
from rredcot.bench.learn import _training_mean, run_curve


def training_mean(run_dir: Path) -> float:
    return _training_mean(run_curve(run_dir))


for build in sys.argv[1:]:
    for lr_dir in sorted(Path(build).glob("lr*")):
        runs = lr_dir / "runs"
        seeds = sorted(p.name for p in (runs / "uniform").glob("seed*"))
        diffs = {
            s: training_mean(runs / "oracle_pooled" / s) - training_mean(runs / "uniform" / s)
            for s in seeds
            if (runs / "oracle_pooled" / s / "metrics.jsonl").exists()
        }
        d = list(diffs.values())
        sem = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
        per = ", ".join(f"{k} {100 * v:+.1f}" for k, v in diffs.items())
        print(
            f"{build} {lr_dir.name}: oracle_pooled - uniform {100 * statistics.fmean(d):+.1f} "
            f"+- {100 * sem:.1f} points over {len(d)} seeds ({per})"
        )
