"""Rollout wall-clock and tokens of tree groups against independent groups, interleaved in one
process on the same policy and prompts (so machine load hits both alike): the 12-step testbed's
warm-start, 16 prompts x 8 completions, the task's completion length, newline segments.

    OMP_NUM_THREADS=1 python benchmarks/investigations/tree_rollout_time.py --repeats 3 > rollout_time.json
"""

import argparse
import json
import statistics
import sys
import time

import torch

from rredcot.config import TreeSamplingConfig
from rredcot.models import load_policy
from rredcot.sampling.rollout import build_rollout_batch
from rredcot.segment import get_segmenter
from rredcot.tasks import get_task
from rredcot.training.sft import default_warmstart


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--num-steps", type=int, default=12)
    args = p.parse_args()
    torch.set_num_threads(1)
    task = get_task("arithmetic", num_steps=args.num_steps)
    policy, tok = load_policy(default_warmstart(task, log=lambda m: print(m, file=sys.stderr)))
    policy.eval()
    max_new = task.suggested_max_new_tokens()
    segmenter = get_segmenter("newline")
    arms = {
        "independent": None,
        "tree_entropy": TreeSamplingConfig(enabled=True, fork_rule="entropy"),
        "tree_random": TreeSamplingConfig(enabled=True, fork_rule="random"),
    }
    rows = {name: [] for name in arms}
    for repeat in range(args.repeats):
        problems = task.train_problems(args.prompts, seed=repeat)
        for name, tree in arms.items():
            torch.manual_seed(repeat)
            start = time.perf_counter()
            _, stats = build_rollout_batch(
                policy,
                tok,
                task,
                problems,
                segmenter,
                num_generations=args.generations,
                max_new_tokens=max_new,
                tree=tree,
            )
            rows[name].append(
                {
                    "seconds": time.perf_counter() - start,
                    "tokens": stats["rollout/tokens"],
                    "leaf_tokens": stats.get("rollout/tree_leaf_tokens", stats["rollout/tokens"]),
                }
            )
    summary = {}
    base = statistics.mean(r["seconds"] for r in rows["independent"])
    base_tokens = statistics.mean(r["tokens"] for r in rows["independent"])
    for name, runs in rows.items():
        sec = statistics.mean(r["seconds"] for r in runs)
        tokens = statistics.mean(r["tokens"] for r in runs)
        leaf = statistics.mean(r["leaf_tokens"] for r in runs)
        summary[name] = {
            "seconds_mean": sec,
            "seconds_ratio_to_independent": sec / base,
            "tokens_mean": tokens,
            "tokens_ratio_to_independent": tokens / base_tokens,
            "saved_share": 1 - tokens / leaf,
            "seconds_per_1k_tokens": 1000 * sec / tokens,
        }
    print(
        json.dumps(
            {"args": vars(args), "max_new_tokens": max_new, "summary": summary, "runs": rows},
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
