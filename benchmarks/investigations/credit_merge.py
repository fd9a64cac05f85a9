"""Merge ``rredcot bench credit`` runs that scored the same traces with different segmenters.

Each segmenter's Monte Carlo ground truth is the slow part and is independent of the others, so
on a machine with spare cores one process per segmenter finishes sooner; this writes the one
table they would have written together (``credit.json``, ``credit.md``, the example pages).

    PYTHONPATH=src python benchmarks/investigations/credit_merge.py --out DIR RUN_DIR [RUN_DIR ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from rredcot.bench.credit import credit_markdown, merge_credit_reports
from rredcot.bench.report import write_report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="output directories of the runs (each has credit.json)")
    p.add_argument("--out", required=True, help="directory for the merged report")
    args = p.parse_args()
    reports = [json.loads((Path(d) / "credit.json").read_text()) for d in args.runs]
    merged = merge_credit_reports(reports)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for run, report in zip(args.runs, reports):
        for page in report.get("examples", {}).values():
            shutil.copyfile(Path(run) / page, out / page)
    merged["config"]["out"] = str(out)
    print(write_report(merged, out, "credit", credit_markdown))


if __name__ == "__main__":
    main()
