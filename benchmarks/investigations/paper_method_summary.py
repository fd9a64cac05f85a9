"""Summarise `rredcot bench credit` reports for the paper-method comparison (issue 30).

    python benchmarks/investigations/paper_method_summary.py REPORT_DIR [REPORT_DIR ...] > summary.md

One row per (segmenter, method) of every report: Spearman rho (pooled), sign agreement,
first-error error_acc with its exact 95% Clopper-Pearson interval (scipy.stats) over the
report's wrong traces, correct_acc, F1, and extra forward / generated tokens per trace.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from scipy.stats import binomtest


def fmt(x, digits=3):
    return "–" if x is None else f"{x:.{digits}f}"


def main(dirs: list[str]) -> None:
    print(
        "| report | segmenter | method | ρ pooled | sign agr. | error_acc [95% CI] | "
        "correct_acc | F1 | fwd tok/trace | gen tok/trace |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d in dirs:
        report = json.loads((Path(d) / "credit.json").read_text())
        for row in report["results"]:
            n = row.get("n_wrong") or 0
            acc = row.get("error_acc")
            ci = ""
            if n and acc is not None:
                k = round(acc * n)
                low, high = binomtest(k, n).proportion_ci(0.95)
                ci = f" [{low:.2f}, {high:.2f}]"
            print(
                f"| {Path(d).name} | {row['segmenter']} | {row['method']} | "
                f"{fmt(row['spearman_pooled'])} | {fmt(row['sign_agreement'])} | "
                f"{fmt(acc)}{ci} (n={n}) | {fmt(row.get('correct_acc'))} | {fmt(row.get('f1'))} | "
                f"{fmt(row.get('extra_forward_tokens_per_trace'), 0)} | "
                f"{fmt(row.get('extra_generated_tokens_per_trace'), 0)} |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
