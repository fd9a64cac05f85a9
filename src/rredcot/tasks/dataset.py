"""Train on your own data: a task over JSONL, Parquet or a Hugging Face `datasets` dataset.

``get_task("dataset", data="mine.jsonl", question_field="problem", answer_field="solution",
answer_format="boxed")`` reads one question and one reference per row; ``get_task("gsm8k",
data="train.jsonl")`` is the same task with GSM8K's fields and ``#### 72`` answers, and also fills
``Verdict.first_error_step`` from the calculator annotations (``gsm8k_steps``).

Where the data comes from (``data`` and ``eval_data``):

- a file: ``.jsonl`` (one JSON object a line), ``.json`` (a list of objects, or JSON lines),
  ``.parquet``;
- a directory: a ``datasets`` ``save_to_disk`` directory (a ``DatasetDict`` picks ``split``), or a
  directory of split files (``train.jsonl``, ``test.parquet``, ``train-00000-of-00001.parquet``);
- anything else: a hub name, loaded with ``datasets.load_dataset(data, subset, split=split)``.

Evaluation problems come from ``eval_data`` if given, else from ``eval_split`` of ``data`` when
``data`` has splits (a hub dataset or a directory), else from an ``eval_fraction`` of the rows held
out from training (a seeded shuffle, so train and eval never overlap).

Prompts are ``prompt_template`` with ``{question}`` replaced; for a model with a chat template,
``render_prompt(problem, tokenizer)`` wraps the prompt as a user turn.
"""

from __future__ import annotations

import json
import math
import random
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rredcot.errors import UserError, missing_extra_message, require_extra
from rredcot.safe_fs import read_json_file
from rredcot.tasks.answers import (
    ANSWER_FORMATS,
    DEFAULT_VERIFY_TIMEOUT,
    VERIFIERS,
    check_answer,
    extract_completion_answer,
    extract_reference,
    math_verify_available,
)
from rredcot.tasks.base import Problem, Task, Verdict, register_task
from rredcot.tasks.gsm8k_steps import check_lines, reasoning_lines

__all__ = [
    "DataError",
    "DatasetParams",
    "DatasetTask",
    "Gsm8kParams",
    "Gsm8kTask",
    "load_rows",
    "render_prompt",
]

_FILE_SUFFIXES = (".jsonl", ".json", ".parquet")
_FORMAT_HINT = {
    "gsm8k": "a line '#### <answer>'",
    "boxed": "a \\boxed{<answer>}",
    "last_number": "a number",
    "raw": "a non-empty value",
}


class DataError(ValueError):
    """A problem with the user's data; the message names the file, the line and the field."""


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


def _help(text: str, **kw: Any) -> Any:
    return field(metadata={"help": text}, **kw)


