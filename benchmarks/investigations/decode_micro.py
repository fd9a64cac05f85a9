"""Decoding alone: Hugging Face ``generate`` against rredcot's fast loop (``rredcot.sampling.decode``) on
the peer bench's batch (the default tiny warm-start, 16 arithmetic prompts x 8 samples, up to 64
new tokens, temperature 1), interleaved (hf, fast, fast, hf, ...), each repetition from the same
seed for both; medians of wall and CPU seconds, and whether the two drew the same tokens.

    PYTHONPATH=src python benchmarks/investigations/decode_micro.py --repeats 9 --threads 1 [--out FILE]

``--long-prompts N`` puts N copies of "Solve step by step. " before every prompt (a stand-in for
a system prompt: the case where the prompt's keys dominate each step's attention).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rredcot.models import load_policy, resolve_model_dir
from rredcot.sampling.rollout import render_prompt, sample
from rredcot.tasks import get_task
from rredcot.training.sft import default_policy_source


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--greedy", action="store_true")
    p.add_argument("--long-prompts", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    task = get_task("arithmetic")
    model_dir = resolve_model_dir(default_policy_source(task, None, log=lambda *_: None))
    policy, tok = load_policy(model_dir)
    policy.eval()
    prefix = "Solve step by step. " * args.long_prompts
    prompts = [prefix + render_prompt(q, tok) for q in task.train_problems(args.prompts, seed=0)]

    def run(decoder: str, seed: int):
        torch.manual_seed(seed)
        wall, cpu = time.perf_counter(), time.process_time()
        ids, _, _, mask = sample(
            policy,
            tok,
            prompts,
            num_generations=args.generations,
            max_new_tokens=args.max_new_tokens,
            greedy=args.greedy,
            decoder=decoder,
        )
        return time.perf_counter() - wall, time.process_time() - cpu, ids, mask

    run("fast", -1), run("hf", -1)  # warm-up
    times = {"hf": {"wall": [], "cpu": []}, "fast": {"wall": [], "cpu": []}}
    same, steps, tokens = [], [], []
    for rep in range(args.repeats):
        order = ("hf", "fast") if rep % 2 == 0 else ("fast", "hf")
        drawn = {}
        for decoder in order:
            wall, cpu, ids, mask = run(decoder, rep)
            times[decoder]["wall"].append(wall)
            times[decoder]["cpu"].append(cpu)
            drawn[decoder] = ids
        same.append(bool(torch.equal(drawn["hf"], drawn["fast"])))
        steps.append(int(mask.shape[1]))
        tokens.append(float(mask.sum()))
    summary = {
        "model": model_dir,
        "batch": f"{args.prompts} prompts x {args.generations} samples",
        "max_new_tokens": args.max_new_tokens,
        "greedy": args.greedy,
        "prompt_prefix_chars": len(prefix),
        "threads": args.threads,
        "repeats": args.repeats,
        "decode_steps": steps,
        "tokens_generated": tokens,
        "same_tokens_every_repeat": all(same),
        **{
            f"{d}_median_{k}_s": statistics.median(v)
            for d in ("hf", "fast")
            for k, v in times[d].items()
        },
        "speedup_wall": statistics.median(times["hf"]["wall"])
        / statistics.median(times["fast"]["wall"]),
        "speedup_cpu": statistics.median(times["hf"]["cpu"])
        / statistics.median(times["fast"]["cpu"]),
        "speedup_paired_wall": statistics.median(
            h / f for h, f in zip(times["hf"]["wall"], times["fast"]["wall"])
        ),
        "raw": times,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
