"""Step time of RREDCoTGRPOTrainer (value head, TRL's defaults) against plain GRPOTrainer on the
same tiny model, CPU, interleaved rounds in one process.

    python examples/trl_overhead.py --rounds 5 --steps 6

Prints the median seconds per step of each and their ratio, and rredcot's extra forwards.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from datasets import Dataset
from trl import GRPOConfig, GRPOTrainer

from rredcot.integrations.trl import RREDCoTGRPOConfig, RREDCoTGRPOTrainer, task_reward
from rredcot.models import build_char_tokenizer, build_tiny_llama
from rredcot.tasks import get_task


def digit_share(completions, **kwargs) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--hidden_size", type=int, default=64)
    a = ap.parse_args()
    torch.set_num_threads(1)
    tok = build_char_tokenizer()
    tmp = tempfile.mkdtemp()
    build_tiny_llama(
        tok, hidden_size=a.hidden_size, num_layers=2, num_heads=2, seed=0
    ).save_pretrained(tmp)
    tok.save_pretrained(tmp)
    problems = get_task("arithmetic", num_steps=2).train_problems(64, seed=0)
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    common = dict(
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=32,
        max_steps=a.steps,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
    )
    times: dict[str, list[float]] = {"grpo": [], "rredcot": []}
    extra: list[float] = []
    for r in range(a.rounds):
        for name in ("grpo", "rredcot") if r % 2 == 0 else ("rredcot", "grpo"):
            if name == "grpo":
                args, cls = GRPOConfig(output_dir=f"{tmp}/g", **common), GRPOTrainer
            else:
                args = RREDCoTGRPOConfig(
                    output_dir=f"{tmp}/r",
                    credit_method="value_head",
                    credit={"segmenter": "tokens:8"},
                    **common,
                )
                cls = RREDCoTGRPOTrainer
            trainer = cls(
                model=tmp,
                reward_funcs=[task_reward("arithmetic", num_steps=2), digit_share],
                args=args,
                train_dataset=data,
                processing_class=tok,
            )
            start = time.perf_counter()
            trainer.train()
            times[name].append((time.perf_counter() - start) / a.steps)
            if name == "rredcot":
                extra += [
                    h["rredcot/extra_forward"]
                    for h in trainer.state.log_history
                    if "rredcot/extra_forward" in h
                ]
    g, o = statistics.median(times["grpo"]), statistics.median(times["rredcot"])
    print(f"GRPOTrainer      {g:.4f} s/step  (rounds: {[round(t, 4) for t in times['grpo']]})")
    print(f"RREDCoT (value)  {o:.4f} s/step  (rounds: {[round(t, 4) for t in times['rredcot']]})")
    print(f"ratio {o / g:.3f}; rredcot/extra_forward mean {sum(extra) / max(len(extra), 1):.2f}")


if __name__ == "__main__":
    main()
