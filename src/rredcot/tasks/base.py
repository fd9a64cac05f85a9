"""Problems, verdicts, the `Task` interface and the task registry.

A task makes prompts (`train_problems`, `eval_problems`), checks completions (`verify`) and,
where it can, writes gold chains of thought (`gold_completion`). Tasks are built from keyword
parameters, which come from YAML or CLI flags (`--task.num_steps 4`), so each task declares them
as a dataclass (`Task.Params`) with help text in `field(metadata={"help": ...})` and checks in
`__post_init__`. String values (as the CLI gives them) are converted to the declared type.

Adding a task::

    @dataclass
    class MyParams:
        size: int = field(default=3, metadata={"help": "How big."})

    @register_task("my_task")
    class MyTask(Task):
        Params = MyParams
        def train_problems(self, n, seed): ...
        def eval_problems(self, n, seed): ...
        def verify(self, problem, completion): ...

A synthetic task that draws its problems from a seeded generator subclasses `GeneratedTask` and
writes `draw(rng, split)` only: the train/held-out split by a hash of the prompt comes with it.

And, for a built-in task whose module should load only when asked for (optional extras), one
line in `rredcot/tasks/__init__.py`: `register_lazy_task("my_task", "rredcot.tasks.my_module")`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import math
import random
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass(frozen=True)
class Problem:
    """One prompt with its reference answer.

    `meta` holds task-specific, JSON-serialisable extras (e.g. the operands of an arithmetic
    chain, the source row of a dataset).
    """

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)

    def __hash__(self) -> int:  # `meta` is a dict; equal problems share prompt and answer
        return hash((self.prompt, self.answer))


TIMEOUT_REASON = "verify timed out"
"""How the reason of a verdict whose check ran past its time bound starts."""


@dataclass(frozen=True)
class Verdict:
    """The verifier's judgement of one completion.

    reward: outcome reward, 1.0 correct / 0.0 wrong or malformed for 0/1 tasks.
    answer: the final answer parsed from the completion, `None` if none could be parsed.
    first_error_step: 0-based index of the first wrong step (line) of the completion; -1 when no
        step is wrong; `None` when the task cannot tell.
    reason: a short human-readable explanation (always set; says what was malformed).
    num_steps: number of reasoning steps found in the completion, `None` when unknown.
    """

    reward: float
    answer: str | None
    first_error_step: int | None
    reason: str
    num_steps: int | None = None

    @property
    def timed_out(self) -> bool:
        """Whether the check ran past its time bound (scored 0; counted by the rollout)."""
        return self.reason.startswith(TIMEOUT_REASON)


@dataclass
class NoParams:
    """Parameters of a task that takes none."""


class Task:
    """Base class of all tasks; subclasses register with `@register_task(name)`.

    Subclasses set `Params` (a dataclass) and implement `train_problems`, `eval_problems` and
    `verify`. `verify` must never raise on model output: malformed text gets reward 0 and a
    reason. The constructor takes the fields of `Params` as keyword arguments.
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type] = NoParams
    answer_cue: ClassVar[str] = "A:"
    """Text that opens the final-answer line; probes append `render_answer(a)` after a prefix."""
    answer_line_pattern: ClassVar[str | None] = None
    """Regex (``re.search``) of the task's final-answer line, for segmentation: the line is kept
    whole and, with ``credit.separate_answer``, is a segment of its own. None: the segmenter's
    default (``A:``, ``Answer:``, ``####``, ``<answer>``, ``\\boxed{``)."""
    tiny_model_default: ClassVar[bool] = False
    """Whether the built-in character model, warm-started on this task, is what runs when no
    model is named (synthetic tasks whose text it can learn: arithmetic, graph_paths)."""
    warmstart_settings: ClassVar[dict[str, Any]] = {}
    """``SFTConfig`` overrides of this task's default warm-start (e.g. its edge-of-competence
    band); a preset or the caller's own overrides win."""

    def __init__(self, **params: Any) -> None:
        self.params = make_params(self.Params, params, owner=f"task {self.name!r}")

    # -- problems -----------------------------------------------------------------------------
    def train_problems(self, n: int, seed: int) -> list[Problem]:
        """`n` training problems, deterministic in (`seed`, task params)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement train_problems")

    def eval_problems(self, n: int, seed: int) -> list[Problem]:
        """`n` held-out problems, disjoint from every training problem where the task can ensure it."""
        raise NotImplementedError(f"{type(self).__name__} does not implement eval_problems")

    # -- checking -----------------------------------------------------------------------------
    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Judge `completion` (the response text only, no prompt, no special tokens)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement verify")

    # -- gold text ----------------------------------------------------------------------------
    def gold_steps(self, problem: Problem) -> list[str] | None:
        """The gold reasoning lines without the answer line, or `None` if the task has none."""
        return None

    def gold_completion(self, problem: Problem) -> str | None:
        """A correct chain of thought ending in the answer line, or `None` if the task has none
        (by default: :meth:`gold_steps`, then the answer line)."""
        steps = self.gold_steps(problem)
        return None if steps is None else "\n".join([*steps, self.render_answer(problem.answer)])

    def truncated_gold(self, problem: Problem, k: int) -> str | None:
        """The first `k` gold steps followed straight by the answer line (`None` if unsupported).

        Used by the supervised warm-start to teach a model to answer before finishing the chain.
        """
        steps = self.gold_steps(problem)
        if steps is None:
            return None
        if not 0 <= k <= len(steps):
            raise ValueError(f"k must be in [0, {len(steps)}] for this problem, got {k}")
        return "\n".join([*steps[:k], self.render_answer(problem.answer)])

    def render_answer(self, answer: str) -> str:
        """The text that, appended after a prefix, states `answer` as the final answer."""
        return f"{self.answer_cue}{answer}"

    def suggested_max_new_tokens(self) -> int | None:
        """A completion length that fits a gold trace with room to spare (`None`: no opinion).

        Benchmarks and the warm-start use it when the user sets no length, so that long tasks
        (12-step chains) are not truncated by a default sized for short ones.
        """
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.params})"


def stable_seed(*parts: object) -> int:
    """A stable 64-bit seed from `parts` (independent of PYTHONHASHSEED)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "big")