@dataclass
class DatasetParams:
    data: str | None = _help(
        "Training data: a .jsonl/.json/.parquet file, a datasets save_to_disk directory, a "
        "directory of split files (train.jsonl, test.parquet), or a hub dataset name.",
        default=None,
    )
    split: str = _help(
        "Split of `data` to train on (hub datasets and directories).", default="train"
    )
    subset: str | None = _help(
        "Hub dataset configuration, e.g. 'main' for openai/gsm8k.", default=None
    )
    eval_data: str | None = _help(
        "Evaluation data (same forms as `data`); empty: use eval_split or eval_fraction.",
        default=None,
    )
    eval_split: str | None = _help(
        "Split of `data` (or of `eval_data`) to evaluate on, e.g. 'test'. Where `data` has no such "
        "split (a single file, a single saved Dataset), eval_fraction of its rows is held out.",
        default=None,
    )
    eval_fraction: float = _help(
        "Share of the training rows held out for evaluation when there is no eval data or split.",
        default=0.1,
    )
    split_seed: int = _help("Seed of the shuffle that picks the held-out rows.", default=0)
    max_examples: int | None = _help(
        "Read at most this many rows from each source (first rows); empty: all.", default=None
    )
    question_field: str = _help("Field holding the question.", default="question")
    answer_field: str = _help(
        "Field holding the reference answer or solution (see answer_format).", default="answer"
    )
    prompt_template: str = _help(
        "Prompt text; '{question}' is replaced by the question.",
        default="Question: {question}\nAnswer:\n",
    )
    answer_format: str = _help(
        "How the reference answer is written in answer_field: gsm8k ('#### 72'), boxed "
        "('\\boxed{72}'), last_number (the last number of the text) or raw (the whole field).",
        default="raw",
    )
    verifier: str = _help(
        "Answer check: auto (math-verify when installed, else exact), math_verify, or exact "
        "(normalised exact match: '1,000' == '1000.0').",
        default="auto",
    )
    verify_timeout: float = _help(
        "Seconds one math-verify check may take (it runs in a worker process, killed at the "
        "deadline); a check that takes longer scores 0 with the reason 'verify timed out' and is "
        "counted in rollout/verify_timeouts.",
        default=DEFAULT_VERIFY_TIMEOUT,
    )
    check_steps: bool = _help(
        "With answer_format=gsm8k: find the first wrong calculator annotation (<<a*b=c>>) of a "
        "completion and report it as Verdict.first_error_step.",
        default=True,
    )
    answer_cue: str | None = _help(
        "Text that opens the final answer ('#### ' for gsm8k); empty: chosen by answer_format.",
        default=None,
    )

    def __post_init__(self) -> None:
        if not self.data:
            raise ValueError(
                "task parameter 'data' is required: --task.data PATH (a .jsonl/.json/.parquet "
                "file, a datasets directory) or a hub dataset name"
            )
        if "{question}" not in self.prompt_template:
            raise ValueError(
                f"prompt_template={self.prompt_template!r} must contain '{{question}}', where the "
                "question goes, e.g. 'Question: {question}\\nAnswer:\\n'"
            )
        if self.answer_format not in ANSWER_FORMATS:
            raise ValueError(
                f"answer_format={self.answer_format!r}; valid: {', '.join(ANSWER_FORMATS)}"
            )
        if self.verifier not in VERIFIERS:
            raise ValueError(f"verifier={self.verifier!r}; valid: {', '.join(VERIFIERS)}")
        if self.verifier == "math_verify" and not math_verify_available():
            raise ValueError(
                missing_extra_message("math-verify", "data", "verifier='math_verify'")
                + " (or use verifier=exact)"
            )
        if not self.verify_timeout > 0:
            raise ValueError(f"verify_timeout={self.verify_timeout} must be > 0 (seconds)")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction={self.eval_fraction} must be in [0, 1)")
        if self.max_examples is not None and self.max_examples < 1:
            raise ValueError(f"max_examples={self.max_examples} must be >= 1 (or empty for all)")
        if not self.question_field or not self.answer_field:
            raise ValueError("question_field and answer_field must be non-empty field names")


@dataclass
class Gsm8kParams(DatasetParams):
    data: str | None = _help(
        "GSM8K data: a .jsonl/.parquet file, a directory with train.jsonl/test.jsonl, a "
        "save_to_disk directory, or the hub name openai/gsm8k.",
        default="openai/gsm8k",
    )
    subset: str | None = _help("Hub dataset configuration of openai/gsm8k.", default="main")
    eval_split: str | None = _help(
        "Split evaluated on where `data` has it; otherwise eval_fraction is held out.",
        default="test",
    )
    answer_format: str = _help("How the reference is written; GSM8K: '#### 72'.", default="gsm8k")


# ---------------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------------

Row = tuple[str, dict]  # (location for error messages, e.g. "train.jsonl line 3", row)


