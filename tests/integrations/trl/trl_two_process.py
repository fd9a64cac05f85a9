"""Run under ``torchrun --nproc_per_node 2`` by ``test_trl_integration.py``: rredcot credit in
TRL's GRPOTrainer on two CPU processes (gloo), with groups that span the processes
(``per_device_train_batch_size=2``, ``num_generations=4``). Writes ``result_{method}_{rank}.json``
into the output directory."""

from __future__ import annotations

import hashlib
import json
import sys

import torch

torch.set_num_threads(1)

from rredcot.integrations.trl import RREDCoTGRPOTrainer  # noqa: E402
from trl_trainers import arithmetic_prompts, make_trainer  # noqa: E402


class Spy(RREDCoTGRPOTrainer):
    def _apply_credit(self, inputs, output):
        trl = output["advantages"].clone()
        output = super()._apply_credit(inputs, output)
        rec = (trl, output["advantages"].clone(), output["completion_mask"].clone())
        self.recs = [*getattr(self, "recs", []), rec]
        return output

    def _compute_loss(self, model, inputs):
        loss = super()._compute_loss(model, inputs)
        if self.model.training:
            self.ours = [*getattr(self, "ours", []), inputs["advantages"].detach().clone()]
        return loss


def run(model_dir: str, out: str, method: str) -> dict:
    # make_trainer's trainer with groups that span the processes (2 rows a process, 4 a group)
    trainer = make_trainer(
        model_dir,
        arithmetic_prompts(),
        f"{out}/{method}",
        method=method,
        cls=Spy,
        per_device_train_batch_size=2,
        max_completion_length=16,
    )
    trainer.train()
    result = {
        "rank": trainer.accelerator.process_index,
        "world": trainer.accelerator.num_processes,
        "rows": int(trainer.recs[0][0].shape[0]),
        "logs": [
            {k: v for k, v in h.items() if k.startswith("rredcot/")}
            for h in trainer.state.log_history
            if "rredcot/extra_forward" in h or "rredcot/credit/mean_abs_segment_reward" in h
        ],
    }
    if method == "uniform":
        # TRL's own advantages (computed over the global batch) row by row.
        worst, nonzero = 0.0, 0
        for trl, ours, mask in trainer.recs:
            worst = max(worst, float((ours - trl.unsqueeze(1) * mask).abs().max()))
            nonzero += int((trl.abs() > 1e-3).sum())
        result.update(worst=worst, nonzero=nonzero)
    else:
        head = trainer.credit_method.head.state_dict()
        digest = hashlib.sha256(b"".join(head[k].cpu().numpy().tobytes() for k in sorted(head)))
        result.update(head=digest.hexdigest(), updates=trainer.credit_method.guard.num_updates)
        result["finite"] = all(bool(torch.isfinite(a).all()) for a in trainer.ours)
    return result


if __name__ == "__main__":
    model_dir, out = sys.argv[1], sys.argv[2]
    for method in ("uniform", "value_head"):
        result = {"method": method, **run(model_dir, out, method)}
        with open(f"{out}/result_{method}_{result['rank']}.json", "w") as f:
            json.dump(result, f)
