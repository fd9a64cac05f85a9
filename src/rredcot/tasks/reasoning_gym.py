"""Any reasoning-gym procedural dataset as a training task, with a strict 0/1 reward.

reasoning-gym (``pip install rredcot[gym]``) generates verifiable problems (``chain_sum``,
``countdown``, ``basic_arithmetic``, ...). Its ``score_answer`` gives partial credit (0.67 for a
wrong sum of the right length, 0.05 for a countdown expression with the wrong value); credit
assignment assumes a 0/1 outcome, so here the reward is 1.0 only when ``score_answer`` is 1.0
(which also accepts other valid answers, e.g. another countdown expression that hits the target).

The model is asked to put its final answer in ``<answer>...</answer>`` tags (an ``A: ...`` or
``Answer: ...`` line is accepted too); ``render_answer`` writes the tags for the answer-likelihood
probe.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from typing import Any

from rredcot.errors import require_extra
from rredcot.tasks.base import Problem, Task, Verdict, register_task

__all__ = ["ReasoningGymParams", "ReasoningGymTask", "extract_tagged_answer"]

_TAG_RE = re.compile(r"<answer>(.*?)</answer>", re.S | re.I)
_LINE_RE = re.compile(r"^[ \t]*(?:A|Answer|Final answer)[ \t]*:[ \t]*(.*\S)", re.M | re.I)


def _import_reasoning_gym() -> Any:
    return require_extra("reasoning_gym", "gym", "the reasoning_gym task")


def _help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


@dataclass
class ReasoningGymParams:
    dataset_name: str = _help(
        "reasoning-gym dataset, e.g. chain_sum, countdown, basic_arithmetic.", default="chain_sum"
    )
    size: int = _help("Training problems generated (distinct seeded items).", default=1000)
    eval_size: int = _help(
        "Evaluation problems generated (questions seen in training are dropped).", default=200
    )
    seed: int = _help(
        "Seed of the generated training set. reasoning-gym seeds item i with seed + i, so the "
        "evaluation set is generated from seed + size: no item seed is shared.",
        default=0,
    )
    dataset_kwargs: dict = _help(
        "Extra arguments of the dataset's config, as a dict or a JSON string, e.g. "
        '\'{"min_terms": 2, "max_terms": 4}\'.',
        default_factory=dict,
    )
    prompt_template: str = _help(
        "Prompt text; '{question}' is replaced by the generated question.",
        default="{question}\nGive your final answer as <answer>...</answer>.\n",
    )

    def __post_init__(self) -> None:
        if isinstance(self.dataset_kwargs, str):
            text = self.dataset_kwargs.strip()
            try:
                self.dataset_kwargs = json.loads(text) if text else {}
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"dataset_kwargs={text!r} is not valid JSON ({e.msg}); write e.g. "
                    "'{\"min_terms\": 2}'"
                ) from None
        if not isinstance(self.dataset_kwargs, dict):
            raise ValueError(f"dataset_kwargs must be a JSON object, got {self.dataset_kwargs!r}")
        for key in ("size", "seed"):
            if key in self.dataset_kwargs:
                raise ValueError(f"set {key} as its own task parameter, not in dataset_kwargs")
        if self.size < 1 or self.eval_size < 0:
            raise ValueError(f"size={self.size} must be >= 1 and eval_size={self.eval_size} >= 0")
        if "{question}" not in self.prompt_template:
            raise ValueError(
                f"prompt_template={self.prompt_template!r} must contain '{{question}}'"
            )


def extract_tagged_answer(completion: str) -> str | None:
    """The last ``<answer>...</answer>``, else the last ``A:``/``Answer:`` line, stripped; never raises."""
    if not isinstance(completion, str):
        return None
    tags = _TAG_RE.findall(completion)
    if tags:
        return tags[-1].strip()
    lines = _LINE_RE.findall(completion)
    return lines[-1].strip() if lines else None


@register_task("reasoning_gym")
class ReasoningGymTask(Task):
    """A reasoning-gym procedural dataset; reward 1 only for a fully correct answer."""

    Params = ReasoningGymParams
    answer_cue = "<answer>"

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        rg = _import_reasoning_gym()
        p = self.params
        from reasoning_gym.factory import DATASETS

        if p.dataset_name not in DATASETS:
            raise ValueError(
                f"unknown reasoning-gym dataset {p.dataset_name!r}; valid: {', '.join(sorted(DATASETS))}"
            )
        try:
            self._train = rg.create_dataset(
                p.dataset_name, size=p.size, seed=p.seed, **p.dataset_kwargs
            )
            self._eval = rg.create_dataset(
                p.dataset_name, size=max(p.eval_size, 1), seed=p.seed + p.size, **p.dataset_kwargs
            )
        except (TypeError, ValueError, AssertionError) as e:
            raise ValueError(
                f"reasoning-gym dataset {p.dataset_name!r} rejected dataset_kwargs="
                f"{p.dataset_kwargs}: {type(e).__name__}: {e}"
            ) from e

    def _problem(self, entry: dict, split: str, index: int) -> Problem:
        answer = entry.get("answer")
        return Problem(
            prompt=self.params.prompt_template.replace("{question}", entry["question"]),
            answer="" if answer is None else str(answer),
            meta={"entry": entry, "split": split, "index": index},
        )

    def train_problems(self, n: int, seed: int) -> list[Problem]:
        """``n`` problems drawn from the generated training set (repeats after ``size``)."""
        rng = random.Random(seed)
        idx = [rng.randrange(len(self._train)) for _ in range(n)]
        return [self._problem(self._train[i], "train", i) for i in idx]

    def eval_problems(self, n: int, seed: int) -> list[Problem]:
        """Up to ``n`` evaluation problems whose question never occurs in the training set."""
        seen = {self._train[i]["question"] for i in range(len(self._train))}
        out = []
        for i in range(min(self.params.eval_size, len(self._eval))):
            entry = self._eval[i]
            if entry["question"] not in seen:
                seen.add(entry["question"])
                out.append(self._problem(entry, "eval", i))
        return out[:n]

    def score(self, problem: Problem, answer: str | None) -> float:
        """reasoning-gym's own (partial-credit) score of ``answer``; 0.0 if it fails."""
        if answer is None:
            return 0.0
        dataset = self._eval if problem.meta.get("split") == "eval" else self._train
        try:
            return float(dataset.score_answer(answer=answer, entry=problem.meta["entry"]))
        except Exception:  # a scorer must not crash training on odd model text
            return 0.0

    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Reward 1.0 only when reasoning-gym scores the extracted answer 1.0; never raises."""
        answer = extract_tagged_answer(completion)
        if answer is None:
            return Verdict(0.0, None, None, "no <answer>...</answer> or 'A:' line found")
        score = self.score(problem, answer)
        if score >= 1.0:
            return Verdict(1.0, answer, None, "correct")
        return Verdict(
            0.0,
            answer,
            None,
            f"wrong answer {answer[:40]!r} (reasoning-gym score {score:.2f}; only 1.0 counts)",
        )

    def render_answer(self, answer: str) -> str:
        return f"<answer>{answer}</answer>"

    def gold_completion(self, problem: Problem) -> str | None:
        """Just the answer line (reasoning-gym gives no chain of thought)."""
        return self.render_answer(problem.answer) if problem.answer else None