def _read_jsonl(path: Path, limit: int | None) -> list[Row]:
    rows: list[Row] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path} line {lineno}"
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark,
                raw = raw[3:]  # as --config and .json data accept one
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{where} is not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1});"
                    " re-save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except RecursionError:
                raise DataError(f"{where} nests JSON too deeply to read; fix the file") from None
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{where} is not valid JSON ({e.msg} at column {e.colno}); each line must be "
                    "one JSON object"
                ) from None
            if not isinstance(obj, dict):
                raise DataError(
                    f"{where} is a JSON {type(obj).__name__}, expected an object {{...}}"
                )
            rows.append((where, obj))
            if limit is not None and len(rows) >= limit:
                break
    return rows


def _read_json(path: Path, limit: int | None) -> list[Row]:
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark is allowed
    except UnicodeDecodeError as e:
        raise DataError(
            f"{path} is not UTF-8 text (byte offset {e.start}); re-save it as UTF-8"
        ) from None
    try:
        obj = json.loads(text)
    except RecursionError:
        raise DataError(f"{path} nests JSON too deeply to read; fix the file") from None
    except json.JSONDecodeError:
        return _read_jsonl(path, limit)  # JSON lines saved as .json
    if isinstance(obj, dict) and len(obj) == 1 and isinstance(next(iter(obj.values())), list):
        obj = next(iter(obj.values()))  # {"data": [...]}
    if not isinstance(obj, list):
        raise DataError(f"{path} holds a JSON {type(obj).__name__}; expected a list of objects")
    rows = []
    for i, item in enumerate(obj[:limit] if limit else obj, start=1):
        if not isinstance(item, dict):
            raise DataError(f"{path} item {i} is a JSON {type(item).__name__}, expected an object")
        rows.append((f"{path} item {i}", item))
    return rows


def _read_parquet(path: Path, limit: int | None) -> list[Row]:
    pq = require_extra("pyarrow.parquet", "data", f"reading {path}")
    try:
        table = pq.read_table(path)
    except Exception as e:
        raise DataError(f"{path} is not a readable Parquet file ({e})") from None
    if limit is not None:
        table = table.slice(0, limit)
    return [(f"{path} row {i}", row) for i, row in enumerate(table.to_pylist(), start=1)]


def _read_file(path: Path, limit: int | None) -> list[Row]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        rows = _read_jsonl(path, limit)
    elif suffix == ".json":
        rows = _read_json(path, limit)
    elif suffix == ".parquet":
        rows = _read_parquet(path, limit)
    else:
        raise DataError(
            f"{path}: unsupported file type {suffix!r}; use {', '.join(_FILE_SUFFIXES)}, a "
            "datasets directory, or a hub name"
        )
    if not rows:
        raise DataError(f"{path} is empty: it holds no examples")
    return rows


def _dataset_rows(ds: Any, name: str, limit: int | None) -> list[Row]:
    if limit is not None:
        ds = ds.select(range(min(limit, len(ds))))
    rows = [(f"{name} row {i}", dict(row)) for i, row in enumerate(ds, start=1)]
    if not rows:
        raise DataError(f"{name} is empty: it holds no examples")
    return rows


def _split_files(directory: Path, split: str, subset: str | None) -> list[Path]:
    found: list[Path] = []
    for d in [directory / subset, directory] if subset else [directory]:
        for pattern in (
            f"{split}.jsonl",
            f"{split}.json",
            f"{split}.parquet",
            f"{split}-*.parquet",
        ):
            found.extend(sorted(d.glob(pattern)))
        if found:
            break
    return found


