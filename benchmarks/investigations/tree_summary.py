"""The columns of the tree benchmark that `rredcot bench learn`'s report does not have: per method,
the share of leaf tokens that sharing saved (1 - generated / tokens in the leaves), the re-fed
tokens, decoding passes per step, wall-clock per step (and of its rollout), steps taken in the
budget, the share of interior segment boundaries that are tree nodes, the share of groups whose
rewards all agree (no GRPO signal) and the mean training reward.

    python benchmarks/investigations/tree_summary.py bench/tree_report 100 102 > tree_summary.json
    # OUT_DIR FIRST_SEED END_SEED (exclusive); prints JSON and a markdown table on stderr
"""

import json
import sys
from pathlib import Path
from statistics import mean


def run_stats(metrics: Path) -> dict:
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    steps = [r for r in records if r.get("step", 0) > 0 and "step_seconds" in r]
    if not steps:
        return {}
    leaf = sum(r.get("rollout/tree_leaf_tokens", r["rollout/tokens"]) for r in steps)
    generated = sum(r["rollout/tokens"] for r in steps)
    node_fraction = [
        r[k]
        for r in steps
        for k in ("credit/node_boundary_fraction", "credit/shared_boundary_fraction")
        if k in r
    ]
    return {
        "steps": len(steps),
        "generated_tokens": generated,
        "leaf_tokens": leaf,
        "saved_share": 1.0 - generated / max(leaf, 1.0),
        "refed_tokens": sum(r.get("rollout/tree_refed_tokens", 0.0) for r in steps),
        "passes_per_step": mean(r.get("rollout/tree_rounds", 1.0) for r in steps),
        "seconds_per_step": mean(r["step_seconds"] for r in steps),
        "rollout_seconds_per_step": mean(r.get("time/rollout", 0.0) for r in steps),
        "seconds_per_1k_tokens": 1000 * sum(r["step_seconds"] for r in steps) / max(generated, 1),
        "node_boundary_fraction": mean(node_fraction) if node_fraction else None,
        "zero_variance_groups": mean(r["zero_variance_groups"] for r in steps),
        "reward_mean": mean(r["reward_mean"] for r in steps),
    }


def main(out_dir: str, first: int, end: int) -> None:
    runs = Path(out_dir) / "runs"
    table = {}
    for method_dir in sorted(p for p in runs.iterdir() if p.is_dir()):
        per_seed = {}
        for seed in range(first, end):
            metrics = method_dir / f"seed{seed}" / "metrics.jsonl"
            if metrics.exists():
                stats = run_stats(metrics)
                if stats:
                    per_seed[seed] = stats
        if not per_seed:
            continue
        keys = next(iter(per_seed.values())).keys()
        table[method_dir.name] = {
            "seeds": sorted(per_seed),
            "mean": {
                k: mean(s[k] for s in per_seed.values())
                for k in keys
                if all(s[k] is not None for s in per_seed.values())
            },
            "per_seed": per_seed,
        }
    json.dump(table, sys.stdout, indent=2)
    print(file=sys.stdout)
    cols = [
        "steps",
        "saved_share",
        "passes_per_step",
        "seconds_per_step",
        "rollout_seconds_per_step",
        "seconds_per_1k_tokens",
        "node_boundary_fraction",
        "zero_variance_groups",
        "reward_mean",
    ]
    print("| method | seeds | " + " | ".join(cols) + " |", file=sys.stderr)
    print("|---" * (len(cols) + 2) + "|", file=sys.stderr)
    for name, row in table.items():
        cells = []
        for c in cols:
            v = row["mean"].get(c)
            cells.append("–" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v))
        seeds = ",".join(map(str, row["seeds"]))
        print(f"| {name} | {seeds} | " + " | ".join(cells) + " |", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
