"""What ``--credit auto``'s rule chooses, seed by seed, from PROMPTS training prompts x G samples
of the starting policy, without training (``--credit auto`` itself reads step 1's batch; this is
the probe it ran before, which measured the testbeds' figures of ``auto_probe.txt``).

    python benchmarks/investigations/probe_auto.py FIRST_SEED END_SEED PROMPTS [--low] [task.KEY=VALUE ...]

Prints ``prompts seed method mean_reward all_wrong probe_tokens`` per seed (``--low``: the
shipped low warm-start, ``model.tiny_warmstart=low``).
"""

import random
import sys
import tempfile
from pathlib import Path

import torch

from rredcot.config import TrainConfig
from rredcot.config.io import resolve_config
from rredcot.methods.auto import choose_from_rollouts
from rredcot.sampling.rollout import sample_groups
from rredcot.training.seeding import seed_everything, step_seed
from rredcot.training.setup import build_train_parts


def main() -> None:
    first, end, prompts, *rest = sys.argv[1:]
    low = "--low" in rest
    task_args = dict(a.split("=", 1) for a in rest if a != "--low")
    torch.set_num_threads(1)
    for seed in range(int(first), int(end)):
        fields = {
            "seed": seed,
            "out": str(Path(tempfile.gettempdir()) / "probe-auto"),
            "threads": 1,
            "credit_method": "uniform",
        }
        if low:
            fields["model.tiny_warmstart"] = "low"
        cfg = resolve_config(TrainConfig, None, fields, task_args)
        parts = build_train_parts(cfg, log=lambda *a: None)
        rng = random.Random(step_seed(seed, 0, salt=23))
        pool = parts.train_pool
        problems = [pool[rng.randrange(len(pool))] for _ in range(int(prompts))]
        seed_everything(step_seed(seed, 0, salt=29))
        parts.policy.eval()
        batch, stats = sample_groups(
            parts.policy, parts.tokenizer, parts.task, problems, parts.segmenter,
            cfg.sampling, parts.decoder, tree=False,
        )  # fmt: skip
        refs = all(parts.task.gold_completion(p) is not None for p in problems)
        choice = choose_from_rollouts(batch.rewards.cpu(), batch.group_ids.cpu(), refs)
        f = {**choice.figures, "tokens": int(stats["rollout/tokens"])}
        print(
            prompts,
            seed,
            choice.method,
            f"{f['mean_reward']:.3f}",
            f"{f['all_wrong']:.3f}",
            f["tokens"],
            flush=True,
        )


if __name__ == "__main__":
    main()