def load_rows(
    source: str, split: str = "train", subset: str | None = None, limit: int | None = None
) -> list[Row]:
    """Rows of ``source`` (a file, a directory or a hub name) as ``(location, dict)`` pairs.

    ``location`` names the file and line (or row) for error messages. Raises ``DataError`` on
    unreadable or empty data and ``FileNotFoundError`` on a path that does not exist.
    """
    path = Path(source).expanduser()
    if path.is_file():
        return _read_file(path, limit)
    if path.is_dir():
        if _saved_splits(path) is not None or (path / "state.json").exists():
            datasets = _import_datasets(f"reading the saved dataset {path}")
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise DataError(
                        f"{path} has splits {', '.join(ds)}; no split {split!r} (set --task.split "
                        "or --task.eval_split)"
                    )
                return _dataset_rows(ds[split], f"{path}[{split}]", limit)
            return _dataset_rows(ds, str(path), limit)
        files = _split_files(path, split, subset)
        if not files:
            raise DataError(
                f"{path} is a directory without a datasets save_to_disk dataset or split files "
                f"({split}.jsonl, {split}.json, {split}.parquet, {split}-*.parquet)"
            )
        rows = [r for f in files for r in _read_file(f, limit)]
        return rows[:limit] if limit is not None else rows
    if path.suffix.lower() in _FILE_SUFFIXES or source.startswith((".", "/", "~")):
        raise FileNotFoundError(f"data file {source!r} does not exist")
    return _load_hub(source, split, subset, limit)


def _saved_splits(folder: Path) -> list[str] | None:
    """The split names a ``save_to_disk`` folder's ``dataset_dict.json`` lists (None: the folder
    has none), read within size and nesting limits; a bad file is a ``DataError`` naming it."""
    path = folder / "dataset_dict.json"
    if not path.exists():
        return None
    try:
        data = read_json_file(path, "saved dataset file")
    except UserError as err:
        raise DataError(str(err)) from None
    splits = data.get("splits") if isinstance(data, dict) else None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise DataError(
            f"{path} is not a datasets save_to_disk dataset_dict.json (an object whose 'splits' "
            "lists the split names); fix or remove it"
        )
    return splits


def _import_datasets(purpose: str) -> Any:
    """The ``datasets`` package, or a one-line ImportError that names the extra to install."""
    return require_extra("datasets", "data", purpose)


def _load_hub(name: str, split: str, subset: str | None, limit: int | None) -> list[Row]:
    datasets = _import_datasets(f"loading the hub dataset {name!r}")
    try:
        ds = datasets.load_dataset(name, subset, split=split)
    except Exception as e:
        raise DataError(
            f"could not load {name!r} (subset {subset!r}, split {split!r}) with "
            f"datasets.load_dataset: {type(e).__name__}: {e}. If it is a local file, check the path."
        ) from e
    return _dataset_rows(ds, f"{name}[{split}]", limit)


def _split_status(source: str, split: str, subset: str | None) -> str:
    """``"yes"`` if ``source`` has ``split``, ``"no"`` if it has splits but not this one,
    ``"none"`` if it has no splits at all (a single file or a single saved ``Dataset``)."""
    path = Path(source).expanduser()
    if path.is_file():
        return "none"
    if path.is_dir():
        splits = _saved_splits(path)
        if splits is not None:
            return "yes" if split in splits else "no"
        if (path / "state.json").exists():
            return "none"
        return "yes" if _split_files(path, split, subset) else "no"
    return "yes"  # a hub dataset: load_dataset will tell


# ---------------------------------------------------------------------------------------------
# Prompts
# ---------------------------------------------------------------------------------------------


def render_prompt(problem: Problem | str, tokenizer: Any = None) -> str:
    """The text fed to the model for ``problem``.

    With a tokenizer that has a chat template, the prompt becomes one user turn followed by the
    assistant header (``add_generation_prompt=True``); otherwise the raw prompt is returned.
    """
    prompt = problem.prompt if isinstance(problem, Problem) else problem
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt


# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------


