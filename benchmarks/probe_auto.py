"""What ``--credit auto`` chooses, seed by seed: its probe of the starting policy, without training.

    python benchmarks/probe_auto.py FIRST_SEED END_SEED PROMPTS [--low] [task.KEY=VALUE ...]

Prints ``prompts seed method mean_reward all_wrong probe_tokens`` per seed (``--low``: the
shipped low warm-start, ``model.tiny_warmstart=low``).
"""

import sys
import tempfile
from pathlib import Path

import torch

from rredcot.config import TrainConfig
from rredcot.config_io import resolve_config
from rredcot.train_setup import build_train_parts, probe_credit_choice


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
        cfg.credit.auto_prompts = int(prompts)
        choice = probe_credit_choice(
            cfg,
            parts.task,
            parts.policy,
            parts.tokenizer,
            parts.segmenter,
            parts.decoder,
            parts.train_pool,
        )
        f = choice.figures
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
