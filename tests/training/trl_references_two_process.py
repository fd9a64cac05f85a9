"""One step of ``RREDCoTGRPOTrainer`` with ``references`` per mode, run by
``test_several_processes.py`` in one process (4 completions of one prompt) and under
``torchrun --nproc_per_node 2`` (gloo, CPU; 2 completions each, so the prompt's group spans the
processes). Writes ``{mode}_{rank}.pt``: the gradient the optimiser step sees and what the step
did.

The completions are fixed (a ``rollout_func`` that writes the same text for the same row of the
generation batch wherever it runs) and all wrong, so the group takes a reference: under ``sft``
the process holding the group's first row builds it (process 1 has none and runs a stand-in
pass), under ``luffy`` the process holding its last row puts it in place of that rollout
(process 0 has none), and the reward functions score it on every process. ``whiten``: no
references, the credit whitened over every token of the generation batch (both processes').
``continuation`` and ``answer``: methods that read the group's other samples
(``continuation_likelihood``, ``answer_likelihood`` with ``source=group``), the hand-over off,
on a group whose right completions sit on process 0 only (rows 0 and 1 of four): process 1's
continuations and answers are all its peers' (``batch.peers``). Each run also writes the
method's measured values of its last batch with and without the peers. ``value_head``: rows 0,
1 (process 0) and 3 (process 1) share their first line, a node of the group's prefix tree that
only the rows of every process show.

Usage: ``trl_references_two_process.py MODEL_DIR OUT_DIR``.
"""

from __future__ import annotations

import os
import sys

import torch

torch.set_num_threads(1)

from datasets import Dataset  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from rredcot.integrations.trl import (  # noqa: E402
    RREDCoTGRPOConfig,
    RREDCoTGRPOTrainer,
    task_reward,
)
from rredcot.models import build_char_tokenizer  # noqa: E402
from rredcot.tasks import get_task  # noqa: E402

GROUP = 4
# wrong answers of different digit shares: the rewards vary inside the group, none reaches 1
TEXTS = ["1+1=2\nA:2", "2+3=5\nabc\nA:5", "4*2=8\nA:8x", "so\nA:0"]
PROBLEMS = get_task("arithmetic", num_steps=2).train_problems(2, seed=0)
READS_THE_GROUP = {
    "continuation": (
        "continuation_likelihood",
        {"continuation_likelihood": {"source": "group", "estimator": "per_token"}},
    ),
    "answer": ("answer_likelihood", {"answer_likelihood": {"source": "group"}}),
    "value_head": ("value_head", {}),
}


def group_texts(prompt: str, method: str) -> list[str]:
    """Two right completions (rows 0 and 1: the gold trace and another) and two wrong ones;
    for the value head, rows 0, 1 and 3 start with the gold trace's first line (a prefix the
    group shares across the processes) and only row 0 is right."""
    problem = next(p for p in PROBLEMS if p.prompt in str(prompt))
    gold = get_task("arithmetic", num_steps=2).gold_completion(problem)
    if method == "value_head":
        line = gold.split("\n")[0] + "\n"
        return [gold, line + "1+1=2\nA:0", "so\nA:0", line + "9*9=81\nA:81"]
    return [gold, f"so\nA:{problem.answer}", "1+1=2\nA:2", "so\nA:0"]


def digit_share(completions, **kwargs) -> list[float]:
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def fixed_rollouts(prompts, trainer) -> dict:
    """The same completion for the same row of the generation batch in any number of
    processes: row ``j`` of the group gets ``TEXTS[j]``."""
    prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    tok = trainer.processing_class
    first = trainer.accelerator.process_index * len(prompts)
    method = trainer.args.credit_method
    texts = [
        group_texts(p, method)[(first + i) % GROUP]
        if method != "uniform"
        else TEXTS[(first + i) % GROUP]
        for i, p in enumerate(prompts)
    ]
    completion_ids = [
        tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for t in texts
    ]
    return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}


class Gradients(TrainerCallback):
    """The gradient as the first optimiser step sees it."""

    def __init__(self) -> None:
        self.trainer, self.grads = None, None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.grads is None:
            params = self.trainer.model.parameters()
            self.grads = [p.grad.detach().clone() for p in params]


def run(model_dir: str, out: str, mode: str) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    problems = PROBLEMS
    data = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    method, credit = READS_THE_GROUP.get(mode, ("uniform", None))
    if method != "uniform":
        credit = {**credit, "handover": {"mode": "off"}}
    elif mode == "whiten":
        credit = {"normalization": "whiten"}
    rewards = [task_reward("arithmetic", num_steps=2)]
    if method == "uniform":
        rewards.append(digit_share)
    args = RREDCoTGRPOConfig(
        output_dir=f"{out}/{mode}",
        use_cpu=True,
        report_to="none",
        bf16=False,
        per_device_train_batch_size=GROUP // world,
        num_generations=GROUP,
        max_completion_length=16,
        max_steps=1,
        learning_rate=1e-3,
        max_grad_norm=0.0,
        logging_steps=1,
        save_strategy="no",
        seed=0,
        reward_weights=[0.5, 0.5] if method == "uniform" else None,
        credit_method=method,
        task="arithmetic",
        task_args={"num_steps": 2},
        references={"mode": mode if mode in ("sft", "luffy") else "off"},
        credit=credit,
        disable_tqdm=True,
    )
    spy = Gradients()
    trainer = RREDCoTGRPOTrainer(
        model=model_dir,
        reward_funcs=rewards,
        args=args,
        train_dataset=data,
        processing_class=build_char_tokenizer(),
        rollout_func=fixed_rollouts,
        callbacks=[spy],
    )
    spy.trainer = trainer
    trainer.train()
    logs = {k: v for h in trainer.state.log_history for k, v in h.items() if "references" in k}
    rank = trainer.accelerator.process_index
    measured = {}
    if trainer.credit_method.reads_group_samples:  # its rows with and without the peers
        batch = trainer.last_batch
        measured = {
            "with_peers": trainer.credit_method.rows(batch).values,
            "alone": trainer.credit_method.rows(batch.replace(peers=None)).values,
        }
    if mode not in ("sft", "luffy"):
        own = 0
    elif mode == "sft":  # the reference rows this process's NLL term holds
        term = trainer._state.references
        own = term.rows.size if term is not None else 0
    else:  # the rollouts this process replaced by a reference
        task = get_task("arithmetic", num_steps=2)
        golds = [task.gold_completion(p) for p in problems]
        own = sum(c in golds for c in trainer.last_batch.completions)
    torch.save(
        {
            "grads": spy.grads,
            "logs": logs,
            "rows": trainer.last_batch.size,
            "own_references": own,
            "rewards": trainer.last_batch.rewards.tolist(),
            "values": trainer.last_credit.values,
            **measured,
        },
        f"{out}/{mode}_{rank}.pt",
    )


if __name__ == "__main__":
    for mode in ("sft", "luffy", "whiten", *READS_THE_GROUP):
        run(sys.argv[1], sys.argv[2], mode)