def _field_text(where: str, row: dict, name: str, param: str) -> str:
    if name not in row:
        fields = ", ".join(sorted(map(str, row))) or "(none)"
        raise DataError(
            f"{where} has no field {name!r} (its fields: {fields}); set --task.{param} to the "
            "field that holds it"
        )
    value = row[name]
    if value is None or isinstance(value, (dict, list)):
        raise DataError(
            f"{where}: field {name!r} is {json.dumps(value)[:60]}, expected text or a number"
        )
    if isinstance(value, float) and not math.isfinite(value):
        raise DataError(f"{where}: field {name!r} is {value}, not a number a trace can reach")
    text = str(value)
    if not text.strip():
        raise DataError(f"{where}: field {name!r} is empty")
    if len(text) > MAX_FIELD_CHARS:
        raise DataError(
            f"{where}: field {name!r} has {len(text):,} characters, more than any model's context "
            f"({MAX_FIELD_CHARS:,} at most); fix or drop that row"
        )
    return text


MAX_FIELD_CHARS = 200_000
"""Longest question or answer read (a long-context model's window is ~128k tokens); a longer one
is refused as it is read, not after minutes of tokenising."""


def _clip(text: str, n: int = 60) -> str:
    return text if len(text) <= n else text[: n - 3] + "..."


