"""How an answer probe is written: which answers count as correct, and the text and token ids
of each probe (docs/answer_likelihood.md, Writing the probe). The probes are scored by
:mod:`rredcot.methods.probe_logprobs`.

**The probe** is ``cue ⊕ a ⊕ close ⊕ eos`` (``credit.answer_likelihood.cue``,
``credit.answer_likelihood.eos``):

- ``task``: the task's own answer line ``task.render_answer(a)`` (``A:15``, ``#### 15``,
  ``\\boxed{15}``) on a line of its own, so ``\\nA:15`` after a prefix that ends mid-line and
  ``A:15`` after one that ends with a newline (gold arithmetic traces put the answer on its own
  line: ``...20-5=15\\nA:15``).
- ``think``: ``\\n</think>\\n\\nThe final answer is \\boxed{15}`` for models that reason inside
  ``<think> ... </think>``. Such a model never answers mid-thought, so a plain answer line scores
  near zero at every boundary of a long trace; closing the thought first asks the question it does
  answer. Once the prefix has closed the thought itself (its last ``</think>`` comes after its last
  ``<think>``, the prompt included), the probe leaves ``</think>`` out.
- ``auto`` (default): ``think`` when the tokenizer or its chat template knows ``</think>``, else
  ``task``. Any other text is a literal cue: the answer follows it and every brace it leaves open
  is closed after the answer.

Leading newlines of the probe that the prefix already ends with are dropped (a prefix ending in
``\\n\\n`` gets ``The final answer is ...``). The probe is tokenised on its own, not jointly with
the prefix. ``eos``: ``true``, ``false`` or ``auto``, where ``auto`` appends EOS only when the
probe does not end in a closing bracket or tag (``A:15<eos>`` must not count ``A:150``;
``\\boxed{15}`` is complete, and a model usually writes more after it). Without EOS, a probe that
is a prefix of another one (``A:1`` of ``A:15``) already counts its mass, so the longer one is
dropped.

**The correct answers** ``A+`` (``credit.answer_likelihood.source``): ``reference`` the problem's
reference answer, ``group`` the distinct parsed answers of the group's verified-correct completions,
``both`` their union. With ``credit.answer_likelihood.renderings`` each answer also brings its
equivalent renderings (:func:`rredcot.tasks.answers.equivalent_renderings`: ``20``, ``20.0``,
``$20``, ``1,000``, ``3/4``, ``\\frac{3}{4}``) that the task's verifier accepts on the task's own
answer line (the arithmetic verifier takes integers only, so there ``A+`` stays ``{15}``). Probes
with the same token ids count once. A group with an empty ``A+`` (``group`` source, no correct
sample) gets ``V = 0`` at every boundary.

The estimate can only **under**-estimate the probability of answering correctly: a correct answer
written in a way that is not probed is missed. How much a missing rendering costs is measured in
docs/answer_likelihood.md (It can only under-estimate).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rredcot.config import AnswerLikelihoodConfig
from rredcot.methods.probe_logprobs import Probe, prompt_token_ids
from rredcot.sampling.batch import RolloutBatch
from rredcot.tasks.answers import equivalent_renderings
from rredcot.tasks.base import safe_verify

CUE_PRESETS = ("auto", "task", "think")
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
THINK_CUE = "\n</think>\n\nThe final answer is \\boxed{"
_CLOSED_END = re.compile(r"(?:[}\])]|</[^<>\s]+>)\s*$")
_TAIL_TOKENS = 4  # prefix tokens decoded to see how the prefix ends


@dataclass(frozen=True)
class ProbeFormat:
    """How a probe is written: ``cue`` (``auto``, ``task``, ``think`` or literal text), ``eos``
    (``auto``, ``true``, ``false``) and whether equivalent ``renderings`` are probed too."""

    cue: str = "auto"
    eos: str = "auto"
    renderings: bool = True

    def __post_init__(self) -> None:
        if not self.cue:
            raise ValueError("answer cue is empty: use auto, task, think or the literal cue text")
        if self.eos not in ("auto", "true", "false"):
            raise ValueError(f"answer eos={self.eos!r}: use auto, true or false")

    @classmethod
    def from_config(cls, config: AnswerLikelihoodConfig) -> ProbeFormat:
        """From ``credit.answer_likelihood``'s ``cue``, ``eos`` and ``renderings``."""
        return cls(config.cue, config.eos, bool(config.renderings))


