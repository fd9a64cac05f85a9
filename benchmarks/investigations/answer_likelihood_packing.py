"""What packing saves in answer_likelihood's probe pass on SmolLM2-135M-Instruct, under the bf16
autocast that TRL puts on a CPU run (issue 32, item 4), and that packed and unpacked log-probs agree.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/investigations/answer_likelihood_packing.py \\
        --data path/to/gsm8k --traces 8 --repeats 3

The completions are GSM8K's own gold solutions (newline segments, the answer line merged), the
probe is the reference answer after every boundary. Prints the probes, the forward tokens of
each pass (``probe_pass_tokens``), the seconds of each pass per repetition (packed and unpacked
interleaved) and the largest log-prob difference between them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from rredcot.methods import answer_probes, probe_logprobs  # noqa: E402
from rredcot.models import load_policy  # noqa: E402
from rredcot.tasks import get_task  # noqa: E402
from text_batches import batch_from_texts  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="GSM8K: hub name, file or directory")
    parser.add_argument("--traces", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    torch.set_num_threads(1)
    model, tokenizer = load_policy("smollm2-135m-instruct")
    Accelerator(mixed_precision="bf16", cpu=True).prepare_model(model)  # TRL's CPU default
    task = get_task("gsm8k", data=args.data)
    problems = task.train_problems(args.traces, seed=0)
    texts = [p.meta["solution"] for p in problems]
    batch = batch_from_texts(tokenizer, task, problems, texts, group_size=4)
    probes, _ = answer_probes.build_probes(batch, tokenizer, task, [[p.answer] for p in problems])
    packed_tokens, unpacked_tokens = probe_logprobs.probe_pass_tokens(batch, probes)
    assert probe_logprobs._trunk_and_head(model) is not None, (
        "the trunk does not reproduce the logits"
    )
    seconds: dict[str, list[float]] = {"packed": [], "unpacked": []}
    worst = 0.0
    for _ in range(args.repeats):
        start = time.perf_counter()
        packed, _ = probe_logprobs.packed_probe_logprobs(model, batch, probes)
        seconds["packed"].append(round(time.perf_counter() - start, 2))
        start = time.perf_counter()
        plain, _ = probe_logprobs.unpacked_probe_logprobs(model, batch, probes)
        seconds["unpacked"].append(round(time.perf_counter() - start, 2))
        worst = max(worst, *(float((a - b).abs().max()) for a, b in zip(packed, plain)))
    print(
        json.dumps(
            {
                "traces": args.traces,
                "probes": len(probes),
                "forward_tokens": {"packed": packed_tokens, "unpacked": unpacked_tokens},
                "seconds": seconds,
                "max_abs_logprob_difference": worst,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
