"""Read the SmolLM2 testbed plan's rule on GRPO's tuning runs (issue 60, item 2).

The rule (``results/smollm2/testbed/PLAN.md``, amendment 2): a run passes when its greedy
accuracy averaged over its last two evaluations is above its first evaluation by more than two
binomial standard errors of one evaluation. Both standard errors are printed, the start's and
the end's, and the run passes only if the gain exceeds twice the larger one.

    python benchmarks/testbed_rule.py benchmarks/results/smollm2/testbed/tuning/lr*_uniform_seed*_metrics.jsonl

Prints one markdown row a file: its evaluations (accuracy % at each evaluated step, sampled
tokens in thousands), the start, the mean of the last two, the gain and the reading.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from rredcot.training.runio import MetricsLog


def evaluations(path: Path) -> list[tuple[int, int, float]]:
    """``(step, sampled tokens, accuracy)`` of every evaluation row, in step order."""
    tokens_at: dict[int, int] = {}
    evals: dict[int, float] = {}
    for row in MetricsLog(path).read():
        tokens_at[row["step"]] = row.get("tokens_generated", tokens_at.get(row["step"], 0))
        if "eval_accuracy" in row:
            evals[row["step"]] = row["eval_accuracy"]
    return [(step, tokens_at.get(step, 0), evals[step]) for step in sorted(evals)]


def binomial_se(accuracy: float, n: int) -> float:
    """One evaluation's standard error at ``accuracy`` over ``n`` problems."""
    return math.sqrt(accuracy * (1.0 - accuracy) / n)


def rule(evals: list[tuple[int, int, float]], n: int) -> dict[str, float | bool]:
    """The plan's reading: start, mean of the last two evaluations, gain in standard errors."""
    if len(evals) < 3:
        raise SystemExit("a run needs a start and two later evaluations to read the rule")
    start = evals[0][2]
    end = (evals[-1][2] + evals[-2][2]) / 2
    se = max(binomial_se(start, n), binomial_se(end, n))
    gain = end - start
    return {"start": start, "end": end, "gain": gain, "se": se, "passes": gain > 2 * se}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", type=Path, help="runs' metrics.jsonl files")
    parser.add_argument("--eval-size", type=int, default=128, help="problems per evaluation")
    args = parser.parse_args()
    print("| run | evaluations: accuracy % (k tokens) | start | last two | gain | 2 s.e. | rule |")
    print("|---|---|---|---|---|---|---|")
    for path in args.metrics:
        evals = evaluations(path)
        read = rule(evals, args.eval_size)
        curve = ", ".join(f"{100 * acc:.1f} ({tokens / 1000:.1f})" for _, tokens, acc in evals)
        name = path.name.removesuffix("_metrics.jsonl").removesuffix(".jsonl")
        print(
            f"| {name} | {curve} | {100 * read['start']:.1f} | {100 * read['end']:.1f} | "
            f"{100 * read['gain']:+.1f} | {200 * read['se']:.1f} | "
            f"{'passes' if read['passes'] else 'fails'} |"
        )


if __name__ == "__main__":
    main()
