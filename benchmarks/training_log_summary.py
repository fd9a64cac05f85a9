"""Summarise what gathered SmolLM2 training logs say, per method, over seeds.

Reads ``{method}_seed{S}_metrics.jsonl`` files (as ``gather_lr.py``'s callers copy them) and
prints one markdown row per method: each quantity is averaged over a run's steps, then over
seeds, with the range over seeds in brackets.

    python benchmarks/training_log_summary.py 400:6 \
        "GRPO 3e-5=benchmarks/results/smollm2/ceiling/block/uniform" \
        "GRPO 1e-5=benchmarks/results/smollm2/ceiling/control/uniform_1e-5" ...

Each ``LABEL=PREFIX`` names a method and the path prefix of its files (``PREFIX_seed400_...``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from rredcot.training.runio import MetricsLog


def read_steps(path: Path) -> list[dict]:
    """The training-step rows of one run's ``metrics.jsonl`` (rows with a reward)."""
    return [row for row in MetricsLog(path).read() if "reward_mean" in row]


def run_summary(steps: list[dict]) -> dict[str, float]:
    """One run's figures: step means, first and last entropy, early and late reward."""

    def mean(key: str, rows: list[dict] = steps) -> float:
        return float(np.mean([row[key] for row in rows]))

    return {
        "advantage": mean("advantage_abs_mean"),
        "grad_norm": mean("grad_norm"),
        "entropy_first": steps[0]["entropy"],
        "entropy_last": steps[-1]["entropy"],
        "reward": 100 * mean("reward_mean"),
        "reward_first3": 100 * mean("reward_mean", steps[:3]),
        "reward_last3": 100 * mean("reward_mean", steps[-3:]),
        "agreeing_groups": 100 * mean("zero_variance_groups"),
    }


def method_row(label: str, runs: list[dict[str, float]]) -> str:
    """A markdown row: mean over seeds, with the range over seeds where it helps."""

    def cell(key: str, digits: int = 2, spread: bool = True) -> str:
        values = np.array([run[key] for run in runs])
        text = f"{values.mean():.{digits}f}"
        if spread:
            text += f" [{values.min():.{digits}f}-{values.max():.{digits}f}]"
        return text

    return (
        f"| {label} | {cell('advantage')} | {cell('grad_norm')} "
        f"| {cell('entropy_first', spread=False)} -> {cell('entropy_last', spread=False)} "
        f"| {cell('reward_first3', 1, False)} -> {cell('reward_last3', 1, False)} "
        f"| {cell('reward', 1)} | {cell('agreeing_groups', 0)} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("seeds", help="FIRST:COUNT, e.g. 400:8")
    parser.add_argument("methods", nargs="+", help="LABEL=PREFIX of the gathered metrics files")
    args = parser.parse_args()
    first, count = (int(part) for part in args.seeds.split(":"))
    print(
        "| run | mean \\|advantage\\| | gradient norm | entropy, step 1 -> last "
        "| reward (%), first 3 -> last 3 steps | reward (%), all steps | agreeing groups (%) |"
    )
    print("|---|---|---|---|---|---|---|")
    for spec in args.methods:
        label, _, prefix = spec.partition("=")
        paths = [Path(f"{prefix}_seed{seed}_metrics.jsonl") for seed in range(first, first + count)]
        missing = [str(path) for path in paths if not path.exists()]
        if missing:
            raise SystemExit(f"{label}: no metrics file {missing[0]}; gather the seed first")
        print(method_row(label, [run_summary(read_steps(path)) for path in paths]))


if __name__ == "__main__":
    main()
