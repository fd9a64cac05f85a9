"""Does ``torch.compile`` of the fast decoder's step pay on CPU? The fast loop
(:mod:`rredcot.sampling.decode`) with its per-token step as written, against the same step compiled by
``torch.compile(dynamic=True)`` (inductor: one graph whatever the decoded length), on the peer
bench's batch (the default tiny warm-start, 16 arithmetic prompts x 8 samples, up to 64 new
tokens, temperature 1). Interleaved (eager, compiled, compiled, eager, ...), each repetition from
the same seed for both; prints the first compiled call (compilation included), the medians of
wall and CPU seconds after it, and whether the two drew the same tokens.

    PYTHONPATH=src python benchmarks/investigations/decode_compile.py --repeats 5 --threads 1 [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rredcot.models import load_policy, resolve_model_dir
from rredcot.sampling import decode
from rredcot.sampling.rollout import render_prompt, sample
from rredcot.tasks import get_task
from rredcot.training.sft import default_policy_source


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    task = get_task("arithmetic")
    model_dir = resolve_model_dir(default_policy_source(task, None, log=lambda *_: None))
    policy, tok = load_policy(model_dir)
    policy.eval()
    prompts = [render_prompt(q, tok) for q in task.train_problems(args.prompts, seed=0)]
    eager_step = decode._Decoder.step
    compiled_step = torch.compile(eager_step, dynamic=True)

    def run(compiled: bool, seed: int):
        decode._Decoder.step = compiled_step if compiled else eager_step
        torch.manual_seed(seed)
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            ids, _, _, mask = sample(
                policy,
                tok,
                prompts,
                num_generations=args.generations,
                max_new_tokens=args.max_new_tokens,
                decoder="fast",
            )
        finally:
            decode._Decoder.step = eager_step
        return time.perf_counter() - wall, time.process_time() - cpu, ids

    run(False, -1)  # warm-up
    first_wall, first_cpu, _ = run(True, -1)  # compilation happens here
    times = {"eager": {"wall": [], "cpu": []}, "compiled": {"wall": [], "cpu": []}}
    same = []
    for rep in range(args.repeats):
        order = (False, True) if rep % 2 == 0 else (True, False)
        drawn = {}
        for compiled in order:
            name = "compiled" if compiled else "eager"
            wall, cpu, ids = run(compiled, rep)
            times[name]["wall"].append(wall)
            times[name]["cpu"].append(cpu)
            drawn[name] = ids
        same.append(bool(torch.equal(drawn["eager"], drawn["compiled"])))
    eager, compiled = (statistics.median(times[n]["wall"]) for n in ("eager", "compiled"))
    summary = {
        "model": model_dir,
        "batch": f"{args.prompts} prompts x {args.generations} samples",
        "max_new_tokens": args.max_new_tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "first_compiled_call_wall_s": first_wall,
        "first_compiled_call_cpu_s": first_cpu,
        "same_tokens_every_repeat": all(same),
        **{
            f"{n}_median_{k}_s": statistics.median(v)
            for n in ("eager", "compiled")
            for k, v in times[n].items()
        },
        "speedup_wall": eager / compiled,
        "speedup_cpu": statistics.median(times["eager"]["cpu"])
        / statistics.median(times["compiled"]["cpu"]),
        "batches_to_repay_compilation": (first_wall - compiled) / (eager - compiled)
        if eager > compiled
        else None,
        "raw": times,
    }
    text = json.dumps(summary, indent=2)
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")


if __name__ == "__main__":
    main()