class GeneratedTask(Task):
    """A task whose problems a seeded generator draws: subclasses write `draw(rng, split)`.

    A prompt is held out when a fixed hash of it and `params.seed` falls below
    `params.eval_fraction` (both fields of the subclass's `Params`), so no training problem is
    ever an evaluation prompt whatever the seeds. Training problems are i.i.d. (repeats
    possible); evaluation problems are distinct, and `eval_problems(n, seed)` is a prefix of
    `eval_problems(m, seed)` for `m > n`."""

    max_stale_draws: ClassVar[int] = 20_000
    """Draws in a row that add no new held-out problem before `eval_problems` gives up."""
    widen_hint: ClassVar[str] = "the problem space"
    """What to widen when the held-out split runs out (named in the error)."""

    def draw(self, rng: random.Random, split: str) -> Problem:
        """One problem from `rng` (`split`, "train" or "eval", may go into its `meta`)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement draw")

    def split_key(self, prompt: str) -> object:
        """What the held-out split hashes for `prompt`: its text (a task may hold out something
        coarser, so that the same problem in other words cannot land in both splits)."""
        return prompt

    def is_eval_prompt(self, prompt: str) -> bool:
        """Whether `prompt` belongs to the held-out split (a fixed hash of its `split_key` and
        the seed)."""
        u = stable_seed("split", self.params.seed, self.split_key(prompt)) / 2.0**64
        return u < self.params.eval_fraction

    def train_problems(self, n: int, seed: int) -> list[Problem]:
        """`n` i.i.d. problems (repeats possible) from the training split: never an eval prompt."""
        rng = random.Random(stable_seed("train", self.params.seed, seed))
        out: list[Problem] = []
        misses = 0
        while len(out) < n:
            problem = self.draw(rng, "train")
            if self.is_eval_prompt(problem.prompt):
                misses += 1
                if misses > 100 * (n + 100):
                    raise ValueError("the training split is (nearly) empty; lower eval_fraction")
                continue
            out.append(problem)
        return out

    def eval_problems(self, n: int, seed: int) -> list[Problem]:
        """`n` distinct held-out problems; a prefix of `eval_problems(m, seed)` for `m > n`."""
        rng = random.Random(stable_seed("eval", self.params.seed, seed))
        out: list[Problem] = []
        seen: set[str] = set()
        stale = 0
        while len(out) < n:
            problem = self.draw(rng, "eval")
            if problem.prompt in seen or not self.is_eval_prompt(problem.prompt):
                stale += 1
                if stale > self.max_stale_draws:
                    raise ValueError(
                        f"found only {len(out)} distinct held-out problems of {n} requested; "
                        f"raise eval_fraction or widen {self.widen_hint}"
                    )
                continue
            stale = 0
            seen.add(problem.prompt)
            out.append(problem)
        return out


def safe_verify(task: Task, problem: Problem, completion: str) -> Verdict:
    """`task.verify`, with any exception turned into reward 0 and a reason (a last guard)."""
    try:
        return task.verify(problem, completion)
    except Exception as e:  # the point is to never crash a training run
        return Verdict(0.0, None, None, f"verifier error: {type(e).__name__}: {e}")


def checked_verify(task: Task, problem: Problem, completion: str) -> tuple[Verdict, bool]:
    """Verify one completion; a verifier that raises or returns a non-number or non-finite reward
    marks the sample bad (skipped and counted) instead of killing the run."""
    verdict = safe_verify(task, problem, completion)
    if verdict.reason.startswith("verifier error"):
        return verdict, False
    try:
        reward = float(verdict.reward)
    except (TypeError, ValueError):
        return Verdict(
            0.0, verdict.answer, None, f"reward is not a number: {verdict.reward!r}"
        ), False
    if not math.isfinite(reward):
        return Verdict(0.0, verdict.answer, None, f"non-finite reward {reward}"), False
    return verdict, True


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


def _coerce(value: Any, tp: Any, name: str) -> Any:
    """Convert a CLI string to the declared field type (int, float, bool, str, optionals)."""
    if not isinstance(value, str):
        return value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if args and type(None) in args:  # Optional[X] / X | None
        if value.strip().lower() in ("none", "null", ""):
            return None
        rest = [a for a in args if a is not type(None)]
        return _coerce(value, rest[0], name) if len(rest) == 1 else value
    if origin is not None:
        return value
    try:
        if tp is bool:
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(value)
        if tp is int:
            return int(value)
        if tp is float:
            return float(value)
    except ValueError:
        raise ValueError(
            f"parameter {name!r} expects {getattr(tp, '__name__', tp)}, got {value!r}"
        ) from None
    return value


def make_params(params_cls: type, params: dict[str, Any], owner: str = "task") -> Any:
    """Build `params_cls(**params)`, converting strings and naming unknown keys clearly."""
    if not dataclasses.is_dataclass(params_cls):
        raise TypeError(f"{owner}: Params must be a dataclass, got {params_cls!r}")
    fields = {f.name: f for f in dataclasses.fields(params_cls) if f.init}
    unknown = sorted(set(params) - set(fields))
    if unknown:
        valid = ", ".join(sorted(fields)) or "(none)"
        raise TypeError(f"{owner} got unknown parameter(s) {', '.join(unknown)}; valid: {valid}")
    hints = typing.get_type_hints(params_cls)
    kwargs = {k: _coerce(v, hints.get(k, Any), k) for k, v in params.items()}
    return params_cls(**kwargs)


def describe_params(params_cls: type) -> list[tuple[str, Any, str]]:
    """(name, default, help) for each field of a Params dataclass, for CLI help pages."""
    out = []
    for f in dataclasses.fields(params_cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        out.append((f.name, default, f.metadata.get("help", "")))
    return out


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------

_TASKS: dict[str, type[Task]] = {}
_LAZY_TASKS: dict[str, str] = {}  # name -> module that registers it on import


def register_task(name: str):
    """Class decorator: make a `Task` subclass available as `get_task(name)`."""

    def deco(cls: type[Task]) -> type[Task]:
        if not (isinstance(cls, type) and issubclass(cls, Task)):
            raise TypeError(f"@register_task({name!r}) needs a Task subclass, got {cls!r}")
        if name in _TASKS and _TASKS[name] is not cls:
            raise ValueError(f"task {name!r} is already registered by {_TASKS[name].__qualname__}")
        cls.name = name
        _TASKS[name] = cls
        return cls

    return deco


def register_lazy_task(name: str, module: str) -> None:
    """Declare that importing `module` registers task `name` (imported on first `get_task`)."""
    _LAZY_TASKS[name] = module.split(":")[0]


def list_tasks() -> list[str]:
    """Names of all known tasks (registered or lazily importable), sorted."""
    return sorted(set(_TASKS) | set(_LAZY_TASKS))


def get_task_class(name: str) -> type[Task]:
    """The class registered as `name`, importing its module if needed."""
    if name not in _TASKS and name in _LAZY_TASKS:
        module = _LAZY_TASKS[name]
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ImportError(
                f"task {name!r} needs module {module!r}, which failed to import ({e}); "
                "install the optional extras it needs (e.g. `pip install rredcot[data]` or "
                "`rredcot[gym]`)"
            ) from e
    if name not in _TASKS:
        raise ValueError(f"unknown task {name!r}; valid: {', '.join(list_tasks())}")
    return _TASKS[name]


def read_task_data(task: Task) -> None:
    """Read and check a task's data now where it reads a file (``dataset``), so that a bad file
    is refused before a model loads, not after."""
    load = getattr(task, "load", None)
    if callable(load):
        load()


def get_task(name: str, **params: Any) -> Task:
    """Build the task registered as `name` from keyword parameters (strings are converted)."""
    return get_task_class(name)(**params)
