"""The Monte Carlo oracle (K = 16) against GRPO and the pooled oracle on the reporting seeds:
per-seed mean held-out accuracy after step 0 (bench learn's `mean acc in training`), paired
differences with scipy's t-test.

    python benchmarks/investigations/headroom_mc_ceiling_compare.py MC_RUNS REF_RUNS   # <runs>/<variant>/seed<k>
"""

import json
import sys
from pathlib import Path

from scipy import stats


def mean_acc(run: Path) -> float:
    accs = [json.loads(line).get("eval_accuracy") for line in (run / "metrics.jsonl").open()]
    accs = [a for a in accs if a is not None][1:]
    return sum(accs) / len(accs)


mc_root, ref_root = Path(sys.argv[1]), Path(sys.argv[2])
seeds = sorted(int(p.name[4:]) for p in mc_root.glob("seed*") if (p / "result.json").exists())
mc = [mean_acc(mc_root / f"seed{s}") for s in seeds]
for ref in ("uniform", "oracle_pooled"):
    base = [mean_acc(ref_root / ref / f"seed{s}") for s in seeds]
    diffs = [a - b for a, b in zip(mc, base)]
    t = stats.ttest_1samp(diffs, 0.0) if len(diffs) > 1 else None
    sem = stats.sem(diffs) if len(diffs) > 1 else float("nan")
    print(
        f"oracle_mc - {ref}: seeds {seeds}, per seed {[round(d, 4) for d in diffs]}, "
        f"mean {sum(diffs) / len(diffs):+.4f} ± {sem:.4f} (sem), p = {t.pvalue if t else float('nan'):.3g}"
    )
print("oracle_mc mean acc per seed", [round(m, 4) for m in mc])