# ---------------------------------------------------------------------------------------------
# What to probe


def correct_answers(batch: RolloutBatch, source: str = "reference") -> list[list[str]]:
    """Per row, the answers counted as correct (``A+``, before renderings), in a stable order.

    ``reference``: ``problem.answer``; ``group``: distinct ``verdict.answer`` of the rows of the
    same group with reward 1, on every process (``batch.peers``: the group's rows other
    processes hold, in the order of every process's rows); ``both``: the union.
    """
    if source not in ("reference", "group", "both"):
        raise ValueError(f"answer_source={source!r}: use reference, group or both")
    if source in ("reference", "both") and len(batch.problems) != batch.size:
        raise ValueError("answer_source needs batch.problems (one Problem per row)")
    if source in ("group", "both") and len(batch.verdicts) != batch.size:
        raise ValueError("answer_source 'group' needs batch.verdicts (one Verdict per row)")
    group_answers: dict[int, list[str]] = {}
    if source in ("group", "both"):
        rows = [
            (int(g), float(r), v.answer)
            for g, r, v in zip(batch.group_ids.tolist(), batch.rewards.tolist(), batch.verdicts)
        ]
        peers = batch.peers
        if peers is not None:
            rows = peers.around(rows, list(zip(peers.group_ids, peers.rewards, peers.answers)))
        for gid, reward, answer in rows:
            found = group_answers.setdefault(gid, [])
            if reward >= 1.0 and answer is not None and str(answer) not in found:
                found.append(str(answer))
    out = []
    for row in range(batch.size):
        answers: list[str] = []
        if source in ("reference", "both"):
            ref = batch.problems[row].answer
            if ref is not None and str(ref) != "":
                answers.append(str(ref))
        for a in group_answers.get(int(batch.group_ids[row]), []):
            if a not in answers:
                answers.append(a)
        out.append(answers)
    return out


def answer_renderings(task, problem, answer: str) -> list[str]:
    """``answer`` and those of its :func:`equivalent_renderings` that the task's verifier scores
    correct (reward >= 1) when written on the task's own answer line."""
    out = [answer]
    for form in equivalent_renderings(answer)[1:]:
        if safe_verify(task, problem, task.render_answer(form)).reward >= 1.0:
            out.append(form)
    return out


def probe_answers(
    batch: RolloutBatch, task, source: str = "reference", renderings: bool = True
) -> list[list[str]]:
    """Per row, every answer string to probe: :func:`correct_answers`, each followed by its
    accepted renderings when ``renderings`` (no repeats)."""
    answers = correct_answers(batch, source)
    if not renderings:
        return answers
    cache: dict[tuple[str, str], list[str]] = {}
    out = []
    for row, found in enumerate(answers):
        problem = batch.problems[row] if batch.problems else None
        expanded: list[str] = []
        for a in found:
            key = (a, "" if problem is None else problem.prompt)
            if key not in cache:
                cache[key] = [a] if problem is None else answer_renderings(task, problem, a)
            expanded += [r for r in cache[key] if r not in expanded]
        out.append(expanded)
    return out