@register_task("dataset")
class DatasetTask(Task):
    """Questions and reference answers from a file, a directory or a hub dataset."""

    Params = DatasetParams

    def __init__(self, **params: Any) -> None:
        super().__init__(**params)
        p = self.params
        if p.answer_cue is not None:
            self.answer_cue = p.answer_cue
        else:
            self.answer_cue = {"gsm8k": "#### ", "boxed": "\\boxed{"}.get(
                p.answer_format, "Answer: "
            )
        self._train: list[Problem] | None = None
        self._eval: list[Problem] | None = None

    # -- loading ------------------------------------------------------------------------------
    def _problems(self, rows: list[Row]) -> list[Problem]:
        p = self.params
        problems = []
        for where, row in rows:
            question = _field_text(where, row, p.question_field, "question_field")
            solution = _field_text(where, row, p.answer_field, "answer_field")
            answer = extract_reference(solution, p.answer_format)
            if answer is None:
                raise DataError(
                    f"{where}: cannot extract a {p.answer_format} answer from field "
                    f"{p.answer_field!r} ({_clip(solution)!r}); expected {_FORMAT_HINT[p.answer_format]}."
                    f" Set --task.answer_format ({', '.join(ANSWER_FORMATS)})"
                )
            problems.append(
                Problem(
                    prompt=p.prompt_template.replace("{question}", question),
                    answer=answer,
                    meta={"question": question, "solution": solution, "source": where},
                )
            )
        return problems

    def load(self) -> None:
        """Read and check the data now (it is otherwise read on first use)."""
        if self._train is not None:
            return
        p = self.params
        train = self._problems(load_rows(p.data, p.split, p.subset, p.max_examples))
        split_status = "none"  # does `data` itself have the eval split?
        if not p.eval_data and p.eval_split:
            split_status = _split_status(p.data, p.eval_split, p.subset)
        if p.eval_data:
            eval_split = p.eval_split or "test"
            self._eval = self._problems(
                load_rows(p.eval_data, eval_split, p.subset, p.max_examples)
            )
        elif split_status == "yes":
            self._eval = self._problems(load_rows(p.data, p.eval_split, p.subset, p.max_examples))
        else:
            if split_status == "no":
                warnings.warn(
                    f"{p.data} has no split {p.eval_split!r}; holding out eval_fraction="
                    f"{p.eval_fraction} of the training rows instead",
                    stacklevel=2,
                )
            order = list(range(len(train)))
            random.Random(p.split_seed).shuffle(order)
            n_eval = math.ceil(p.eval_fraction * len(train)) if p.eval_fraction > 0 else 0
            if n_eval >= len(train):
                raise DataError(
                    f"{p.data} has {len(train)} example(s): too few to hold out "
                    f"eval_fraction={p.eval_fraction} and still train; give --task.eval_data"
                )
            held = set(order[:n_eval])
            self._eval = [pr for i, pr in enumerate(train) if i in held]
            train = [pr for i, pr in enumerate(train) if i not in held]
        self._train = train

    # -- problems -----------------------------------------------------------------------------
    def train_problems(self, n: int, seed: int) -> list[Problem]:
        """``n`` training problems: seeded shuffles of the training rows, one epoch after another."""
        self.load()
        assert self._train is not None
        rng, out = random.Random(seed), []
        while len(out) < n:
            epoch = list(self._train)
            rng.shuffle(epoch)
            out.extend(epoch[: n - len(out)])
        return out

    def eval_problems(self, n: int, seed: int) -> list[Problem]:
        """Up to ``n`` distinct held-out problems (all of them if there are fewer), seeded order."""
        self.load()
        if not self._eval:
            raise DataError(
                f"{self.params.data}: no evaluation problems; give --task.eval_data, "
                "--task.eval_split or --task.eval_fraction > 0"
            )
        problems = list(self._eval)
        random.Random(seed).shuffle(problems)
        return problems[:n]

    # -- checking -----------------------------------------------------------------------------
    def _steps(self) -> bool:
        return self.params.answer_format == "gsm8k" and self.params.check_steps

    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Reward 1.0 when the completion's final answer matches the reference; never raises.

        With gsm8k steps on, ``first_error_step`` is the first reasoning line with a wrong
        calculator annotation; if there is none it is -1 for a correct answer and ``None`` (cannot
        tell) for a wrong one.
        """
        if not isinstance(completion, str):
            return Verdict(0.0, None, None, f"completion is {type(completion).__name__}, not text")
        predicted = extract_completion_answer(completion)
        correct, failure = check_answer(
            predicted, problem.answer, self.params.verifier, self.params.verify_timeout
        )
        if failure is not None:  # timed out: scored 0, counted by the rollout
            return Verdict(0.0, predicted, None, failure)
        if predicted is None:
            reason = "no final answer found"
        elif correct:
            reason = "correct"
        else:
            reason = f"wrong answer {_clip(predicted, 40)!r}, expected {problem.answer!r}"
        reward = 1.0 if correct else 0.0
        if not self._steps():
            return Verdict(reward, predicted, None, reason)
        checks = check_lines(completion)
        wrong = next((c for c in checks if c.status == "wrong"), None)
        unparseable = sum(c.status == "unparseable" for c in checks)
        if wrong is not None:
            first_error = wrong.index
            reason += f"; step {wrong.index} wrong: {wrong.detail}"
        else:
            first_error = -1 if correct else None
        if unparseable:
            reason += f"; {unparseable} line(s) with annotations that are not plain arithmetic"
        return Verdict(reward, predicted, first_error, reason, num_steps=len(checks))

    # -- gold text ----------------------------------------------------------------------------
    def render_answer(self, answer: str) -> str:
        if self.params.answer_cue is None and self.params.answer_format == "boxed":
            return f"\\boxed{{{answer}}}"
        return f"{self.answer_cue}{answer}"

    def gold_completion(self, problem: Problem) -> str | None:
        """The reference solution (GSM8K: its lines and ``#### 72``); raw answers: the answer line."""
        solution = problem.meta.get("solution")
        if solution is None or self.params.answer_format == "raw":
            return self.render_answer(problem.answer)
        return solution

    def truncated_gold(self, problem: Problem, k: int) -> str | None:
        """GSM8K format: the first ``k`` reasoning lines, then the answer line."""
        solution = problem.meta.get("solution")
        if self.params.answer_format != "gsm8k" or solution is None:
            return None
        lines = [solution[s:e] for s, e in reasoning_lines(solution)][: max(k, 0)]
        return "\n".join([*lines, self.render_answer(problem.answer)])

    def render_prompt(self, problem: Problem, tokenizer: Any = None) -> str:
        """``render_prompt(problem, tokenizer)``: through the chat template when there is one."""
        return render_prompt(problem, tokenizer)


@register_task("gsm8k")
class Gsm8kTask(DatasetTask):
    """GSM8K (or any data in its format): ``question``, ``answer`` ending in ``#### 72``."""

    Params = Gsm8kParams
