"""Per-step figures of benchmarks/investigations/probe_cache.sh's runs: ``ROOT/TESTBED/cache_{true,false}/
metrics.jsonl`` -> ``ROOT/summary.json`` and a markdown table on stdout."""

from __future__ import annotations

import json
import sys
from pathlib import Path

KEYS = (
    "credit/extra_forward_tokens",
    "credit/probe_from_cache",
    "time/credit",
    "rollout/tokens",
)


def steps_of(run: Path) -> list[dict]:
    """The step records of one run (evaluation lines left out), the :data:`KEYS` of each."""
    rows = []
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "credit/extra_forward_tokens" in record:
            rows.append({"step": record["step"], **{k: record[k] for k in KEYS}})
    return rows


def main(root: Path) -> None:
    summary = {
        testbed.name: {run.name: steps_of(run) for run in sorted(testbed.glob("cache_*"))}
        for testbed in sorted(p for p in root.iterdir() if p.is_dir())
    }
    (root / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(
        "| testbed | cache | step | extra forward tokens | from cache | time/credit (s) | rollout tokens |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for testbed, runs in summary.items():
        for name, rows in runs.items():
            for r in rows:
                print(
                    f"| {testbed} | {name.removeprefix('cache_')} | {r['step']} | "
                    f"{r['credit/extra_forward_tokens']:.0f} | {r['credit/probe_from_cache']:.2f} | "
                    f"{r['time/credit']:.2f} | {r['rollout/tokens']:.0f} |"
                )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
