"""GRPO with rredcot value-head credit on GSM8K, in TRL (a GPU example; not run in CI).

One GPU:

    python examples/trl_gsm8k.py

Several GPUs (DeepSpeed ZeRO-2 config shipped with TRL) with vLLM colocated for generation:

    accelerate launch --num_processes 4 \\
        --config_file "$(python -c 'import trl, os; print(os.path.dirname(trl.__file__))')/accelerate_configs/zero2.yaml" \\
        examples/trl_gsm8k.py --use_vllm --vllm_mode colocate

Every ``GRPOConfig`` flag works (``--learning_rate``, ``--num_generations``, ``--beta``, ...), plus
the rredcot ones: ``--credit_method value_head|answer_likelihood|uniform`` and ``--credit`` (JSON
fields of ``rredcot.config.CreditConfig``, e.g. ``'{"segmenter": "sentence", "lam": 0.5}'``).
The reward is rredcot's GSM8K verifier (the number after ``####``, math-verify when installed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import Dataset
from transformers import AutoTokenizer, HfArgumentParser

from rredcot.integrations.trl import RREDCoTGRPOConfig, RREDCoTGRPOTrainer, task_reward
from rredcot.tasks import get_task

INSTRUCTION = (
    "Solve the problem step by step, one step per line. "
    "Write the final answer on the last line as '#### <number>'."
)


@dataclass
class ScriptArguments:
    model: str = field(default="Qwen/Qwen2.5-0.5B-Instruct", metadata={"help": "Hub id or path."})
    data: str = field(
        default="openai/gsm8k",
        metadata={"help": "GSM8K source: hub name, a .jsonl/.parquet file or a directory."},
    )
    num_train: int = field(default=7473, metadata={"help": "Training problems to use."})
    num_eval: int = field(default=256, metadata={"help": "Held-out problems (test split)."})


def gsm8k_dataset(task, problems) -> Dataset:
    """Conversational prompts for an instruct model, with the reference answer per row."""
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"{INSTRUCTION}\n\n{p.prompt}"}],
                "answer": p.answer,
            }
            for p in problems
        ]
    )


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, RREDCoTGRPOConfig))
    parser.set_defaults(
        output_dir="runs/trl_gsm8k_value_head",
        credit_method="value_head",
        credit='{"segmenter": "newline"}',  # the other CreditConfig fields keep their defaults
        task="gsm8k",
        learning_rate=1e-6,
        per_device_train_batch_size=8,
        num_generations=8,
        max_completion_length=384,
        temperature=1.0,
        beta=0.0,
        max_steps=500,
        bf16=True,
        gradient_checkpointing=True,
        logging_steps=5,
        save_steps=100,
        eval_strategy="steps",
        eval_steps=100,
        per_device_eval_batch_size=8,
        report_to="none",
    )
    script, args = parser.parse_args_into_dataclasses()
    args.task_args = {"data": script.data}
    task = get_task("gsm8k", data=script.data)
    train = gsm8k_dataset(task, task.train_problems(script.num_train, seed=args.seed))
    held_out = gsm8k_dataset(task, task.eval_problems(script.num_eval, seed=args.seed))

    trainer = RREDCoTGRPOTrainer(
        model=script.model,
        reward_funcs=task_reward(task),
        args=args,
        train_dataset=train,
        eval_dataset=held_out,
        processing_class=AutoTokenizer.from_pretrained(script.model, padding_side="left"),
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)  # the policy and value_head.pt


if __name__ == "__main__":
    main()
