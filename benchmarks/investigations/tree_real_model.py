"""Tree groups on the real model (SmolLM2-135M-Instruct, word problems): a smoke run, not a
learning run. For the same prompts it samples independent groups and tree groups of G completions
and reports tokens generated, the share of leaf tokens saved by sharing, wall-clock, rewards, and
whether every leaf token was drawn from the distribution a plain forward gives (the forked KV
cache checked on a real model).

    OMP_NUM_THREADS=1 python benchmarks/investigations/tree_real_model.py --prompts 8 --generations 8 \
        --max-new-tokens 80 > benchmarks/results/tree/real_model_smoke.json
"""

import argparse
import json
import time

import torch

from rredcot.config import TreeSamplingConfig
from rredcot.models import DEFAULT_REAL_MODEL, load_policy
from rredcot.sampling.forward import policy_forward
from rredcot.sampling.rollout import build_rollout_batch, render_prompt, sample_tree_group
from rredcot.segment import get_segmenter
from rredcot.tasks import get_task


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=80)
    p.add_argument("--segmenter", default="sentence")
    p.add_argument("--fork-rule", default="entropy")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    policy, tok = load_policy(DEFAULT_REAL_MODEL)
    policy.eval()
    task = get_task("word_problems")
    problems = task.train_problems(args.prompts, seed=args.seed)
    segmenter = get_segmenter(args.segmenter)
    tree = TreeSamplingConfig(enabled=True, fork_rule=args.fork_rule)
    out = {"args": vars(args), "model": DEFAULT_REAL_MODEL, "task": "word_problems"}
    for name, tree_cfg in (("independent", None), ("tree", tree)):
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        batch, stats = build_rollout_batch(
            policy,
            tok,
            task,
            problems,
            segmenter,
            num_generations=args.generations,
            max_new_tokens=args.max_new_tokens,
            tree=tree_cfg,
        )
        seconds = time.perf_counter() - start
        out[name] = {
            "seconds": seconds,
            "reward_mean": float(batch.rewards.mean()),
            **{k: v for k, v in stats.items() if k.startswith("rollout/")},
        }
        print(name, json.dumps(out[name]), flush=True)
    # the forked cache on the real model: sampling entropies against a plain forward
    torch.manual_seed(args.seed)
    prompts = [render_prompt(q, tok) for q in problems[:2]]
    ids, mask, P, rmask, grown = sample_tree_group(
        policy,
        tok,
        prompts,
        segmenter,
        tree,
        num_generations=args.generations,
        max_new_tokens=args.max_new_tokens,
    )
    with torch.no_grad():
        fwd = policy_forward(policy, ids, mask, P, with_entropy=True)
    worst = 0.0
    for row, ent in enumerate(grown.entropies):
        got = fwd.entropy[row, : len(ent)].float()
        worst = max(worst, float((got - torch.tensor(ent)).abs().max()) if ent else 0.0)
    out["forked_cache_max_entropy_error"] = worst
    out["forked_cache_fork_depths"] = grown.fork_depths
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
