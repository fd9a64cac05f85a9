"""How much of cl_cheap's update a tail floor would cut (issue 49, item 2): trains cl_cheap
(``probe_cache_credit_time.cl_cheap``: lr 1e-4, one thread) for ``STEPS`` steps and, for each
step's token advantages, the share of response tokens and rows the loss forward needs, and the
share of the advantages' total magnitude dropped, with the tail of each row below each floor
cut (``rredcot.training.row_policies.drop_small_tails``; floor 0: the exact update, every non-zero advantage).

    python benchmarks/investigations/advantage_tails.py {arith12_low,arith4_default} OUT_DIR [STEPS]

Prints and writes ``OUT_DIR/advantage_tails_TESTBED.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from probe_cache_credit_time import cl_cheap

from rredcot.training.row_policies import drop_small_tails
from rredcot.training.trainer import Trainer

FLOORS = (0.0, 0.01, 0.03, 0.1)


def tail_figures(advantages: torch.Tensor, mask: torch.Tensor) -> dict[str, dict[str, float]]:
    """Per floor: the shares of tokens and rows forwarded, and of ``|A|`` mass dropped."""
    mask = mask.bool()
    total = float(advantages.abs().sum()) or 1.0
    position = torch.arange(1, advantages.shape[1] + 1)
    out = {}
    for floor in FLOORS:
        kept = drop_small_tails(advantages, mask, floor) if floor else advantages
        columns = ((kept != 0) & mask).mul(position).amax(dim=1)
        out[str(floor)] = {
            "tokens": float(columns.sum() / mask.sum()),
            "rows": float((columns > 0).float().mean()),
            "mass_dropped": float((advantages - kept).abs().sum()) / total,
        }
    return out


def main(testbed: str, out: Path, steps: int = 6) -> None:
    trainer = Trainer(cl_cheap(testbed, out), log=lambda *_: None)
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    update_rows = trainer._update_rows  # the update's advantages, once per step

    def record(batch, *rest):
        advantages, columns, stats = update_rows(batch, *rest)
        seen.append((advantages.detach().cpu(), batch.response_mask.cpu()))
        return advantages, columns, stats

    trainer._update_rows = record
    per_step = []
    for step in range(1, steps + 1):
        trainer.step = step
        metrics = trainer.train_step(step)
        figures = tail_figures(*seen[-1])
        per_step.append({"step": step, "handover_weight": metrics.get("credit/handover_weight")})
        per_step[-1].update(figures)
        print(json.dumps(per_step[-1]))
    trainer.release()
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"advantage_tails_{testbed}.json"
    path.write_text(json.dumps({"testbed": testbed, "steps": per_step}, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]), *(int(a) for a in sys.argv[3:4]))
