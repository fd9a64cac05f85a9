"""One cl_cheap credit call (``method.rows``) on the same sampled batch, its probes read from the
rollout's KV cache and re-forwarded, alternately ``repeats`` times each (issue 49, item 1): the
probe pass's time without the rest of a training step's noise.

    python benchmarks/investigations/probe_cache_credit_time.py {arith12_low,arith4_default} OUT_DIR [REPEATS]

Prints and writes ``OUT_DIR/credit_time_TESTBED.json``.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from rredcot.config import TrainConfig
from rredcot.training.trainer import Trainer


def cl_cheap(testbed: str, out: Path) -> TrainConfig:
    """cl_cheap (gather_lr.py's SPECS) on ``testbed`` at one thread."""
    twelve = testbed == "arith12_low"
    cfg = TrainConfig(
        task="arithmetic",
        task_args={"num_steps": 12} if twelve else {},
        credit_method="continuation_likelihood",
        out=str(out / f"run_{testbed}"),
        overwrite=True,
        lr=1e-4,
        threads=1,
        progress=False,
        eval_size=8,
    )
    if twelve:
        cfg.model.tiny_warmstart = "low"
    cfg.credit.lam, cfg.credit.anchor, cfg.credit.handover.smoothing = 0.0, "none", 0.5
    cfg.credit.continuation_likelihood.window = 1
    return cfg


def main(testbed: str, out: Path, repeats: int = 3) -> None:
    trainer = Trainer(cl_cheap(testbed, out), log=lambda *_: None)
    torch.manual_seed(0)
    batch, stats = trainer.rollout(trainer.prompts_for_step(1), forward=False, keep_cache=True)
    plain = batch.replace(probe_cache=None)
    trainer.method.rows(plain)  # the first re-forwarding batch's packing check, untimed
    seconds: dict[str, list[float]] = {"cache": [], "reforward": []}
    tokens = {}
    for _ in range(repeats):
        for name, b in (("reforward", plain), ("cache", batch)):
            start = time.perf_counter()
            rows = trainer.method.rows(b)
            seconds[name].append(time.perf_counter() - start)
            tokens[name] = rows.cost.extra_forward_tokens
    result = {
        "testbed": testbed,
        "rows": batch.size,
        "rollout_tokens": stats["rollout/tokens"],
        "extra_forward_tokens": tokens,
        "seconds": seconds,
        "median_seconds": {k: statistics.median(v) for k, v in seconds.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"credit_time_{testbed}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    trainer.release()


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *(int(a) for a in sys.argv[3:4]))
