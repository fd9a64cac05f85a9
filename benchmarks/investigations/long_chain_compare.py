"""Paired comparisons of learn-bench runs that live in different --out directories (the oracle
ran in its own): per-seed mean accuracy over training and final accuracy, paired differences
(scipy t) and rliable's probability of improvement (rredcot.bench.stats).

    python benchmarks/investigations/long_chain_compare.py \
        '{"uniform": ["bench/report12", "uniform"], "oracle": ["bench/report12_oracle", "oracle"]}' \
        100 105      # seeds 100..104; the first entry is the reference; a root may be a glob
"""

import glob
import json
import sys
from pathlib import Path

from rredcot.bench import stats
from rredcot.bench.learn import run_curve


def per_seed(run_root, method, seeds):
    """Per-seed figures of ``method``; ``run_root`` may be a glob (``bench/report5e5*``: the
    seeds of one comparison split over several --out directories)."""
    roots = sorted(glob.glob(run_root)) or [run_root]
    out = {}
    for s in seeds:
        found = [Path(r) / "runs" / method / f"seed{s}" for r in roots]
        found = [d for d in found if (d / "metrics.jsonl").exists()]
        if not found:
            continue
        d = found[0]
        c = run_curve(d)
        acc = c["accuracy"]
        if len(acc) < 2:
            continue
        out[s] = {
            "mean": sum(acc[1:]) / len(acc[1:]),
            "final": acc[-1],
            "warm": acc[0],
            "min": min(acc[1:]),
            "steps": c["step"][-1],
        }
    return out


def compare(ref, other, key):
    common = sorted(set(ref) & set(other))
    diffs = [other[s][key] - ref[s][key] for s in common]
    return {
        "seeds": common,
        "diffs": [round(d, 4) for d in diffs],
        **stats.paired_difference(diffs),
        "p_improve": stats.probability_of_improvement(
            [other[s][key] for s in common], [ref[s][key] for s in common]
        ),
    }


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])  # {"name": [root, method]}, first is the reference
    seeds = list(range(int(sys.argv[2]), int(sys.argv[3])))
    data = {n: per_seed(r, m, seeds) for n, (r, m) in spec.items()}
    names = list(spec)
    ref = data[names[0]]
    report = {"per_seed": data, "vs_" + names[0]: {}}
    for n in names[1:]:
        report["vs_" + names[0]][n] = {k: compare(ref, data[n], k) for k in ("mean", "final")}
    print(json.dumps(report, indent=1, default=float))
