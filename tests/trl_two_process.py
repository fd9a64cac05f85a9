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

from datasets import Dataset  # noqa: E402

from rredcot.integrations.trl import (  # noqa: E402
    RREDCoTGRPOConfig,
    RREDCoTGRPOTrainer,
    task_reward,
)
from rredcot.models import build_char_tokenizer  # noqa: E402
from rredcot.tasks import get_task  # noqa: E402


def digit_share(completions, **kwargs) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


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
    problems = get_task("arithmetic", num_steps=2).train_problems(4, seed=0)
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    args = RREDCoTGRPOConfig(
        output_dir=f"{out}/{method}",
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=2,
        num_generations=4,
        max_completion_length=16,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        reward_weights=[0.5, 0.5],
        credit_method=method,
        credit={"segmenter": "tokens:4", "handover": {"mode": "off"}, "lam": 0.5},
        task="arithmetic",
        task_args={"num_steps": 2},
        disable_tqdm=True,
    )
    trainer = Spy(
        model=model_dir,
        reward_funcs=[task_reward("arithmetic", num_steps=2), digit_share],
        args=args,
        train_dataset=data,
        processing_class=build_char_tokenizer(),
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
