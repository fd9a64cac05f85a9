"""How much of a run's held-out word problems a run's training pool already holds as arithmetic.

`word_problems` holds a prompt out by a hash of its text, so the same chain (start amount,
operations, operands) told with another name or item can sit in both splits. For each seed:
the share of the `eval_size` held-out problems whose chain occurs among the training pool's
(`rredcot train` draws its steps from `train_problems(4096, seed)`), and the share of exact prompts.

    python benchmarks/word_problems_overlap.py OUT.json --seeds 0,200,400 [--task-arg KEY=VALUE]
"""

from __future__ import annotations

import argparse
import json

from rredcot.tasks import get_task
from rredcot.tasks.word_problems import parse_problem

POOL = 4096  # train_setup._prompt_sets: max(4096, prompts_per_step * 8)


def chain(problem) -> tuple:
    return parse_problem(problem.prompt).chain


def overlap(task, seed: int, eval_size: int) -> dict:
    pool = task.train_problems(POOL, seed=seed)
    held = task.eval_problems(eval_size, seed=seed)
    chains = {chain(p) for p in pool}
    prompts = {p.prompt for p in pool}
    return {
        "seed": seed,
        "eval_size": len(held),
        "pool": len(pool),
        "distinct_pool_chains": len(chains),
        "eval_chains_in_pool": sum(chain(p) in chains for p in held),
        "eval_prompts_in_pool": sum(p.prompt in prompts for p in held),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seeds", default="0,200")
    ap.add_argument("--eval-size", type=int, default=128)
    ap.add_argument("--task-arg", action="append", default=[], help="KEY=VALUE, repeatable")
    args = ap.parse_args()
    task_args = dict(kv.split("=", 1) for kv in args.task_arg)
    task = get_task("word_problems", **task_args)
    rows = [overlap(task, int(s), args.eval_size) for s in args.seeds.split(",")]
    for row in rows:
        print(json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump({"task": "word_problems", "task_args": task_args, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