def uses_think_tags(tokenizer) -> bool:
    """Whether the tokenizer (its vocabulary or its chat template) knows ``</think>``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = " ".join(str(t) for t in template.values())
    if isinstance(template, str) and THINK_CLOSE in template:
        return True
    try:
        token_id = tokenizer.convert_tokens_to_ids(THINK_CLOSE)
    except (AttributeError, KeyError, TypeError):
        return False
    return token_id is not None and token_id != getattr(tokenizer, "unk_token_id", None)


def resolve_cue(cue: str, tokenizer) -> str:
    """``auto`` -> ``think`` or ``task`` (see the module docstring); anything else unchanged."""
    if cue == "auto":
        return "think" if uses_think_tags(tokenizer) else "task"
    return cue


def thought_closed(text: str) -> bool:
    """Whether ``text`` has closed its thought: a ``</think>`` after its last ``<think>``."""
    close = text.rfind(THINK_CLOSE)
    return close >= 0 and close > text.rfind(THINK_OPEN)


def _drop_newline_overlap(tail: str, text: str) -> str:
    """``text`` without the leading newlines that ``tail`` (how the prefix ends) already has."""
    lead = len(text) - len(text.lstrip("\n"))
    k = lead
    while k > 0 and not tail.endswith("\n" * k):
        k -= 1
    return text[k:]


def probe_text(task, answer: str, cue: str, tail: str = "\n", closed: bool = False) -> str:
    """The text appended after a prefix that ends with ``tail`` to state ``answer``.

    ``cue``: ``task``, ``think`` or literal text (``auto`` resolved already, see
    :func:`resolve_cue`); ``closed``: the prefix has closed its thought (``think`` and literal cues
    holding ``</think>`` then leave it out).
    """
    if cue == "auto":
        raise ValueError("probe_text needs a resolved cue: call resolve_cue(cue, tokenizer)")
    if cue == "task":
        text = "\n" + task.render_answer(answer)
    else:
        opening = THINK_CUE if cue == "think" else cue
        if closed and THINK_CLOSE in opening:
            opening = opening[opening.index(THINK_CLOSE) + len(THINK_CLOSE) :]
        unclosed = max(opening.count("{") - opening.count("}"), 0)
        text = opening + answer + "}" * unclosed
    return _drop_newline_overlap(tail, text)


def wants_eos(text: str, eos: str) -> bool:
    """``eos`` ``true``/``false`` as given; ``auto``: unless ``text`` ends in ``} ] )`` or a
    closing tag."""
    if eos == "auto":
        return _CLOSED_END.search(text) is None
    return eos == "true"


def probe_token_ids(tokenizer, text: str, eos: bool = True) -> tuple[int, ...]:
    """``text`` tokenised without special tokens, then EOS (with ``eos`` and a tokenizer that has
    one)."""
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if eos and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise ValueError(f"probe text {text!r} encodes to no tokens (and no EOS is appended)")
    return tuple(ids)


def _drop_dominated(probes: list[Probe]) -> list[Probe]:
    """Drop a probe whose ids extend another probe's at the same boundary (its mass is counted in
    the shorter one already); keeps the order."""
    by_slot: dict[tuple[int, int], list[tuple[int, ...]]] = {}
    for p in probes:
        by_slot.setdefault((p.row, p.k), []).append(p.ids)
    keep = []
    for p in probes:
        others = by_slot[(p.row, p.k)]
        if not any(len(o) < len(p.ids) and p.ids[: len(o)] == o for o in others):
            keep.append(p)
    return keep


def build_probes(
    batch: RolloutBatch,
    tokenizer,
    task,
    answers: list[list[str]],
    probe: ProbeFormat | None = None,
) -> tuple[list[Probe], list[list[int]]]:
    """Every probe of the batch: for each row, each boundary ``k < n`` and each answer.

    Returns the probes and, per row, the boundaries probed. The text of each probe is
    :func:`probe_text` for the prefix ``s_k`` (see the module docstring for the cue rules).
    """
    probe = probe or ProbeFormat()
    cue = resolve_cue(probe.cue, tokenizer)
    needs_closure = cue == "think" or THINK_CLOSE in cue
    id_cache: dict[str, tuple[int, ...]] = {}
    tail_cache: dict[tuple[int, ...], str] = {}
    probes: list[Probe] = []
    probed: list[list[int]] = []
    for row, bounds in enumerate(batch.boundaries):
        n = len(bounds) - 1
        ks = list(range(n)) if answers[row] else []
        probed.append(ks)
        if not ks:
            continue
        prompt_ids = prompt_token_ids(batch, row)
        response = batch.response_tokens(row)
        prompt_text = (
            tokenizer.decode(prompt_ids, skip_special_tokens=False) if needs_closure else ""
        )
        for k in ks:
            b = bounds[k]
            last = tuple((prompt_ids + response[:b])[-_TAIL_TOKENS:])
            if last not in tail_cache:
                tail_cache[last] = tokenizer.decode(list(last), skip_special_tokens=False)
            closed = needs_closure and thought_closed(
                prompt_text + tokenizer.decode(response[:b], skip_special_tokens=False)
            )
            for a in answers[row]:
                text = probe_text(task, a, cue, tail_cache[last], closed)
                if text not in id_cache:
                    id_cache[text] = probe_token_ids(tokenizer, text, wants_eos(text, probe.eos))
                probes.append(Probe(row, k, b, id_cache[text]))
    # Two answers that render the same are one answer: drop repeated (row, k, ids).
    unique = list(dict.fromkeys(probes))
    return _drop_dominated(unique), probed
