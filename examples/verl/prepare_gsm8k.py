"""Write GSM8K as verl parquet files (prompt messages + ground truth) from rredcot's gsm8k task.

python examples/verl/prepare_gsm8k.py --out ~/data/rredcot_gsm8k [--data openai/gsm8k]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from datasets import Dataset

from rredcot.tasks import get_task

INSTRUCTION = (
    "Solve the problem step by step, one step per line. "
    "Write the final answer on the last line as '#### <number>'."
)


def rows(problems, split: str) -> list[dict]:
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{INSTRUCTION}\n\n{p.prompt}"}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": p.answer},
            "extra_info": {"split": split, "index": i, "question": p.meta.get("question", "")},
        }
        for i, p in enumerate(problems)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True, help="Output directory.")
    parser.add_argument("--data", default="openai/gsm8k", help="Hub name, file or directory.")
    parser.add_argument("--num_train", type=int, default=7473)
    parser.add_argument("--num_test", type=int, default=1319)
    args = parser.parse_args()
    task = get_task("gsm8k", data=args.data)
    out = Path(args.out).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(rows(task.train_problems(args.num_train, seed=0), "train")).to_parquet(
        str(out / "train.parquet")
    )
    Dataset.from_list(rows(task.eval_problems(args.num_test, seed=0), "test")).to_parquet(
        str(out / "test.parquet")
    )
    print(f"wrote {out}/train.parquet and {out}/test.parquet")


if __name__ == "__main__":
    main()
