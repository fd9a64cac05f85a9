"""Seeded short runs of every credit method, for showing that a refactor changed no behaviour.

Runs ``rredcot train`` for a few steps with each credit method and the variants below (tree
groups, the references' modes, the entropy segmenter, micro-batches, the KL reference, off-policy
epochs, two forwards, every row updated) on the default task and warm-start, one thread, a fixed
seed, and writes every run's ``metrics.jsonl`` without its wall-clock keys into one JSON file.
Run it before and after a change and compare:

    python benchmarks/seam_equivalence.py --out before.json        # on the old commit
    python benchmarks/seam_equivalence.py --out after.json         # on the new one
    python benchmarks/seam_equivalence.py --compare before.json after.json

``--compare`` prints every key whose value differs (exactly, no tolerance) and exits 1 if any.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

PRM = Path(__file__).resolve().parent / "seam_equivalence_prm.py"

# name -> extra train flags (every run also gets the common flags below)
VARIANTS: dict[str, list[str]] = {
    "uniform": ["--credit_method", "uniform"],
    "node_values": ["--credit_method", "node_values"],
    "value_head": ["--credit_method", "value_head"],
    "value_head_lam0_pretrain": [
        "--credit_method",
        "value_head",
        "--credit.lam",
        "0",
        "--credit.value_head.pretrain_steps",
        "1",
        "--credit.handover.smoothing",
        "0.5",
    ],
    "value_head_reweight": ["--credit_method", "value_head", "--credit.form", "reweight"],
    "answer_likelihood": ["--credit_method", "answer_likelihood"],
    "continuation_likelihood": ["--credit_method", "continuation_likelihood"],
    "process_reward": [
        "--credit_method",
        "process_reward",
        "--credit.process_reward.function",
        f"{PRM}:score_steps",
    ],
    "monte_carlo": ["--credit_method", "monte_carlo", "--credit.monte_carlo.rollouts", "2"],
    "gradient": ["--credit_method", "gradient"],
    "attention": ["--credit_method", "attention"],
    "first_last": ["--credit_method", "first_last"],
    "oracle": ["--credit_method", "oracle"],
    "oracle_pooled": ["--credit_method", "oracle", "--credit.oracle.values", "pooled"],
    "uniform_tree": [
        "--credit_method",
        "uniform",
        "--sampling.tree.enabled",
        "true",
    ],
    "value_head_tree": [
        "--credit_method",
        "value_head",
        "--sampling.tree.enabled",
        "true",
    ],
    # the references' modes, the entropy segmenter, micro-batches, the KL reference, off-policy
    # epochs, two forwards, and every row updated
    "refs_sft": [
        "--credit_method",
        "uniform",
        "--references.mode",
        "sft",
        "--references.groups",
        "all",
    ],
    "refs_sft_failed": ["--credit_method", "value_head", "--references.mode", "sft"],
    "refs_luffy": [
        "--credit_method",
        "uniform",
        "--references.mode",
        "luffy",
        "--references.groups",
        "all",
    ],
    "refs_luffy_vh": [
        "--credit_method",
        "value_head",
        "--references.mode",
        "luffy",
        "--references.groups",
        "all",
    ],
    "refs_bread": [
        "--credit_method",
        "uniform",
        "--references.mode",
        "bread",
        "--references.groups",
        "all",
    ],
    "entropy_seg": ["--credit_method", "value_head", "--credit.segmenter", "entropy"],
    "entropy_seg_single": [
        "--credit_method",
        "uniform",
        "--credit.segmenter",
        "entropy",
        "--micro_batch_tokens",
        "256",
    ],
    "micro_batches": ["--credit_method", "value_head", "--micro_batch_tokens", "256"],
    "micro_uniform": ["--credit_method", "uniform", "--micro_batch_tokens", "256"],
    "kl_ref": ["--credit_method", "uniform", "--kl_coef", "0.05"],
    "offpolicy": ["--credit_method", "value_head", "--epochs_per_batch", "2", "--minibatches", "2"],
    "no_single": ["--credit_method", "uniform", "--single_forward", "false"],
    "skip_rows_off": ["--credit_method", "first_last", "--skip_zero_advantage_rows", "false"],
}

COMMON = [
    "--steps",
    "3",
    "--seed",
    "0",
    "--prompts_per_step",
    "4",
    "--eval_every",
    "0",
    "--threads",
    "1",
    "--progress",
    "false",
]


def run_one(name: str, flags: list[str], workdir: Path) -> list[dict]:
    out = workdir / name
    cmd = ["rredcot", "train", *COMMON, *flags, "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{name} failed:\n{done.stderr[-3000:]}")
    rows = []
    for line in (out / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.append(
            {k: v for k, v in record.items() if not (k.startswith("time/") or "seconds" in k)}
        )
    return rows


def same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def compare(before: dict, after: dict) -> int:
    differences = 0
    for name in sorted(set(before) | set(after)):
        if name not in before or name not in after:
            print(f"{name}: only in {'after' if name in after else 'before'}")
            differences += 1
            continue
        for step, (a, b) in enumerate(zip(before[name], after[name], strict=False)):
            for key in sorted(set(a) | set(b)):
                if not same(a.get(key), b.get(key)):
                    print(f"{name} step {step} {key}: {a.get(key)!r} -> {b.get(key)!r}")
                    differences += 1
        if len(before[name]) != len(after[name]):
            print(f"{name}: {len(before[name])} records -> {len(after[name])}")
            differences += 1
    total = sum(len(r) for v in after.values() for r in v)
    print(f"{len(after)} runs, {total} logged values compared: {differences} differences")
    return 1 if differences else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the runs' metrics here (JSON)")
    parser.add_argument("--only", default="", help="comma-separated variant names (default all)")
    parser.add_argument("--compare", nargs=2, metavar=("BEFORE", "AFTER"))
    args = parser.parse_args()
    if args.compare:
        a, b = (json.loads(Path(p).read_text()) for p in args.compare)
        sys.exit(compare(a, b))
    if not args.out:
        parser.error("give --out (or --compare BEFORE AFTER)")
    names = [n for n in args.only.split(",") if n] or list(VARIANTS)
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; valid: {', '.join(VARIANTS)}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            results[name] = run_one(name, VARIANTS[name], Path(tmp))
            print(f"{name}: {len(results[name])} records", flush=True)
    Path(args.out).write_text(json.dumps(results, indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
