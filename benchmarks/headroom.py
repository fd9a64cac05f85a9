"""How much a testbed leaves credit assignment to win, measured before anything is tuned.

Samples ``--batches`` training batches (``--prompts`` prompts x ``--samples`` completions, the
run's sampling settings) from a checkpoint on any task and prints, as JSON:

- ``mean_reward``; ``agreeing_groups`` (share of groups whose rewards all agree: GRPO learns
  nothing from them) split into ``all_wrong_groups`` and ``all_right_groups``;
- ``right_lines_before_error``: over wrong traces with a step label, the mean number of right
  lines before the first wrong one, and the share of wrong traces with at least one;
- GRPO's logit-gradient mass on the wrong traces of mixed groups
  (``long_chain_gradient_share.region_shares``, on ``rredcot.diagnose``'s figures): the share
  that lands on the correct prefix before the first slip, on the slip's segment and after it,
  with the mean ``1 - p(y)`` of each. ``rredcot diagnose`` reports these and more with intervals.

    python benchmarks/headroom.py --task graph_paths --batches 4 --seed 7
    python benchmarks/headroom.py --task arithmetic --task-arg num_steps=12 --init DIR
    python benchmarks/headroom.py --task word_problems --init smollm2-135m-instruct \\
        --temperature 1.0 --batches 2 --prompts 8

Without ``--init`` the task's default policy is used (the tiny warm-start where the task has
one, built and cached; ``--preset`` picks a named warm-start such as ``low``).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from long_chain_gradient_share import region_shares  # benchmarks/ (the script's folder)

from rredcot.config import TrainConfig
from rredcot.config.io import resolve_config
from rredcot.training.trainer import Trainer


def group_agreement(batches) -> dict[str, float]:
    """Shares of prompt groups whose rewards are all 0, all 1, or all equal."""
    wrong = right = total = 0
    for batch in batches:
        for g in batch.group_ids.unique():
            r = batch.rewards[batch.group_ids == g]
            total += 1
            wrong += int(bool((r == 0).all()))
            right += int(bool((r == r.max()).all() and r.max() > 0))
    return {
        "agreeing_groups": (wrong + right) / total,
        "all_wrong_groups": wrong / total,
        "all_right_groups": right / total,
        "groups": total,
    }


def right_lines_before_error(batches) -> dict[str, float]:
    """Over wrong traces whose first wrong line is known: right lines before it."""
    counts = [
        v.first_error_step
        for b in batches
        for row, v in enumerate(b.verdicts)
        if b.rewards[row] < 1.0 and v.first_error_step is not None and v.first_error_step >= 0
    ]
    if not counts:
        return {"mean": float("nan"), "share_with_one_or_more": float("nan"), "traces": 0}
    return {
        "mean": statistics.fmean(counts),
        "share_with_one_or_more": sum(c > 0 for c in counts) / len(counts),
        "traces": len(counts),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--task", default="arithmetic")
    ap.add_argument(
        "--task-arg", action="append", default=[], metavar="KEY=VALUE", help="task parameter"
    )
    ap.add_argument("--init", default=None, help="checkpoint (default: the task's default policy)")
    ap.add_argument("--preset", default=None, help="named tiny warm-start (model.tiny_warmstart)")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the task's suggestion")
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    task_args = dict(pair.split("=", 1) for pair in args.task_arg)
    overrides = {
        "task": args.task,
        "seed": args.seed,
        "out": "/tmp/rredcot-headroom",
        "overwrite": True,
        "threads": 1,
        "progress": False,
        "eval_size": 1,
        "prompts_per_step": args.prompts,
        "sampling.num_generations": args.samples,
        "sampling.temperature": args.temperature,
        "sampling.max_new_tokens": args.max_new_tokens,
    }
    if args.init:
        overrides["init"] = args.init
    if args.preset:
        overrides["model.tiny_warmstart"] = args.preset
    cfg = resolve_config(TrainConfig, None, overrides, task_args)
    trainer = Trainer(cfg, log=lambda *a, **k: None)
    batches = [
        trainer.rollout(trainer.prompts_for_step(step), forward=False)[0]
        for step in range(1, args.batches + 1)
    ]
    report = {
        "task": args.task,
        "task_args": task_args,
        "init": str(trainer.source),
        "temperature": args.temperature,
        "max_new_tokens": cfg.sampling.max_new_tokens,
        "seed": args.seed,
        "traces": sum(b.size for b in batches),
        "mean_reward": float(torch.cat([b.rewards for b in batches]).mean()),
        **group_agreement(batches),
        "right_lines_before_error": right_lines_before_error(batches),
        **region_shares(trainer.policy, batches, trainer.segmenter, cfg.sampling.temperature),
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
