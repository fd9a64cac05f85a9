"""Where each method's training time goes: the phase timers of learn-bench runs, per run.

    python benchmarks/phase_seconds.py ROOT FIRST:N uniform=5e-5 cl_cheap=1e-4 ...

ROOT is a ``gather_lr.py`` layout (``ROOT/lr<LR>/runs/<method>/seed<S>/metrics.jsonl``). Prints,
per method, the mean over the seeds every named method finished of each phase's seconds summed
over a run (``time/*``), the run's training seconds (``step_seconds``) and its ratio to the first
method's, and the share of response tokens the update forwarded (``update/tokens_forwarded``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PHASES = ("rollout", "reference", "old_logprobs", "credit", "update", "value_update")


def run_totals(path: Path) -> dict[str, float]:
    """One run's phase seconds and training seconds (summed over steps), and its mean share of
    tokens forwarded by the update."""
    totals = {p: 0.0 for p in PHASES} | {"train": 0.0}
    forwarded = []
    for line in path.read_text().splitlines():
        row = json.loads(line)
        for p in PHASES:
            totals[p] += row.get(f"time/{p}", 0.0)
        totals["train"] += row.get("step_seconds", 0.0)
        if "update/tokens_forwarded" in row:
            forwarded.append(row["update/tokens_forwarded"])
    totals["forwarded"] = sum(forwarded) / max(len(forwarded), 1)
    return totals


def main(argv: list[str]) -> None:
    if len(argv) < 3 or ":" not in argv[1]:
        sys.exit(__doc__)
    root = Path(argv[0])
    first, n = (int(x) for x in argv[1].split(":"))
    methods = [spec.split("=") for spec in argv[2:]]
    path = "lr{}/runs/{}/seed{}/metrics.jsonl"
    seeds = [
        s
        for s in range(first, first + n)
        if all((root / path.format(lr, m, s)).exists() for m, lr in methods)
    ]
    if not seeds:
        sys.exit(f"no seed in {first}:{n} where every method finished under {root}")
    print(f"{root}: seeds {seeds} (mean per run, seconds)")
    print("| method | " + " | ".join(PHASES) + " | train | / first | tokens forwarded |")
    print("|---" * (len(PHASES) + 4) + "|")
    base = None
    for m, lr in methods:
        runs = [run_totals(root / path.format(lr, m, s)) for s in seeds]
        mean = {k: sum(r[k] for r in runs) / len(runs) for k in runs[0]}
        base = base or mean["train"]
        cells = [f"{mean[p]:.1f}" for p in PHASES]
        ratio = mean["train"] / base
        print(
            f"| {m} | " + " | ".join(cells) + f" | {mean['train']:.1f} | {ratio:.2f} | "
            f"{mean['forwarded']:.2f} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
