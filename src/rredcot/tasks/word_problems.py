"""Short word problems with step labels: the edge of competence of a small pretrained chat model.

The arithmetic chains of ``rredcot.tasks.arithmetic`` (left to right, one operation a step), told
as a story about someone's things, for a pretrained instruct model with a chat template::

    Tom has 8 apples. He buys 5 more, then eats 2. How many apples does Tom have now?

``+`` is told as *buys / finds / gets N more*, ``-`` as *eats / gives away / loses N* (*eats* only
for food). By default a problem takes one or two operations (``min_steps``, ``max_steps``): inside
the edge of competence of greedy SmolLM2-135M-Instruct (its accuracy, overall and by length:
``benchmarks/results/real_model/README.md``). It writes one short sentence per step ("She buys 7
more, so she has 3 + 7 = 10 oranges."), so newline and sentence segmentation have something to
cut, and its slips are real ones: the wrong operation (``7 - 2`` for "buys 2 more"), wrong
arithmetic (``3 + 9 = 21``), or undoing a right result on the next line.

Prompt: the problem is the user turn. With ``example=True`` a system turn asks for one step per
line and shows one worked example, which makes the model close with ``The answer is N.``
(``Problem.meta["system"]``, rendered by ``rollout.render_prompt``); it costs prompt tokens and
lowers greedy accuracy (the model copies the example's two steps on one-step problems; the
figures: ``benchmarks/results/real_model/README.md``), so it is off by default.

Verification reads only the prompt text and the completion (so TRL's reward functions, which see
no ``meta``, score the same way):

- the answer is the number after the first ``answer is`` or ``####`` (the model's committed
  answer; small models often ramble on after it), else the last number of the completion; reward
  1.0 iff it equals the reference;
- ``first_error_step`` is a *line* index of the completion (as the credit benchmark's
  localisation expects): the first line holding an equation ``<expr> = <number>`` that is either
  wrong arithmetic (``7 - 5 = 11``) or whose result is not the next value of the gold chain
  (``9 - 8 = 1`` when Tom buys 8 more; restating a value already reached is fine, skipping ahead
  to a later gold value is fine). When every equation is right but the answer is wrong, the line
  stating the answer is the first error. Lines after the answer line are not checked. ``-1``: no
  wrong line; ``None``: unknown, either no number anywhere to judge, or no answer stated (no
  ``answer is``) while every equation is right and the chain is not finished: a trace cut by
  the token cap after a right line is not wrong at that line (its last number is no answer).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from rredcot.segment import DEFAULT_ANSWER_PATTERN
from rredcot.tasks.base import GeneratedTask, Problem, Verdict, register_task
from rredcot.tasks.gsm8k_steps import UnparseableExpression, evaluate

NAMES = (
    ("Tom", "He"),
    ("Ann", "She"),
    ("Sam", "He"),
    ("Mia", "She"),
    ("Ben", "He"),
    ("Lily", "She"),
    ("Max", "He"),
    ("Emma", "She"),
)
FOODS = ("apples", "cookies", "oranges", "plums", "candies")
THINGS = ("pens", "cards", "marbles", "stickers", "books")
ADD_VERBS = ("buys", "finds", "gets")
SUB_VERBS_FOOD = ("eats", "gives away")
SUB_VERBS_THING = ("loses", "gives away")
VALID_OPERATORS = "+-"
SPLITS = ("prompt", "chain")

_ITEM = "|".join(FOODS + THINGS)
_NAME = "|".join(n for n, _ in NAMES)
_PRONOUN = "|".join(sorted({p for _, p in NAMES}))
_ADD = "|".join(ADD_VERBS)
_SUB = "|".join(sorted(set(SUB_VERBS_FOOD + SUB_VERBS_THING)))
_PROMPT_RE = re.compile(
    rf"(?P<name>{_NAME}) has (?P<start>\d+) (?P<item>{_ITEM})\. (?:{_PRONOUN}) (?P<steps>.+?)\. "
    rf"How many (?P=item) does (?P=name) have now\?"
)
_STEP_RE = re.compile(rf"(?:(?P<add>{_ADD}) (?P<b_add>\d+) more|(?P<sub>{_SUB}) (?P<b_sub>\d+))")
_NUMBER = r"-?\d+(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUMBER)
# an equation: numbers (each optionally followed by one unit word: "9 apples - 8 apples = 1")
# joined by operators, "=", a number. Each term and each "operator term" is atomic and their
# repetition possessive: whitespace between a term and an operator could otherwise be split in
# two ways at every operator, and a long "1 - 1 - 1 ..." line with no "=" took exponential time
# (14 terms: 45 s). No match changes: what follows a term or operator is never "=".
_TERM = rf"(?>\(?\s*{_NUMBER}(?:\s+[A-Za-z]+)?\s*\)?)"
_EQUATION_RE = re.compile(
    rf"(?P<left>{_TERM}(?>\s*[-+*/×÷]\s*{_TERM})++)\s*=\s*(?P<right>{_NUMBER})"
)
_ANSWER_RE = re.compile(rf"(?:answer is\s*:?|####)\s*\$?\s*(?P<n>{_NUMBER})", re.I)


@dataclass
class WordProblemParams:
    """Parameters of the word-problem task (CLI: `--task.<name> <value>`)."""

    min_steps: int = field(default=1, metadata={"help": "Fewest operations in a problem."})
    max_steps: int = field(
        default=2,
        metadata={"help": "Most operations in a problem (each problem draws uniformly between)."},
    )
    operators: str = field(
        default="+-", metadata={"help": "Operators to draw from, a subset of '+-'."}
    )
    min_operand: int = field(default=2, metadata={"help": "Smallest number in a problem."})
    max_operand: int = field(default=9, metadata={"help": "Largest number in a problem."})
    max_value: int = field(
        default=99, metadata={"help": "Every intermediate amount stays in [0, max_value]."}
    )
    example: bool = field(
        default=False,
        metadata={
            "help": "A system turn asking for one step per line, with one worked example "
            "(chat models then end with 'The answer is N.')."
        },
    )
    eval_fraction: float = field(
        default=0.1, metadata={"help": "Share of all prompts held out for evaluation."}
    )
    split: str = field(
        default="prompt",
        metadata={
            "help": "What is held out: 'prompt' (a hash of the prompt's text: the same chain told "
            "with another name or item can be in both splits) or 'chain' (a hash of the start "
            "amount, operations and operands: no held-out chain occurs in training)."
        },
    )
    seed: int = field(
        default=0, metadata={"help": "Seed of the split: which prompts are held out."}
    )

    def __post_init__(self) -> None:
        if not 1 <= self.min_steps <= self.max_steps:
            raise ValueError(
                f"need 1 <= min_steps <= max_steps, got {self.min_steps}, {self.max_steps}"
            )
        bad = sorted(set(self.operators) - set(VALID_OPERATORS))
        if not self.operators or bad:
            raise ValueError(
                f"operators must be a non-empty subset of {VALID_OPERATORS!r}, got {self.operators!r}"
            )
        if not 0 <= self.min_operand <= self.max_operand <= self.max_value:
            raise ValueError(
                "need 0 <= min_operand <= max_operand <= max_value, got "
                f"{self.min_operand}, {self.max_operand}, {self.max_value}"
            )
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.split not in SPLITS:
            raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {self.split!r}")


EXAMPLE_QUESTION = "Ann has 3 pens. She buys 4 more, then loses 2. How many pens does Ann have now?"
EXAMPLE_SOLUTION = (
    "She buys 4 more, so she has 3 + 4 = 7 pens.\n"
    "She loses 2, so she has 7 - 2 = 5 pens.\n"
    "The answer is 5."
)
SYSTEM_PROMPT = (
    "Solve the problem one step per line, like this example:\n"
    f"{EXAMPLE_QUESTION}\n{EXAMPLE_SOLUTION}"
)


def _verb(op: str, b: int, food: bool, rng: random.Random) -> str:
    if op == "+":
        return f"{rng.choice(ADD_VERBS)} {b} more"
    return f"{rng.choice(SUB_VERBS_FOOD if food else SUB_VERBS_THING)} {b}"


@dataclass(frozen=True)
class ParsedProblem:
    start: int
    operators: list[str]
    operands: list[int]
    phrases: list[str]  # 'buys 4 more', 'eats 2', ...
    name: str
    pronoun: str
    item: str

    @property
    def values(self) -> list[int]:
        return chain_values(self.start, self.operators, self.operands)

    @property
    def chain(self) -> tuple[int, tuple[str, ...], tuple[int, ...]]:
        """The arithmetic the story tells, whatever the names, items and verbs."""
        return (self.start, tuple(self.operators), tuple(self.operands))


def parse_problem(prompt: str) -> ParsedProblem | None:
    """The chain told by a word-problem prompt, `None` if `prompt` is not one."""
    m = _PROMPT_RE.fullmatch(prompt.strip())
    if m is None:
        return None
    ops, operands, phrases = [], [], []
    for part in m.group("steps").split(", then "):
        s = _STEP_RE.fullmatch(part.strip())
        if s is None:
            return None
        phrases.append(s.group(0))
        if s.group("add"):
            ops.append("+")
            operands.append(int(s.group("b_add")))
        else:
            ops.append("-")
            operands.append(int(s.group("b_sub")))
    pronoun = next(p for n, p in NAMES if n == m.group("name"))
    return ParsedProblem(
        int(m.group("start")), ops, operands, phrases, m.group("name"), pronoun, m.group("item")
    )


def _gold_lines(parsed: ParsedProblem, wrong_step: int | None = None, delta: int = 0) -> list[str]:
    """'He buys 4 more, so he has 3 + 4 = 7 apples.' per step (step ``wrong_step`` off by
    ``delta``, carried forward); the last entry is the final amount."""
    lines, value = [], parsed.start
    he = parsed.pronoun
    for i, (phrase, op, b) in enumerate(zip(parsed.phrases, parsed.operators, parsed.operands)):
        new = (value + b if op == "+" else value - b) + (delta if i == wrong_step else 0)
        lines.append(f"{he} {phrase}, so {he.lower()} has {value} {op} {b} = {new} {parsed.item}.")
        value = new
    return [*lines, str(value)]


def chain_values(start: int, ops: list[str], operands: list[int]) -> list[int]:
    """The amounts after each operation."""
    values, v = [], start
    for op, b in zip(ops, operands):
        v = v + b if op == "+" else v - b
        values.append(v)
    return values


def _evaluate(left: str) -> float | None:
    try:
        return evaluate(re.sub(r"[A-Za-z]+", " ", left).replace("×", "*").replace("÷", "/"))
    except UnparseableExpression:
        return None


def _same(a: float, b: float) -> bool:
    return abs(a - b) < 1e-9


def committed_answer(completion: str) -> tuple[str | None, int | None]:
    """``(answer, line index)``: the number after the first 'answer is' or '####', else the last
    number of the text; ``(None, None)`` without a number."""
    m = _ANSWER_RE.search(completion)
    if m is not None:
        pos, text = m.start("n"), m.group("n")
    else:
        numbers = list(_NUMBER_RE.finditer(completion.replace(",", "")))
        if not numbers:
            return None, None
        # positions in the comma-free text; map back through the line count only
        last = numbers[-1]
        stripped = completion.replace(",", "")
        return _normalise(last.group(0)), stripped.count("\n", 0, last.start())
    return _normalise(text), completion.count("\n", 0, pos)


def _normalise(number: str) -> str:
    value = float(number)
    return str(int(value)) if value == int(value) else str(value)


@register_task("word_problems")
class WordProblemTask(GeneratedTask):
    """One- and two-step word problems ('Tom has 8 apples. He buys 5 more, then eats 2. ...')."""

    Params = WordProblemParams
    answer_cue = "The answer is "
    answer_line_pattern = DEFAULT_ANSWER_PATTERN + r"|\banswer is\b"  # the model's closing line
    max_stale_draws = 50_000
    params: WordProblemParams

    def render_answer(self, answer: str) -> str:
        return f"{self.answer_cue}{answer}."

    def split_key(self, prompt: str) -> object:
        """``split='chain'``: the chain the prompt tells (:attr:`ParsedProblem.chain`), so a
        held-out chain never occurs in training in other words; else the prompt's text."""
        parsed = parse_problem(prompt) if self.params.split == "chain" else None
        return prompt if parsed is None else parsed.chain

    def suggested_max_new_tokens(self) -> int:
        """BPE tokens: about 16 a step line, plus the answer line and some slack."""
        return 24 * self.params.max_steps + 24

    # -- problems -----------------------------------------------------------------------------
    def draw(self, rng: random.Random, split: str) -> Problem:
        p = self.params
        for _ in range(1000):
            n = rng.randint(p.min_steps, p.max_steps)
            name, pronoun = rng.choice(NAMES)
            food = rng.random() < 0.5
            item = rng.choice(FOODS if food else THINGS)
            start = rng.randint(p.min_operand, p.max_operand)
            ops, operands, value = [], [], start
            for _ in range(n):
                choices = []
                for op in p.operators:
                    for b in range(p.min_operand, p.max_operand + 1):
                        r = value + b if op == "+" else value - b
                        if 0 <= r <= p.max_value:
                            choices.append((op, b))
                if not choices:
                    break
                ops_here = sorted({op for op, _ in choices})
                op = rng.choice(ops_here)
                b = rng.choice([x for o, x in choices if o == op])
                ops.append(op)
                operands.append(b)
                value = value + b if op == "+" else value - b
            else:
                verbs = [_verb(op, b, food, rng) for op, b in zip(ops, operands)]
                prompt = (
                    f"{name} has {start} {item}. {pronoun} {', then '.join(verbs)}. "
                    f"How many {item} does {name} have now?"
                )
                meta = {
                    "start": start,
                    "operators": ops,
                    "operands": operands,
                    "values": chain_values(start, ops, operands),
                    "verbs": verbs,
                    "pronoun": pronoun,
                    "item": item,
                }
                if p.example:
                    meta["system"] = SYSTEM_PROMPT
                return Problem(prompt=prompt, answer=str(value), meta=meta)
        raise ValueError(
            f"no {p.max_steps}-step problem with operands {p.min_operand}..{p.max_operand} keeps "
            f"amounts in [0, {p.max_value}]; widen the bounds"
        )

    # -- gold text ----------------------------------------------------------------------------
    def gold_steps(self, problem: Problem) -> list[str] | None:
        """The gold step lines (no answer line), `None` if the prompt is not a word problem."""
        parsed = parse_problem(problem.prompt)
        return None if parsed is None else _gold_lines(parsed)[:-1]

    def inject_error(self, problem: Problem, step: int, delta: int = 1) -> str:
        """The gold trace with the result of step ``step`` off by ``delta``, carried forward (later
        steps compute correctly from the wrong value; the answer line states the wrong result)."""
        parsed = parse_problem(problem.prompt)
        if parsed is None:
            raise ValueError(f"not a word problem: {problem.prompt!r}")
        if not 0 <= step < len(parsed.operators):
            raise ValueError(f"step must be in [0, {len(parsed.operators)}), got {step}")
        if delta == 0:
            raise ValueError("delta must not be 0")
        *lines, final = _gold_lines(parsed, step, delta)
        return "\n".join([*lines, self.render_answer(final)])

    # -- checking -----------------------------------------------------------------------------
    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Reward from the committed answer; first wrong line from the equations (module doc)."""
        if not isinstance(completion, str):
            return Verdict(0.0, None, None, f"completion is {type(completion).__name__}, not str")
        answer, answer_line = committed_answer(completion)
        try:
            expected = _normalise(str(problem.answer))
        except ValueError:
            return Verdict(
                0.0, answer, None, f"reference answer {problem.answer!r} is not a number"
            )
        reward = 1.0 if answer is not None and answer == expected else 0.0
        if answer is None:
            reason = "no number in the completion"
        elif reward:
            reason = "correct"
        else:
            reason = f"wrong answer {answer} (expected {expected})"

        parsed = parse_problem(problem.prompt)
        if parsed is None:
            return Verdict(reward, answer, None, reason + "; steps not checked")
        gold = [float(parsed.start), *map(float, parsed.values)]
        lines = completion.split("\n")
        last = len(lines) - 1 if answer_line is None else answer_line
        progress = 0  # index into gold of the latest value reached
        first_error, why = -1, ""
        for i, line in enumerate(lines[: last + 1]):
            for m in _EQUATION_RE.finditer(line.replace(",", "")):
                computed = _evaluate(m.group("left"))
                right = float(m.group("right"))
                if computed is None:
                    continue
                if not _same(computed, right):
                    first_error, why = i, f"{m.group(0).strip()} is wrong arithmetic"
                    break
                later = [j for j in range(progress + 1, len(gold)) if _same(gold[j], right)]
                if later:
                    progress = later[0]
                elif not any(_same(g, right) for g in gold[: progress + 1]):
                    first_error = i
                    why = (
                        f"{m.group(0).strip()} leaves the chain (next amount "
                        f"{_normalise(str(gold[min(progress + 1, len(gold) - 1)]))})"
                    )
                    break
            if first_error >= 0:
                break
        steps = sum(bool(_EQUATION_RE.search(x.replace(",", ""))) for x in lines[: last + 1])
        if first_error == -1 and reward == 0.0:
            unfinished = _ANSWER_RE.search(completion) is None and progress < len(gold) - 1
            if answer_line is None or unfinished:
                # no answer stated and the chain not finished (cut by the token cap, or stopped
                # early): the last number is not an answer, and no line is known to be wrong
                if unfinished:
                    reason += "; no answer stated before the chain ended: first wrong line unknown"
                return Verdict(reward, answer, None, reason, steps)
            first_error, why = answer_line, "the answer line"
        if first_error >= 0:
            reason += f"; first wrong line {first_error}: {why}"
        return Verdict(reward, answer, first_error, reason, steps)
