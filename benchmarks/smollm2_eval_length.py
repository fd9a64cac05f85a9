"""How much of SmolLM2's starting accuracy on word_problems the evaluation's token cap decides.

Greedy accuracy of SmolLM2-135M-Instruct on a run's held-out problems (``eval_problems(N,
seed)``, as ``rredcot train`` builds them) at several ``max_new_tokens``, with the share of
completions that hit the cap (no EOS). The learning protocol (``smollm2_learn.sh``) trains and
evaluates at 72, the task's suggestion.

    python benchmarks/smollm2_eval_length.py OUT.json --seed 200 --caps 72,144,256
    python benchmarks/smollm2_eval_length.py OUT.json --task gsm8k \
        --task-arg data=../shared/data/gsm8k --caps 256   (headroom of another testbed)
    python benchmarks/smollm2_eval_length.py OUT.json --sampled 8 --caps 224 --eval-size 16 \
        --seed 5   (training's view: 8 samples at temperature 1 per training prompt; the share
                    that ends by each cap is read off one long cap, and the share of groups
                    all wrong or all right, where GRPO has no signal)
    --model DIR reads a warm-up of the model (`rredcot sft --init smollm2-135m-instruct ...`).
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from rredcot.models import load_policy
from rredcot.sampling.rollout import render_prompt, sample
from rredcot.tasks import get_task
from rredcot.tasks.base import checked_verify


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=200)
    ap.add_argument("--eval-size", type=int, default=128)
    ap.add_argument("--caps", default="72,144,256")
    ap.add_argument("--task", default="word_problems")
    ap.add_argument("--task-arg", action="append", default=[], help="KEY=VALUE, repeatable")
    ap.add_argument(
        "--sampled",
        type=int,
        default=0,
        help="G samples at temperature 1 per "
        "training prompt instead of greedy evaluation (0: greedy)",
    )
    ap.add_argument(
        "--temperature", type=float, default=1.0, help="of --sampled rows (training's: 1.0)"
    )
    ap.add_argument(
        "--model",
        default="smollm2-135m-instruct",
        help="the policy: the shipped model, or a warm-up of it (`rredcot sft --init ...`)",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    policy, tokenizer = load_policy(args.model, dtype="float32")
    policy.eval()
    task_args = dict(kv.split("=", 1) for kv in args.task_arg)
    task = get_task(args.task, **task_args)
    if args.sampled:
        problems = task.train_problems(args.eval_size, seed=args.seed)
    else:
        problems = task.eval_problems(args.eval_size, seed=args.seed)
    G = max(args.sampled, 1)
    prompts = [render_prompt(p, tokenizer) for p in problems]
    rows = []
    for cap in (int(c) for c in args.caps.split(",")):
        t0 = time.perf_counter()
        correct = capped = 0
        lengths, finished = [], []
        solved = [0] * len(problems)  # per prompt: how many of its G samples are right
        # prompts per generate call: 64 greedy rows, or 32 sampled rows (the chunking fixes the
        # RNG stream, so ceiling/lengths.json is reproduced only with it)
        step = 64 if G == 1 else max(32 // G, 1)
        for start in range(0, len(problems), step):
            chunk = slice(start, start + step)
            with torch.no_grad():
                ids, _, P, mask = sample(
                    policy,
                    tokenizer,
                    prompts[chunk],
                    num_generations=G,
                    max_new_tokens=cap,
                    greedy=not args.sampled,
                    temperature=args.temperature,
                )
            for row in range(ids.shape[0]):
                problem = problems[chunk][row // G]
                n = int(mask[row].sum())
                text = tokenizer.decode(ids[row, P : P + n], skip_special_tokens=True)
                verdict, ok = checked_verify(task, problem, text)
                correct += float(verdict.reward) if ok else 0.0
                solved[start + row // G] += int(ok and float(verdict.reward) == 1.0)
                ended = int(ids[row, P + n - 1]) == tokenizer.eos_token_id
                capped += int(n >= cap and not ended)
                lengths.append(n)
                finished.append(n if ended else None)
        row = {
            "max_new_tokens": cap,
            "accuracy": correct / len(lengths),
            "hit_cap": capped / len(lengths),
            "ended_by": {
                c: sum(n is not None and n <= c for n in finished) / len(lengths)
                for c in (72, 96, 128, 160, 192, 224)
                if c <= cap
            },
            "mean_length": sum(lengths) / len(lengths),
            **(
                {  # the headroom of GRPO's groups: where all G agree it has no signal
                    "groups_all_wrong": sum(k == 0 for k in solved) / len(solved),
                    "groups_all_right": sum(k == G for k in solved) / len(solved),
                }
                if G > 1
                else {}
            ),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    meta = {
        "model": args.model,
        "task": args.task,
        "seed": args.seed,
        "eval_size": len(problems),
        "greedy": not args.sampled,
        "samples_per_prompt": G,
        **({"task_args": task_args} if task_args else {}),
        **({"temperature": args.temperature} if args.sampled else {}),
    }
    with open(args.out, "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
