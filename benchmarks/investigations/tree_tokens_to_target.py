"""Tokens to target with the crossing interpolated between evaluations, per seed and paired.

`rredcot bench learn` takes the first evaluation at or above the target. Its evaluations come
every `eval_every` steps, and a tree step samples ~0.55x the tokens of an independent step, so the
tree arms are evaluated 1.8x as often in tokens: the first-evaluation rule alone then favours them
by up to the spacing of the reference's grid. Here the crossing point is interpolated linearly
between the last evaluation below the target and the first at or above it (censored at the last
evaluation's tokens when never reached), on the same per-seed target (warm-start accuracy + 0.1).

    python benchmarks/investigations/tree_tokens_to_target.py bench/tree/report grpo 100 103
"""

import json
import sys
from pathlib import Path
from statistics import mean, stdev


def crossing(curve, target):
    prev = None
    for tokens, acc in curve:
        if acc >= target:
            if prev is None:
                return tokens
            t0, a0 = prev
            return t0 + (target - a0) / (acc - a0) * (tokens - t0)
        prev = (tokens, acc)
    return None


def main(out_dir, reference, first, end):
    runs = Path(out_dir) / "runs"
    table = {}
    for method in sorted(p.name for p in runs.iterdir() if p.is_dir()):
        per = {}
        for seed in range(first, end):
            f = runs / method / f"seed{seed}" / "metrics.jsonl"
            if not f.exists():
                continue
            recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
            curve = [
                (
                    r.get("tokens_generated", 0) + r.get("extra_tokens_generated", 0),
                    r["eval_accuracy"],
                )
                for r in recs
                if "eval_accuracy" in r
            ]
            target = curve[0][1] + 0.1
            hit = crossing(curve, target)
            per[seed] = {"target": target, "tokens": hit, "censored_at": curve[-1][0]}
        table[method] = per
    ref = table[reference]
    summary = {}
    for method, per in table.items():
        value = {
            s: (v["tokens"] if v["tokens"] is not None else v["censored_at"])
            for s, v in per.items()
        }
        ratios = [value[s] / (ref[s]["tokens"] or ref[s]["censored_at"]) for s in value if s in ref]
        diffs = [value[s] - (ref[s]["tokens"] or ref[s]["censored_at"]) for s in value if s in ref]
        summary[method] = {
            "per_seed": per,
            "tokens_mean": mean(value.values()),
            "paired_difference_mean": mean(diffs),
            "paired_difference_se": stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else None,
            "ratio_mean": mean(ratios),
            "reached": sum(v["tokens"] is not None for v in per.values()),
        }
    json.dump(summary, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
