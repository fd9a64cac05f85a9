"""Procedural multi-step arithmetic: the CPU testbed task, with exact step-level ground truth.

Format (the tiny character model learns exactly this):

    prompt      "7+3*2-5=?\\n"          evaluated strictly LEFT TO RIGHT, no operator precedence
    completion  "7+3=10\\n10*2=20\\n20-5=15\\nA:15"

One step per line (`<left><op><operand>=<result>`), the first step starting from the first
operand and every later step from the previous step's result, then the answer line
`A:<integer>` with no trailing newline (the model's eos token follows). Every intermediate result
stays in `[0, max_value]`; division only appears where it is exact.

Verification: the reward is 1.0 iff the last line is a well-formed answer line whose integer
equals the reference answer (the answer line is what counts, as on GSM8K; trailing whitespace at
the very end of the completion is ignored, anything else malformed scores 0). `first_error_step`
indexes the lines of the completion: the first step line whose arithmetic is wrong, that does not
continue from the previous written result (the first from the first operand), or that uses the
wrong operator or operand for its position. A missing step is wrong at the first missing index,
an extra line is wrong where it stands, and when every step is right but the answer line is wrong
or missing, the answer line's index (`num_steps`) is the first error. -1 means no wrong line.

`inject_error` corrupts the gold trace at a chosen step and carries the wrong value forward: the
ground truth for first-error localisation in the credit benchmark.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass, field

from rredcot.tasks.base import GeneratedTask, Problem, Verdict, register_task

VALID_OPERATORS = "+-*/"
_MAX_DIGITS = 30  # longer numbers in model output are malformed (and never reach int())
_NUM = rf"(-?[0-9]{{1,{_MAX_DIGITS}}})"
_STEP_RE = re.compile(rf"{_NUM}([-+*/]){_NUM}={_NUM}")
_ANSWER_RE = re.compile(rf"A:{_NUM}")
_PROMPT_RE = re.compile(r"([0-9]{1,30})((?:[-+*/][0-9]{1,30})+)=\?\n?")
_TERM_RE = re.compile(r"([-+*/])([0-9]+)")


def apply_op(a: int, op: str, b: int) -> int | None:
    """`a op b` on integers; `None` for a division that is not exact (or by zero)."""
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        return a // b if b != 0 and a % b == 0 else None
    raise ValueError(f"unknown operator {op!r}; valid: {', '.join(VALID_OPERATORS)}")


@dataclass
class ArithmeticParams:
    """Parameters of the arithmetic task (CLI: `--task.<name> <value>`)."""

    num_steps: int = field(
        default=4, metadata={"help": "Operations per chain (lines of reasoning)."}
    )
    operators: str = field(
        default="+-*", metadata={"help": "Operators to draw from, a subset of '+-*/'."}
    )
    min_operand: int = field(default=1, metadata={"help": "Smallest operand (>= 0)."})
    max_operand: int = field(default=9, metadata={"help": "Largest operand."})
    max_value: int = field(
        default=99,
        metadata={"help": "Every intermediate result stays in [0, max_value] (steps are redrawn)."},
    )
    eval_fraction: float = field(
        default=0.1,
        metadata={
            "help": "Share of all possible prompts reserved for evaluation (never trained on)."
        },
    )
    seed: int = field(
        default=0, metadata={"help": "Seed of the problem set: which prompts are held out."}
    )

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        bad = sorted(set(self.operators) - set(VALID_OPERATORS))
        if not self.operators or bad:
            raise ValueError(
                f"operators must be a non-empty subset of {VALID_OPERATORS!r}, got {self.operators!r}"
            )
        if len(set(self.operators)) != len(self.operators):
            raise ValueError(f"operators has duplicates: {self.operators!r}")
        if not 0 <= self.min_operand <= self.max_operand:
            raise ValueError(
                f"need 0 <= min_operand <= max_operand, got {self.min_operand}, {self.max_operand}"
            )
        if self.max_operand > self.max_value:
            raise ValueError(
                f"max_operand ({self.max_operand}) exceeds max_value ({self.max_value}); "
                "raise max_value or lower max_operand"
            )
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in (0, 1), got {self.eval_fraction}")
        sample_chain(random.Random(0), self)  # fails now, clearly, if no chain fits the bounds


# ---------------------------------------------------------------------------------------------
# Chains: (operands, operators), len(operands) == len(operators) + 1
# ---------------------------------------------------------------------------------------------


def sample_chain(rng: random.Random, p: ArithmeticParams) -> tuple[list[int], list[str]]:
    """Draw a chain whose every intermediate result lies in `[0, p.max_value]`.

    Each step draws an operator uniformly among those with at least one admissible operand, then
    an admissible operand uniformly; a dead end (no admissible step) restarts the chain.
    """
    operand_range = range(p.min_operand, p.max_operand + 1)
    for _ in range(1000):
        value = rng.randint(p.min_operand, p.max_operand)
        operands, ops = [value], []
        for _ in range(p.num_steps):
            choices: dict[str, list[int]] = {}
            for op in p.operators:
                ok = []
                for b in operand_range:
                    r = apply_op(value, op, b)
                    if r is not None and 0 <= r <= p.max_value:
                        ok.append(b)
                if ok:
                    choices[op] = ok
            if not choices:
                break
            op = rng.choice(list(choices))
            b = rng.choice(choices[op])
            value = apply_op(value, op, b)
            operands.append(b)
            ops.append(op)
        else:
            return operands, ops
    raise ValueError(
        f"no {p.num_steps}-step chain with operators {p.operators!r} and operands "
        f"{p.min_operand}..{p.max_operand} keeps results in [0, {p.max_value}]; "
        "raise max_value, add operators or use fewer steps"
    )


def chain_results(operands: list[int], ops: list[str]) -> list[int] | None:
    """Intermediate results, left to right; `None` if a division is not exact."""
    results, value = [], operands[0]
    for op, b in zip(ops, operands[1:]):
        value = apply_op(value, op, b)
        if value is None:
            return None
        results.append(value)
    return results


def format_prompt(operands: list[int], ops: list[str]) -> str:
    """`"7+3*2-5=?\\n"`."""
    return str(operands[0]) + "".join(f"{op}{b}" for op, b in zip(ops, operands[1:])) + "=?\n"


def parse_prompt(prompt: str) -> tuple[list[int], list[str]] | None:
    """Inverse of `format_prompt`; `None` if `prompt` is not an arithmetic prompt."""
    m = _PROMPT_RE.fullmatch(prompt)
    if m is None:
        return None
    terms = _TERM_RE.findall(m.group(2))
    operands = [int(m.group(1))] + [int(b) for _, b in terms]
    ops = [op for op, _ in terms]
    return (operands, ops) if chain_results(operands, ops) is not None else None


def _step_lines(operands: list[int], ops: list[str]) -> list[str]:
    lines, value = [], operands[0]
    for op, b in zip(ops, operands[1:]):
        r = apply_op(value, op, b)
        lines.append(f"{value}{op}{b}={r}")
        value = r
    return lines


# ---------------------------------------------------------------------------------------------
# The task
# ---------------------------------------------------------------------------------------------


@register_task("arithmetic")
class ArithmeticTask(GeneratedTask):
    """Left-to-right integer chains such as `7+3*2-5`, solved one operation per line."""

    Params = ArithmeticParams
    answer_cue = "A:"
    tiny_model_default = True
    widen_hint = "the problem space (num_steps, operands)"
    params: ArithmeticParams

    # -- problems -----------------------------------------------------------------------------
    def suggested_max_new_tokens(self) -> int:
        """Character tokens: a step line is at most ``len("99*99=99\n")``; 64 at 4 steps or fewer."""
        return max(64, 10 * self.params.num_steps + 16)

    def draw(self, rng: random.Random, split: str) -> Problem:
        operands, ops = sample_chain(rng, self.params)
        results = chain_results(operands, ops)
        return Problem(
            prompt=format_prompt(operands, ops),
            answer=str(results[-1]),
            meta={"operands": operands, "operators": ops, "results": results, "split": split},
        )

    # -- gold text ----------------------------------------------------------------------------
    def gold_steps(self, problem: Problem) -> list[str] | None:
        """The gold step lines (no answer line), `None` if the prompt is not arithmetic."""
        chain = parse_prompt(problem.prompt)
        return None if chain is None else _step_lines(*chain)

    def gold_completion(self, problem: Problem, num_steps_shown: int | None = None) -> str | None:
        """The full gold trace, or with `num_steps_shown` the first k steps and then the answer."""
        if num_steps_shown is not None:
            return self.truncated_gold(problem, num_steps_shown)
        return super().gold_completion(problem)

    def inject_error(
        self,
        problem: Problem,
        step: int,
        rng: random.Random | None = None,
        delta: int | None = None,
    ) -> str:
        """See the module-level `inject_error`."""
        return inject_error(problem, step, rng=rng, delta=delta)

    # -- checking -----------------------------------------------------------------------------
    def verify(self, problem: Problem, completion: str) -> Verdict:
        """Reward from the answer line; first wrong line from the steps (see module docstring)."""
        if not isinstance(completion, str):
            return Verdict(0.0, None, None, f"completion is {type(completion).__name__}, not str")
        text = completion.rstrip()
        if not text:
            return Verdict(0.0, None, 0, "empty completion", 0)
        lines = text.split("\n")
        answer: str | None = None
        if lines[-1].startswith(self.answer_cue):
            step_lines = lines[:-1]
            m = _ANSWER_RE.fullmatch(lines[-1])
            if m is not None:
                answer = str(int(m.group(1)))
                reason = ""
            else:
                reason = f"malformed answer line {_clip(lines[-1])}: expected 'A:<integer>'"
        else:
            step_lines = lines
            if any(line.startswith(self.answer_cue) for line in lines):
                reason = "text after the answer line"
            else:
                reason = "no answer line"

        try:
            expected = int(problem.answer)
        except ValueError:
            return Verdict(
                0.0, answer, None, f"reference answer {problem.answer!r} is not an integer"
            )
        reward = 1.0 if answer is not None and int(answer) == expected else 0.0
        if answer is not None:
            reason = "correct" if reward else f"wrong answer {answer} (expected {expected})"

        chain = parse_prompt(problem.prompt)
        if chain is None:
            return Verdict(reward, answer, None, reason + "; steps not checked", len(step_lines))
        first_error, why = _first_wrong_step(step_lines, *chain)
        if first_error == -1 and reward == 0.0:
            first_error, why = len(step_lines), "the answer line"
        if first_error >= 0:
            reason += f"; first wrong line {first_error}: {why}"
        return Verdict(reward, answer, first_error, reason, len(step_lines))


def _clip(s: str, n: int = 40) -> str:
    return repr(s if len(s) <= n else s[:n] + "...")


def _first_wrong_step(lines: list[str], operands: list[int], ops: list[str]) -> tuple[int, str]:
    """(index of the first wrong step line, why); (-1, "") if all `len(ops)` steps are right."""
    value = operands[0]
    for i, line in enumerate(lines):
        if i >= len(ops):
            return i, f"extra line {_clip(line)}"
        m = _STEP_RE.fullmatch(line)
        if m is None:
            return i, f"not a step: {_clip(line)}"
        a, op, b, r = int(m.group(1)), m.group(2), int(m.group(3)), int(m.group(4))
        if a != value:
            return i, f"starts from {a}, not {value}"
        if op != ops[i] or b != operands[i + 1]:
            return i, f"applies {op}{b}, the problem says {ops[i]}{operands[i + 1]}"
        if apply_op(a, op, b) != r:
            return i, f"{a}{op}{b} is not {r}"
        value = r
    if len(lines) < len(ops):
        return len(lines), "missing step"
    return -1, ""


def _corrupt(operands: list[int], ops: list[str], step: int, delta: int) -> str | None:
    """Gold trace with `delta` added to the result of `step`, carried forward; `None` if invalid."""
    lines, value = [], operands[0]
    for i, (op, b) in enumerate(zip(ops, operands[1:])):
        r = apply_op(value, op, b)
        if r is None:
            return None
        if i == step:
            r += delta
        lines.append(f"{value}{op}{b}={r}")
        value = r
    answer = value + delta if step == len(ops) else value
    if answer == chain_results(operands, ops)[-1]:
        return None
    return "\n".join([*lines, f"A:{answer}"])


def inject_error(
    problem: Problem,
    step: int,
    rng: random.Random | None = None,
    delta: int | None = None,
) -> str:
    """The gold trace of `problem` with step `step`'s result off by `delta`, the error carried forward.

    Later steps compute correctly from the wrong value, so the final answer is wrong and the
    verifier's `first_error_step` is `step`. `step == num_steps` corrupts only the answer
    line. Without `delta`, one is drawn from `rng` (default `Random(0)`) among small offsets
    that keep divisions exact, change the final answer and, where possible, keep the wrong
    value non-negative.
    """
    chain = parse_prompt(problem.prompt)
    if chain is None:
        raise ValueError(f"not an arithmetic prompt: {problem.prompt!r}")
    n = len(chain[1])
    if not 0 <= step <= n:
        raise ValueError(f"step must be in [0, {n}] (num_steps = answer line), got {step}")
    if delta is not None:
        text = _corrupt(*chain, step, delta)
        if text is None:
            raise ValueError(
                f"delta {delta} at step {step} makes a later division inexact or leaves the "
                "final answer unchanged; pick another delta"
            )
        return text
    rng = rng or random.Random(0)
    results = chain_results(*chain)
    wrong_at = results[step] if step < n else results[-1]
    for width in (3, 10, 100):
        deltas = [d for d in range(-width, width + 1) if d != 0]
        rng.shuffle(deltas)
        deltas.sort(key=lambda d: wrong_at + d < 0)  # stable: non-negative values first
        for d in deltas:
            text = _corrupt(*chain, step, d)
            if text is not None:
                return text
    raise ValueError(f"could not corrupt step {step} of {problem.prompt!r}")
